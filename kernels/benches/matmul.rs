//! Criterion benches for the linear-layer matmuls in `caracal_kernels::gemm`.
//!
//! GEMV (n = 1, decode) and GEMM (n = 64, prefill) for f32 and bf16 weights at
//! `[rows × cols]` = `[1536 × 576]` (SmolLM2 FFN up/gate), `[576 × 1536]` (its
//! down projection) and `[4096 × 4096]`. Throughput is `rows·cols·n` elements,
//! so the report's "elem/s" reads as weights·tokens per second. The scalar
//! f64 reference runs at the smallest shape so the speed-up is visible.
//!
//! `cargo bench -p caracal-kernels --bench matmul`; set `RAYON_NUM_THREADS`
//! to compare one and two threads.

use std::hint::black_box;
use std::time::Duration;

use caracal_kernels::dtype::f32_to_bf16;
use caracal_kernels::gemm::{matmul_bf16, matmul_bf16_ref, matmul_f32, matmul_f32_ref};
use caracal_kernels::testing::values;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// `[rows, cols]` weight shapes.
const SHAPES: &[(usize, usize)] = &[(1536, 576), (576, 1536), (4096, 4096)];

fn bench_batch(c: &mut Criterion, n: usize, label: &str) {
    for &(rows, cols) in SHAPES {
        let wf = values(1, rows * cols);
        let wb: Vec<u16> = wf.iter().map(|&v| f32_to_bf16(v)).collect();
        let x = values(2, n * cols);
        let mut out = vec![0.0f32; n * rows];
        let id = format!("{rows}x{cols}");
        let mut group = c.benchmark_group(format!("{label}_n{n}"));
        group.throughput(Throughput::Elements((rows * cols * n) as u64));
        group.bench_with_input(BenchmarkId::new("f32", &id), &(), |b, _| {
            b.iter(|| matmul_f32(black_box(&x), n, black_box(&wf), rows, cols, &mut out))
        });
        group.bench_with_input(BenchmarkId::new("bf16", &id), &(), |b, _| {
            b.iter(|| matmul_bf16(black_box(&x), n, black_box(&wb), rows, cols, &mut out))
        });
        if (rows, cols) == SHAPES[0] {
            group.bench_with_input(BenchmarkId::new("f32_scalar_ref", &id), &(), |b, _| {
                b.iter(|| matmul_f32_ref(black_box(&x), n, black_box(&wf), rows, cols, &mut out))
            });
            group.bench_with_input(BenchmarkId::new("bf16_scalar_ref", &id), &(), |b, _| {
                b.iter(|| matmul_bf16_ref(black_box(&x), n, black_box(&wb), rows, cols, &mut out))
            });
        }
        group.finish();
    }
}

fn gemv(c: &mut Criterion) {
    bench_batch(c, 1, "gemv");
}

fn gemm(c: &mut Criterion) {
    bench_batch(c, 64, "gemm");
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = gemv, gemm
}
criterion_main!(benches);
