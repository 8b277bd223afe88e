//! MXFP4 matmul benchmarks: the fused packed kernels against the dense bf16
//! GEMM and against "plain decode, then f32 GEMM", at an MLA-sized shape
//! ([1536 × 576]) and a square one ([4096 × 4096]), for one token (GEMV) and
//! for 64 tokens.
//!
//! Throughput is reported in multiply-adds (`rows · cols · n` elements).
//! Weight bytes read per call are `rows · cols · 17/32` for MXFP4 and
//! `rows · cols · 2` for bf16. The same matrix is reused across iterations, so
//! a [4096 × 4096] MXFP4 weight (8.9 MB) sits in the 32 MiB L3: figures are
//! cache-hot, not DRAM-streaming. The `*_cold` group rotates through enough
//! copies of the [4096 × 4096] weight (≥ 96 MB) that every call streams its
//! weights from DRAM, as routed experts do. Run with `RAYON_NUM_THREADS=1` or `2`.

use std::hint::black_box;
use std::time::Duration;

use caracal_kernels::dtype::f32_to_bf16;
use caracal_kernels::testing::values;
use caracal_kernels::{gemm, mxfp4};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn bench_mxfp4(c: &mut Criterion) {
    for (rows, cols) in [(1536, 576), (4096, 4096)] {
        let w = values(1, rows * cols);
        let (blocks, scales) = mxfp4::quantize(&w, rows, cols).expect("cols is a multiple of 32");
        // The bf16 weight holds exactly the MXFP4 values (E2M1 × 2^k fits bf16).
        let dense = mxfp4::dequantize(&blocks, &scales, rows, cols).expect("valid layout");
        let bf16: Vec<u16> = dense.iter().map(|&v| f32_to_bf16(v)).collect();
        for n in [1, 64] {
            let x = values(2, n * cols);
            let mut out = vec![0.0f32; n * rows];
            let mut group = c.benchmark_group(format!("mxfp4_{rows}x{cols}_n{n}"));
            group.throughput(Throughput::Elements((rows * cols * n) as u64));
            group.bench_function("mxfp4_fused", |b| {
                b.iter(|| {
                    mxfp4::matmul_mxfp4(black_box(&x), n, &blocks, &scales, rows, cols, &mut out)
                })
            });
            group.bench_function("mxfp4_fused_q8", |b| {
                b.iter(|| {
                    mxfp4::matmul_mxfp4_q8(black_box(&x), n, &blocks, &scales, rows, cols, &mut out)
                })
            });
            group.bench_function("bf16_gemm", |b| {
                b.iter(|| gemm::matmul_bf16(black_box(&x), n, &bf16, rows, cols, &mut out))
            });
            group.bench_function("decode_then_f32_gemm", |b| {
                b.iter(|| {
                    let w = mxfp4::dequantize(&blocks, &scales, rows, cols).expect("valid layout");
                    gemm::matmul_f32(black_box(&x), n, &w, rows, cols, &mut out)
                })
            });
            group.finish();
        }
    }
}

/// Copies of one weight whose total size exceeds the L3 several times over.
fn copies<T: Clone>(v: &[T], bytes_each: usize) -> Vec<Vec<T>> {
    vec![v.to_vec(); (96_000_000usize).div_ceil(bytes_each).max(2)]
}

fn bench_mxfp4_cold(c: &mut Criterion) {
    let (rows, cols, n) = (4096, 4096, 1);
    let w = values(1, rows * cols);
    let (blocks, scales) = mxfp4::quantize(&w, rows, cols).expect("cols is a multiple of 32");
    let dense = mxfp4::dequantize(&blocks, &scales, rows, cols).expect("valid layout");
    let bf16: Vec<u16> = dense.iter().map(|&v| f32_to_bf16(v)).collect();
    let packed = copies(&[blocks, scales], rows * cols * 17 / 32);
    let bf16 = copies(&bf16, rows * cols * 2);
    let x = values(2, n * cols);
    let mut out = vec![0.0f32; n * rows];
    let mut group = c.benchmark_group(format!("mxfp4_{rows}x{cols}_n{n}_cold"));
    group.throughput(Throughput::Elements((rows * cols * n) as u64));
    let mut k = 0;
    group.bench_function("mxfp4_fused", |b| {
        b.iter(|| {
            k = (k + 1) % packed.len();
            mxfp4::matmul_mxfp4(
                black_box(&x),
                n,
                &packed[k][0],
                &packed[k][1],
                rows,
                cols,
                &mut out,
            )
        })
    });
    group.bench_function("mxfp4_fused_q8", |b| {
        b.iter(|| {
            k = (k + 1) % packed.len();
            mxfp4::matmul_mxfp4_q8(
                black_box(&x),
                n,
                &packed[k][0],
                &packed[k][1],
                rows,
                cols,
                &mut out,
            )
        })
    });
    group.bench_function("bf16_gemm", |b| {
        b.iter(|| {
            k = (k + 1) % bf16.len();
            gemm::matmul_bf16(black_box(&x), n, &bf16[k], rows, cols, &mut out)
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench_mxfp4, bench_mxfp4_cold
}
criterion_main!(benches);
