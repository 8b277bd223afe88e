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
    # NVRTC: a toolkit's lib folder, or the pip wheel (nvidia-cuda-nvrtc)
    # that Python images carry under site-packages/nvidia/*/lib.
    pip_nv=$(python3 -c 'import nvidia, os; print(" ".join(sorted({os.path.join(r, "lib") for r in [os.path.join(p, d) for p in nvidia.__path__ for d in os.listdir(p)]})))' 2>/dev/null || true)
    lib=$(for d in ${LD_LIBRARY_PATH//:/ } /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $pip_nv; do
        ls "$d"/libnvrtc.so* 2>/dev/null || true
    done | grep -v builtins | head -1)
    mkdir -p /tmp/nv
    if [ -n "$lib" ]; then
        ln -sf "$lib" /tmp/nv/libnvrtc.so
        export LD_LIBRARY_PATH="/tmp/nv:$(dirname "$lib"):${LD_LIBRARY_PATH:-}"
    fi
    # The driver library: cudarc asks for libcuda.so, which a driver mount
    # may hold only as libcuda.so.1.
    cuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so/ {print $NF; exit}')
    [ -z "$cuda" ] && cuda=$(ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null | head -1)
    if [ -n "$cuda" ]; then
        ln -sf "$cuda" /tmp/nv/libcuda.so
        export LD_LIBRARY_PATH="/tmp/nv:${LD_LIBRARY_PATH:-}"
    fi
    echo "nvrtc: ${lib:-not found}"
    echo "libcuda: ${cuda:-not found}"
    ldd --version | sed -n 1p
    nvidia-smi -L || true
    CARACAL_REQUIRE_CUDA=1 target/gpu/kernels_tests cuda --nocapture --test-threads 1
    target/gpu/cuda_gemv_bench
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
