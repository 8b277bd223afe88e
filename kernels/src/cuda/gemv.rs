//! # Batched GEMV kernels: `out[n, rows] = x[n, cols] · Wᵀ` for n = 1..=16
//!
//! The weight stays on the device in the layout [`crate::Matrix`] stores:
//! - **BF16**: `u16 [rows, cols]`; a 16-byte load holds 8 values, value `2j`
//!   in the low half of word `j`.
//! - **Q8_0**: `i8 [rows, cols]` plus f32 scales `[rows, cols/32]`; a 16-byte
//!   load is half a block.
//! - **MXFP4**: blocks `u8 [rows, cols/32, 16]` plus E8M0 scales
//!   `u8 [rows, cols/32]`; a 16-byte load is one block, byte `j` holding
//!   element `2j` in its low nibble and `2j+1` in its high nibble; scale byte
//!   `e` is `2^(e−127)`, `0xFF` is NaN (its whole row comes out NaN).
//!
//! `cols` must be a multiple of 32 for every dtype (checked at upload), which
//! also makes every row start 16-byte aligned.
//!
//! ## Kernel shape
//!
//! One kernel per (dtype, `N` ∈ {1, 2, 4, 8}, `RT` ∈ {1, 2, 4}, staged or
//! direct activations), all from the template `caracal_gemv<N, RT, DX, Format>`:
//! - A block is 8 warps. Each warp owns `RT` consecutive weight rows and
//!   walks their whole length, lane `l` taking 16-byte chunks `l, l+32, …`
//!   of every row, so each warp-wide load is 512 contiguous bytes. A lane
//!   issues `RT · U` chunk loads (`U = 4/RT`, at least 1) before using any.
//! - Activations, two ways (`DX`): the *direct* kernels (BF16 and Q8_0 by
//!   default, see [`default_direct_x`]) read each lane's `float4`s of x from
//!   global memory, where every warp of the SM reading the same x keeps it
//!   in L1, with no shared memory and no block barrier. The *staged*
//!   kernels (MXFP4) copy `kt_max` columns of the `N` activation rows at a
//!   time to shared memory (≤ 36 KiB), padded by 4 floats per 32 so that the
//!   `float4` reads of consecutive lanes fall in distinct banks. Rows `n..N`
//!   read as zeros either way; the template is chosen as the smallest
//!   `N ≥ n`, and batches above 8 run as several launches of ≤ 8 rows.
//! - Decoding is in registers: bf16 is a shift or a mask; int8 is a byte
//!   permute plus one exact float subtraction (no conversion instruction);
//!   an E2M1 code is one shift and one mask giving its byte offset into a
//!   16-float table in shared memory (the 16 entries sit in 16 distinct
//!   banks, so a warp's lookups never conflict; equal codes broadcast).
//!   For MXFP4 and Q8_0, whose 16-byte chunk shares one scale, each chunk's
//!   products are summed unscaled and the sum is multiplied by the scale
//!   once (`RT · N ≤ 8`; larger tiles scale each value to save registers).
//!   Accumulation is f32 `fmaf` into `RT × N` registers.
//! - The end is a butterfly `__shfl_xor_sync` reduction; lane `r·N + i`
//!   stores `out[i, row0 + r]`.
//!
//! Each product is an f32 product of the decoded value and the activation,
//! as on the CPU; the scale is applied per chunk (exact for MXFP4's powers of
//! two, one extra rounding for Q8_0's f32 scales) and the summation order
//! differs, so results agree with [`crate::Matrix::matmul`] (f32 activation
//! mode) to f32 rounding. Known edge: MXFP4 scale bytes ≥ 253 can overflow
//! f32 on either path, and an overflowed partial sum may then differ (±∞ vs
//! NaN) from the CPU's per-value overflow.
//!
//! The CUDA C++ body below is plain enough to compile as host C++ with a small
//! emulation of `threadIdx`, `__syncthreads`, `__shfl_xor_sync`, `__byte_perm`
//! and the two prelude helpers; that is how it was checked before any GPU ran
//! it (the emulation is not part of the crate).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{driver, CudaDevice, CudaError, CudaResult};
use crate::dtype::DType;
use crate::matrix::Matrix;

/// Warps per block; each warp owns `rows_per_warp` weight rows.
pub const WARPS_PER_BLOCK: usize = 8;
/// Threads per block (the kernels' `__launch_bounds__`).
pub const THREADS_PER_BLOCK: u32 = (WARPS_PER_BLOCK * 32) as u32;
/// Largest activation batch one launch handles; larger batches are split.
pub const MAX_BATCH_PER_LAUNCH: usize = 8;
/// Activation elements (`N · kt_max`) staged in shared memory per block:
/// 8192 floats plus 1/8 padding = 36 KiB, under the 48 KiB a launch may use
/// without opting in, leaving room for 5–6 blocks per SM on Hopper.
const STAGE_ELEMS: usize = 8192;
/// Batch templates compiled (`N`); a batch of `n` runs the smallest `N ≥ n`.
const TEMPLATE_N: [usize; 4] = [1, 2, 4, 8];
/// Rows-per-warp templates compiled (`RT`).
pub const ROWS_PER_WARP: [usize; 3] = [1, 2, 4];

/// Helpers written in CUDA-specific syntax (dynamic shared memory, inline
/// PTX for 32-bit shared addresses), kept apart from the portable body.
const PRELUDE: &str = r#"
// Dynamic shared memory of the launch (16-byte aligned through float4).
__device__ __forceinline__ float* caracal_dyn_smem() {
    extern __shared__ float4 caracal_smem4[];
    return reinterpret_cast<float*>(caracal_smem4);
}

// 32-bit shared-window address of a __shared__ object.
__device__ __forceinline__ unsigned int caracal_smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// f32 load from a shared-window address.
__device__ __forceinline__ float caracal_lds_f32(unsigned int a) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a));
    return v;
}
"#;

/// The kernels (CUDA C++, no headers: NVRTC provides the vector types and
/// intrinsics). See the module docs for the design.
const KERNELS: &str = r#"// ---- Caracal GEMV kernels (the prelude defines caracal_dyn_smem, caracal_smem_addr, caracal_lds_f32) ----

// E2M1 code -> value (codes 8-15 carry the sign; 8 is -0.0).
__constant__ float CARACAL_E2M1[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

__device__ __forceinline__ int caracal_min(int a, int b) { return a < b ? a : b; }

// The E2M1 table in shared memory, filled by each MXFP4 kernel at its start;
// 64-byte aligned so that base | (code * 4) is its entry's address.
__shared__ __align__(64) float caracal_e2m1_smem[16];

// Word i (0..3) of a 16-byte chunk; i is a compile-time constant after unrolling.
__device__ __forceinline__ unsigned int caracal_word(const uint4& q, int i) {
    return i == 0 ? q.x : (i == 1 ? q.y : (i == 2 ? q.z : q.w));
}

// Index of element k of a staged activation row: 4 floats of padding after
// every 32 so that the float4 reads of 8 consecutive lanes hit distinct banks.
__device__ __forceinline__ int caracal_xpad(int k) { return k + ((k >> 5) << 2); }

// E8M0 byte -> 2^(e-127); 0 is the subnormal 2^-127, 0xFF is NaN.
__device__ __forceinline__ float caracal_e8m0(unsigned int e) {
    return e == 0u ? __uint_as_float(0x00400000u)
                   : (e == 255u ? __uint_as_float(0x7fc00000u) : __uint_as_float(e << 23));
}

// bf16 rows: a chunk is 8 values; element 2j is the low half of word j.
// Unscaled: decode gives the weights themselves.
struct CaracalBf16 {
    static constexpr int ELEMS = 8;
    static constexpr bool SCALED = false;
    const uint4* w;
    int chunks_per_row;
    __device__ __forceinline__ float scale(int row, int chunk) const { return 1.0f; }
    __device__ __forceinline__ void decode(const uint4& q, int g, float* v) const {
        const unsigned int a = caracal_word(q, 2 * g);
        const unsigned int b = caracal_word(q, 2 * g + 1);
        v[0] = __uint_as_float(a << 16);
        v[1] = __uint_as_float(a & 0xffff0000u);
        v[2] = __uint_as_float(b << 16);
        v[3] = __uint_as_float(b & 0xffff0000u);
    }
};

// Q8_0 rows: a chunk is 16 int8 values, half a 32-value block with one f32
// scale (applied by caracal_gemv per chunk, or per value for large tiles).
struct CaracalQ8 {
    static constexpr int ELEMS = 16;
    static constexpr bool SCALED = true;
    const uint4* w;
    int chunks_per_row;
    const float* scales;
    int blocks_per_row;
    __device__ __forceinline__ float scale(int row, int chunk) const {
        return __ldg(scales + (unsigned long long)row * blocks_per_row + (chunk >> 1));
    }
    // int8 -> f32 without a conversion instruction: byte ^ 0x80 is b + 128;
    // 0x4B0000uu is the float 2^23 + uu, and subtracting 2^23 + 128 is exact.
    __device__ __forceinline__ void decode(const uint4& q, int g, float* v) const {
        const unsigned int u = caracal_word(q, g) ^ 0x80808080u;
        v[0] = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7440u)) - 8388736.0f;
        v[1] = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7441u)) - 8388736.0f;
        v[2] = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7442u)) - 8388736.0f;
        v[3] = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7443u)) - 8388736.0f;
    }
};

// MXFP4 rows: a chunk is one 32-value block; byte j holds element 2j in its
// low nibble and 2j+1 in its high nibble, so nibble t of word i is element
// 8i+t. Codes are looked up in a 16-float shared table: its entries sit in 16
// distinct banks, so a warp's lookups are conflict-free (equal codes
// broadcast). The E8M0 scale is applied by caracal_gemv like Q8_0's.
struct CaracalMxfp4 {
    static constexpr int ELEMS = 32;
    static constexpr bool SCALED = true;
    const uint4* w;
    int chunks_per_row;
    const unsigned char* scales;
    unsigned int lut;  // shared-window address of caracal_e2m1_smem
    __device__ __forceinline__ float scale(int row, int chunk) const {
        return caracal_e8m0(__ldg(scales + (unsigned long long)row * chunks_per_row + chunk));
    }
    // Value of the code at bit p of word: its byte offset code*4 is one shift
    // and one mask, OR-ed into the aligned table address (one LOP3).
    __device__ __forceinline__ float code(unsigned int word, int p) const {
        const unsigned int off = (p >= 2 ? (word >> (p - 2)) : (word << 2)) & 0x3cu;
        return caracal_lds_f32(lut | off);
    }
    __device__ __forceinline__ void decode(const uint4& q, int g, float* v) const {
        const unsigned int word = caracal_word(q, g >> 1);
        const int p = (g & 1) * 16;
        v[0] = code(word, p);
        v[1] = code(word, p + 4);
        v[2] = code(word, p + 8);
        v[3] = code(word, p + 12);
    }
};

// Loads the U chunks c0, c0+32, ... of each of a warp's RT rows (and their
// scales); chunks at or past nch read as zeros with a zero scale.
template <int U, int RT, class F>
__device__ __forceinline__ void caracal_load(const F& f, const int (&rc)[RT], int cb, int c0,
                                             int nch, uint4 (&q)[U][RT], float (&s)[U][RT]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = c0 + 32 * u;
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            if (c < nch) {
                q[u][r] = __ldg(f.w + (unsigned long long)rc[r] * f.chunks_per_row + (cb + c));
                s[u][r] = f.scale(rc[r], cb + c);
            } else {
                q[u][r].x = 0u;
                q[u][r].y = 0u;
                q[u][r].z = 0u;
                q[u][r].w = 0u;
                s[u][r] = 0.0f;
            }
        }
    }
}

// y[i, row] = sum_k x[i, k] * W[row, k] for i < n <= N, rows of W in format F.
// Each warp owns RT consecutive rows and walks their whole length; the block
// stages kt_max columns of the N activation rows in shared memory at a time.
// With DX the activations are not staged: each lane reads its float4s of x
// straight from global memory (L1-cached, as every warp of the SM reads the
// same x), kt_max is cols and the block never synchronises.
template <int N, int RT, bool DX, class F>
__device__ __forceinline__ void caracal_gemv(const F& f, const float* __restrict__ x,
                                             float* __restrict__ y, int rows, int cols,
                                             int n, int kt_max) {
    constexpr int U = RT >= 4 ? 1 : 4 / RT;  // chunks in flight per row and lane
    constexpr int E = F::ELEMS;
    float* xs = caracal_dyn_smem();
    const int lane = threadIdx.x & 31;
    const int row0 = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * RT;
    const int ld = caracal_xpad(kt_max);
    int rc[RT];
#pragma unroll
    for (int r = 0; r < RT; ++r) rc[r] = caracal_min(row0 + r, rows - 1);
    float acc[RT][N];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int i = 0; i < N; ++i) acc[r][i] = 0.0f;
    }
    for (int k0 = 0; k0 < cols; k0 += kt_max) {
        const int kt = caracal_min(kt_max, cols - k0);
        if (!DX) __syncthreads();
#pragma unroll
        for (int i = 0; i < N && !DX; ++i) {
            float* xsi = xs + i * ld;
            if (i < n) {
                const float* xr = x + (unsigned long long)i * cols + k0;
                for (int k = threadIdx.x; k < kt; k += blockDim.x) xsi[caracal_xpad(k)] = xr[k];
            } else {
                for (int k = threadIdx.x; k < kt; k += blockDim.x) xsi[caracal_xpad(k)] = 0.0f;
            }
        }
        if (!DX) __syncthreads();
        if (row0 < rows) {
            const int nch = kt / E;
            const int cb = k0 / E;
            for (int c0 = lane; c0 < nch; c0 += 32 * U) {
                uint4 q[U][RT];
                float s[U][RT];
                caracal_load<U, RT>(f, rc, cb, c0, nch, q, s);
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = c0 + 32 * u;
                    if (c < nch) {
                        // Partial sums per chunk, scaled once per chunk, while
                        // they fit in registers; else each value is scaled.
                        constexpr bool PARTIAL = F::SCALED && RT * N <= 8;
                        float part[RT][N];
#pragma unroll
                        for (int r = 0; r < RT; ++r) {
#pragma unroll
                            for (int i = 0; i < N; ++i) part[r][i] = 0.0f;
                        }
#pragma unroll
                        for (int g = 0; g < E / 4; ++g) {
                            const int off = caracal_xpad(c * E + 4 * g);
                            float4 xv[N];
#pragma unroll
                            for (int i = 0; i < N; ++i) {
                                if (!DX) {
                                    xv[i] = *reinterpret_cast<const float4*>(xs + i * ld + off);
                                } else if (i < n) {
                                    xv[i] = __ldg(reinterpret_cast<const float4*>(
                                        x + (unsigned long long)i * cols + k0 + c * E + 4 * g));
                                } else {
                                    xv[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                                }
                            }
#pragma unroll
                            for (int r = 0; r < RT; ++r) {
                                float v[4];
                                f.decode(q[u][r], g, v);
                                if (F::SCALED && !PARTIAL) {
#pragma unroll
                                    for (int t = 0; t < 4; ++t) v[t] *= s[u][r];
                                }
#pragma unroll
                                for (int i = 0; i < N; ++i) {
                                    float& a = PARTIAL ? part[r][i] : acc[r][i];
                                    a = fmaf(v[0], xv[i].x, a);
                                    a = fmaf(v[1], xv[i].y, a);
                                    a = fmaf(v[2], xv[i].z, a);
                                    a = fmaf(v[3], xv[i].w, a);
                                }
                            }
                        }
                        if (PARTIAL) {
#pragma unroll
                            for (int r = 0; r < RT; ++r) {
#pragma unroll
                                for (int i = 0; i < N; ++i)
                                    acc[r][i] = fmaf(part[r][i], s[u][r], acc[r][i]);
                            }
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            float v = acc[r][i];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            acc[r][i] = v;
        }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if (lane == r * N + i && row0 + r < rows && i < n)
                y[(unsigned long long)i * rows + row0 + r] = acc[r][i];
        }
    }
}

#define CARACAL_GEMV_KERNELS(N, RT, DX, SFX)                                                      \
    extern "C" __global__ void __launch_bounds__(256, 2) caracal_gemv_bf16_n##N##_r##RT##SFX(        \
        const uint4* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,     \
        int rows, int cols, int n, int kt_max) {                                             \
        CaracalBf16 f;                                                                       \
        f.w = w;                                                                             \
        f.chunks_per_row = cols / 8;                                                         \
        caracal_gemv<N, RT, DX>(f, x, y, rows, cols, n, kt_max);                                 \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2) caracal_gemv_q8_0_n##N##_r##RT##SFX(        \
        const uint4* __restrict__ w, const float* __restrict__ scales,                       \
        const float* __restrict__ x, float* __restrict__ y, int rows, int cols, int n,       \
        int kt_max) {                                                                        \
        CaracalQ8 f;                                                                         \
        f.w = w;                                                                             \
        f.chunks_per_row = cols / 16;                                                        \
        f.scales = scales;                                                                   \
        f.blocks_per_row = cols / 32;                                                        \
        caracal_gemv<N, RT, DX>(f, x, y, rows, cols, n, kt_max);                                 \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2) caracal_gemv_mxfp4_n##N##_r##RT##SFX(       \
        const uint4* __restrict__ w, const unsigned char* __restrict__ scales,               \
        const float* __restrict__ x, float* __restrict__ y, int rows, int cols, int n,       \
        int kt_max) {                                                                        \
        if (threadIdx.x < 16) caracal_e2m1_smem[threadIdx.x] = CARACAL_E2M1[threadIdx.x];    \
        CaracalMxfp4 f;                                                                      \
        f.w = w;                                                                             \
        f.chunks_per_row = cols / 32;                                                        \
        f.scales = scales;                                                                   \
        f.lut = caracal_smem_addr(caracal_e2m1_smem);                                        \
        caracal_gemv<N, RT, DX>(f, x, y, rows, cols, n, kt_max);                                 \
    }

CARACAL_GEMV_KERNELS(1, 1, false, )
CARACAL_GEMV_KERNELS(1, 1, true, _dx)
CARACAL_GEMV_KERNELS(1, 2, false, )
CARACAL_GEMV_KERNELS(1, 2, true, _dx)
CARACAL_GEMV_KERNELS(1, 4, false, )
CARACAL_GEMV_KERNELS(1, 4, true, _dx)
CARACAL_GEMV_KERNELS(2, 1, false, )
CARACAL_GEMV_KERNELS(2, 1, true, _dx)
CARACAL_GEMV_KERNELS(2, 2, false, )
CARACAL_GEMV_KERNELS(2, 2, true, _dx)
CARACAL_GEMV_KERNELS(2, 4, false, )
CARACAL_GEMV_KERNELS(2, 4, true, _dx)
CARACAL_GEMV_KERNELS(4, 1, false, )
CARACAL_GEMV_KERNELS(4, 1, true, _dx)
CARACAL_GEMV_KERNELS(4, 2, false, )
CARACAL_GEMV_KERNELS(4, 2, true, _dx)
CARACAL_GEMV_KERNELS(4, 4, false, )
CARACAL_GEMV_KERNELS(4, 4, true, _dx)
CARACAL_GEMV_KERNELS(8, 1, false, )
CARACAL_GEMV_KERNELS(8, 1, true, _dx)
CARACAL_GEMV_KERNELS(8, 2, false, )
CARACAL_GEMV_KERNELS(8, 2, true, _dx)
CARACAL_GEMV_KERNELS(8, 4, false, )
CARACAL_GEMV_KERNELS(8, 4, true, _dx)
"#;

/// The full CUDA source NVRTC compiles: prelude, then the kernels.
pub fn source() -> String {
    format!("{PRELUDE}\n{KERNELS}")
}

/// Kernel-name fragment of a dtype (`None` when there is no GPU kernel for it).
fn dtype_tag(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::BF16 => Some("bf16"),
        DType::Q8_0 => Some("q8_0"),
        DType::Mxfp4 => Some("mxfp4"),
        DType::F32 | DType::F16 => None,
    }
}

/// Name of the kernel for a dtype tag, batch template `n`, rows per warp and
/// whether it reads the activations straight from global memory.
fn kernel_name(tag: &str, n: usize, rows_per_warp: usize, direct_x: bool) -> String {
    let dx = if direct_x { "_dx" } else { "" };
    format!("caracal_gemv_{tag}_n{n}_r{rows_per_warp}{dx}")
}

/// Every kernel the module defines (what [`CudaDevice::open`] loads).
pub fn kernel_names() -> Vec<String> {
    let mut names = Vec::new();
    for tag in ["bf16", "q8_0", "mxfp4"] {
        for n in TEMPLATE_N {
            for rt in ROWS_PER_WARP {
                for dx in [false, true] {
                    names.push(kernel_name(tag, n, rt, dx));
                }
            }
        }
    }
    names
}

/// How one launch of at most [`MAX_BATCH_PER_LAUNCH`] activation rows is run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchPlan {
    /// The kernel's name in the module.
    pub kernel: String,
    /// The batch template `N` (≥ the rows this launch multiplies).
    pub template_n: usize,
    /// Weight rows each warp owns (`RT`).
    pub rows_per_warp: usize,
    /// Whether the kernel reads the activations from global memory instead
    /// of staging them in shared memory (`DX`).
    pub direct_x: bool,
    /// Blocks in the grid (`ceil(rows / (8 · RT))`).
    pub grid: u32,
    /// Columns of activations staged in shared memory at a time (multiple of 32).
    pub kt_max: u32,
    /// Dynamic shared memory per block in bytes.
    pub shared_mem_bytes: u32,
}

/// Rows per warp when the caller does not choose: the largest of 4, 2, 1
/// that still gives every SM at least one block (more rows per warp reuse
/// each staged activation more; more blocks hide more memory latency).
pub fn default_rows_per_warp(rows: usize, sm_count: usize) -> usize {
    for rt in [4, 2] {
        if rows.div_ceil(WARPS_PER_BLOCK * rt) >= sm_count.max(1) {
            return rt;
        }
    }
    1
}

/// Whether a launch reads x directly when the caller does not choose: yes
/// for BF16 and Q8_0, no for MXFP4.
///
/// Measured on an H200 (`cuda_gemv_bench`, n = 1 and 8, three shapes):
/// reading x through L1 instead of staging it beat staging by 1.1–1.2× at
/// n = 1 and 1.5–2.4× at n = 8 for BF16 (e.g. [4096 × 14336] n = 8: 609 →
/// 1486 GB/s), and for Q8_0 at its best rows per warp (n = 8 [4096 ×
/// 14336]: 349 → 742 GB/s). MXFP4's kernels, already at the 128-register
/// cap with their table decode, spill when x comes from global memory and
/// ran at 0.4–0.9× of the staged ones, so they keep the stage.
pub fn default_direct_x(dtype: DType) -> bool {
    dtype != DType::Mxfp4
}

/// Rows per warp for a launch when the caller does not choose:
/// [`default_rows_per_warp`], except that Q8_0's direct 8-row kernels take 4
/// (on the H200 rt4 ran 1.4–1.7× rt2 there even with fewer blocks than SMs).
fn default_launch_rows_per_warp(
    dtype: DType,
    template_n: usize,
    direct_x: bool,
    rows: usize,
    sm_count: usize,
) -> usize {
    if dtype == DType::Q8_0 && template_n == 8 && direct_x {
        4
    } else {
        default_rows_per_warp(rows, sm_count)
    }
}

/// Plans one launch for `n` (1..=8) activation rows of a `[rows, cols]`
/// weight. `rows_per_warp` overrides the default rows per warp (1, 2 or 4;
/// see [`default_rows_per_warp`]) and `direct_x` [`default_direct_x`].
pub fn plan(
    dtype: DType,
    rows: usize,
    cols: usize,
    n: usize,
    sm_count: usize,
    rows_per_warp: Option<usize>,
    direct_x: Option<bool>,
) -> CudaResult<LaunchPlan> {
    let tag = dtype_tag(dtype).ok_or_else(|| CudaError::DType {
        op: "gemv plan",
        dtype: dtype.to_string(),
    })?;
    check_dims("gemv plan", rows, cols)?;
    if n == 0 || n > MAX_BATCH_PER_LAUNCH {
        return Err(CudaError::Shape {
            op: "gemv plan",
            detail: format!("one launch takes 1..={MAX_BATCH_PER_LAUNCH} activation rows, got {n}"),
        });
    }
    let template_n = TEMPLATE_N
        .into_iter()
        .find(|&t| t >= n)
        .expect("n <= MAX_BATCH_PER_LAUNCH = the largest template");
    let direct_x = direct_x.unwrap_or_else(|| default_direct_x(dtype));
    let rt = rows_per_warp.unwrap_or_else(|| {
        default_launch_rows_per_warp(dtype, template_n, direct_x, rows, sm_count)
    });
    if !ROWS_PER_WARP.contains(&rt) {
        return Err(CudaError::Shape {
            op: "gemv plan",
            detail: format!("rows per warp must be one of {ROWS_PER_WARP:?}, got {rt}"),
        });
    }
    let kt_max = if direct_x {
        cols
    } else {
        cols.min(STAGE_ELEMS / template_n)
    };
    let padded = if direct_x { 0 } else { kt_max / 32 * 36 };
    Ok(LaunchPlan {
        kernel: kernel_name(tag, template_n, rt, direct_x),
        template_n,
        rows_per_warp: rt,
        direct_x,
        grid: rows.div_ceil(WARPS_PER_BLOCK * rt) as u32,
        kt_max: kt_max as u32,
        shared_mem_bytes: (template_n * padded * 4) as u32,
    })
}

/// Checks the dimensions every kernel relies on.
fn check_dims(op: &'static str, rows: usize, cols: usize) -> CudaResult<()> {
    if cols == 0 || !cols.is_multiple_of(32) {
        return Err(CudaError::Shape {
            op,
            detail: format!("GPU matmul needs cols to be a positive multiple of 32, got {cols}"),
        });
    }
    if rows == 0 || rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(CudaError::Shape {
            op,
            detail: format!("rows and cols must be in 1..=2^31-1, got [{rows}, {cols}]"),
        });
    }
    Ok(())
}

/// Checks that `m` can be uploaded: a dtype with a kernel, `cols` a multiple
/// of 32, and row-layout data/scales of exactly the sizes its layout needs
/// (its `rows`, `cols` and `dtype` are public, so an altered `Matrix` may be
/// inconsistent).
pub fn check_matrix(m: &Matrix) -> CudaResult<()> {
    const OP: &str = "DeviceMatrix::upload";
    if dtype_tag(m.dtype).is_none() {
        return Err(CudaError::DType {
            op: OP,
            dtype: m.dtype.to_string(),
        });
    }
    check_dims(OP, m.rows, m.cols)?;
    let elems = m.rows * m.cols;
    let (data, scales) = match m.dtype {
        DType::BF16 => (elems * 2, 0),
        DType::Q8_0 => (elems, elems / 32 * 4),
        DType::Mxfp4 => (elems / 2, elems / 32),
        DType::F32 | DType::F16 => unreachable!("rejected above"),
    };
    let (got_data, got_scales) = m.row_bytes_len();
    if got_data != data || got_scales != scales {
        return Err(CudaError::Shape {
            op: OP,
            detail: format!(
                "[{}, {}] {} needs {data} data bytes and {scales} scale bytes, got {} and {got_scales}",
                m.rows,
                m.cols,
                m.dtype, got_data
            ),
        });
    }
    Ok(())
}

/// A weight matrix in device memory, in its stored dtype and layout.
///
/// Uploaded once with [`DeviceMatrix::upload`]; each [`DeviceMatrix::matmul`]
/// then reads the packed bytes exactly once per launch of ≤ 8 activation rows.
pub struct DeviceMatrix {
    /// The device the bytes live on (kept alive by every matrix on it).
    device: Arc<CudaDevice>,
    /// Output features.
    rows: usize,
    /// Input features (a multiple of 32).
    cols: usize,
    /// How `data` is encoded: BF16, Q8_0 or MXFP4.
    dtype: DType,
    /// The row-major weight bytes, as [`Matrix::row_bytes`] gives them.
    data: CudaSlice<u8>,
    /// Block scales as [`Matrix::row_bytes`] gives them (f32 bytes for Q8_0,
    /// E8M0 for MXFP4).
    scales: Option<CudaSlice<u8>>,
    /// Rows per warp forced by [`DeviceMatrix::set_rows_per_warp`] (tuning);
    /// `None` takes the plan's default (see [`plan`]).
    rows_per_warp: Option<usize>,
    /// Activation reads forced by [`DeviceMatrix::set_direct_x`] (tuning);
    /// `None` picks [`default_direct_x`].
    direct_x: Option<bool>,
}

impl std::fmt::Debug for DeviceMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceMatrix([{}, {}] {} on {})",
            self.rows,
            self.cols,
            self.dtype,
            self.device.name()
        )
    }
}

impl DeviceMatrix {
    /// Copies `m` (BF16, MXFP4 or Q8_0; `cols` a multiple of 32) to `device`,
    /// in row layout (an int8 MXFP4 matrix's panels are unpacked for it).
    pub fn upload(device: &Arc<CudaDevice>, m: &Matrix) -> CudaResult<DeviceMatrix> {
        check_matrix(m)?;
        let (bytes, scale_bytes) = m.row_bytes();
        let data = device.upload(&bytes)?;
        let scales = match scale_bytes {
            Some(s) if m.dtype != DType::BF16 => Some(device.upload(&s)?),
            _ => None,
        };
        Ok(DeviceMatrix {
            device: device.clone(),
            rows: m.rows,
            cols: m.cols,
            dtype: m.dtype,
            data,
            scales,
            rows_per_warp: None,
            direct_x: None,
        })
    }

    /// Forces this matrix's kernels to `rows_per_warp` (1, 2 or 4) weight
    /// rows per warp; `None` restores the automatic choice. For tuning and
    /// benches: results are identical whichever is used.
    pub fn set_rows_per_warp(&mut self, rows_per_warp: Option<usize>) -> CudaResult<()> {
        if let Some(rt) = rows_per_warp {
            if !ROWS_PER_WARP.contains(&rt) {
                return Err(CudaError::Shape {
                    op: "DeviceMatrix::set_rows_per_warp",
                    detail: format!("rows per warp must be one of {ROWS_PER_WARP:?}, got {rt}"),
                });
            }
        }
        self.rows_per_warp = rows_per_warp;
        Ok(())
    }

    /// Forces this matrix's kernels to read the activations straight from
    /// global memory (`Some(true)`) or to stage them in shared memory
    /// (`Some(false)`); `None` restores the automatic choice. For tuning and
    /// benches: results are identical either way (same products, same order).
    pub fn set_direct_x(&mut self, direct_x: Option<bool>) {
        self.direct_x = direct_x;
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The stored dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the matrix lives on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Weight bytes one launch reads: data plus scales.
    pub fn nbytes(&self) -> usize {
        self.data.len() + self.scales.as_ref().map(|s| s.len()).unwrap_or(0)
    }

    /// The launch plan for a batch of `n` (1..=8) rows on this matrix.
    pub fn plan(&self, n: usize) -> CudaResult<LaunchPlan> {
        plan(
            self.dtype,
            self.rows,
            self.cols,
            n,
            self.device.sm_count(),
            self.rows_per_warp,
            self.direct_x,
        )
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ` from host slices: uploads `x`, runs
    /// [`DeviceMatrix::matmul_device`], downloads into `out` (and waits).
    pub fn matmul(&self, x: &[f32], out: &mut [f32]) -> CudaResult<()> {
        let n = x.len() / self.cols;
        if x.len() != n * self.cols || out.len() != n * self.rows {
            return Err(CudaError::Shape {
                op: "DeviceMatrix::matmul",
                detail: format!(
                    "x has {} values and out {} for a [{}, {}] weight; need n·{} and n·{}",
                    x.len(),
                    out.len(),
                    self.rows,
                    self.cols,
                    self.cols,
                    self.rows
                ),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let xd = self.device.upload(x)?;
        // SAFETY: every element of `yd` is written by the kernels before it is read.
        let mut yd =
            unsafe { self.device.stream().alloc::<f32>(out.len()) }.map_err(driver("alloc"))?;
        self.matmul_device(&xd, n, &mut yd)?;
        self.device.download_into(&yd, out)
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ` on device buffers (a [`CudaSlice`]
    /// or a view of one), queued on the device's stream without waiting.
    /// `x` must hold exactly `n · cols` values and `out` `n · rows`; `out` is
    /// overwritten. Any `n` is accepted; batches above 8 run as several launches.
    pub fn matmul_device<X, Y>(&self, x: &X, n: usize, out: &mut Y) -> CudaResult<()>
    where
        X: DevicePtr<f32>,
        Y: DevicePtrMut<f32>,
    {
        if x.len() != n * self.cols || out.len() != n * self.rows {
            return Err(CudaError::Shape {
                op: "DeviceMatrix::matmul_device",
                detail: format!(
                    "x has {} values and out {} for n = {n} and a [{}, {}] weight",
                    x.len(),
                    out.len(),
                    self.rows,
                    self.cols
                ),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let stream = self.device.stream();
        let (x_ptr, _x_sync) = x.device_ptr(stream);
        let (y_ptr, _y_sync) = out.device_ptr_mut(stream);
        let (w_ptr, _w_sync) = self.data.device_ptr(stream);
        let scales_ptr = self.scales.as_ref().map(|s| s.device_ptr(stream));
        let mut i0 = 0;
        while i0 < n {
            let nc = (n - i0).min(MAX_BATCH_PER_LAUNCH);
            let p = self.plan(nc)?;
            let func = self.device.function(&p.kernel)?;
            let xp: u64 = x_ptr + (i0 * self.cols * 4) as u64;
            let yp: u64 = y_ptr + (i0 * self.rows * 4) as u64;
            let (rows, cols, nn, kt) = (
                self.rows as i32,
                self.cols as i32,
                nc as i32,
                p.kt_max as i32,
            );
            let cfg = LaunchConfig {
                grid_dim: (p.grid, 1, 1),
                block_dim: (THREADS_PER_BLOCK, 1, 1),
                shared_mem_bytes: p.shared_mem_bytes,
            };
            let mut launch = stream.launch_builder(func);
            launch.arg(&w_ptr);
            if let Some((s_ptr, _)) = &scales_ptr {
                launch.arg(s_ptr);
            }
            launch
                .arg(&xp)
                .arg(&yp)
                .arg(&rows)
                .arg(&cols)
                .arg(&nn)
                .arg(&kt);
            // SAFETY: the argument list matches the kernel's signature for this
            // dtype (weights, [scales], x, y, rows, cols, n, kt_max); the
            // buffers were checked to hold [rows, cols] weights (at upload),
            // n·cols activations and n·rows outputs, and outlive the launch
            // (stream-ordered frees).
            unsafe { launch.launch(cfg) }.map_err(driver("gemv launch"))?;
            i0 += nc;
        }
        Ok(())
    }
}
