//! Tests of the batched decode attention against the per-sequence tiled
//! kernel on its f32 products ([`crate::flash::tiled_f32`], itself tested
//! against f64 references) and the f64 [`dense_attention`], with every instruction
//! set this CPU supports, on f32, bf16 and int8 pools (int8 with a scale per
//! head, read in place, and with coarser segments, widened per row).
//!
//! Tolerance: `2e-5 · max|out|` of the reference, per element (f32
//! accumulation over up to ~2,000 keys of O(1) values; every kernel and the
//! dense reference read the same stored rows, so bf16 or int8 rounding does
//! not enter the comparison).

use super::*;
use crate::attention::dense_attention;
use crate::flash::tiled_f32;
use crate::paged::{common_segment, KvDtype};
use crate::testing::values;

/// Every instruction set this CPU can run.
fn isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|&i| i.supported()).collect()
}

/// Every (instruction set, inner kernel) pair this CPU can run: both
/// kernels are checked on every shape, whichever the call would pick.
fn runs() -> Vec<(Isa, Kernel)> {
    isas()
        .into_iter()
        .flat_map(|i| [(i, Kernel::KeysInLanes), (i, Kernel::RowsInLanes)])
        .collect()
}

/// Asserts `got` is within `rel · max|want|` of `want`, element-wise.
fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let tol = rel * want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: {g} vs {w} (tol {tol})"
        );
    }
}

/// A batch of sequences in one pool: per sequence its K/V (`[ctx, ·]`, as
/// written), its block table (pages drawn from one shuffled list, so tables
/// interleave), its query row and its query.
struct Batch {
    pool: KvPool,
    tables: Vec<Vec<u32>>,
    keys: Vec<Vec<f32>>,
    vals: Vec<Vec<f32>>,
    rows: Vec<usize>,
    ctx: Vec<usize>,
    /// `[rows, q_heads·head_dim]`; rows no sequence names hold garbage.
    q: Vec<f32>,
}

/// Builds a batch with contexts `ctx` (the query of sequence `i` sits at
/// position `ctx[i] − 1`); `kw`/`vw` values per K/V row (`vw = 0` for latent
/// rows), queries `qw` wide, int8 rows in segments of `segment` values.
#[allow(clippy::too_many_arguments)]
fn batch(
    ctx: &[usize],
    kw: usize,
    vw: usize,
    qw: usize,
    page: usize,
    dtype: KvDtype,
    segment: usize,
    seed: u64,
) -> Batch {
    let pages: Vec<usize> = ctx.iter().map(|c| c.div_ceil(page)).collect();
    let total: usize = pages.iter().sum::<usize>() + 3;
    let mut ids: Vec<u32> = (0..total as u32).collect();
    let r = values(seed, total);
    for i in (1..total).rev() {
        let j = ((r[i] + 1.0) * 0.5 * (i + 1) as f32) as usize;
        ids.swap(i, j.min(i));
    }
    let mut pool = KvPool::with_layout(2, total, page, kw + vw, segment, dtype);
    let (mut tables, mut keys, mut vals) = (Vec::new(), Vec::new(), Vec::new());
    let mut at = 0;
    for (i, (&c, &np)) in ctx.iter().zip(&pages).enumerate() {
        let table = ids[at..at + np].to_vec();
        at += np;
        let k = values(seed + 10 * i as u64 + 1, c * kw);
        let v = values(seed + 10 * i as u64 + 2, c * vw);
        for p in 0..c {
            pool.write_row(
                1,
                &table,
                p,
                &[&k[p * kw..(p + 1) * kw], &v[p * vw..(p + 1) * vw]],
            );
        }
        tables.push(table);
        keys.push(k);
        vals.push(v);
    }
    // Rows in reverse order with a gap, so row ≠ sequence index.
    let n = ctx.len();
    let rows: Vec<usize> = (0..n).map(|i| n - i).collect();
    let q: Vec<f32> = values(seed + 5, (n + 1) * qw)
        .iter()
        .map(|x| x * 3.0)
        .collect();
    Batch {
        pool,
        tables,
        keys,
        vals,
        rows,
        ctx: ctx.to_vec(),
        q,
    }
}

impl Batch {
    /// The call's sequences.
    fn seqs(&self) -> Vec<DecodeSeq<'_>> {
        (0..self.ctx.len())
            .map(|i| DecodeSeq {
                row: self.rows[i],
                pos: self.ctx[i] - 1,
                block_table: &self.tables[i],
            })
            .collect()
    }
}

/// Context lengths of the GQA tests: one key, partial and whole tiles and
/// vectors, and lengths long enough to split on two or more threads.
const CONTEXTS: &[usize] = &[1, 5, 17, 64, 65, 300, 700, 1100];

/// [`check_gqa_in`] with int8 segments as large as the heads allow (one
/// per head when `head_dim = v_dim`).
fn check_gqa(shape: AttnShape, page: usize, dtype: KvDtype, seed: u64) {
    check_gqa_in(
        shape,
        page,
        dtype,
        common_segment(shape.head_dim, shape.v_dim),
        seed,
    );
}

/// Checks every sequence of a GQA batch against the tiled kernel run on
/// that sequence alone, and against f64 dense attention over the stored
/// rows.
fn check_gqa_in(shape: AttnShape, page: usize, dtype: KvDtype, segment: usize, seed: u64) {
    let (kw, vw, qw, ow) = (
        shape.kv_heads * shape.head_dim,
        shape.kv_heads * shape.v_dim,
        shape.q_heads * shape.head_dim,
        shape.q_heads * shape.v_dim,
    );
    let b = batch(CONTEXTS, kw, vw, qw, page, dtype, segment, seed);
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let seqs = b.seqs();
    for (isa, kernel) in runs() {
        let mut out = vec![f32::NAN; (seqs.len() + 1) * ow];
        decode_with(
            isa,
            &b.q,
            &b.pool,
            1,
            &seqs,
            &shape,
            false,
            scale,
            Some(kernel),
            &mut out,
        );
        assert!(
            out[..ow].iter().all(|x| x.is_nan()),
            "a row no sequence names was written"
        );
        for (i, s) in seqs.iter().enumerate() {
            let what = format!(
                "{isa:?} {kernel:?} {dtype:?} {shape:?} page {page} ctx {}",
                b.ctx[i]
            );
            let q = &b.q[s.row * qw..(s.row + 1) * qw];
            let got = &out[s.row * ow..(s.row + 1) * ow];
            let mut tiled = vec![0.0; ow];
            tiled_f32(
                q,
                &b.pool,
                1,
                s.block_table,
                s.pos,
                &shape,
                false,
                scale,
                &mut tiled,
            );
            assert_close(got, &tiled, 2e-5, &format!("vs tiled {what}"));
            let (mut k, mut v) = (Vec::new(), Vec::new());
            let mut buf = vec![0.0; kw + vw];
            for p in 0..b.ctx[i] {
                let row = b.pool.read_row(1, s.block_table, p, &mut buf);
                k.extend_from_slice(&row[..kw]);
                v.extend_from_slice(&row[kw..]);
            }
            if dtype == KvDtype::F32 {
                assert_eq!((&k, &v), (&b.keys[i], &b.vals[i]));
            }
            let mut want = vec![0.0; ow];
            dense_attention(q, &k, &v, 1, b.ctx[i], &shape, scale, &mut want);
            assert_close(got, &want, 2e-5, &format!("vs dense {what}"));
        }
    }
}

/// A head layout.
fn shape(q_heads: usize, kv_heads: usize, head_dim: usize, v_dim: usize) -> AttnShape {
    AttnShape {
        q_heads,
        kv_heads,
        head_dim,
        v_dim,
    }
}

#[test]
fn batched_decode_equals_per_sequence_tiled_for_smollm2_heads() {
    for dtype in [KvDtype::Bf16, KvDtype::F32, KvDtype::Int8] {
        check_gqa(shape(9, 3, 64, 64), 16, dtype, 100);
    }
}

#[test]
fn int8_rows_decode_in_place_per_head_and_widened_otherwise() {
    // A scale per head (keys in lanes read the int8 rows), pages of 7 so
    // that a vector of keys spans two pages' scales.
    check_gqa(shape(4, 4, 32, 32), 7, KvDtype::Int8, 210);
    check_gqa(shape(16, 2, 128, 128), 16, KvDtype::Int8, 310);
    // Segments finer than a head, and one per row: the rows are widened.
    check_gqa_in(shape(9, 3, 64, 64), 16, KvDtype::Int8, 32, 110);
    check_gqa_in(shape(9, 3, 64, 64), 5, KvDtype::Int8, 384, 120);
    // head_dim ≠ v_dim.
    check_gqa(shape(6, 2, 20, 12), 5, KvDtype::Int8, 410);
}

#[test]
fn batched_decode_equals_per_sequence_tiled_for_groups_1_and_8() {
    check_gqa(shape(4, 4, 32, 32), 7, KvDtype::Bf16, 200);
    check_gqa(shape(16, 2, 128, 128), 16, KvDtype::Bf16, 300);
}

#[test]
fn batched_decode_handles_head_dims_off_the_vector_width() {
    // head_dim 20 and v_dim 12: partial vectors in QK and PV.
    check_gqa(shape(6, 2, 20, 12), 5, KvDtype::Bf16, 400);
    check_gqa(shape(14, 1, 72, 40), 3, KvDtype::F32, 500);
}

#[test]
fn batched_latent_decode_equals_per_sequence_tiled() {
    // (heads, row width r + dr, v_dim = r): a K3-like 16 heads over rows
    // of 64 + 16, and an odd row of 36 + 10.
    for (n, (heads, width, vd)) in [(16usize, 80usize, 64usize), (5, 46, 36)]
        .into_iter()
        .enumerate()
    {
        for dtype in [KvDtype::Bf16, KvDtype::F32, KvDtype::Int8] {
            let seed = 600 + 50 * n as u64;
            let qw = heads * width;
            // int8: the latent and the rope part in separate segments.
            let segment = common_segment(vd, width - vd);
            let b = batch(CONTEXTS, width, 0, qw, 16, dtype, segment, seed);
            let seqs = b.seqs();
            let scale = 1.0 / (width as f32).sqrt();
            let ow = heads * vd;
            for (isa, kernel) in runs() {
                let mut out = vec![f32::NAN; (seqs.len() + 1) * ow];
                let s = AttnShape {
                    q_heads: heads,
                    kv_heads: 1,
                    head_dim: width,
                    v_dim: vd,
                };
                decode_with(
                    isa,
                    &b.q,
                    &b.pool,
                    1,
                    &seqs,
                    &s,
                    true,
                    scale,
                    Some(kernel),
                    &mut out,
                );
                let what = format!("{isa:?} {kernel:?} {dtype:?} latent {heads}×{width}");
                assert_latent_like_tiled(&b, &s, scale, &out, 2e-5, &what);
            }
        }
    }
}

#[test]
fn latent_decode_on_the_best_products_matches_the_f32_tiles() {
    // The call's own choice (no forced kernel): on CPUs with AVX-512 BF16 or
    // AMX-BF16 the rows-in-lanes pieces take bf16 products, so the
    // tolerance is the tiled bf16 test's, 1e-2 · max|out| (bf16 rounding of
    // scale·q and of the softmax weights); elsewhere the FMA tiles, well
    // inside it. Heads: K3 `small` (8 over 64 + 16) and Kimi K3's rows of
    // 512 + 64 under 16 heads.
    for (n, (heads, width, vd)) in [(8usize, 80usize, 64usize), (16, 576, 512)]
        .into_iter()
        .enumerate()
    {
        let seed = 700 + 50 * n as u64;
        let qw = heads * width;
        let b = batch(CONTEXTS, width, 0, qw, 16, KvDtype::Bf16, width, seed);
        let seqs = b.seqs();
        let scale = 1.0 / (width as f32).sqrt();
        let ow = heads * vd;
        let mut out = vec![f32::NAN; (seqs.len() + 1) * ow];
        latent_decode_attention_batch(&b.q, &b.pool, 1, &seqs, heads, vd, scale, &mut out);
        let s = AttnShape::latent(heads, width, vd, "test");
        let what = format!("best products, latent {heads}×{width}");
        assert_latent_like_tiled(&b, &s, scale, &out, 1e-2, &what);
    }
}

/// Asserts that each sequence's row of the latent decode output `out` is
/// within `rel · max|out|` of the f32 tiled kernel run on that sequence
/// alone (`s` from `AttnShape::latent`).
fn assert_latent_like_tiled(
    b: &Batch,
    s: &AttnShape,
    scale: f32,
    out: &[f32],
    rel: f32,
    what: &str,
) {
    let (qw, ow) = (s.q_heads * s.head_dim, s.q_heads * s.v_dim);
    for (i, sq) in b.seqs().iter().enumerate() {
        let q = &b.q[sq.row * qw..(sq.row + 1) * qw];
        let mut tiled = vec![0.0; ow];
        tiled_f32(
            q,
            &b.pool,
            1,
            sq.block_table,
            sq.pos,
            s,
            true,
            scale,
            &mut tiled,
        );
        let got = &out[sq.row * ow..(sq.row + 1) * ow];
        assert_close(got, &tiled, rel, &format!("{what} ctx {}", b.ctx[i]));
    }
}

#[test]
fn a_sequence_decodes_bit_identically_alone_or_batched() {
    let s = shape(9, 3, 64, 64);
    let (kw, qw, ow) = (3 * 64, 9 * 64, 9 * 64);
    let b = batch(CONTEXTS, kw, kw, qw, 16, KvDtype::Bf16, 2 * kw, 700);
    let seqs = b.seqs();
    let mut all = vec![0.0; (seqs.len() + 1) * ow];
    decode_attention_batch(&b.q, &b.pool, 1, &seqs, &s, 0.125, &mut all);
    for sq in &seqs {
        let mut alone = vec![0.0; (seqs.len() + 1) * ow];
        decode_attention_batch(&b.q, &b.pool, 1, &[*sq], &s, 0.125, &mut alone);
        let r = sq.row * ow..(sq.row + 1) * ow;
        assert_eq!(alone[r.clone()], all[r], "row {}", sq.row);
    }
}

#[test]
fn key_splits_merge_to_the_unsplit_result() {
    // Eight threads split the 1,100-key sequence in 4 (256 keys each at
    // least), one thread does not split at all.
    let s = shape(9, 3, 64, 64);
    let (kw, qw, ow) = (3 * 64, 9 * 64, 9 * 64);
    let b = batch(&[1100, 700], kw, kw, qw, 16, KvDtype::Bf16, 2 * kw, 800);
    let seqs = b.seqs();
    assert_eq!(splits_for(1100, 3, 8), 4);
    assert_eq!(splits_for(1100, 3, 1), 1);
    // The f32 kernel (forced) merges to within f32 rounding; the call's own
    // choice may take bf16 pair products, whose rounding of the
    // probabilities depends on each split's running max: the bf16 tests'
    // tolerance (1e-2 · max|out|) there.
    for (kernel, tol) in [(Some(Kernel::KeysInLanes), 2e-5), (None, 1e-2)] {
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a rayon pool");
            let mut out = vec![0.0; 3 * ow];
            pool.install(|| {
                decode_with(
                    Isa::best(),
                    &b.q,
                    &b.pool,
                    1,
                    &seqs,
                    &s,
                    false,
                    0.125,
                    kernel,
                    &mut out,
                )
            });
            out
        };
        let (one, eight) = (run(1), run(8));
        assert_close(
            &eight[ow..],
            &one[ow..],
            tol,
            &format!("{kernel:?}: 8 threads vs 1"),
        );
    }
}

#[test]
#[should_panic(expected = "named by two sequences")]
fn a_row_named_twice_panics() {
    let s = shape(2, 1, 16, 16);
    let b = batch(&[3, 4], 16, 16, 32, 4, KvDtype::F32, 32, 900);
    let mut seqs = b.seqs();
    seqs[1].row = seqs[0].row;
    let mut out = vec![0.0; 3 * 32];
    decode_attention_batch(&b.q, &b.pool, 1, &seqs, &s, 1.0, &mut out);
}

#[test]
#[should_panic(expected = "block table covers")]
fn a_short_block_table_panics() {
    let s = shape(2, 1, 16, 16);
    let b = batch(&[3, 4], 16, 16, 32, 4, KvDtype::F32, 32, 901);
    let mut seqs = b.seqs();
    seqs[0].pos = 9;
    let mut out = vec![0.0; 3 * 32];
    decode_attention_batch(&b.q, &b.pool, 1, &seqs, &s, 1.0, &mut out);
}

#[test]
fn gqa_decode_on_the_best_products_matches_the_f32_tiles() {
    // The call's own choice (no forced kernel) over bf16 rows: on CPUs with
    // AVX-512 BF16 keys-in-lanes pieces take bf16 pair products for QK
    // (`decode_pairs.rs`: scale·q rounded to bf16), so the tolerance is the
    // tiled bf16 test's, 1e-2 · max|out| (2.6e-3 seen: the rounding's 2⁻⁹
    // relative step on queries of up to ±3); elsewhere the f32 kernel, well
    // inside it (6e-7 seen). Head dims of
    // 1 to 4 vectors of pairs, groups of 1 to 4 (scores summed in
    // registers, `pairs::qk_scores`) and 6 (through the partial sums), and
    // one (head_dim 20) that stays on the f32 loop.
    for (n, s) in [
        shape(9, 3, 64, 64),
        shape(4, 2, 64, 64),
        shape(12, 2, 64, 64),
        shape(4, 4, 32, 32),
        shape(8, 2, 128, 128),
        shape(6, 2, 96, 96),
        shape(6, 2, 20, 12),
    ]
    .into_iter()
    .enumerate()
    {
        let (kw, vw, qw, ow) = (
            s.kv_heads * s.head_dim,
            s.kv_heads * s.v_dim,
            s.q_heads * s.head_dim,
            s.q_heads * s.v_dim,
        );
        let segment = common_segment(s.head_dim, s.v_dim);
        let b = batch(
            CONTEXTS,
            kw,
            vw,
            qw,
            16,
            KvDtype::Bf16,
            segment,
            800 + n as u64,
        );
        let seqs = b.seqs();
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        for isa in isas() {
            let mut out = vec![f32::NAN; (seqs.len() + 1) * ow];
            decode_with(
                isa, &b.q, &b.pool, 1, &seqs, &s, false, scale, None, &mut out,
            );
            for (i, sq) in seqs.iter().enumerate() {
                let q = &b.q[sq.row * qw..(sq.row + 1) * qw];
                let got = &out[sq.row * ow..(sq.row + 1) * ow];
                let mut tiled = vec![0.0; ow];
                tiled_f32(
                    q,
                    &b.pool,
                    1,
                    sq.block_table,
                    sq.pos,
                    &s,
                    false,
                    scale,
                    &mut tiled,
                );
                let what = format!("{isa:?} best products {s:?} ctx {}", b.ctx[i]);
                assert_close(got, &tiled, 1e-2, &what);
            }
        }
    }
}

/// `lanes::qk_scores` (the f32 products' scores summed in registers) against
/// plain f64 dot products of the stored values, on every tree build this CPU
/// runs, over f32, bf16 and int8 rows: 1 to `LANES` keys scattered through
/// a buffer, 1 to 4 heads, 1 to 4 vectors a head. Tolerance 1e-5 · Σ|q·k|
/// per score (f32 sums of up to 64 products); lanes past the last key are 0.
#[test]
fn lane_scores_summed_in_registers_are_the_plain_dot_products() {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::dtype::{bf16_to_f32, f32_to_bf16};
        use crate::simd::{Avx2, Avx512};
        fn check<S: DecSimd, T: KvElem>(rows: &[T], widen: impl Fn(T) -> f64, what: &str) {
            let lanes = S::LANES;
            for full in 1..=4 {
                let hd = full * lanes;
                for g in 1..=SCORE_HEADS {
                    assert!(lanes::scores_in_registers::<S>(g, hd));
                    let q = values(40 + g as u64, g * hd);
                    for nk in 1..=lanes {
                        // Keys in reverse order, every other row of 40.
                        let koff: Vec<usize> = (0..nk).map(|j| (39 - 2 * j) * hd).collect();
                        let mut s = vec![f32::NAN; g * 20];
                        // SAFETY: the tree build is supported (checked by the
                        // caller); every offset names `hd` values of `rows`.
                        unsafe {
                            lanes::qk_scores::<S, T>(
                                g,
                                q.as_ptr(),
                                hd,
                                hd,
                                rows.as_ptr(),
                                &koff,
                                s.as_mut_ptr(),
                                20,
                            )
                        };
                        for r in 0..g {
                            for kk in 0..lanes {
                                let (want, mag) = koff.get(kk).map_or((0.0, 0.0), |&off| {
                                    (0..hd).fold((0.0f64, 0.0f64), |(sum, mag), d| {
                                        let t = q[r * hd + d] as f64 * widen(rows[off + d]);
                                        (sum + t, mag + t.abs())
                                    })
                                });
                                let got = s[r * 20 + kk] as f64;
                                assert!(
                                    (got - want).abs() <= 1e-5 * mag,
                                    "{what} hd {hd} heads {g} keys {nk}: head {r} key {kk}: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
        let f: Vec<f32> = values(3, 40 * 64);
        let b: Vec<u16> = f.iter().map(|&v| f32_to_bf16(v)).collect();
        let i: Vec<i8> = f
            .iter()
            .map(|&v| (v * 120.0).round().clamp(-127.0, 127.0) as i8)
            .collect();
        if Isa::Avx512.supported() {
            check::<Avx512, f32>(&f, |v| v as f64, "avx512 f32");
            check::<Avx512, u16>(&b, |v| bf16_to_f32(v) as f64, "avx512 bf16");
            check::<Avx512, i8>(&i, |v| v as f64, "avx512 int8");
        }
        if Isa::Avx2.supported() {
            check::<Avx2, f32>(&f, |v| v as f64, "avx2 f32");
            check::<Avx2, u16>(&b, |v| bf16_to_f32(v) as f64, "avx2 bf16");
            check::<Avx2, i8>(&i, |v| v as f64, "avx2 int8");
        }
    }
}
