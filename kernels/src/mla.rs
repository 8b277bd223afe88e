//! Multi-head latent attention (MLA) over the compressed latent cache.
//!
//! Paper: DeepSeek-V2 (arXiv 2405.04434) §2.1; reference implementations
//! whose numbers we match: transformers 5.x `DeepseekV3Attention` and
//! `KimiLinearAttention` (eager path). Those decompress every cached token
//! with `kv_b_proj` into per-head keys `[k_nope | k_pe]` and values; here the
//! cache keeps only the latent row `[c_kv (r) | k_pe (dr)]` per token (one
//! row shared by all heads, stored in a [`KvPool`]) and attention runs with
//! the up-projections absorbed into the query and the output:
//!
//! ```text
//! q̃_h      = W_UK_hᵀ · q_nope_h                     (r)
//! score_j  = (q̃_h · c_j + q_pe_h · k_pe_j) · scale   causal over cached positions
//! p        = softmax(score)
//! lat_h    = Σ_j p_j · c_j                           (r)
//! out_h    = W_UV_h · lat_h                          (v)
//! ```
//!
//! which is algebraically the same as the decompressed form
//! (`q_nope · (W_UK c) = (W_UKᵀ q_nope) · c`), up to f32 rounding.
//!
//! NoPE models (Kimi-Linear, K3): transformers' `KimiLinearAttention` skips
//! the rotary embedding but still concatenates the unrotated `q_pe`/`k_pe`
//! dims into the scores, so callers pass them unrotated; they are not dropped.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::flash::{latent_attention_tiled, latent_decode_attention_batch, DecodeSeq};
use crate::paged::KvPool;

/// Head geometry of one MLA layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaShape {
    /// Attention heads (`num_attention_heads`).
    pub heads: usize,
    /// Query/key dims without position encoding per head (`qk_nope_head_dim`).
    pub nope_dim: usize,
    /// Query/key dims carrying RoPE per head, shared key part (`qk_rope_head_dim`).
    pub rope_dim: usize,
    /// Value dims per head (`v_head_dim`).
    pub v_dim: usize,
    /// Width of the compressed latent `c_kv` (`kv_lora_rank`).
    pub kv_lora_rank: usize,
}

impl MlaShape {
    /// f32 values per cached token: `kv_lora_rank + rope_dim`.
    pub fn cache_width(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }
}

/// `kv_b_proj` split per head into the two absorbed up-projections.
pub struct MlaAbsorbed {
    /// Key up-projection `W_UK`, `[H, nope, r]`: `k_nope_h = W_UK_h · c`.
    w_uk: Vec<f32>,
    /// Value up-projection `W_UV`, `[H, v, r]`: `v_h = W_UV_h · c`.
    w_uv: Vec<f32>,
}

impl MlaAbsorbed {
    /// Splits `kv_b_proj.weight` (`[H·(nope+v), r]`, widened to f32): per
    /// head the first `nope` rows are the key rows, the next `v` rows the
    /// value rows (transformers views the projection as `[.., H, nope+v]`).
    pub fn from_kv_b(kv_b: &[f32], shape: &MlaShape) -> Result<MlaAbsorbed> {
        let MlaShape {
            heads,
            nope_dim,
            v_dim,
            kv_lora_rank: r,
            ..
        } = *shape;
        let want = heads * (nope_dim + v_dim) * r;
        if kv_b.len() != want {
            return Err(Error::Shape {
                op: "MlaAbsorbed::from_kv_b",
                detail: format!(
                    "kv_b_proj has {} values, expected [{heads}·({nope_dim}+{v_dim}), {r}] = {want}",
                    kv_b.len()
                ),
            });
        }
        let mut w_uk = Vec::with_capacity(heads * nope_dim * r);
        let mut w_uv = Vec::with_capacity(heads * v_dim * r);
        for head in kv_b.chunks_exact((nope_dim + v_dim) * r) {
            let (k_rows, v_rows) = head.split_at(nope_dim * r);
            w_uk.extend_from_slice(k_rows);
            w_uv.extend_from_slice(v_rows);
        }
        Ok(MlaAbsorbed { w_uk, w_uv })
    }

    /// `W_UK`, `[H, nope, r]` row-major.
    pub fn w_uk(&self) -> &[f32] {
        &self.w_uk
    }

    /// `W_UV`, `[H, v, r]` row-major.
    pub fn w_uv(&self) -> &[f32] {
        &self.w_uv
    }
}

/// Writes `t` latent rows `[c_kv | k_pe]` for positions
/// `start_pos..start_pos + t` of `layer` into the pool.
///
/// `c_kv` is `[t, r]` (already `kv_a_layernorm`-ed), `k_pe` is `[t, dr]`
/// (after RoPE, or unrotated for NoPE models).
///
/// # Panics
/// If the pool width is not `r + dr`, the lengths disagree, or `block_table`
/// does not cover the positions (call [`KvPool::ensure_capacity`] first).
pub fn write_latent(
    pool: &mut KvPool,
    layer: usize,
    block_table: &[u32],
    start_pos: usize,
    c_kv: &[f32],
    k_pe: &[f32],
    shape: &MlaShape,
) {
    let (r, dr) = (shape.kv_lora_rank, shape.rope_dim);
    assert_eq!(
        pool.width,
        r + dr,
        "write_latent: pool width {} != kv_lora_rank + rope_dim {}",
        pool.width,
        r + dr
    );
    assert!(r > 0, "write_latent: kv_lora_rank must be positive");
    assert_eq!(
        c_kv.len() % r,
        0,
        "write_latent: c_kv must be [t, kv_lora_rank]"
    );
    let t = c_kv.len() / r;
    assert_eq!(
        k_pe.len(),
        t * dr,
        "write_latent: k_pe must be [t, rope_dim]"
    );
    assert!(
        (start_pos + t).div_ceil(pool.page_size) <= block_table.len(),
        "write_latent: block table of {} pages does not cover {} positions",
        block_table.len(),
        start_pos + t
    );
    for i in 0..t {
        let (c, kp) = (&c_kv[i * r..(i + 1) * r], &k_pe[i * dr..(i + 1) * dr]);
        pool.write_row(layer, block_table, start_pos + i, &[c, kp]);
    }
}

/// Checks attention arguments; returns the number of query tokens.
#[allow(clippy::too_many_arguments)]
fn check_attention(
    q_nope: &[f32],
    q_pe: &[f32],
    pool: &KvPool,
    block_table: &[u32],
    start_pos: usize,
    shape: &MlaShape,
    out: &[f32],
    op: &str,
) -> usize {
    let MlaShape {
        heads,
        nope_dim,
        rope_dim,
        v_dim,
        ..
    } = *shape;
    assert!(
        heads > 0 && nope_dim > 0,
        "{op}: heads and nope_dim must be positive"
    );
    assert_eq!(
        pool.width,
        shape.cache_width(),
        "{op}: pool width != kv_lora_rank + rope_dim"
    );
    assert_eq!(
        q_nope.len() % (heads * nope_dim),
        0,
        "{op}: q_nope must be [t, heads·nope_dim]"
    );
    let t = q_nope.len() / (heads * nope_dim);
    assert_eq!(
        q_pe.len(),
        t * heads * rope_dim,
        "{op}: q_pe must be [t, heads·rope_dim]"
    );
    assert_eq!(
        out.len(),
        t * heads * v_dim,
        "{op}: out must be [t, heads·v_dim]"
    );
    assert!(
        (start_pos + t).div_ceil(pool.page_size) <= block_table.len(),
        "{op}: block table does not cover {} positions",
        start_pos + t
    );
    t
}

/// MLA over the latent cache with absorbed up-projections (prefill and
/// decode). Query token `i` sits at position `start_pos + i` and attends to
/// cached positions `0..=start_pos + i`, which must already be written (call
/// [`write_latent`] for the current tokens first).
///
/// - `q_nope`: `[t, H·nope]`; `q_pe`: `[t, H·dr]` (RoPE applied by the
///   caller, or left unrotated for NoPE models).
/// - `scale`: the softmax scale (`(nope+dr)^-0.5`, times the YaRN `mscale²`
///   for K2).
/// - `out`: `[t, H·v]`.
///
/// The scores and the weighted latent sum run in
/// [`latent_attention_tiled`] (all heads share the latent rows, like GQA with
/// one KV head); the absorbed projections are parallel over (token, head).
///
/// # Panics
/// If a length disagrees with `shape`, or the block table is too short.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention_absorbed(
    q_nope: &[f32],
    q_pe: &[f32],
    pool: &KvPool,
    layer: usize,
    block_table: &[u32],
    start_pos: usize,
    w: &MlaAbsorbed,
    shape: &MlaShape,
    scale: f32,
    out: &mut [f32],
) {
    check_attention(
        q_nope,
        q_pe,
        pool,
        block_table,
        start_pos,
        shape,
        out,
        "mla_attention_absorbed",
    );
    let MlaShape {
        heads,
        nope_dim,
        v_dim,
        kv_lora_rank: r,
        ..
    } = *shape;
    assert_eq!(
        w.w_uk.len(),
        heads * nope_dim * r,
        "mla_attention_absorbed: weights built for another shape"
    );
    assert_eq!(
        w.w_uv.len(),
        heads * v_dim * r,
        "mla_attention_absorbed: weights built for another shape"
    );
    let t = q_nope.len() / (heads * nope_dim);
    let rows: Vec<usize> = (0..t).collect();
    let qcat = absorb_queries(q_nope, q_pe, &rows, w, shape);
    // lat_h = softmax(scale·q̃·[c | k_pe]) · c, tiled over the cached rows.
    let mut lat = vec![0.0f32; t * heads * r];
    latent_attention_tiled(
        &qcat,
        pool,
        layer,
        block_table,
        start_pos,
        heads,
        r,
        scale,
        &mut lat,
    );
    expand_values(&lat, w, shape, out);
}

/// MLA decode of one query per sequence, every decoding sequence of a step
/// in one call: the absorbed queries of all of them, one
/// [`latent_decode_attention_batch`] over their latent rows, then the value
/// up-projection. Sequence `s` reads row `s.row` of `q_nope` (`[rows,
/// H·nope]`) and `q_pe` (`[rows, H·dr]`) and writes row `s.row` of `out`
/// (`[rows, H·v]`); its latent row at `s.pos` must already be written.
/// Same numbers as [`mla_attention_absorbed`] per sequence, up to f32
/// summation order.
///
/// # Panics
/// If a length disagrees with `shape`, a row lies outside the arrays or is
/// named twice, or a block table is too short.
#[allow(clippy::too_many_arguments)]
pub fn mla_decode_attention_batch(
    q_nope: &[f32],
    q_pe: &[f32],
    pool: &KvPool,
    layer: usize,
    seqs: &[DecodeSeq<'_>],
    w: &MlaAbsorbed,
    shape: &MlaShape,
    scale: f32,
    out: &mut [f32],
) {
    let MlaShape {
        heads,
        nope_dim,
        rope_dim: dr,
        v_dim,
        kv_lora_rank: r,
    } = *shape;
    assert_eq!(
        pool.width,
        shape.cache_width(),
        "mla_decode_attention_batch: pool width != kv_lora_rank + rope_dim"
    );
    assert_eq!(
        (w.w_uk.len(), w.w_uv.len()),
        (heads * nope_dim * r, heads * v_dim * r),
        "mla_decode_attention_batch: weights built for another shape"
    );
    let ow = heads * v_dim;
    for s in seqs {
        assert!(
            q_nope.len() >= (s.row + 1) * heads * nope_dim
                && q_pe.len() >= (s.row + 1) * heads * dr
                && out.len() >= (s.row + 1) * ow,
            "mla_decode_attention_batch: row {} lies outside the arrays",
            s.row
        );
    }
    let rows: Vec<usize> = seqs.iter().map(|s| s.row).collect();
    let qcat = absorb_queries(q_nope, q_pe, &rows, w, shape);
    // The absorbed queries are dense: sequence i is row i of qcat and lat.
    let dense: Vec<DecodeSeq<'_>> = seqs
        .iter()
        .enumerate()
        .map(|(i, s)| DecodeSeq { row: i, ..*s })
        .collect();
    let n = seqs.len();
    let mut lat = vec![0.0f32; n * heads * r];
    latent_decode_attention_batch(&qcat, pool, layer, &dense, heads, r, scale, &mut lat);
    let mut dst = vec![0.0f32; n * ow];
    expand_values(&lat, w, shape, &mut dst);
    for (i, &row) in rows.iter().enumerate() {
        out[row * ow..(row + 1) * ow].copy_from_slice(&dst[i * ow..(i + 1) * ow]);
    }
}

/// The absorbed queries of rows `rows` of `q_nope`/`q_pe`: per row and head
/// `[W_UK_hᵀ · q_nope_h | q_pe_h]` (one query over the latent row `[c |
/// k_pe]`), `[rows.len(), H·(r + dr)]`, parallel over (row, head).
fn absorb_queries(
    q_nope: &[f32],
    q_pe: &[f32],
    rows: &[usize],
    w: &MlaAbsorbed,
    shape: &MlaShape,
) -> Vec<f32> {
    let MlaShape {
        heads,
        nope_dim,
        rope_dim: dr,
        kv_lora_rank: r,
        ..
    } = *shape;
    let width = r + dr;
    let mut qcat = vec![0.0f32; rows.len() * heads * width];
    qcat.par_chunks_mut(width)
        .enumerate()
        .for_each(|(idx, qc)| {
            let (i, h) = (rows[idx / heads], idx % heads);
            let qn = &q_nope[(i * heads + h) * nope_dim..(i * heads + h + 1) * nope_dim];
            let wk = &w.w_uk[h * nope_dim * r..(h + 1) * nope_dim * r];
            let (qt, qp) = qc.split_at_mut(r);
            for (n, &qv) in qn.iter().enumerate() {
                for (acc, &wv) in qt.iter_mut().zip(&wk[n * r..(n + 1) * r]) {
                    *acc += qv * wv;
                }
            }
            qp.copy_from_slice(&q_pe[(i * heads + h) * dr..(i * heads + h + 1) * dr]);
        });
    qcat
}

/// `out_h = W_UV_h · lat_h` for every row and head: `lat` `[n, H·r]`, `out`
/// `[n, H·v]`, parallel over (row, head).
fn expand_values(lat: &[f32], w: &MlaAbsorbed, shape: &MlaShape, out: &mut [f32]) {
    let (heads, v_dim, r) = (shape.heads, shape.v_dim, shape.kv_lora_rank);
    out.par_chunks_mut(v_dim).enumerate().for_each(|(idx, o)| {
        let h = idx % heads;
        let l = &lat[idx * r..(idx + 1) * r];
        let wv = &w.w_uv[h * v_dim * r..(h + 1) * v_dim * r];
        for (e, ov) in o.iter_mut().enumerate() {
            *ov = dot(&wv[e * r..(e + 1) * r], l);
        }
    });
}

/// Reference MLA, as transformers' eager path computes it: decompresses
/// `k_nope` and `v` of every cached token with `kv_b` (`kv_b_proj.weight`,
/// `[H·(nope+v), r]` in f32) and runs ordinary causal attention with keys
/// `[k_nope | k_pe]`. Accumulates in f64, so it also serves as the oracle
/// for [`mla_attention_absorbed`]. Arguments as there; slow (O(H·(nope+v)·r)
/// per cached token and query) and meant for tests.
///
/// # Panics
/// If a length disagrees with `shape`, or the block table is too short.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention_naive(
    q_nope: &[f32],
    q_pe: &[f32],
    pool: &KvPool,
    layer: usize,
    block_table: &[u32],
    start_pos: usize,
    kv_b: &[f32],
    shape: &MlaShape,
    scale: f32,
    out: &mut [f32],
) {
    let t = check_attention(
        q_nope,
        q_pe,
        pool,
        block_table,
        start_pos,
        shape,
        out,
        "mla_attention_naive",
    );
    let MlaShape {
        heads,
        nope_dim,
        rope_dim: dr,
        v_dim,
        kv_lora_rank: r,
    } = *shape;
    assert_eq!(
        kv_b.len(),
        heads * (nope_dim + v_dim) * r,
        "mla_attention_naive: kv_b must be [H·(nope+v), r]"
    );
    let row_dot = |row: usize, c: &[f32]| -> f64 {
        kv_b[row * r..(row + 1) * r]
            .iter()
            .zip(c)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum()
    };
    for i in 0..t {
        let len = start_pos + i + 1;
        for h in 0..heads {
            let qn = &q_nope[(i * heads + h) * nope_dim..(i * heads + h + 1) * nope_dim];
            let qp = &q_pe[(i * heads + h) * dr..(i * heads + h + 1) * dr];
            let base = h * (nope_dim + v_dim);
            let mut scores = Vec::with_capacity(len);
            let mut values = Vec::with_capacity(len);
            for pos in 0..len {
                let mut buf = vec![0.0f32; pool.width];
                let row = pool.read_row(layer, block_table, pos, &mut buf);
                let (c, kpe) = row.split_at(r);
                let k_nope: Vec<f64> = (0..nope_dim).map(|n| row_dot(base + n, c)).collect();
                let v: Vec<f64> = (0..v_dim)
                    .map(|e| row_dot(base + nope_dim + e, c))
                    .collect();
                let s: f64 = qn
                    .iter()
                    .zip(&k_nope)
                    .map(|(&a, &b)| a as f64 * b)
                    .sum::<f64>()
                    + qp.iter()
                        .zip(kpe)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>();
                scores.push(s * scale as f64);
                values.push(v);
            }
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            let o = &mut out[(i * heads + h) * v_dim..(i * heads + h + 1) * v_dim];
            for (e, ov) in o.iter_mut().enumerate() {
                *ov = (weights
                    .iter()
                    .zip(&values)
                    .map(|(p, v)| p * v[e])
                    .sum::<f64>()
                    / sum) as f32;
            }
        }
    }
}

/// Dot product of two equally long slices.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paged::KvDtype;
    use crate::testing::Rng;

    const SHAPE: MlaShape = MlaShape {
        heads: 3,
        nope_dim: 8,
        rope_dim: 4,
        v_dim: 6,
        kv_lora_rank: 16,
    };

    /// Asserts |got − want| ≤ tol·max|want| elementwise (relative to the
    /// largest reference magnitude).
    fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
        assert_eq!(got.len(), want.len());
        let peak = want.iter().fold(0.0f32, |m, w| m.max(w.abs())).max(1e-30);
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol * peak,
                "{what}[{i}]: got {g}, want {w}, peak {peak}"
            );
        }
    }

    #[test]
    fn absorbed_equals_naive_on_shuffled_pages_for_prefill_and_decode() {
        // Tolerance: 1e-5 relative (|err| ≤ 1e-5·max|ref|); the naive
        // reference accumulates in f64, the absorbed path in f32.
        let s = SHAPE;
        let mut rng = Rng::new(0x5EED);
        let kv_b = rng.vec(s.heads * (s.nope_dim + s.v_dim) * s.kv_lora_rank, 0.5);
        let w = MlaAbsorbed::from_kv_b(&kv_b, &s).expect("kv_b has the right length");
        let page_size = 4;
        let mut pool = KvPool::new(2, 12, page_size, s.cache_width());
        // Shuffled block table: positions land on pages out of order.
        let table: Vec<u32> = vec![7, 2, 10, 0, 5, 11, 3];
        let layer = 1;
        let scale = ((s.nope_dim + s.rope_dim) as f32).powf(-0.5) * 1.3;
        // Prefill 7 tokens, continue with a 4-token chunk, then decode 3 tokens.
        let mut pos = 0;
        for t in [7usize, 4, 1, 1, 1] {
            let c_kv = rng.vec(t * s.kv_lora_rank, 1.0);
            let k_pe = rng.vec(t * s.rope_dim, 1.0);
            write_latent(&mut pool, layer, &table, pos, &c_kv, &k_pe, &s);
            let q_nope = rng.vec(t * s.heads * s.nope_dim, 1.0);
            let q_pe = rng.vec(t * s.heads * s.rope_dim, 1.0);
            let mut fast = vec![0.0; t * s.heads * s.v_dim];
            let mut slow = vec![0.0; t * s.heads * s.v_dim];
            mla_attention_absorbed(
                &q_nope, &q_pe, &pool, layer, &table, pos, &w, &s, scale, &mut fast,
            );
            mla_attention_naive(
                &q_nope, &q_pe, &pool, layer, &table, pos, &kv_b, &s, scale, &mut slow,
            );
            assert_close(&fast, &slow, 1e-5, &format!("t={t} at pos {pos}"));
            pos += t;
        }
        // Layer 0 was never written.
        assert!(pool.row(0, &table, 3).iter().all(|&x| x == 0.0));
    }

    #[test]
    fn single_cached_token_returns_its_value() {
        // With one position the softmax weight is 1: out_h = W_UV_h · c.
        // Tolerance 1e-5 relative.
        let s = SHAPE;
        let mut rng = Rng::new(99);
        let kv_b = rng.vec(s.heads * (s.nope_dim + s.v_dim) * s.kv_lora_rank, 1.0);
        let w = MlaAbsorbed::from_kv_b(&kv_b, &s).expect("kv_b has the right length");
        let mut pool = KvPool::new(1, 1, 2, s.cache_width());
        let table = [0u32];
        let c = rng.vec(s.kv_lora_rank, 1.0);
        write_latent(&mut pool, 0, &table, 0, &c, &rng.vec(s.rope_dim, 1.0), &s);
        let mut out = vec![0.0; s.heads * s.v_dim];
        let q_nope = rng.vec(s.heads * s.nope_dim, 1.0);
        let q_pe = rng.vec(s.heads * s.rope_dim, 1.0);
        mla_attention_absorbed(&q_nope, &q_pe, &pool, 0, &table, 0, &w, &s, 0.3, &mut out);
        let r = s.kv_lora_rank;
        for h in 0..s.heads {
            for e in 0..s.v_dim {
                let row = h * (s.nope_dim + s.v_dim) + s.nope_dim + e;
                let want: f32 = (0..r).map(|j| kv_b[row * r + j] * c[j]).sum();
                let got = out[h * s.v_dim + e];
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "h{h} e{e}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn batched_decode_equals_absorbed_per_sequence() {
        // Three sequences of 1, 9 and 300 positions on interleaved pages,
        // rows in reverse order. Tolerance 2e-5 relative (f32 summation
        // order of the batched kernel vs the tiled one).
        let s = SHAPE;
        let mut rng = Rng::new(0xDEC0);
        let kv_b = rng.vec(s.heads * (s.nope_dim + s.v_dim) * s.kv_lora_rank, 0.5);
        let w = MlaAbsorbed::from_kv_b(&kv_b, &s).expect("kv_b has the right length");
        let page_size = 8;
        let mut pool = KvPool::with_dtype(1, 120, page_size, s.cache_width(), KvDtype::Bf16);
        let lens = [1usize, 9, 300];
        let tables: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                (0..n.div_ceil(page_size) as u32)
                    .map(|p| 3 * p + i as u32)
                    .collect()
            })
            .collect();
        for (table, &n) in tables.iter().zip(&lens) {
            let c_kv = rng.vec(n * s.kv_lora_rank, 1.0);
            let k_pe = rng.vec(n * s.rope_dim, 1.0);
            write_latent(&mut pool, 0, table, 0, &c_kv, &k_pe, &s);
        }
        let rows = lens.len();
        let q_nope = rng.vec(rows * s.heads * s.nope_dim, 1.0);
        let q_pe = rng.vec(rows * s.heads * s.rope_dim, 1.0);
        let seqs: Vec<DecodeSeq<'_>> = (0..rows)
            .map(|i| DecodeSeq {
                row: rows - 1 - i,
                pos: lens[i] - 1,
                block_table: &tables[i],
            })
            .collect();
        let scale = 0.4;
        let ow = s.heads * s.v_dim;
        let mut got = vec![f32::NAN; rows * ow];
        mla_decode_attention_batch(&q_nope, &q_pe, &pool, 0, &seqs, &w, &s, scale, &mut got);
        for sq in &seqs {
            let (qn, qp) = (s.heads * s.nope_dim, s.heads * s.rope_dim);
            let mut want = vec![0.0; ow];
            mla_attention_absorbed(
                &q_nope[sq.row * qn..(sq.row + 1) * qn],
                &q_pe[sq.row * qp..(sq.row + 1) * qp],
                &pool,
                0,
                sq.block_table,
                sq.pos,
                &w,
                &s,
                scale,
                &mut want,
            );
            let r = sq.row * ow..(sq.row + 1) * ow;
            assert_close(&got[r], &want, 2e-5, &format!("pos {}", sq.pos));
        }
    }

    #[test]
    fn from_kv_b_splits_key_and_value_rows_per_head() {
        let s = MlaShape {
            heads: 2,
            nope_dim: 1,
            rope_dim: 0,
            v_dim: 2,
            kv_lora_rank: 1,
        };
        // Rows: h0 [k0, v0a, v0b], h1 [k1, v1a, v1b].
        let w = MlaAbsorbed::from_kv_b(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &s).expect("right length");
        assert_eq!(w.w_uk(), &[1.0, 4.0]);
        assert_eq!(w.w_uv(), &[2.0, 3.0, 5.0, 6.0]);
        assert!(MlaAbsorbed::from_kv_b(&[0.0; 5], &s).is_err());
    }
}
