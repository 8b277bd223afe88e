//! Causal grouped-query attention over the paged KV layout of [`KvPool`].
//!
//! A cache row of one token in one layer is `[k: kv_heads·head_dim | v:
//! kv_heads·v_dim]` ([`AttnShape::row_width`] values). Query head `h` reads kv
//! head `h / (q_heads / kv_heads)`. The step for a layer is: [`write_kv`] the
//! new tokens' K/V at their positions, then [`paged_attention`] for their
//! queries, each of which sees every cached position up to its own.
//!
//! [`paged_attention`] runs one rayon task per (query, head) pair: scores
//! `scale·q·k` (SIMD dot products), a max-subtracted softmax in f32, and the
//! weighted sum of V. [`dense_attention`] is the plain f64 reference on
//! contiguous K/V used by the tests.

use rayon::prelude::*;

use crate::cpu::Isa;
use crate::paged::KvPool;

/// Head layout of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// Key/value heads shared by groups of query heads.
    pub kv_heads: usize,
    /// Width of one query/key head.
    pub head_dim: usize,
    /// Width of one value head (equal to `head_dim` in most models).
    pub v_dim: usize,
}

impl AttnShape {
    /// The shape of attention over an MLA latent cache in the absorbed form:
    /// `heads` query heads share one KV head whose key is the whole `width`-wide
    /// row `[c | k_pe]` and whose value is its first `v_dim` values.
    ///
    /// # Panics
    /// If `v_dim` exceeds `width` (`what` names the caller in the message).
    pub(crate) fn latent(heads: usize, width: usize, v_dim: usize, what: &str) -> AttnShape {
        assert!(
            v_dim <= width,
            "{what}: v_dim {v_dim} exceeds the row width {width}"
        );
        AttnShape {
            q_heads: heads,
            kv_heads: 1,
            head_dim: width,
            v_dim,
        }
    }

    /// f32 values in one token's cache row: `kv_heads·(head_dim + v_dim)`.
    pub fn row_width(&self) -> usize {
        self.kv_heads * (self.head_dim + self.v_dim)
    }

    /// Query heads per kv head.
    fn group(&self) -> usize {
        assert!(
            self.kv_heads > 0 && self.q_heads.is_multiple_of(self.kv_heads),
            "q_heads ({}) must be a positive multiple of kv_heads ({})",
            self.q_heads,
            self.kv_heads
        );
        self.q_heads / self.kv_heads
    }
}

/// Writes the K/V of `t` tokens at positions `start_pos..start_pos + t` into
/// `layer` of the pool; `k` is `[t, kv_heads·head_dim]`, `v` is
/// `[t, kv_heads·v_dim]`. The block table must already cover those positions.
pub fn write_kv(
    pool: &mut KvPool,
    layer: usize,
    block_table: &[u32],
    start_pos: usize,
    k: &[f32],
    v: &[f32],
    shape: &AttnShape,
) {
    let (kw, vw) = (
        shape.kv_heads * shape.head_dim,
        shape.kv_heads * shape.v_dim,
    );
    assert_eq!(
        pool.width,
        shape.row_width(),
        "write_kv: pool rows have {} values, shape needs {}",
        pool.width,
        shape.row_width()
    );
    let t = k.len().checked_div(kw).unwrap_or(0);
    assert_eq!(
        k.len(),
        t * kw,
        "write_kv: k is not a whole number of tokens"
    );
    assert_eq!(
        v.len(),
        t * vw,
        "write_kv: v holds a different number of tokens than k"
    );
    assert!(
        block_table.len() * pool.page_size >= start_pos + t,
        "write_kv: block table covers {} positions, need {}",
        block_table.len() * pool.page_size,
        start_pos + t
    );
    for i in 0..t {
        let (ki, vi) = (&k[i * kw..(i + 1) * kw], &v[i * vw..(i + 1) * vw]);
        pool.write_row(layer, block_table, start_pos + i, &[ki, vi]);
    }
}

/// Causal attention of `t` new queries against the paged cache.
///
/// `q` is `[t, q_heads·head_dim]` for positions `start_pos..start_pos + t`;
/// query `i` attends to cached positions `0..=start_pos + i`, whose K/V must
/// already be written ([`write_kv`]). `out` is `[t, q_heads·v_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    pool: &KvPool,
    layer: usize,
    block_table: &[u32],
    start_pos: usize,
    shape: &AttnShape,
    scale: f32,
    out: &mut [f32],
) {
    let group = shape.group();
    let (hd, vd) = (shape.head_dim, shape.v_dim);
    let qw = shape.q_heads * hd;
    assert_eq!(
        pool.width,
        shape.row_width(),
        "paged_attention: pool rows have {} values, shape needs {}",
        pool.width,
        shape.row_width()
    );
    assert!(qw > 0 && vd > 0, "paged_attention: empty heads");
    let t = q.len() / qw;
    assert_eq!(
        q.len(),
        t * qw,
        "paged_attention: q is not a whole number of tokens"
    );
    assert_eq!(
        out.len(),
        t * shape.q_heads * vd,
        "paged_attention: out must be [t, q_heads·v_dim]"
    );
    assert!(
        block_table.len() * pool.page_size >= start_pos + t,
        "paged_attention: block table covers {} positions, need {}",
        block_table.len() * pool.page_size,
        start_pos + t
    );
    let k_width = shape.kv_heads * hd;

    // One task per (query, KV head): the `group` query heads that share a KV
    // head read each cached K/V row once. Their outputs are contiguous.
    let job = GroupJob {
        q,
        pool,
        layer,
        block_table,
        start_pos,
        shape,
        scale,
        qw,
        k_width,
    };
    let wide = Isa::Avx2.supported();
    out.par_chunks_mut(group * shape.v_dim)
        .enumerate()
        .for_each_init(Vec::new, |scores: &mut Vec<f32>, (idx, o)| {
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: AVX2 and FMA were detected at run time.
                unsafe { attend_group_avx2(&job, idx, scores, o) };
                return;
            }
            let _ = wide;
            attend_group(&job, idx, scores, o);
        });
}

/// Everything one (query, KV head) task reads.
struct GroupJob<'a> {
    q: &'a [f32],
    pool: &'a KvPool,
    layer: usize,
    block_table: &'a [u32],
    start_pos: usize,
    shape: &'a AttnShape,
    scale: f32,
    qw: usize,
    k_width: usize,
}

/// [`attend_group`] compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_group_avx2(job: &GroupJob<'_>, idx: usize, scores: &mut Vec<f32>, o: &mut [f32]) {
    attend_group(job, idx, scores, o)
}

/// Attention of the `group` query heads of one KV head for one query.
#[inline(always)]
fn attend_group(job: &GroupJob<'_>, idx: usize, scores: &mut Vec<f32>, o: &mut [f32]) {
    let shape = job.shape;
    let (hd, vd, group) = (shape.head_dim, shape.v_dim, shape.group());
    let (i, kvh) = (idx / shape.kv_heads, idx % shape.kv_heads);
    let ctx = job.start_pos + i + 1;
    scores.clear();
    scores.resize(group * ctx, 0.0);
    let q0 = i * job.qw + kvh * group * hd;
    let mut buf = vec![0.0f32; job.pool.width];
    for p in 0..ctx {
        let k =
            &job.pool.read_row(job.layer, job.block_table, p, &mut buf)[kvh * hd..(kvh + 1) * hd];
        for g in 0..group {
            let qv = &job.q[q0 + g * hd..q0 + (g + 1) * hd];
            scores[g * ctx + p] = dot_lanes(qv, k) * job.scale;
        }
    }
    o.fill(0.0);
    for g in 0..group {
        let row = &mut scores[g * ctx..(g + 1) * ctx];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for s in row.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        for s in row.iter_mut() {
            *s *= inv;
        }
    }
    for p in 0..ctx {
        let row = job.pool.read_row(job.layer, job.block_table, p, &mut buf);
        let vv = &row[job.k_width + kvh * vd..job.k_width + (kvh + 1) * vd];
        for g in 0..group {
            let w = scores[g * ctx + p];
            for (a, &b) in o[g * vd..(g + 1) * vd].iter_mut().zip(vv) {
                *a += w * b;
            }
        }
    }
}

/// Dot product with 8 independent lanes, so the compiler vectorises it
/// inline (head dims are small; a dispatched call per key costs more than
/// the arithmetic).
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    acc.iter().sum::<f32>() + tail
}

/// Plain causal GQA attention on contiguous K/V, accumulated in f64 (the
/// reference for [`paged_attention`]).
///
/// `q` `[t_q, q_heads·head_dim]`, `k` `[t_kv, kv_heads·head_dim]`, `v`
/// `[t_kv, kv_heads·v_dim]`, `out` `[t_q, q_heads·v_dim]`; query `i` sees
/// keys `0..=t_kv − t_q + i` (the queries are the last `t_q` positions).
#[allow(clippy::too_many_arguments)]
pub fn dense_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t_q: usize,
    t_kv: usize,
    shape: &AttnShape,
    scale: f32,
    out: &mut [f32],
) {
    let group = shape.group();
    let (hd, vd, qh, kh) = (shape.head_dim, shape.v_dim, shape.q_heads, shape.kv_heads);
    assert!(
        t_kv >= t_q,
        "dense_attention: {t_q} queries but only {t_kv} keys"
    );
    assert_eq!(
        q.len(),
        t_q * qh * hd,
        "dense_attention: q must be [t_q, q_heads·head_dim]"
    );
    assert_eq!(
        k.len(),
        t_kv * kh * hd,
        "dense_attention: k must be [t_kv, kv_heads·head_dim]"
    );
    assert_eq!(
        v.len(),
        t_kv * kh * vd,
        "dense_attention: v must be [t_kv, kv_heads·v_dim]"
    );
    assert_eq!(
        out.len(),
        t_q * qh * vd,
        "dense_attention: out must be [t_q, q_heads·v_dim]"
    );
    for i in 0..t_q {
        let ctx = t_kv - t_q + i + 1;
        for h in 0..qh {
            let kvh = h / group;
            let qv = &q[(i * qh + h) * hd..(i * qh + h + 1) * hd];
            let scores: Vec<f64> = (0..ctx)
                .map(|p| {
                    let kv = &k[(p * kh + kvh) * hd..(p * kh + kvh + 1) * hd];
                    qv.iter()
                        .zip(kv)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            for d in 0..vd {
                let acc: f64 = (0..ctx)
                    .map(|p| weights[p] * v[(p * kh + kvh) * vd + d] as f64)
                    .sum();
                out[(i * qh + h) * vd + d] = (acc / sum) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::values;

    fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
        assert_eq!(got.len(), want.len());
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= tol, "{what}: element {i}: {g} vs {w}");
        }
    }

    #[test]
    fn paged_matches_dense_through_prefill_and_decode_on_shuffled_pages() {
        // page_size 3, a non-contiguous block table, GQA 6/2 heads, v_dim != head_dim.
        // Steps: prefill 5 tokens, a 3-token chunk, then 4 single-token decodes.
        // Tolerance 2e-5 absolute (f32 vs f64 on O(1) values).
        let shape = AttnShape {
            q_heads: 6,
            kv_heads: 2,
            head_dim: 20,
            v_dim: 12,
        };
        let scale = 1.0 / (shape.head_dim as f32).sqrt() * 2.0;
        let mut pool = KvPool::new(2, 16, 3, shape.row_width());
        let table: Vec<u32> = vec![11, 2, 7, 0, 14, 5];
        let layer = 1;
        let (kw, vw, qw) = (
            shape.kv_heads * shape.head_dim,
            shape.kv_heads * shape.v_dim,
            shape.q_heads * shape.head_dim,
        );
        let (mut all_k, mut all_v) = (Vec::new(), Vec::new());
        let mut pos = 0;
        for (step, &t) in [5usize, 3, 1, 1, 1, 1].iter().enumerate() {
            let seed = 100 * step as u64;
            let k = values(seed + 1, t * kw);
            let v = values(seed + 2, t * vw);
            let q: Vec<f32> = values(seed + 3, t * qw).iter().map(|x| x * 3.0).collect();
            write_kv(&mut pool, layer, &table, pos, &k, &v, &shape);
            all_k.extend_from_slice(&k);
            all_v.extend_from_slice(&v);
            let mut got = vec![f32::NAN; t * shape.q_heads * shape.v_dim];
            paged_attention(&q, &pool, layer, &table, pos, &shape, scale, &mut got);
            let mut want = vec![0.0; got.len()];
            dense_attention(&q, &all_k, &all_v, t, pos + t, &shape, scale, &mut want);
            assert_close(&got, &want, 2e-5, &format!("step {step}"));
            pos += t;
        }
        // The other layer was never written.
        assert!(pool.row(0, &table, 0).iter().all(|&x| x == 0.0));
    }

    #[test]
    fn query_head_h_reads_kv_head_h_over_group() {
        // 4 query heads on 2 kv heads: V of kv head 0 is all 1, of kv head 1
        // all 2, so heads 0–1 must output 1 and heads 2–3 output 2 exactly
        // (up to 1e-6: softmax weights sum to 1 in f32).
        let shape = AttnShape {
            q_heads: 4,
            kv_heads: 2,
            head_dim: 8,
            v_dim: 8,
        };
        let mut pool = KvPool::new(1, 4, 2, shape.row_width());
        let table = vec![3u32, 1];
        let t = 3;
        let k = values(7, t * 16);
        let v: Vec<f32> = (0..t)
            .flat_map(|_| [vec![1.0f32; 8], vec![2.0f32; 8]].concat())
            .collect();
        write_kv(&mut pool, 0, &table, 0, &k, &v, &shape);
        let q = values(8, t * 32);
        let mut out = vec![0.0; t * 32];
        paged_attention(&q, &pool, 0, &table, 0, &shape, 0.5, &mut out);
        for i in 0..t {
            for h in 0..4 {
                let want = if h < 2 { 1.0 } else { 2.0 };
                for d in 0..8 {
                    assert!(
                        (out[(i * 4 + h) * 8 + d] - want).abs() < 1e-6,
                        "token {i} head {h}"
                    );
                }
            }
        }
    }

    #[test]
    fn first_query_sees_only_the_first_key() {
        // Causality: query 0 of a prefill returns V[0] whatever later keys hold.
        let shape = AttnShape {
            q_heads: 1,
            kv_heads: 1,
            head_dim: 4,
            v_dim: 3,
        };
        let q = values(1, 3 * 4);
        let k = values(2, 3 * 4);
        let v = values(3, 3 * 3);
        let mut out = vec![0.0; 3 * 3];
        dense_attention(&q, &k, &v, 3, 3, &shape, 1.0, &mut out);
        assert_close(&out[..3], &v[..3], 1e-7, "dense query 0");
        let mut pool = KvPool::new(1, 2, 3, shape.row_width());
        let table = vec![1u32];
        write_kv(&mut pool, 0, &table, 0, &k, &v, &shape);
        let mut paged = vec![0.0; 9];
        paged_attention(&q, &pool, 0, &table, 0, &shape, 1.0, &mut paged);
        assert_close(&paged[..3], &v[..3], 1e-7, "paged query 0");
    }

    #[test]
    fn large_scores_do_not_overflow() {
        let shape = AttnShape {
            q_heads: 1,
            kv_heads: 1,
            head_dim: 2,
            v_dim: 1,
        };
        let mut pool = KvPool::new(1, 1, 4, shape.row_width());
        let table = vec![0u32];
        write_kv(
            &mut pool,
            0,
            &table,
            0,
            &[100.0, 0.0, 90.0, 0.0],
            &[1.0, 3.0],
            &shape,
        );
        let mut out = vec![0.0; 1];
        paged_attention(&[100.0, 0.0], &pool, 0, &table, 1, &shape, 1.0, &mut out);
        // Weight of the first key is 1 / (1 + e^-1000) = 1 in f32.
        assert!((out[0] - 1.0).abs() < 1e-6 && out[0].is_finite());
    }
}
