#!/usr/bin/env python3
"""Caracal's server vs llama.cpp's llama-server, side by side, on SmolLM2-135M-Instruct.

Same GGUF (.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf), same machine, one run.
Each server is started in turn on 127.0.0.1 and loaded with `caracal bench --url`:

  * serving: output throughput and TTFT at concurrency 1 and 8
    (`--num-prompts` random-word prompts of `--input-len` words, `--output-len`
    tokens each, ignore_eos, streamed chat completions);
  * agent-loop: 16 sessions x 6 turns; each turn appends the answer and a tool
    result and resends the conversation; first-turn vs follow-up TTFT and the
    cached prompt share the server reports;
  * gateway overhead (Caracal only): a 256-token streamed response over HTTP
    (decode tok/s = 1000 / TPOT) vs in-process `caracal generate` on the same
    model (decode tok/s), interleaved repetitions, medians.

llama-server runs with `-np 8` (8 slots), `-t THREADS`, `--jinja` (the GGUF's
chat template); Caracal's server with RAYON_NUM_THREADS=THREADS. For Caracal the
GGUF is imported with `caracal import-gguf` (bf16) and, by default, quantized
with `caracal quantize --to mxfp4` (MXFP4 layers, tied table Q8_0), Caracal's
fast path; `--caracal-format bf16` serves the import as is.

Prints a table with the ratios Caracal / llama-server and the CPU pressure
(/proc/pressure/cpu) at start and end; writes bench/.work/serving.json.
Needs llama-server in bench/.work/llama.cpp-build/bin (bench/build-llama-cpp.sh)
and a release build of caracal (`cargo build --release`; CARACAL_BIN overrides it,
CARACAL_BENCH_BIN the binary that runs `caracal bench --url`).

Usage: bench/serving.py [--num-prompts 16] [--threads 2] [--quick]
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work"
MODELS = WORK / "models"
LLAMA_SERVER = WORK / "llama.cpp-build" / "bin" / "llama-server"
GGUF = Path(os.environ.get("CARACAL_CACHE", ROOT / ".cache" / "models")) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def cpu_pressure():
    try:
        return Path("/proc/pressure/cpu").read_text().strip().splitlines()[0]
    except OSError:
        return "n/a"


def caracal_bin():
    if os.environ.get("CARACAL_BIN"):
        return Path(os.environ["CARACAL_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    subprocess.run(["cargo", "build", "--release", "--bin", "caracal"], cwd=ROOT, check=True)
    return target / "release" / "caracal"


def run(cmd, env=None):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=e)
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def caracal_model(cbin, fmt):
    bf16 = MODELS / "smollm2-135m-bf16"
    if not (bf16 / "config.json").exists():
        log("== caracal import-gguf", GGUF)
        run([cbin, "import-gguf", GGUF, bf16, "--quiet"])
    if fmt == "bf16":
        return bf16
    mx = MODELS / "smollm2-135m-mxfp4"
    if not (mx / "config.json").exists():
        log("== caracal quantize --to mxfp4")
        run([cbin, "quantize", "--to", "mxfp4", bf16, mx, "--quiet"])
    return mx


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url, proc, secs=300):
    deadline = time.time() + secs
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not healthy after {secs} s")


class Server:
    def __init__(self, name, cmd, env):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        e = dict(os.environ)
        e.update(env)
        self.log = open(WORK / f"serving-{name}.log", "w")
        cmd = [str(c) for c in cmd] + ["--port", str(self.port)]
        log(f"== start {name}: {' '.join(cmd)}")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e)

    def __enter__(self):
        wait_healthy(self.url, self.proc)
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def bench(cbin, url, args):
    # The load generator may be another build than the server (CARACAL_BENCH_BIN).
    client = os.environ.get("CARACAL_BENCH_BIN", cbin)
    out = run([client, "bench", "--url", url, "--json", *args])
    return json.loads(out)


def measure(cbin, server, a):
    r = {}
    log(f"   serving c=1,8 on {server.name}")
    r["serving"] = bench(cbin, server.url, [
        "--num-prompts", a.num_prompts, "--input-len", a.input_len, "--output-len", a.output_len,
        "--concurrency", "1,8", "--seed", "1"])
    log(f"   agent-loop {a.sessions}x{a.turns} on {server.name}")
    r["agent_loop"] = bench(cbin, server.url, [
        "--scenario", "agent-loop", "--sessions", a.sessions, "--turns", a.turns,
        "--input-len", a.agent_input_len, "--output-len", a.agent_output_len,
        "--tool-result-len", a.tool_result_len, "--seed", "2"])
    return r


def gateway_overhead(cbin, server, model, threads, reps):
    http, local = [], []
    for i in range(reps):
        h = bench(cbin, server.url, ["--num-prompts", "1", "--concurrency", "1",
                                     "--input-len", "8", "--output-len", "256", "--seed", str(10 + i)])
        tpot = h["levels"][0]["tpot_ms"]["mean"]
        http.append(1000.0 / tpot if tpot > 0 else 0.0)
        g = json.loads(run([cbin, "generate", "--model", model, "--chat", "--prompt",
                            "Tell me a long story about a river.", "--max-tokens", "256",
                            "--ignore-eos", "--json"], env={"RAYON_NUM_THREADS": str(threads)}))
        local.append(g["decode_tokens_per_s"])
        log(f"   overhead rep {i + 1}: http {http[-1]:.1f} tok/s, generate {local[-1]:.1f} tok/s")
    return {"http_decode_tok_s": http, "generate_decode_tok_s": local,
            "http_median": statistics.median(http), "generate_median": statistics.median(local),
            "ratio": statistics.median(http) / max(statistics.median(local), 1e-9)}


def table(res):
    l, c = res["llama-server"], res["caracal"]
    lv = lambda r, i: r["serving"]["levels"][i]
    ag = lambda r: r["agent_loop"]["agent_loop"]
    share = lambda t: "n/a" if t["cached_share"] is None else f"{t['cached_share'] * 100:.1f}%"
    rows = []
    for i, conc in enumerate([1, 8]):
        rows.append((f"output tok/s, concurrency {conc}", lv(l, i)["output_throughput"], lv(c, i)["output_throughput"], True))
        rows.append((f"TTFT p50 ms, concurrency {conc}", lv(l, i)["ttft_ms"]["p50"], lv(c, i)["ttft_ms"]["p50"], False))
        rows.append((f"ITL p50 ms, concurrency {conc}", lv(l, i)["itl_ms"]["p50"], lv(c, i)["itl_ms"]["p50"], False))
    a_l, a_c = ag(l), ag(c)
    rows.append(("agent-loop output tok/s", a_l["output_throughput"], a_c["output_throughput"], True))
    rows.append(("agent-loop first-turn TTFT p50 ms", a_l["first_turn"]["ttft_ms"]["p50"], a_c["first_turn"]["ttft_ms"]["p50"], False))
    rows.append(("agent-loop follow-up TTFT p50 ms", a_l["follow_up"]["ttft_ms"]["p50"], a_c["follow_up"]["ttft_ms"]["p50"], False))
    rows.append(("agent-loop follow-up TTFT mean ms", a_l["follow_up"]["ttft_ms"]["mean"], a_c["follow_up"]["ttft_ms"]["mean"], False))
    rows.append(("agent-loop follow-up TTFT p99 ms", a_l["follow_up"]["ttft_ms"]["p99"], a_c["follow_up"]["ttft_ms"]["p99"], False))
    lines = [f"{'metric':<38} {'llama-server':>13} {'caracal':>10} {'caracal/llama':>14}"]
    for name, a, b, _ in rows:
        lines.append(f"{name:<38} {a:>13.1f} {b:>10.1f} {b / a if a else float('nan'):>13.2f}x")
    lines.append(f"{'agent-loop follow-up cached share':<38} {share(a_l['follow_up']):>13} {share(a_c['follow_up']):>10}")
    lines.append(f"{'mean prompt tokens, serving c=1':<38} {lv(l, 0)['prompt_tokens_mean']:>13.1f} {lv(c, 0)['prompt_tokens_mean']:>10.1f}")
    fails = sum(lv(r, i)["failed"] for r in (l, c) for i in (0, 1)) + a_l["failed"] + a_c["failed"]
    lines.append(f"failed requests (all runs): {fails}")
    o = res.get("gateway_overhead")
    if o:
        lines.append(f"gateway overhead: 256-token stream over HTTP {o['http_median']:.1f} tok/s vs "
                     f"in-process generate {o['generate_median']:.1f} tok/s = {o['ratio']:.3f}x "
                     f"(HTTP {(o['ratio'] - 1) * 100:+.1f}% vs generate)")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--agent-input-len", type=int, default=256)
    p.add_argument("--agent-output-len", type=int, default=32)
    p.add_argument("--tool-result-len", type=int, default=64)
    p.add_argument("--overhead-reps", type=int, default=3)
    p.add_argument("--caracal-format", choices=["mxfp4", "bf16"], default="mxfp4")
    p.add_argument("--quick", action="store_true", help="4 prompts, 4 sessions x 3 turns, 1 overhead rep")
    a = p.parse_args()
    if a.quick:
        a.num_prompts, a.sessions, a.turns, a.overhead_reps = 4, 4, 3, 1
    for k in ("num_prompts", "input_len", "output_len", "sessions", "turns",
              "agent_input_len", "agent_output_len", "tool_result_len"):
        setattr(a, k, str(getattr(a, k)))
    if not LLAMA_SERVER.exists():
        raise SystemExit(f"{LLAMA_SERVER} missing: run bench/build-llama-cpp.sh")
    if not GGUF.exists():
        raise SystemExit(f"{GGUF} missing: run tools/fetch-models.sh")
    MODELS.mkdir(parents=True, exist_ok=True)
    cbin = caracal_bin()
    model = caracal_model(cbin, a.caracal_format)
    res = {"cpu_pressure_start": cpu_pressure(), "threads": a.threads,
           "caracal_model": str(model), "gguf": str(GGUF), "args": vars(a)}
    log("cpu pressure at start:", res["cpu_pressure_start"])
    t = str(a.threads)
    llama_cmd = [LLAMA_SERVER, "-m", GGUF, "--host", "127.0.0.1", "-np", "8", "-t", t, "-tb", t,
                 "-c", "16384", "--jinja", "--alias", "smollm2"]
    with Server("llama-server", llama_cmd, {}) as s:
        res["llama-server"] = measure(cbin, s, a)
    caracal_cmd = [cbin, "serve", "--model", model, "--host", "127.0.0.1", "--served-model-name", "smollm2"]
    with Server("caracal", caracal_cmd, {"RAYON_NUM_THREADS": t}) as s:
        res["caracal"] = measure(cbin, s, a)
        res["gateway_overhead"] = gateway_overhead(cbin, s, model, a.threads, a.overhead_reps)
    res["cpu_pressure_end"] = cpu_pressure()
    log("cpu pressure at end:", res["cpu_pressure_end"])
    res["table"] = table(res)
    (WORK / "serving.json").write_text(json.dumps(res, indent=1))
    print(res["table"])
    print(f"cpu pressure: start {res['cpu_pressure_start']}; end {res['cpu_pressure_end']}")
    print(f"wrote {WORK / 'serving.json'}")


if __name__ == "__main__":
    main()
