#!/usr/bin/env bash
# Build llama.cpp (CPU) from the source tree inside the PyPI sdist of llama-cpp-python,
# for side-by-side comparisons with Caracal (bench/side-by-side.sh).
#
# Everything goes into bench/.work/ (git-ignored):
#   bench/.work/venv/            python venv with cmake + ninja (PyPI wheels)
#   bench/.work/src/             the unpacked sdist (vendor/llama.cpp inside)
#   bench/.work/llama.cpp-build/ the cmake build; binaries in .../bin/
#
# Flags: native CPU detection OFF and AMX OFF (llama.cpp's AMX kernels trap with SIGILL on
# these VMs, which advertise amx_tile/amx_int8 but fault on tileloadd; llama.cpp PR 26954),
# AVX2/FMA/F16C and AVX-512 (F, VBMI, VNNI, BF16) ON.
#
# Usage: bench/build-llama-cpp.sh            (idempotent; reruns only what is missing)
# Env:   LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default: nproc)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
work="$here/.work"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
jobs="${JOBS:-$(nproc)}"
mkdir -p "$work"

if [ ! -x "$work/venv/bin/cmake" ] || [ ! -x "$work/venv/bin/ninja" ]; then
    echo "== venv with cmake + ninja"
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install --progress-bar on cmake ninja
fi

sdist="$work/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
    echo "== pip download llama-cpp-python==$version (sdist)"
    # --no-binary for this one package only: ':all:' would also build cmake from source.
    python3 -m pip download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$version" -d "$work"
fi

src="$work/src/llama_cpp_python-$version"
if [ ! -d "$src/vendor/llama.cpp" ]; then
    echo "== unpack"
    mkdir -p "$work/src"
    tar -xzf "$sdist" -C "$work/src"
fi

build="$work/llama.cpp-build"
export PATH="$work/venv/bin:$PATH"
if [ ! -f "$build/build.ninja" ] || ! grep -q "LLAMA_BUILD_SERVER:BOOL=ON" "$build/CMakeCache.txt"; then
    echo "== configure"
    cmake -S "$src/vendor/llama.cpp" -B "$build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=OFF \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
        -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
fi

echo "== build (-j$jobs)"
cmake --build "$build" -j "$jobs" \
    --target llama-bench llama-perplexity llama-quantize llama-completion llama-tokenize llama-server

echo "== done: binaries in $build/bin"
ls -1 "$build/bin"
