//! Criterion benches for causal GQA attention over the paged KV cache:
//! `attention::paged_attention` (one task per query and kv head) side by side
//! with `flash::paged_attention_tiled` (flash-attention tiles).
//!
//! Shape: SmolLM2-135M (9 query heads, 3 kv heads, head_dim = v_dim = 64),
//! pages of 16 rows behind a shuffled block table, one layer. Cases:
//! - `chunk_t64`: a follow-up turn, 64 new tokens after 4,096 cached ones;
//! - `decode_t1`: one token after 4,096 cached ones;
//! - `prefill_t512`: a cold prefill of 512 tokens (start_pos 0).
//!
//! `tiled_bf16_rows` runs the tiled kernel on the same rows stored as bf16.
//!
//! Throughput is the attention FLOP count (`2·(head_dim + v_dim)` per query
//! head per visible key), so the report's "elem/s" reads as FLOP/s.
//!
//! `cargo bench -p caracal-kernels --bench attention`; set
//! `RAYON_NUM_THREADS` to compare one and two threads.

use std::hint::black_box;
use std::time::Duration;

use caracal_kernels::attention::{paged_attention, write_kv, AttnShape};
use caracal_kernels::flash::paged_attention_tiled;
use caracal_kernels::paged::{KvDtype, KvPool};
use caracal_kernels::testing::values;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// SmolLM2-135M attention heads.
const SHAPE: AttnShape = AttnShape {
    q_heads: 9,
    kv_heads: 3,
    head_dim: 64,
    v_dim: 64,
};

/// Rows per page, as the runtime uses.
const PAGE: usize = 16;

/// Attention FLOPs of `t` queries after `start_pos` cached tokens.
fn flops(start_pos: usize, t: usize) -> u64 {
    let keys: usize = (0..t).map(|i| start_pos + i + 1).sum();
    (keys * SHAPE.q_heads * 2 * (SHAPE.head_dim + SHAPE.v_dim)) as u64
}

/// Benches both kernels on `t` queries after `start_pos` cached tokens.
fn bench_case(c: &mut Criterion, name: &str, start_pos: usize, t: usize) {
    let total = start_pos + t;
    let pages = total.div_ceil(PAGE);
    let mut pool = KvPool::new(1, pages + 8, PAGE, SHAPE.row_width());
    // Page ids in reverse order, so positions never run across a page edge
    // into the next page in memory.
    let table: Vec<u32> = (0..pages as u32).rev().map(|i| i + 8).collect();
    let k = values(1, total * SHAPE.kv_heads * SHAPE.head_dim);
    let v = values(2, total * SHAPE.kv_heads * SHAPE.v_dim);
    write_kv(&mut pool, 0, &table, 0, &k, &v, &SHAPE);
    let q = values(3, t * SHAPE.q_heads * SHAPE.head_dim);
    let scale = 1.0 / (SHAPE.head_dim as f32).sqrt();
    let mut out = vec![0.0f32; t * SHAPE.q_heads * SHAPE.v_dim];
    let id = format!("start{start_pos}");
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(flops(start_pos, t)));
    group.bench_with_input(BenchmarkId::new("paged_attention", &id), &(), |b, _| {
        b.iter(|| {
            paged_attention(
                black_box(&q),
                &pool,
                0,
                &table,
                start_pos,
                &SHAPE,
                scale,
                &mut out,
            )
        })
    });
    group.bench_with_input(
        BenchmarkId::new("paged_attention_tiled", &id),
        &(),
        |b, _| {
            b.iter(|| {
                paged_attention_tiled(
                    black_box(&q),
                    &pool,
                    0,
                    &table,
                    start_pos,
                    &SHAPE,
                    scale,
                    &mut out,
                )
            })
        },
    );
    // The same rows stored as bf16 (the runtime's default): the tiled kernel
    // reads them in place and, with AVX-512 BF16, multiplies on bf16 pair
    // dot products (`CARACAL_ATTENTION_PRODUCTS=f32` keeps it on f32 FMAs).
    let mut bf16 = KvPool::with_dtype(1, pages + 8, PAGE, SHAPE.row_width(), KvDtype::Bf16);
    write_kv(&mut bf16, 0, &table, 0, &k, &v, &SHAPE);
    group.bench_with_input(BenchmarkId::new("tiled_bf16_rows", &id), &(), |b, _| {
        b.iter(|| {
            paged_attention_tiled(
                black_box(&q),
                &bf16,
                0,
                &table,
                start_pos,
                &SHAPE,
                scale,
                &mut out,
            )
        })
    });
    group.finish();
}

fn chunk(c: &mut Criterion) {
    bench_case(c, "chunk_t64", 4096, 64);
}

fn decode(c: &mut Criterion) {
    bench_case(c, "decode_t1", 4096, 1);
}

fn prefill(c: &mut Criterion) {
    bench_case(c, "prefill_t512", 0, 512);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = chunk, decode, prefill
}
criterion_main!(benches);
