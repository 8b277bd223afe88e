//! Tests of [`paged_attention_tiled`] against the f64 reference
//! [`dense_attention`] and the per-query [`paged_attention`], run with every
//! instruction set this CPU supports (AVX-512F, AVX2+FMA, portable).
//!
//! Tolerance: `2e-5 · max|out|` of the f64 reference, per element, unless a
//! test states otherwise (f32 accumulation over up to ~1,100 keys; the
//! inputs are O(1) and the queries are scaled so outputs stay O(0.1–1)).

use super::*;
use crate::attention::{dense_attention, paged_attention, write_kv};
use crate::testing::values;

/// Every instruction set this CPU can run.
fn isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|&i| i.supported()).collect()
}

/// A pool holding `k`/`v` for positions `0..total` behind a shuffled block
/// table of pages of `page_size` rows (more pages than needed, so page ids
/// are neither contiguous nor in order). Layer 1 of 2 is written.
fn shuffled_pool(
    shape: &AttnShape,
    page_size: usize,
    total: usize,
    k: &[f32],
    v: &[f32],
    seed: u64,
) -> (KvPool, Vec<u32>) {
    let pages = total.div_ceil(page_size);
    let num_pages = pages + 5;
    let mut ids: Vec<u32> = (0..num_pages as u32).collect();
    let r = values(seed, num_pages);
    for i in (1..num_pages).rev() {
        let j = ((r[i] + 1.0) * 0.5 * (i + 1) as f32) as usize;
        ids.swap(i, j.min(i));
    }
    ids.truncate(pages);
    let mut pool = KvPool::new(2, num_pages, page_size, shape.row_width());
    write_kv(&mut pool, 1, &ids, 0, k, v, shape);
    (pool, ids)
}

/// Largest |x|.
fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Asserts `got` is within `rel · max|want|` of `want`, element-wise.
fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let tol = rel * max_abs(want);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: {g} vs {w} (tol {tol})"
        );
    }
}

/// Runs the tiled attention with instruction set `isa`.
#[allow(clippy::too_many_arguments)]
fn tiled_with(
    isa: Isa,
    q: &[f32],
    pool: &KvPool,
    layer: usize,
    table: &[u32],
    start_pos: usize,
    shape: &AttnShape,
    scale: f32,
) -> Vec<f32> {
    let t = q.len() / (shape.q_heads * shape.head_dim);
    let mut out = vec![f32::NAN; t * shape.q_heads * shape.v_dim];
    let call = Call {
        q,
        pool,
        layer,
        block_table: table,
        start_pos,
        shape,
        scale,
        latent: false,
    };
    attend_with(isa, Tiles::Fma, call, &mut out);
    out
}

/// Checks one case: `t` queries after `start_pos` cached tokens, for each
/// page size, against the f64 reference and `paged_attention`, with every
/// instruction set.
fn check_case(shape: AttnShape, start_pos: usize, t: usize, pages: &[usize], seed: u64) {
    let total = start_pos + t;
    let (kw, vw, qw) = (
        shape.kv_heads * shape.head_dim,
        shape.kv_heads * shape.v_dim,
        shape.q_heads * shape.head_dim,
    );
    let k = values(seed + 1, total * kw);
    let v = values(seed + 2, total * vw);
    // Amplitude 3 makes the softmax peaky, so outputs stay O(0.1–1).
    let q: Vec<f32> = values(seed + 3, t * qw).iter().map(|x| x * 3.0).collect();
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let mut want = vec![0.0; t * shape.q_heads * shape.v_dim];
    dense_attention(&q, &k, &v, t, total, &shape, scale, &mut want);
    for &page in pages {
        let (pool, table) = shuffled_pool(&shape, page, total, &k, &v, seed + 4);
        let what = format!("{shape:?} page {page} start {start_pos} t {t}");
        let mut paged = vec![0.0; want.len()];
        paged_attention(&q, &pool, 1, &table, start_pos, &shape, scale, &mut paged);
        assert_close(&paged, &want, 2e-5, &format!("paged_attention {what}"));
        for isa in isas() {
            let got = tiled_with(isa, &q, &pool, 1, &table, start_pos, &shape, scale);
            assert_close(&got, &want, 2e-5, &format!("{isa:?} {what}"));
            assert_close(&got, &paged, 2e-5, &format!("{isa:?} vs paged {what}"));
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

/// Every (start_pos, t) pair of the grid.
const LENGTHS: &[(usize, usize)] = &[
    (0, 1),
    (0, 3),
    (0, 17),
    (0, 64),
    (0, 130),
    (1000, 1),
    (1000, 3),
    (1000, 17),
    (1000, 64),
    (1000, 130),
];

#[test]
fn tiled_equals_dense_for_group_1_3_8_on_pages_of_1_7_16() {
    // Group 1 (MHA), 3 (SmolLM2: 9/3 heads of 64) and 8 with head_dim 128.
    let shapes = [
        shape(3, 3, 64, 64),
        shape(9, 3, 64, 64),
        shape(8, 1, 128, 128),
    ];
    for (n, s) in shapes.into_iter().enumerate() {
        for (m, &(start, t)) in LENGTHS.iter().enumerate() {
            check_case(s, start, t, &[1, 7, 16], (100 * n + m) as u64);
        }
    }
}

#[test]
fn tiled_equals_dense_when_v_dim_differs_from_head_dim() {
    // MLA-like layouts (head_dim 128 / v_dim 64 and 64 / 128), and odd
    // widths that exercise every remainder path (v_dim 12 < every column block).
    let shapes = [
        shape(6, 2, 128, 64),
        shape(8, 2, 64, 128),
        shape(6, 2, 20, 12),
    ];
    for (n, s) in shapes.into_iter().enumerate() {
        for (m, &(start, t)) in LENGTHS.iter().enumerate() {
            check_case(s, start, t, &[7, 16], (1000 + 100 * n + m) as u64);
        }
    }
}

#[test]
fn cold_prefill_of_512_tokens_equals_dense() {
    // start_pos 0, t 512: many query blocks of very different (causal) cost,
    // every key tile of the first blocks is a diagonal tile.
    check_case(shape(9, 3, 64, 64), 0, 512, &[16], 77);
}

#[test]
fn key_splits_merge_to_the_unsplit_result() {
    // With 4 threads a decode step of 2 kv heads is split over the keys
    // (flash-decoding); the merged result must equal the reference.
    let pool4 = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .expect("a 4-thread pool");
    pool4.install(|| {
        for isa in isas() {
            let p = Plan::new(
                isa,
                1,
                4,
                2,
                2000,
                rayon::current_num_threads(),
                TARGET_ROWS,
            );
            assert!(p.splits > 1, "{isa:?}: decode should split keys, got {p:?}");
        }
        check_case(shape(8, 2, 64, 64), 2000, 1, &[16], 5);
        check_case(shape(8, 2, 64, 64), 1500, 2, &[7], 6);
        check_case(shape(9, 3, 64, 64), 700, 5, &[16], 8);
    });
}

#[test]
fn plan_gives_two_threads_work_for_smollm2_shapes() {
    // SmolLM2: group 3, 3 kv heads. A 64-token chunk gets 16-query blocks
    // (48 rows = 3 AVX-512 vectors): 12 tasks, no split. Decode uses 8 lanes
    // where AVX2 exists and splits the keys into 2 (6 pieces for 2 threads).
    for isa in isas() {
        let p = Plan::new(isa, 64, 3, 3, 4096, 2, TARGET_ROWS);
        assert_eq!(
            (p.qb, p.blocks, p.splits),
            (16, 4, 1),
            "{isa:?} chunk: {p:?}"
        );
        let d = Plan::new(isa, 1, 3, 3, 4096, 2, TARGET_ROWS);
        assert_eq!(
            (d.qb, d.blocks, d.splits),
            (1, 1, 2),
            "{isa:?} decode: {d:?}"
        );
        if isa == Isa::Avx512 {
            assert_eq!(d.isa, Isa::Avx2, "decode rows 3 <= 8 use 8 lanes");
        }
    }
    // Group 1 with one kv head: blocks shrink so 4 tasks exist.
    let p = Plan::new(Isa::Portable, 64, 1, 1, 0, 2, TARGET_ROWS);
    assert_eq!(p.blocks, 4, "{p:?}");
}

#[test]
fn huge_score_ranges_keep_the_softmax_exact() {
    // Integer-valued q and k with scale 1 make every score exact in f32, so
    // the only error is the softmax itself. Scores span ±~6,000 and the row
    // maxima jump by thousands between key tiles (rescale factors underflow
    // to 0), with the largest score both early and late in the context.
    let s = shape(4, 2, 16, 8);
    let (start, t) = (400, 40);
    let total = start + t;
    let k: Vec<f32> = values(11, total * 32)
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let pos = i / 32;
            let amp = if pos % 97 == 0 { 60.0 } else { 8.0 };
            (x * amp).round()
        })
        .collect();
    let v = values(12, total * 16);
    let q: Vec<f32> = values(13, t * 64)
        .iter()
        .map(|x| (x * 6.0).round())
        .collect();
    let mut want = vec![0.0; t * 32];
    dense_attention(&q, &k, &v, t, total, &s, 1.0, &mut want);
    let (pool, table) = shuffled_pool(&s, 16, total, &k, &v, 14);
    for isa in isas() {
        let got = tiled_with(isa, &q, &pool, 1, &table, start, &s, 1.0);
        assert!(
            got.iter().all(|x| x.is_finite()),
            "{isa:?}: non-finite output"
        );
        // Outputs are close to single V values here; 2e-5 of max|out|.
        assert_close(&got, &want, 2e-5, &format!("{isa:?} huge scores"));
    }
}

#[test]
fn first_query_of_a_cold_prefill_returns_v0() {
    // Causality: query 0 at position 0 sees only key 0, whatever the rest
    // hold (1e-6: softmax of one key is exactly 1, V passes through).
    let s = shape(2, 1, 8, 5);
    let t = 40;
    let k = values(1, t * 8);
    let v = values(2, t * 5);
    let q = values(3, t * 16);
    let (pool, table) = shuffled_pool(&s, 7, t, &k, &v, 4);
    for isa in isas() {
        let got = tiled_with(isa, &q, &pool, 1, &table, 0, &s, 1.0);
        for h in 0..2 {
            for c in 0..5 {
                assert!((got[h * 5 + c] - v[c]).abs() <= 1e-6, "{isa:?} head {h}");
            }
        }
    }
}

#[test]
fn vector_exp_matches_f64_exp() {
    // Relative error < 1e-6 on [-87.3, 88] (every 1/4096 step plus the ends),
    // exactly 1 at 0, exactly 0 below -87.3 and at -inf.
    /// Evaluates the vector exp of `S` on `xs` (length a multiple of 16).
    ///
    /// # Safety
    /// `S`'s instruction set is supported.
    #[inline(always)]
    unsafe fn eval<S: Simd>(xs: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; xs.len()];
        for (x, o) in xs
            .chunks_exact(S::LANES)
            .zip(out.chunks_exact_mut(S::LANES))
        {
            S::store(o.as_mut_ptr(), exp::<S>(S::load(x.as_ptr())));
        }
        out
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn eval_avx512(xs: &[f32]) -> Vec<f32> {
        eval::<Avx512>(xs)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn eval_avx2(xs: &[f32]) -> Vec<f32> {
        eval::<Avx2>(xs)
    }
    let mut xs: Vec<f32> = Vec::new();
    let mut x = EXP_LO;
    while x <= EXP_HI {
        xs.push(x);
        x += 1.0 / 4096.0;
    }
    xs.extend([
        EXP_LO,
        EXP_HI,
        0.0,
        -0.0,
        1e-8,
        -1e-8,
        0.5 * std::f32::consts::LN_2,
    ]);
    xs.resize(xs.len().next_multiple_of(16), 0.0);
    let specials = {
        let mut s = vec![-87.31f32, -88.0, -100.0, -1e30, f32::NEG_INFINITY, 0.0];
        s.resize(16, 0.0);
        s
    };
    for isa in isas() {
        let run = |v: &[f32]| match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: isas() only lists supported instruction sets.
            Isa::Avx512 => unsafe { eval_avx512(v) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { eval_avx2(v) },
            // SAFETY: the portable path needs no CPU feature.
            _ => unsafe { eval::<Portable>(v) },
        };
        let got = run(&xs);
        let mut worst = 0.0f64;
        for (&x, &y) in xs.iter().zip(&got) {
            let want = (x as f64).exp();
            worst = worst.max(((y as f64 - want) / want).abs());
        }
        assert!(worst < 1e-6, "{isa:?}: max relative error {worst:e}");
        let sp = run(&specials);
        assert_eq!(
            &sp[..6],
            &[0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
            "{isa:?} specials"
        );
    }
}

#[test]
fn zero_queries_leave_out_untouched() {
    let s = shape(2, 1, 8, 8);
    let pool = KvPool::new(1, 1, 4, s.row_width());
    let mut out: Vec<f32> = Vec::new();
    paged_attention_tiled(&[], &pool, 0, &[0], 0, &s, 1.0, &mut out);
    assert!(out.is_empty());
}

#[test]
#[should_panic(expected = "block table covers 4 positions, need 5")]
fn short_block_table_panics_like_paged_attention() {
    let s = shape(2, 1, 8, 8);
    let pool = KvPool::new(1, 2, 4, s.row_width());
    let mut out = vec![0.0; 16];
    paged_attention_tiled(&[0.0; 16], &pool, 0, &[0], 4, &s, 1.0, &mut out);
}

#[test]
#[should_panic(expected = "must be a positive multiple of kv_heads")]
fn heads_not_divisible_by_kv_heads_panic() {
    let s = shape(3, 2, 8, 8);
    let pool = KvPool::new(1, 2, 4, s.row_width());
    let mut out = vec![0.0; 24];
    paged_attention_tiled(&[0.0; 24], &pool, 0, &[0], 0, &s, 1.0, &mut out);
}

#[test]
fn bf16_pool_equals_dense_attention_of_the_rounded_rows() {
    use crate::dtype::round_to_bf16;
    use crate::paged::KvDtype;
    // Decode (one query after 1000 keys: key splits) and a prefill chunk,
    // GQA groups of 3 and 8, shuffled pages of 7 rows.
    for (n, (s, start, t)) in [
        (shape(9, 3, 64, 64), 1000, 1),
        (shape(9, 3, 64, 64), 40, 17),
        (shape(8, 1, 128, 128), 300, 3),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 7000 + 10 * n as u64;
        let total = start + t;
        let (kw, vw, qw) = (
            s.kv_heads * s.head_dim,
            s.kv_heads * s.v_dim,
            s.q_heads * s.head_dim,
        );
        let k = values(seed + 1, total * kw);
        let v = values(seed + 2, total * vw);
        let q: Vec<f32> = values(seed + 3, t * qw).iter().map(|x| x * 3.0).collect();
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let (f32_pool, table) = shuffled_pool(&s, 7, total, &k, &v, seed + 4);
        let mut pool = KvPool::with_dtype(2, f32_pool.num_pages(), 7, s.row_width(), KvDtype::Bf16);
        write_kv(&mut pool, 1, &table, 0, &k, &v, &s);
        let (mut kr, mut vr) = (k.clone(), v.clone());
        round_to_bf16(&mut kr);
        round_to_bf16(&mut vr);
        let mut want = vec![0.0; t * s.q_heads * s.v_dim];
        dense_attention(&q, &kr, &vr, t, total, &s, scale, &mut want);
        let mut exact = vec![0.0; want.len()];
        dense_attention(&q, &k, &v, t, total, &s, scale, &mut exact);
        let what = format!("bf16 {s:?} start {start} t {t}");
        let mut paged = vec![0.0; want.len()];
        paged_attention(&q, &pool, 1, &table, start, &s, scale, &mut paged);
        // The widened rows are exactly the rounded values: f32 tolerance.
        assert_close(&paged, &want, 2e-5, &format!("paged {what}"));
        for isa in isas() {
            let got = tiled_with(isa, &q, &pool, 1, &table, start, &s, scale);
            assert_close(&got, &want, 2e-5, &format!("{isa:?} {what}"));
            // Against unrounded f32 rows: bf16 keeps 8 mantissa bits (relative
            // step 2^-8 on O(1) keys and values), so 2e-2 · max|out|.
            assert_close(&got, &exact, 2e-2, &format!("{isa:?} vs f32 rows {what}"));
        }
    }
}

/// A bf16 pool of `width`-value rows for positions `0..total` (layer 1 of
/// 2, shuffled pages of `page_size`), from `rows` (`[total, width]`).
fn bf16_pool(
    width: usize,
    page_size: usize,
    total: usize,
    rows: &[f32],
    seed: u64,
) -> (KvPool, Vec<u32>) {
    use crate::paged::KvDtype;
    let s = shape(1, 1, width / 2, width / 2);
    let zeros = vec![0.0; rows.len() / 2];
    let (f32_pool, table) = shuffled_pool(&s, page_size, total, &zeros, &zeros, seed);
    let mut pool = KvPool::with_dtype(2, f32_pool.num_pages(), page_size, width, KvDtype::Bf16);
    for (pos, row) in rows.chunks_exact(width).enumerate() {
        pool.write_row(1, &table, pos, &[row]);
    }
    (pool, table)
}

#[test]
fn bf16_and_amx_products_match_the_f32_tiles_on_bf16_pools() {
    // Tolerance: 1e-2 · max|out| of the f32 tiles on the same bf16 rows.
    // The bf16 pieces round scale·q and the softmax weights to bf16 (8
    // mantissa bits, relative step 2^-8 at worst): with peaky O(1)-input
    // softmaxes that moves outputs by ~0.3% of their range (measured:
    // 0.07–0.26% on these cases).
    let isa = Isa::Avx512;
    // GQA (SmolLM2's 9/3 heads of 64, a group of 8 of 128, head_dim 72
    // with a 8-dim last chunk) and MLA latent rows (K3 `small`: 8 heads over
    // 64 + 16 values, value = the first 64); pages of 16, 32 and 7; causal
    // diagonals, several key tiles, and key splits (16 rows after 2,000
    // keys).
    let cases: [(AttnShape, bool, usize, usize); 8] = [
        (shape(9, 3, 64, 64), false, 40, 17),
        (shape(9, 3, 64, 64), false, 300, 64),
        (shape(8, 1, 128, 128), false, 2000, 2),
        (shape(4, 2, 72, 32), false, 0, 130),
        (AttnShape::latent(8, 80, 64, "test"), true, 500, 9),
        (AttnShape::latent(8, 80, 64, "test"), true, 0, 100),
        (AttnShape::latent(16, 48, 32, "test"), true, 1000, 4),
        (AttnShape::latent(16, 576, 512, "test"), true, 200, 3),
    ];
    for (n, (s, latent, start, t)) in cases.into_iter().enumerate() {
        let seed = 9000 + 10 * n as u64;
        let total = start + t;
        let width = if latent { s.head_dim } else { s.row_width() };
        let rows = values(seed + 1, total * width);
        let q: Vec<f32> = values(seed + 3, t * s.q_heads * s.head_dim)
            .iter()
            .map(|x| x * 3.0)
            .collect();
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        for page in [16, 32, 7] {
            let (pool, table) = bf16_pool(width, page, total, &rows, seed + 4);
            let call = Call {
                q: &q,
                pool: &pool,
                layer: 1,
                block_table: &table,
                start_pos: start,
                shape: &s,
                scale,
                latent,
            };
            // Every product kind this CPU runs: AMX machines run both.
            let kinds: &[Tiles] = match Tiles::best(&call) {
                Tiles::Amx => &[Tiles::Bf16, Tiles::Amx],
                Tiles::Bf16 => &[Tiles::Bf16],
                Tiles::Fma => &[],
            };
            if kinds.is_empty() || !isa.supported() {
                eprintln!("SKIPPED: no AVX-512 BF16 here");
                return;
            }
            let len = t * s.q_heads * s.v_dim;
            let mut want = vec![f32::NAN; len];
            attend_with(isa, Tiles::Fma, call, &mut want);
            let pool4 = rayon::ThreadPoolBuilder::new()
                .num_threads(4)
                .build()
                .unwrap();
            for &tiles in kinds {
                let mut got = vec![f32::NAN; len];
                pool4.install(|| attend_with(isa, tiles, call, &mut got));
                let what =
                    format!("{tiles:?} {s:?} latent {latent} page {page} start {start} t {t}");
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0.0f32, f32::max);
                eprintln!(
                    "{what}: max error {:.2e} of max|out| {:.2e}",
                    err,
                    max_abs(&want)
                );
                assert_close(&got, &want, 1e-2, &what);
            }
        }
    }
}
