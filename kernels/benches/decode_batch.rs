//! Criterion bench of one decode step's attention for a batch of sequences:
//! `flash::paged_attention_tiled` called once per sequence (the layers' path
//! before batching) side by side with one `flash::decode_attention_batch`
//! call for all of them, and the same for MLA latent rows
//! (`flash::latent_attention_tiled` per sequence vs
//! `flash::latent_decode_attention_batch`).
//!
//! Cases: 8 sequences × {128, 1024} cached tokens each, bf16 rows (the serve
//! default), pages of 16 rows with the sequences' pages interleaved.
//! Shapes: SmolLM2-135M GQA (9 query heads, 3 kv heads, head_dim 64) and a
//! K3-like MLA layer (16 heads over latent rows of 512 + 64).
//!
//! `decode8_gqa_smollm2_step` runs the batched call over all 30 layers of a
//! SmolLM2 cache, as a decode step does (so the rows come from memory, not
//! from a cache a single layer fits in), with bf16 rows and with int8 rows
//! (a scale per token and head, `--kv-cache-dtype int8`).
//!
//! Throughput is the attention FLOP count (`2·(key width + value width)` per
//! query head per visible key), so "elem/s" reads as FLOP/s.
//!
//! `cargo bench -p caracal-kernels --bench decode_batch`; set
//! `RAYON_NUM_THREADS` to compare one and two threads.

use std::hint::black_box;
use std::time::Duration;

use caracal_kernels::attention::AttnShape;
use caracal_kernels::flash::{
    decode_attention_batch, latent_attention_tiled, latent_decode_attention_batch,
    paged_attention_tiled, DecodeSeq,
};
use caracal_kernels::paged::{KvDtype, KvPool};
use caracal_kernels::testing::values;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// SmolLM2-135M attention heads.
const GQA: AttnShape = AttnShape {
    q_heads: 9,
    kv_heads: 3,
    head_dim: 64,
    v_dim: 64,
};

/// MLA heads and latent row (`kv_lora_rank + rope_dim`) of a K3-like layer.
const MLA_HEADS: usize = 16;
const MLA_RANK: usize = 512;
const MLA_WIDTH: usize = 512 + 64;

/// Rows per page, as the runtime uses.
const PAGE: usize = 16;

/// Sequences per step.
const SEQS: usize = 8;

/// SmolLM2-135M's layers.
const LAYERS: usize = 30;

/// A bf16 pool holding `SEQS` sequences of `ctx` rows of `width` values,
/// their pages interleaved (page `p` of sequence `s` is `p·SEQS + s`).
fn pool(ctx: usize, width: usize) -> (KvPool, Vec<Vec<u32>>) {
    pool_of(ctx, width, 1, width, KvDtype::Bf16)
}

/// [`pool`] with `layers` layers of `dtype` rows in segments of `segment`.
fn pool_of(
    ctx: usize,
    width: usize,
    layers: usize,
    segment: usize,
    dtype: KvDtype,
) -> (KvPool, Vec<Vec<u32>>) {
    let pages = ctx.div_ceil(PAGE);
    let mut pool = KvPool::with_layout(layers, pages * SEQS, PAGE, width, segment, dtype);
    let tables: Vec<Vec<u32>> = (0..SEQS)
        .map(|s| (0..pages).map(|p| (p * SEQS + s) as u32).collect())
        .collect();
    for (s, table) in tables.iter().enumerate() {
        let rows = values(s as u64 + 1, ctx * width);
        for layer in 0..layers {
            for p in 0..ctx {
                pool.write_row(layer, table, p, &[&rows[p * width..(p + 1) * width]]);
            }
        }
    }
    (pool, tables)
}

/// The step's sequences: sequence `s` in row `s`, its query at `ctx − 1`.
fn seqs(tables: &[Vec<u32>], ctx: usize) -> Vec<DecodeSeq<'_>> {
    tables
        .iter()
        .enumerate()
        .map(|(s, t)| DecodeSeq {
            row: s,
            pos: ctx - 1,
            block_table: t,
        })
        .collect()
}

fn gqa(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode8_gqa_smollm2_bf16");
    for ctx in [128usize, 1024] {
        let (pool, tables) = pool(ctx, GQA.row_width());
        let batch = seqs(&tables, ctx);
        let (qw, ow) = (GQA.q_heads * GQA.head_dim, GQA.q_heads * GQA.v_dim);
        let q = values(100, SEQS * qw);
        let scale = 1.0 / (GQA.head_dim as f32).sqrt();
        let mut out = vec![0.0f32; SEQS * ow];
        let flops = SEQS * ctx * GQA.q_heads * 2 * (GQA.head_dim + GQA.v_dim);
        group.throughput(Throughput::Elements(flops as u64));
        let id = format!("ctx{ctx}");
        group.bench_with_input(BenchmarkId::new("per_sequence", &id), &(), |b, _| {
            b.iter(|| {
                for s in &batch {
                    paged_attention_tiled(
                        black_box(&q[s.row * qw..(s.row + 1) * qw]),
                        &pool,
                        0,
                        s.block_table,
                        s.pos,
                        &GQA,
                        scale,
                        &mut out[s.row * ow..(s.row + 1) * ow],
                    );
                }
            })
        });
        group.bench_with_input(BenchmarkId::new("batched", &id), &(), |b, _| {
            b.iter(|| {
                decode_attention_batch(black_box(&q), &pool, 0, &batch, &GQA, scale, &mut out)
            })
        });
    }
    group.finish();
}

fn gqa_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode8_gqa_smollm2_step");
    for ctx in [128usize, 1024] {
        for dtype in [KvDtype::Bf16, KvDtype::Int8] {
            let (pool, tables) = pool_of(ctx, GQA.row_width(), LAYERS, GQA.head_dim, dtype);
            let batch = seqs(&tables, ctx);
            let (qw, ow) = (GQA.q_heads * GQA.head_dim, GQA.q_heads * GQA.v_dim);
            let q = values(100, SEQS * qw);
            let scale = 1.0 / (GQA.head_dim as f32).sqrt();
            let mut out = vec![0.0f32; SEQS * ow];
            let flops = LAYERS * SEQS * ctx * GQA.q_heads * 2 * (GQA.head_dim + GQA.v_dim);
            group.throughput(Throughput::Elements(flops as u64));
            let id = format!("ctx{ctx}");
            group.bench_with_input(BenchmarkId::new(dtype.name(), &id), &(), |b, _| {
                b.iter(|| {
                    for layer in 0..LAYERS {
                        decode_attention_batch(
                            black_box(&q),
                            &pool,
                            layer,
                            &batch,
                            &GQA,
                            scale,
                            &mut out,
                        )
                    }
                })
            });
        }
    }
    group.finish();
}

fn mla(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode8_mla_latent576_bf16");
    for ctx in [128usize, 1024] {
        let (pool, tables) = pool(ctx, MLA_WIDTH);
        let batch = seqs(&tables, ctx);
        let (qw, ow) = (MLA_HEADS * MLA_WIDTH, MLA_HEADS * MLA_RANK);
        let q = values(200, SEQS * qw);
        let scale = 1.0 / (192f32).sqrt();
        let mut out = vec![0.0f32; SEQS * ow];
        let flops = SEQS * ctx * MLA_HEADS * 2 * (MLA_WIDTH + MLA_RANK);
        group.throughput(Throughput::Elements(flops as u64));
        let id = format!("ctx{ctx}");
        group.bench_with_input(BenchmarkId::new("per_sequence", &id), &(), |b, _| {
            b.iter(|| {
                for s in &batch {
                    latent_attention_tiled(
                        black_box(&q[s.row * qw..(s.row + 1) * qw]),
                        &pool,
                        0,
                        s.block_table,
                        s.pos,
                        MLA_HEADS,
                        MLA_RANK,
                        scale,
                        &mut out[s.row * ow..(s.row + 1) * ow],
                    );
                }
            })
        });
        group.bench_with_input(BenchmarkId::new("batched", &id), &(), |b, _| {
            b.iter(|| {
                latent_decode_attention_batch(
                    black_box(&q),
                    &pool,
                    0,
                    &batch,
                    MLA_HEADS,
                    MLA_RANK,
                    scale,
                    &mut out,
                )
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    targets = gqa, gqa_step, mla
}
criterion_main!(benches);
