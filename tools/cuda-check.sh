#!/usr/bin/env bash
# GPU check of the `cuda` feature, in two halves.
#
#   bash tools/cuda-check.sh build   # here (no GPU needed): builds the kernels'
#                                    # test binary and the GEMV bench into target/gpu/
#   bash tools/cuda-check.sh run     # on a machine with an NVIDIA GPU and no Rust
#                                    # toolchain: runs them (carry target/gpu)
#
# cudarc loads libcuda and libnvrtc at run time; it looks for `libnvrtc.so`
# and `.so.12` but not `.so.13`, so `run` links the first libnvrtc it finds
# as libnvrtc.so and puts its folder (which holds libnvrtc-builtins) on
# LD_LIBRARY_PATH. CARACAL_REQUIRE_CUDA=1 turns a missing device into a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
build)
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target-cuda}"
    bin=$(cargo test -p caracal-kernels --features cuda --lib --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "caracal_kernels":
        print(m["executable"])' | tail -1)
    cargo build -p caracal-kernels --features cuda --example cuda_gemv_bench --release
    mkdir -p target/gpu
    cp "$bin" target/gpu/kernels_tests
    cp "$CARGO_TARGET_DIR/release/examples/cuda_gemv_bench" target/gpu/
    ls -la target/gpu
    ;;
run)
    lib=$(for d in ${LD_LIBRARY_PATH//:/ } /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        ls "$d"/libnvrtc.so* 2>/dev/null || true
    done | grep -v builtins | head -1)
    if [ -n "$lib" ]; then
        mkdir -p /tmp/nv && ln -sf "$lib" /tmp/nv/libnvrtc.so
        export LD_LIBRARY_PATH="/tmp/nv:$(dirname "$lib"):${LD_LIBRARY_PATH:-}"
    fi
    echo "nvrtc: ${lib:-not found}"
    nvidia-smi -L || true
    CARACAL_REQUIRE_CUDA=1 target/gpu/kernels_tests cuda --nocapture
    target/gpu/cuda_gemv_bench
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
