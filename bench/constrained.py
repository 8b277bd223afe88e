#!/usr/bin/env python3
"""Constrained vs free decoding, and jump-forward on vs off, side by side.

Imports SmolLM2-135M-Instruct (the Q4_1 GGUF in .cache/models) with
`caracal import-gguf` once (bench/.work/smollm2), then for each of
`--jump-forward on` and `off` starts `caracal serve` on it and measures,
over the OpenAI Chat Completions API:

  * free: plain chat completions with `ignore_eos` and a fixed
    `max_tokens` (decode tokens/s = completion tokens / wall time);
  * constrained: the same with a `response_format` json_schema whose keys
    are long fixed strings (most of the output is forced), run until the
    grammar completes;

at concurrency 1 and 8 (`--concurrency`). Output: one table and
bench/.work/constrained.json. Needs a release build (`cargo build
--release`; set CARACAL_BIN to use another binary).

Usage: bench/constrained.py [--reps 3] [--max-tokens 128] [--concurrency 1,8]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "bench", ".work")
GGUF = os.path.join(ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
BIN = os.environ.get("CARACAL_BIN", os.path.join(
    os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "caracal"))

# Long fixed keys: the grammar forces them, jump-forward appends them at once.
LONG_KEYS = {
    "type": "object",
    "properties": {
        "the_name_of_the_city_being_described": {"type": "string", "maxLength": 16},
        "the_number_of_days_in_the_forecast_window": {"type": "integer", "minimum": 1, "maximum": 14},
        "the_unit_system_used_for_every_temperature": {"enum": ["celsius", "fahrenheit"]},
        "a_short_free_text_summary_of_the_weather": {"type": "string", "maxLength": 40},
    },
    "required": ["the_name_of_the_city_being_described",
                 "the_number_of_days_in_the_forecast_window",
                 "the_unit_system_used_for_every_temperature",
                 "a_short_free_text_summary_of_the_weather"],
    "additionalProperties": False,
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def run_batch(port, body, n):
    """n identical requests at once; returns (completion tokens, seconds)."""
    tokens = [0] * n
    def one(i):
        b = dict(body, seed=i)
        tokens[i] = post(port, b)["usage"]["completion_tokens"]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens), time.perf_counter() - t0


def serve(model_dir, jump_forward):
    port = free_port()
    p = subprocess.Popen([BIN, "serve", "--model", model_dir, "--port", str(port),
                          "--jump-forward", jump_forward],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p, port
        except Exception:
            if p.poll() is not None:
                sys.exit(f"caracal serve exited: {p.stderr.read()}")
            time.sleep(0.5)
    p.kill()
    sys.exit("caracal serve did not come up")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    os.makedirs(WORK, exist_ok=True)
    model_dir = os.path.join(WORK, "smollm2")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        subprocess.run([BIN, "import-gguf", GGUF, model_dir, "--quiet"], check=True)
    messages = [{"role": "user", "content": "Describe the weather in Paris this week."}]
    free = {"model": "smollm2", "messages": messages, "max_tokens": args.max_tokens,
            "ignore_eos": True, "temperature": 1.0}
    constrained = {"model": "smollm2", "messages": messages, "max_tokens": 512,
                   "temperature": 1.0,
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "w", "schema": LONG_KEYS}}}
    results = {}
    for jf in ("on", "off"):
        p, port = serve(model_dir, jf)
        try:
            post(port, dict(free, max_tokens=4))  # warm-up
            for name, body in (("free", free), ("constrained", constrained)):
                for n in levels:
                    rates = []
                    for _ in range(args.reps):
                        toks, secs = run_batch(port, body, n)
                        rates.append(toks / secs)
                    results[f"jump-forward {jf} / {name} / c={n}"] = max(rates)
        finally:
            p.terminate()
            p.wait()
    print(f"{'run':45} {'decode tok/s (best of reps)':>28}")
    for k, v in results.items():
        print(f"{k:45} {v:28.1f}")
    for n in levels:
        f, c = results[f"jump-forward off / free / c={n}"], results[f"jump-forward off / constrained / c={n}"]
        j = results[f"jump-forward on / constrained / c={n}"]
        print(f"c={n}: constrained/free {c / f:.3f} (jump-forward off), "
              f"jump-forward on/off on long keys {j / c:.3f}")
    with open(os.path.join(WORK, "constrained.json"), "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
