#!/usr/bin/env python3
"""Caracal vs llama.cpp, side by side, on SmolLM2-135M-Instruct.

Same GGUF, same thread counts, same text, in one run:

  * imports the Q4_1 GGUF with Caracal (bf16) and quantizes that to MXFP4 with
    `caracal quantize` (default: min-MSE block scales, tied embedding Q8_0 as
    llama.cpp does; also the OCP scale rule, the embedding kept bf16, and the
    embedding in MXFP4 too);
  * makes llama.cpp's comparable files from the same GGUF with
    `llama-quantize --allow-requantize`: Q4_0, MXFP4 for every block tensor
    (`--tensor-type 'blk\\..*=mxfp4'`, embedding Q8_0) and the same with a
    BF16 embedding;
  * speed: `llama-bench` (pp64, pp512, tg128; one timed run per call after
    its own warm-up) for llama.cpp and `caracal generate --json` for Caracal
    (prefill tok/s of a 64- and a 512-token prompt; decode tok/s over 128
    tokens after a 1-token prompt, as llama-bench's tg128 does), with
    `-t N` / RAYON_NUM_THREADS=N. Runs are interleaved (every variant once
    per repetition) so that load drift on a shared machine hits all alike;
    cells report the median and the best run;
  * quality: `llama-perplexity -c 512` and `caracal eval ppl --ctx 512` on
    /usr/share/common-licenses/GPL-3 (2 threads);
  * the memory-bandwidth ceiling: streaming read bandwidth measured now with
    bench/membw.c (1 and 2 threads), divided by the bytes each format streams
    per generated token (all weights once; the tied table once, as lm_head).

Prints one table and the ratios Caracal / llama.cpp; writes everything to
bench/.work/results.json. Needs bench/build-llama-cpp.sh to have run, the
GGUF (tools/fetch-models.sh) and a release build of caracal
(`cargo build --release`; CARGO_TARGET_DIR is honoured, or set CARACAL_BIN).

Usage: bench/side-by-side.py [--reps 3] [--threads 1,2] [--no-speed] [--no-ppl] [--only NAMES]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work"
MODELS = WORK / "models"
LLAMA_BIN = WORK / "llama.cpp-build" / "bin"
GGUF = Path(os.environ.get("CARACAL_CACHE", ROOT / ".cache" / "models")) / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = Path("/usr/share/common-licenses/GPL-3")
# Reference figures of shared/reference/llamacpp-baseline.md, GB/s.
REF_BW = {1: 9.0, 2: 14.8}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def run(cmd, env=None, capture=True, check=True):
    log("$", " ".join(str(c) for c in cmd))
    full_env = dict(os.environ, **(env or {}))
    p = subprocess.run([str(c) for c in cmd], env=full_env, text=True,
                       stdout=subprocess.PIPE if capture else None,
                       stderr=subprocess.PIPE if capture else None)
    if check and p.returncode != 0:
        log(p.stdout or "", p.stderr or "")
        raise SystemExit(f"command failed ({p.returncode}): {cmd[0]}")
    return p


def cpu_pressure():
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(re.search(r"avg10=([\d.]+)", line).group(1))
    except Exception:
        return None


def caracal_bin():
    if os.environ.get("CARACAL_BIN"):
        return Path(os.environ["CARACAL_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    exe = target / "release" / "caracal"
    run(["cargo", "build", "--release", "--bin", "caracal"], capture=False)
    return exe


def safetensors_bytes(folder):
    """Tensor bytes of a checkpoint folder (what a decode step streams)."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def gguf_bytes(cbin, path):
    out = run([cbin, "inspect", path]).stdout
    m = re.search(r"\((\d+) parameters, (\d+) data bytes", out)
    return int(m.group(2)), int(m.group(1))


def stats(xs):
    return {"mean": statistics.mean(xs), "median": statistics.median(xs), "max": max(xs),
            "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "samples": xs}


def prompt_ids(n):
    # Deterministic ids in [17, 49152): past the 17 control tokens of SmolLM2.
    return ",".join(str(17 + (i * 7919 + 104729) % (49152 - 17)) for i in range(n))


def caracal_once(cbin, model, threads, test):
    """One Caracal measurement, tokens/s: `pp64`, `pp512` (prefill) or `tg128` (decode)."""
    env = {"RAYON_NUM_THREADS": str(threads)}
    if test.startswith("pp"):
        ids, n, field = prompt_ids(int(test[2:])), 1, "prefill_tokens_per_s"
    else:
        ids, n, field = prompt_ids(1), int(test[2:]) + 1, "decode_tokens_per_s"
    out = run([cbin, "generate", "--model", model, "--prompt-ids", ids, "--max-tokens", str(n), "--ignore-eos", "--json"], env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])[field]


def llama_once(model, threads, test):
    """One llama-bench measurement (its own warm-up run, then one timed run), tokens/s."""
    p, n = (test[2:], "0") if test.startswith("pp") else ("0", test[2:])
    out = run([LLAMA_BIN / "llama-bench", "-m", model, "-p", p, "-n", n, "-t", str(threads), "-r", "1", "-o", "json"]).stdout
    rows = [r for r in json.loads(out) if r["n_prompt"] + r["n_gen"] > 0]
    return rows[0]["avg_ts"]


def speed_all(cbin, variants, threads, reps):
    """Interleaved measurements: for each repetition, every variant once per
    (threads, test), so that load drift on a shared machine hits all alike."""
    tests = ("pp64", "pp512", "tg128")
    samples = {v[0]: {t: {k: [] for k in tests} for t in threads} for v in variants}
    for name, engine, path, *_ in variants:  # warm-up: page the weights in
        if engine == "caracal":
            caracal_once(cbin, path, 1, "pp64")
    for rep in range(reps):
        for t in threads:
            for k in tests:
                for name, engine, path, *_ in variants:
                    x = caracal_once(cbin, path, t, k) if engine == "caracal" else llama_once(path, t, k)
                    samples[name][t][k].append(x)
        log(f"repetition {rep + 1}/{reps} done; CPU pressure avg10 {cpu_pressure()}%")
    return {n: {t: {k: stats(xs) for k, xs in per_t.items()} for t, per_t in per.items()} for n, per in samples.items()}


def caracal_ppl(cbin, model):
    p = run([cbin, "eval", "ppl", "--model", model, "--file", TEXT, "--ctx", "512", "--json"], env={"RAYON_NUM_THREADS": "2"})
    ppl = float(re.search(r"^perplexity: ([\d.]+)", p.stdout, re.M).group(1))
    err = float(re.search(r"\+/- ([\d.]+)", p.stdout).group(1))
    return {"ppl": ppl, "err": err}


def llama_ppl(model):
    p = run([LLAMA_BIN / "llama-perplexity", "-m", model, "-f", TEXT, "-c", "512", "-t", "2"])
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", p.stdout + p.stderr)
    return {"ppl": float(m.group(1)), "err": float(m.group(2))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--reuse-ppl", action="store_true", help="take perplexities from the previous results.json")
    ap.add_argument("--only", default="", help="comma-separated subset of variant names")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]

    if not (LLAMA_BIN / "llama-bench").exists():
        raise SystemExit("llama.cpp is not built: run bench/build-llama-cpp.sh")
    if not GGUF.exists():
        run([ROOT / "tools" / "fetch-models.sh"], capture=False)
    cbin = caracal_bin()
    MODELS.mkdir(parents=True, exist_ok=True)

    # --- the files ------------------------------------------------------------
    bf16 = MODELS / "caracal-bf16"
    if not (bf16 / "model.safetensors").exists():
        run([cbin, "import-gguf", GGUF, bf16, "--quiet"])
    variants_c = {
        "caracal-mxfp4": [],
        "caracal-mxfp4-ocp": ["--scales", "ocp"],
        "caracal-mxfp4-bf16emb": ["--embeddings", "keep"],
        "caracal-mxfp4-emb": ["--embeddings", "mxfp4"],
    }
    for name, extra in variants_c.items():
        # Re-quantize when the folder was made with other arguments or by an older build.
        stamp = MODELS / name / "caracal-quantize-args.json"
        want = json.dumps({"args": extra, "bin_mtime": int(Path(cbin).stat().st_mtime)})
        if not (MODELS / name / "model.safetensors").exists() or not stamp.exists() or stamp.read_text() != want:
            run([cbin, "quantize", "--to", "mxfp4", bf16, MODELS / name, "--quiet", *extra])
            stamp.write_text(want)
    llama_files = {"llama-q4_1": GGUF}
    for name, qargs in {
        "llama-q4_0": ["Q4_0"],
        "llama-mxfp4": ["--tensor-type", r"blk\..*=mxfp4", "Q8_0"],
        "llama-mxfp4-bf16emb": ["--tensor-type", r"blk\..*=mxfp4", "--token-embedding-type", "bf16", "Q8_0"],
    }.items():
        out = MODELS / f"{name}.gguf"
        if not out.exists():
            type_arg = qargs[-1]
            run([LLAMA_BIN / "llama-quantize", "--allow-requantize", *qargs[:-1], GGUF, out, type_arg])
        llama_files[name] = out

    variants = [
        # name, engine, path, speed?, what it is
        ("llama-q4_1", "llama.cpp", llama_files["llama-q4_1"], True, "original GGUF (Q4_1 blocks, Q8_0 embedding)"),
        ("caracal-bf16", "caracal", bf16, True, "imported GGUF, bf16"),
        ("llama-q4_0", "llama.cpp", llama_files["llama-q4_0"], True, "llama-quantize --allow-requantize Q4_0"),
        ("llama-mxfp4", "llama.cpp", llama_files["llama-mxfp4"], True, "blk.* MXFP4, embedding Q8_0"),
        ("llama-mxfp4-bf16emb", "llama.cpp", llama_files["llama-mxfp4-bf16emb"], True, "blk.* MXFP4, embedding BF16"),
        ("caracal-mxfp4", "caracal", MODELS / "caracal-mxfp4", True, "caracal quantize (min-MSE scales), embedding Q8_0"),
        ("caracal-mxfp4-ocp", "caracal", MODELS / "caracal-mxfp4-ocp", False, "caracal quantize --scales ocp, embedding Q8_0"),
        ("caracal-mxfp4-bf16emb", "caracal", MODELS / "caracal-mxfp4-bf16emb", True, "caracal quantize --embeddings keep (bf16)"),
        ("caracal-mxfp4-emb", "caracal", MODELS / "caracal-mxfp4-emb", True, "caracal quantize --embeddings mxfp4"),
    ]
    if args.only:
        keep = set(args.only.split(","))
        variants = [v for v in variants if v[0] in keep]

    previous = {}
    if (WORK / "results.json").exists():
        previous = json.loads((WORK / "results.json").read_text()).get("variants", {})
    results = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": threads, "reps": args.reps, "variants": {}}
    psi0 = cpu_pressure()
    results["cpu_pressure_avg10_start"] = psi0
    if psi0 is not None and psi0 > 20:
        log(f"warning: CPU pressure avg10={psi0}% (busy machine); speed figures will be noisy")

    # --- bandwidth ---------------------------------------------------------------
    membw = WORK / "membw"
    src = ROOT / "bench" / "membw.c"
    if not membw.exists() or membw.stat().st_mtime < src.stat().st_mtime:
        run(["cc", "-O3", "-mavx2", "-mfma", "-pthread", src, "-o", membw])
    bw = {t: float(run([membw, str(t), "1024", "5"]).stdout.strip()) for t in threads}
    log(f"streaming read bandwidth: {bw} GB/s")
    results["bandwidth_gbs"] = bw

    for name, engine, path, speed, what in variants:
        v = {"engine": engine, "path": str(path), "what": what}
        if engine == "caracal":
            v["bytes_per_token"] = safetensors_bytes(path)
        else:
            v["bytes_per_token"], params = gguf_bytes(cbin, path)
        if args.reuse_ppl and "ppl" in previous.get(name, {}):
            v["ppl"] = previous[name]["ppl"]
        elif not args.no_ppl:
            v["ppl"] = caracal_ppl(cbin, path) if engine == "caracal" else llama_ppl(path)
            log(f"{name}: PPL {v['ppl']['ppl']:.4f}")
        results["variants"][name] = v
    if not args.no_speed:
        timed = [v for v in variants if v[3]]
        for name, per in speed_all(cbin, timed, threads, args.reps).items():
            results["variants"][name]["speed"] = per
    results["cpu_pressure_avg10_end"] = cpu_pressure()
    (WORK / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(render(results, threads))


def render(r, threads):
    V = r["variants"]
    bw = {int(k): x for k, x in r["bandwidth_gbs"].items()}
    lines = []
    head = "| variant | MB/token | PPL GPL-3 (c=512) |"
    sep = "|---|---|---|"
    for t in threads:
        head += f" pp64 t{t} | pp512 t{t} | tg128 t{t} | tg t{t} % ceiling |"
        sep += "---|---|---|---|"
    lines += [head, sep]
    for name, v in V.items():
        mb = v["bytes_per_token"] / 1e6
        row = f"| {name} | {mb:.1f} | " + (f"{v['ppl']['ppl']:.3f} ± {v['ppl']['err']:.3f}" if "ppl" in v else "-") + " |"
        for t in threads:
            s = v.get("speed", {}).get(t) or v.get("speed", {}).get(str(t))
            if s:
                ceil = bw[t] * 1e9 / v["bytes_per_token"]
                row += "".join(f" {s[k]['median']:.1f} ({s[k]['max']:.1f}) |" for k in ("pp64", "pp512", "tg128"))
                row += f" {100 * s['tg128']['max'] / ceil:.0f}% of {ceil:.0f} |"
            else:
                row += " - | - | - | - |"
        lines.append(row)
    lines.append("")
    lines.append("Speed cells: median (best) tokens/s over the repetitions; '% ceiling' uses the best tg128.")
    lines.append("Ratios: median (best).")
    lines.append("Bandwidth (bench/membw.c, now): " + ", ".join(f"{bw[t]:.1f} GB/s at {t} thread(s)" for t in threads)
                 + f"; reference figures {REF_BW[1]} / {REF_BW[2]} GB/s.")
    lines.append(f"CPU pressure avg10: start {r.get('cpu_pressure_avg10_start')}%, end {r.get('cpu_pressure_avg10_end')}%.")

    def ratio(a, b, t, k):
        try:
            sa = V[a]["speed"].get(t) or V[a]["speed"][str(t)]
            sb = V[b]["speed"].get(t) or V[b]["speed"][str(t)]
            return sa[k]["median"] / sb[k]["median"], sa[k]["max"] / sb[k]["max"]
        except (KeyError, TypeError, ZeroDivisionError):
            return None

    lines.append("")
    if "caracal-bf16" in V and "llama-q4_1" in V and "ppl" in V["caracal-bf16"] and "ppl" in V["llama-q4_1"]:
        a, b = V["caracal-bf16"]["ppl"]["ppl"], V["llama-q4_1"]["ppl"]["ppl"]
        lines.append(f"PPL caracal-bf16 / llama-q4_1 = {a:.4f} / {b:.4f} = {a / b:.4f} ({100 * (a / b - 1):+.2f}%; must be within ±1%)")
    for a, b in (("caracal-mxfp4", "llama-mxfp4"), ("caracal-mxfp4-bf16emb", "llama-mxfp4-bf16emb"), ("caracal-mxfp4", "llama-q4_0"),
                 ("caracal-mxfp4-emb", "llama-mxfp4"), ("caracal-bf16", "llama-q4_1")):
        if a in V and b in V:
            parts = []
            for t in threads:
                for k in ("pp64", "pp512", "tg128"):
                    x = ratio(a, b, t, k)
                    if x is not None:
                        parts.append(f"{k} t{t} {x[0]:.2f}x ({x[1]:.2f}x)")
            ppl = ""
            if "ppl" in V[a] and "ppl" in V[b]:
                ppl = f"; PPL {V[a]['ppl']['ppl']:.3f} vs {V[b]['ppl']['ppl']:.3f}"
            lines.append(f"{a} / {b}: " + (", ".join(parts) or "-") + ppl)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
