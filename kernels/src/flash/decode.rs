//! Batched decode attention: one call per layer for every decoding sequence
//! of a step, each with its own position and block table, over f32, bf16 or
//! int8 KV rows read in place from their pages (bf16 and int8 are widened in
//! registers, all sums are f32; on CPUs with AVX-512 BF16 the keys-in-lanes
//! pieces over bf16 rows take `vdpbf16ps` pair products instead, the query
//! and the probabilities rounded to bf16: `decode_pairs.rs`).
//!
//! # Why not the prefill kernel
//!
//! [`super::paged_attention_tiled`] puts query rows in the SIMD lanes and
//! broadcasts one K value per key and dimension. A decode query of a small
//! GQA group (SmolLM2: 3 query heads per kv head) fills 3 of 8 or 16 lanes,
//! and a bf16 row must first be widened into a scratch tile. Here **keys sit
//! in the lanes** of the scores instead, so every vector of the softmax is
//! full whatever the group size:
//!
//! 1. `QK`: for each key the `group` dot products run with head dims in the
//!    lanes (one load of the K row per `LANES` dims feeds `group` FMAs), and
//!    `LANES` keys' partial vectors are then reduced together by a transpose
//!    tree into one vector of `LANES` scores, key `j` in lane `j`.
//! 2. Online softmax over key tiles of [`DECODE_TILE`] keys: per query head a
//!    running max `m` and sum `l`; `P = exp(S − m')` with the vectorised exp
//!    of [`crate::simd`], keys in lanes.
//! 3. `PV`: value dims in the lanes, `O[g] += P[g][j]·V[j]`, a register
//!    block of `NC` value vectors × up to 6 query heads per pass over the
//!    tile, with the rescale `α = exp(m − m')` folded into loading `O`.
//!
//! MLA latent rows are the case of one kv head whose key is the whole row
//! `[c | k_pe]` and whose value is its first `v_dim` values.
//!
//! # int8 rows
//!
//! With one scale per (token, head) — GQA rows whose segments are the heads
//! — the scales come out of the sums: `S_j = sk_j · (q · k̂_j)` is one
//! vector multiply per `LANES` scores, and `Σ_j P_j·sv_j·v̂_j` folds `sv_j`
//! into the probabilities once per tile (after the running sum `l` took
//! them unscaled). The inner loops read the int8 values only. Other int8
//! layouts (MLA latent rows, segments finer than a head) run the rows-in-
//! lanes path, which widens each row once.
//!
//! # Work items
//!
//! A piece is (sequence, kv head, key range). A sequence's keys are split
//! into `min(⌈2·threads / kv_heads⌉, ⌊ctx / DECODE_SPLIT_KEYS⌋)` ranges (at
//! least one), merged afterwards with weights `exp(m_s − max m)` as in
//! flash-decoding. The split depends only on the sequence's own context
//! length and the thread count, never on the rest of the batch, so a
//! sequence's output is the same whatever it is batched with. All pieces of
//! the step run as one rayon parallel loop, so 8 short sequences × 3 kv
//! heads are 24 pieces spread over every worker.

use rayon::prelude::*;

use crate::attention::AttnShape;
use crate::cpu::{prefetch_span, Isa};
use crate::paged::{KvDtype, KvPool, LayerRows};
use crate::simd::{exp, Portable};
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};
use crate::split::OutPtr;

/// Calls `f::<..., GB>` with the const `GB` equal to `gb` (1..=8).
macro_rules! with_rows {
    ($gb:expr, $f:ident::<$($p:tt),*>($($a:expr),*)) => {
        match $gb {
            1 => $f::<$($p),*, 1>($($a),*),
            2 => $f::<$($p),*, 2>($($a),*),
            3 => $f::<$($p),*, 3>($($a),*),
            4 => $f::<$($p),*, 4>($($a),*),
            5 => $f::<$($p),*, 5>($($a),*),
            6 => $f::<$($p),*, 6>($($a),*),
            7 => $f::<$($p),*, 7>($($a),*),
            _ => $f::<$($p),*, 8>($($a),*),
        }
    };
}

/// Keys per online-softmax step: a multiple of 16 (whole score vectors on
/// every instruction set). The score tile (`group · DECODE_TILE` f32) and
/// the tile's V rows stay in L1. Range 16..=256, default 64.
pub const DECODE_TILE: usize = 64;

/// A sequence's keys are only split over threads when every split keeps at
/// least this many keys, so the merge stays negligible. Default 256.
pub const DECODE_SPLIT_KEYS: usize = 256;

/// Query heads per kv head from which a decode piece runs with heads in the
/// lanes ([`Kernel::RowsInLanes`], the prefill kernel's tiles) instead of
/// keys: 8 heads fill an AVX2 vector. MLA layers (one latent row for 16 to
/// 128 heads) and GQA groups of 8 take that path. Default 8.
pub const ROWS_IN_LANES_GROUP: usize = 8;

/// The inner kernel of a decode piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    /// Keys in the score lanes (small groups).
    KeysInLanes,
    /// Query heads in the lanes (groups of [`ROWS_IN_LANES_GROUP`] or more).
    RowsInLanes,
}

/// How many 16-key blocks ahead a decode piece hints K rows. Default 1 (2
/// measured the same in a served 8-sequence decode).
const K_AHEAD_BLOCKS: usize = 1;

/// Most query heads one QK pass keeps accumulators for.
const QK_ROWS: usize = 8;

/// Most query heads whose `QK` scores are summed in registers
/// (`pairs::qk_scores`, `lanes::qk_scores`): their transpose trees keep up
/// to four pending vectors a head beside the queries'.
const SCORE_HEADS: usize = 4;

/// Most query heads one PV pass keeps accumulators for.
const PV_ROWS: usize = 6;

/// One decoding sequence of a batch.
#[derive(Clone, Copy, Debug)]
pub struct DecodeSeq<'a> {
    /// Row of the sequence's query in `q`, and of its output in `out`.
    pub row: usize,
    /// Position of the query: it attends to cached positions `0..=pos`,
    /// which must already be written.
    pub pos: usize,
    /// The sequence's pages, in position order.
    pub block_table: &'a [u32],
}

/// GQA decode attention of one query per sequence, every sequence of the
/// step in one call (see the module docs).
///
/// `q` is `[rows, q_heads·head_dim]` and `out` `[rows, q_heads·v_dim]`;
/// only the rows the sequences name are read and written. Each sequence's
/// block table must cover `pos + 1` positions.
///
/// # Panics
/// On a shape/pool mismatch, a row out of range or named twice, or a short
/// block table.
pub fn decode_attention_batch(
    q: &[f32],
    pool: &KvPool,
    layer: usize,
    seqs: &[DecodeSeq<'_>],
    shape: &AttnShape,
    scale: f32,
    out: &mut [f32],
) {
    decode_with(
        Isa::best(),
        q,
        pool,
        layer,
        seqs,
        shape,
        false,
        scale,
        None,
        out,
    );
}

/// Decode attention over an MLA latent cache in the absorbed form, every
/// sequence of the step in one call: all `heads` query heads of a sequence
/// attend to its rows `[c (v_dim) | k_pe]` (key = the whole row, value = its
/// first `v_dim` values).
///
/// `q` is `[rows, heads·pool.width]` (each head `[W_UKᵀ·q_nope | q_pe]`),
/// `out` is `[rows, heads·v_dim]`; rows and panics as
/// [`decode_attention_batch`], and also if `v_dim` exceeds the row width.
#[allow(clippy::too_many_arguments)]
pub fn latent_decode_attention_batch(
    q: &[f32],
    pool: &KvPool,
    layer: usize,
    seqs: &[DecodeSeq<'_>],
    heads: usize,
    v_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    let shape = AttnShape::latent(heads, pool.width, v_dim, "latent_decode_attention_batch");
    decode_with(
        Isa::best(),
        q,
        pool,
        layer,
        seqs,
        &shape,
        true,
        scale,
        None,
        out,
    );
}

/// Key splits of a sequence whose query sees `ctx` keys.
fn splits_for(ctx: usize, kv_heads: usize, threads: usize) -> usize {
    if threads <= 1 {
        return 1;
    }
    (2 * threads)
        .div_ceil(kv_heads)
        .min(ctx / DECODE_SPLIT_KEYS)
        .max(1)
}

/// One unit of work.
#[derive(Clone, Copy, Debug)]
struct Piece {
    /// Index into the call's sequences.
    seq: usize,
    /// Kv head.
    kvh: usize,
    /// First key position.
    k0: usize,
    /// One past the last key position.
    k1: usize,
    /// Partial-result slot, or `None` when the piece is its task's only one
    /// and writes `out` itself.
    slot: Option<usize>,
}

/// Everything a piece reads.
struct Job<'a> {
    /// Queries `[rows, q_heads·head_dim]`.
    q: &'a [f32],
    /// The cache (page size, row offsets).
    pool: &'a KvPool,
    /// Layer of `pool` to read.
    layer: usize,
    /// The layer's buffer, read in place.
    rows: LayerRows<'a>,
    /// The sequences of the call.
    seqs: &'a [DecodeSeq<'a>],
    /// Head layout (one kv head of `pool.width` for latent rows).
    shape: &'a AttnShape,
    /// Query heads per kv head.
    group: usize,
    /// MLA latent rows (key = whole row, value = its head).
    latent: bool,
    /// Score scale.
    scale: f32,
    /// Keys-in-lanes pieces over bf16 rows take the bf16 pair products of
    /// [`pairs`] (AVX-512 BF16, a kernel the caller did not force).
    pairs: bool,
}

/// Validates, plans and runs a batched decode call with instruction set
/// `isa` (narrowed to one the CPU has) and the inner `kernel` (`None`: by
/// group size, rows-in-lanes pieces on the best products; a forced kernel
/// keeps rows-in-lanes pieces on the f32 FMA tiles).
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_with(
    isa: Isa,
    q: &[f32],
    pool: &KvPool,
    layer: usize,
    seqs: &[DecodeSeq<'_>],
    shape: &AttnShape,
    latent: bool,
    scale: f32,
    kernel: Option<Kernel>,
    out: &mut [f32],
) {
    assert!(
        shape.kv_heads > 0 && shape.q_heads.is_multiple_of(shape.kv_heads),
        "q_heads ({}) must be a positive multiple of kv_heads ({})",
        shape.q_heads,
        shape.kv_heads
    );
    let (hd, vd) = (shape.head_dim, shape.v_dim);
    assert!(hd > 0 && vd > 0, "decode_attention_batch: empty heads");
    let width = if latent { hd } else { shape.row_width() };
    assert_eq!(
        pool.width, width,
        "decode_attention_batch: pool rows have {} values, shape needs {width}",
        pool.width
    );
    let (qw, ow) = (shape.q_heads * hd, shape.q_heads * vd);
    let mut rows: Vec<usize> = seqs.iter().map(|s| s.row).collect();
    rows.sort_unstable();
    assert!(
        rows.windows(2).all(|w| w[0] != w[1]),
        "decode_attention_batch: a row is named by two sequences"
    );
    if let Some(&last) = rows.last() {
        assert!(
            q.len() >= (last + 1) * qw && out.len() >= (last + 1) * ow,
            "decode_attention_batch: row {last} lies outside q or out"
        );
    }
    for s in seqs {
        assert!(
            s.block_table.len() * pool.page_size > s.pos,
            "decode_attention_batch: block table covers {} positions, need {}",
            s.block_table.len() * pool.page_size,
            s.pos + 1
        );
    }
    let group = shape.q_heads / shape.kv_heads;
    let threads = rayon::current_num_threads();
    let mut pieces = Vec::new();
    let mut slots = 0;
    for (i, s) in seqs.iter().enumerate() {
        let ctx = s.pos + 1;
        let splits = splits_for(ctx, shape.kv_heads, threads);
        let tiles = ctx.div_ceil(DECODE_TILE);
        for kvh in 0..shape.kv_heads {
            for sp in 0..splits {
                let (a, z) = (sp * tiles / splits, (sp + 1) * tiles / splits);
                let slot = (splits > 1).then(|| {
                    slots += 1;
                    slots - 1
                });
                pieces.push(Piece {
                    seq: i,
                    kvh,
                    k0: a * DECODE_TILE,
                    k1: (z * DECODE_TILE).min(ctx),
                    slot,
                });
            }
        }
    }
    // The splits of one (sequence, kv head) are adjacent pieces with
    // consecutive slots: (first piece, first slot, count) per split task.
    let mut tasks = Vec::new();
    let mut i = 0;
    while i < pieces.len() {
        let mut j = i + 1;
        while j < pieces.len() && pieces[j].seq == pieces[i].seq && pieces[j].kvh == pieces[i].kvh {
            j += 1;
        }
        if let Some(s0) = pieces[i].slot {
            tasks.push((pieces[i], s0, j - i));
        }
        i = j;
    }
    let isa = if isa.supported() { isa } else { Isa::Portable };
    let forced = kernel.is_some();
    #[cfg(target_arch = "x86_64")]
    let pairs = !forced && isa == Isa::Avx512 && pool.dtype() == KvDtype::Bf16 && pairs::usable(hd);
    #[cfg(not(target_arch = "x86_64"))]
    let pairs = false;
    let job = Job {
        q,
        pool,
        layer,
        rows: pool.layer_rows(layer),
        seqs,
        shape,
        group,
        latent,
        scale,
        pairs,
    };
    let kernel = kernel.unwrap_or(if group >= ROWS_IN_LANES_GROUP {
        Kernel::RowsInLanes
    } else {
        Kernel::KeysInLanes
    });
    // Keys in lanes reads int8 rows in place only with a scale per head.
    let per_head = !latent && pool.segment() == hd && hd == vd;
    let kernel = if pool.dtype() == KvDtype::Int8 && !per_head {
        Kernel::RowsInLanes
    } else {
        kernel
    };
    if kernel == Kernel::RowsInLanes {
        return rows_in_lanes(isa, forced, &job, &pieces, &tasks, slots, threads, out);
    }
    let part_len = group * (2 + vd);
    let mut parts = vec![0.0f32; slots * part_len];
    let (out_ptr, part_ptr) = (OutPtr(out.as_mut_ptr()), OutPtr(parts.as_mut_ptr()));
    let run = |sc: &mut Scratch, p: &Piece| {
        let sink = match p.slot {
            // SAFETY: each slot belongs to one piece and lies inside `parts`.
            Some(s) => Sink::Part(unsafe { part_ptr.get().add(s * part_len) }),
            None => Sink::Out(out_ptr),
        };
        run_piece(isa, &job, p, sc, sink);
    };
    if pieces.len() <= 1 || threads <= 1 {
        Scratch::with(|sc| pieces.iter().for_each(|p| run(sc, p)));
    } else {
        pieces
            .par_iter()
            .for_each(|p| Scratch::with(|sc| run(sc, p)));
    }
    let parts = &parts;
    tasks.par_iter().for_each(|&(p, s0, n)| {
        let chunk = &parts[s0 * part_len..(s0 + n) * part_len];
        merge(&job, p, chunk, part_len, out_ptr);
    });
}

/// Runs the pieces with the prefill kernel's piece code (query heads in
/// the lanes, see [`super`]): for groups of [`ROWS_IN_LANES_GROUP`] or more
/// the heads fill a vector, and one vector of `Qᵀ` then feeds many keys per
/// broadcast, which beats reducing per-key dot products. Pieces take the
/// prefill kernel's best products (bf16 or AMX tiles over bf16 rows on
/// 16-lane plans), or its f32 FMA tiles when `fma` is set (a kernel the
/// caller forced: the tests' bit-close reference).
#[allow(clippy::too_many_arguments)]
fn rows_in_lanes(
    isa: Isa,
    fma: bool,
    job: &Job<'_>,
    pieces: &[Piece],
    tasks: &[(Piece, usize, usize)],
    slots: usize,
    threads: usize,
    out: &mut [f32],
) {
    let shape = job.shape;
    let tiles = match job.seqs.first() {
        Some(s) if !fma => super::Tiles::best(&call(job, s)),
        _ => super::Tiles::Fma,
    };
    // The tiled kernel's own choice for a tile of `group` rows, except that
    // AMX tiles beat 8-lane FMAs even half empty.
    let amx = tiles == super::Tiles::Amx;
    let isa = if isa == Isa::Avx512 && job.group <= 8 && Isa::Avx2.supported() && !amx {
        Isa::Avx2
    } else {
        isa
    };
    let mp = job.group.next_multiple_of(isa.lanes());
    let part_len = (2 + shape.v_dim) * mp;
    let ow = shape.q_heads * shape.v_dim;
    let mut parts = vec![0.0f32; slots * part_len];
    let (out_ptr, part_ptr) = (OutPtr(out.as_mut_ptr()), OutPtr(parts.as_mut_ptr()));
    // The tiled kernel's call for one sequence's single query.
    fn call<'a>(job: &Job<'a>, s: &DecodeSeq<'a>) -> super::Call<'a> {
        let qw = job.shape.q_heads * job.shape.head_dim;
        super::Call {
            q: &job.q[s.row * qw..(s.row + 1) * qw],
            pool: job.pool,
            layer: job.layer,
            block_table: s.block_table,
            start_pos: s.pos,
            shape: job.shape,
            scale: job.scale,
            latent: job.latent,
        }
    }
    let tile_piece = |p: &Piece| super::Piece {
        kvh: p.kvh,
        i0: 0,
        i1: 1,
        k0: p.k0,
        k1: p.k1,
    };
    // SAFETY (both pointers): `decode_with` checked that every row lies in
    // `out` and no row is named twice; each slot lies in `parts` and belongs
    // to one piece.
    let row_out = |s: &DecodeSeq<'_>| OutPtr(unsafe { out_ptr.get().add(s.row * ow) });
    let run = |sc: &mut super::Scratch, p: &Piece| {
        let s = &job.seqs[p.seq];
        let sink = match p.slot {
            Some(k) => super::Sink::Partial(unsafe {
                std::slice::from_raw_parts_mut(part_ptr.get().add(k * part_len), part_len)
            }),
            None => super::Sink::Out(row_out(s)),
        };
        let c = call(job, s);
        super::run_tiles(isa, tiles, &c, tile_piece(p), sc, sink);
    };
    if pieces.len() <= 1 || threads <= 1 {
        super::Scratch::with(|sc| pieces.iter().for_each(|p| run(sc, p)));
    } else {
        pieces
            .par_iter()
            .for_each(|p| super::Scratch::with(|sc| run(sc, p)));
    }
    let parts = &parts;
    tasks.par_iter().for_each(|&(p, s0, n)| {
        let s = &job.seqs[p.seq];
        let chunk = &parts[s0 * part_len..(s0 + n) * part_len];
        super::merge_splits(
            &call(job, s),
            tile_piece(&p),
            mp,
            chunk,
            part_len,
            row_out(s),
        );
    });
}

/// Combines the splits of one (sequence, kv head):
/// `out = Σ w_s·O_s / Σ w_s·l_s` with `w_s = exp(m_s − max m)`.
fn merge(job: &Job<'_>, p: Piece, parts: &[f32], part_len: usize, out: OutPtr) {
    let (g, vd, qh) = (job.group, job.shape.v_dim, job.shape.q_heads);
    let row = job.seqs[p.seq].row;
    let parts: Vec<&[f32]> = parts.chunks_exact(part_len).collect();
    let mut acc = vec![0.0f32; vd];
    for r in 0..g {
        let mx = parts.iter().map(|s| s[r]).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        acc.fill(0.0);
        for s in &parts {
            let w = (s[r] - mx).exp();
            sum += w * s[g + r];
            let o = &s[2 * g + r * vd..2 * g + (r + 1) * vd];
            for (a, &x) in acc.iter_mut().zip(o) {
                *a += w * x;
            }
        }
        let inv = 1.0 / sum;
        let h = p.kvh * g + r;
        for (c, &a) in acc.iter().enumerate() {
            // SAFETY: (row, head h) belongs to this task alone; `out` holds
            // the row (checked by `decode_with`).
            unsafe { *out.get().add((row * qh + h) * vd + c) = a * inv };
        }
    }
}

/// Where a piece puts its result.
enum Sink {
    /// Normalise into the caller's `out`.
    Out(OutPtr),
    /// Store `[m: group | l: group | O: group·v_dim]` at this slot.
    Part(*mut f32),
}

/// Per-thread scratch, grown on demand and reused by every piece the
/// thread runs ([`Scratch::with`]).
#[derive(Default)]
struct Scratch {
    /// Scaled queries `[group][head_dim rounded up to LANES]`, zero padded.
    q: Vec<f32>,
    /// The scaled queries as bf16 dword pairs `[group][head_dim / 2]`
    /// (pieces on [`pairs`] products).
    qp: Vec<u32>,
    /// The tile's probabilities as bf16 key pairs `[group][DECODE_TILE / 2]`
    /// (pieces on [`pairs`] products).
    pp: Vec<u32>,
    /// Per-key partial dot products `[group][LANES keys][LANES]`.
    part: Vec<f32>,
    /// Scores then probabilities `[group][DECODE_TILE]`.
    s: Vec<f32>,
    /// Unnormalised outputs `[group][v_dim rounded up to LANES]`.
    o: Vec<f32>,
    /// Per head: running max, running sum, last rescale factor.
    stats: Vec<f32>,
    /// Offsets of the tile's K rows (at this kv head) in the layer buffer.
    koff: Vec<usize>,
    /// Offsets of the tile's V rows (at this kv head) in the layer buffer.
    voff: Vec<usize>,
    /// int8 rows: the K scales of the tile's keys, then zeros to a whole
    /// vector.
    ks: Vec<f32>,
    /// int8 rows: the V scales of the tile's keys, zero padded likewise.
    vs: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
}

impl Scratch {
    /// Runs `f` on this thread's scratch.
    fn with<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
        crate::threads::with_local(&SCRATCH, f)
    }
}

/// Runs one piece with instruction set `isa` on the pool's stored dtype.
fn run_piece(isa: Isa, job: &Job<'_>, p: &Piece, sc: &mut Scratch, sink: Sink) {
    macro_rules! go {
        ($s:ty, $base:expr) => {
            match $base {
                LayerRows::F32(b) => piece::<$s, f32>(job, p, sc, b, None, sink),
                LayerRows::Bf16(b) => piece::<$s, u16>(job, p, sc, b, None, sink),
                LayerRows::Int8 { q, scale } => piece::<$s, i8>(job, p, sc, q, Some(scale), sink),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `decode_with` only keeps an ISA the CPU supports.
        Isa::Avx512 => unsafe { piece_avx512(job, p, sc, sink) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { piece_avx2(job, p, sc, sink) },
        // SAFETY: the portable build needs no CPU feature.
        _ => unsafe { go!(Portable, job.rows) },
    }
}

/// [`piece`] compiled for AVX-512F.
///
/// # Safety
/// The CPU supports AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn piece_avx512(job: &Job<'_>, p: &Piece, sc: &mut Scratch, sink: Sink) {
    match job.rows {
        LayerRows::F32(b) => piece::<Avx512, f32>(job, p, sc, b, None, sink),
        LayerRows::Bf16(b) => piece::<Avx512, u16>(job, p, sc, b, None, sink),
        LayerRows::Int8 { q, scale } => piece::<Avx512, i8>(job, p, sc, q, Some(scale), sink),
    }
}

/// [`piece`] compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn piece_avx2(job: &Job<'_>, p: &Piece, sc: &mut Scratch, sink: Sink) {
    match job.rows {
        LayerRows::F32(b) => piece::<Avx2, f32>(job, p, sc, b, None, sink),
        LayerRows::Bf16(b) => piece::<Avx2, u16>(job, p, sc, b, None, sink),
        LayerRows::Int8 { q, scale } => piece::<Avx2, i8>(job, p, sc, q, Some(scale), sink),
    }
}

/// Attention of one piece (see the module docs).
///
/// # Safety
/// `S`'s instruction set is supported by the CPU; `job` passed the checks of
/// [`decode_with`] and `p` is one of its pieces; `base` is the layer buffer
/// and `scales` its int8 scales, whose segments are the heads (checked by
/// [`decode_with`]).
#[inline(always)]
unsafe fn piece<S: DecSimd, T: KvElem>(
    job: &Job<'_>,
    p: &Piece,
    sc: &mut Scratch,
    base: &[T],
    scales: Option<&[f32]>,
    sink: Sink,
) {
    let lanes = S::LANES;
    let shape = job.shape;
    let (g, hd, vd, qh) = (job.group, shape.head_dim, shape.v_dim, shape.q_heads);
    let (hdp, vdp) = (hd.next_multiple_of(lanes), vd.next_multiple_of(lanes));
    let seq = &job.seqs[p.seq];
    let pool = job.pool;

    sc.q.clear();
    sc.q.resize(g * hdp, 0.0);
    for r in 0..g {
        let h = p.kvh * g + r;
        let src = &job.q[(seq.row * qh + h) * hd..(seq.row * qh + h + 1) * hd];
        for (d, &x) in sc.q[r * hdp..r * hdp + hd].iter_mut().zip(src) {
            *d = x * job.scale;
        }
    }
    // `job.pairs` is only set for bf16 rows on AVX-512 (16 lanes).
    let pairs = job.pairs && size_of::<T>() == 2 && lanes == 16;
    if pairs {
        // SAFETY: `decode_with` set `pairs` only with AVX-512 BF16 here and
        // `pairs::usable(hd)`; `sc.q` holds `g` rows of `hdp` values.
        #[cfg(target_arch = "x86_64")]
        pairs::pack(sc.q.as_ptr(), hdp, hd, g, &mut sc.qp);
    }
    let qp = sc.qp.as_ptr();
    // Groups of up to `SCORE_HEADS` heads sum their pair products into
    // scores in registers (`pairs::qk_scores`), not through `part`.
    #[cfg(target_arch = "x86_64")]
    let tree = pairs && g <= SCORE_HEADS;
    #[cfg(not(target_arch = "x86_64"))]
    let tree = false;
    // Otherwise the f32 products do the same where the build has the tree.
    let lane_tree = !pairs && lanes::scores_in_registers::<S>(g, hd);
    // PV on pair products too when the value rows are whole vectors of pairs.
    #[cfg(target_arch = "x86_64")]
    let pairs_pv = pairs && pairs::usable(vd);
    #[cfg(not(target_arch = "x86_64"))]
    let pairs_pv = false;
    sc.o.clear();
    sc.o.resize(g * vdp, 0.0);
    sc.stats.clear();
    sc.stats.resize(3 * g, 0.0);
    sc.stats[..g].fill(f32::NEG_INFINITY);
    if sc.part.len() < g * lanes * lanes {
        sc.part.resize(g * lanes * lanes, 0.0);
    }
    if sc.s.len() < g * DECODE_TILE {
        sc.s.resize(g * DECODE_TILE, 0.0);
    }
    let (k_at, v_at) = if job.latent {
        (0, 0)
    } else {
        let kw = shape.kv_heads * hd;
        (p.kvh * hd, kw + p.kvh * vd)
    };
    let (q, part, s, o) = (
        sc.q.as_ptr(),
        sc.part.as_mut_ptr(),
        sc.s.as_mut_ptr(),
        sc.o.as_mut_ptr(),
    );
    let base = base.as_ptr();
    let (k_bytes, v_bytes) = (hd * size_of::<T>(), vd * size_of::<T>());
    let mut j0 = p.k0;
    while j0 < p.k1 {
        let j1 = (j0 + DECODE_TILE).min(p.k1);
        let nk = j1 - j0;
        // Offsets of the tile's rows and of the keys after it whose K rows
        // are hinted while the tile's last blocks are scored.
        let ahead = K_AHEAD_BLOCKS * lanes;
        // int8: segment `kvh` is the head's K, `kv_heads + kvh` its V.
        let (ks0, vs0) = (
            p.kvh * pool.page_size,
            (shape.kv_heads + p.kvh) * pool.page_size,
        );
        // Filled by index through slices, not pushed: a push through
        // `&mut Scratch` stored each Vec's length back every row (the
        // stores may alias it), ~10% of a piece in the profile.
        let jk = (j1 + ahead).min(p.k1);
        let nsc = if scales.is_some() { nk } else { 0 };
        sc.koff.resize(jk - j0, 0);
        sc.voff.resize(nk, 0);
        sc.ks.resize(nsc, 0.0);
        sc.vs.resize(nsc, 0.0);
        let (koff, voff) = (&mut sc.koff[..], &mut sc.voff[..]);
        let (ksc, vsc) = (&mut sc.ks[..], &mut sc.vs[..]);
        pool.for_each_row(seq.block_table, j0..jk, |j, at, so| {
            let i = j - j0;
            koff[i] = at + k_at;
            if j < j1 {
                voff[i] = at + v_at;
                if let Some(scale) = scales {
                    ksc[i] = scale[so + ks0];
                    vsc[i] = scale[so + vs0];
                }
            }
        });
        if scales.is_some() {
            let padded = nk.next_multiple_of(lanes);
            sc.ks.resize(padded, 0.0);
            sc.vs.resize(padded, 0.0);
        }
        if j0 == p.k0 {
            for &off in &sc.koff[..ahead.min(nk)] {
                prefetch_span(base.add(off).cast(), k_bytes);
            }
        }
        // Scores, LANES keys at a time, keys in lanes. Each block hints the
        // K rows of the block [`K_AHEAD_BLOCKS`] on and its own V rows (read by the PV pass
        // after the tile's scores): the rows of a piece lie a row width
        // apart within a page and anywhere across pages, so the hardware
        // prefetcher does not follow them.
        let mut b = 0;
        while b < nk {
            let nb = lanes.min(nk - b);
            for &off in sc
                .koff
                .get(b + ahead..(b + ahead + lanes).min(sc.koff.len()))
                .unwrap_or(&[])
            {
                prefetch_span(base.add(off).cast(), k_bytes);
            }
            for &off in &sc.voff[b..b + nb] {
                prefetch_span(base.add(off).cast(), v_bytes);
            }
            let koff = &sc.koff[b..b + nb];
            if tree || lane_tree {
                if tree {
                    // SAFETY: as for `pack` above; `T` is bf16 (`u16`), `qp`
                    // holds the group's `hd / 2` pairs a head, and row `r`
                    // of `s` has room for the block's 16 lanes at `b`.
                    #[cfg(target_arch = "x86_64")]
                    pairs::qk_scores(g, qp, hd, base.cast::<u16>(), koff, s.add(b), DECODE_TILE);
                } else {
                    // SAFETY: `scores_in_registers` holds; `q` has the
                    // group's `g` rows; row `r` of `s` has room at `b`.
                    lanes::qk_scores::<S, T>(g, q, hdp, hd, base, koff, s.add(b), DECODE_TILE);
                }
                let ks = scales.map(|_| S::load(sc.ks.as_ptr().add(b)));
                for r in 0..g {
                    let dst = s.add(r * DECODE_TILE + b);
                    if let Some(k) = ks {
                        S::store(dst, S::mul(S::load(dst), k));
                    }
                    for kk in nb..lanes {
                        *dst.add(kk) = f32::NEG_INFINITY;
                    }
                }
                b += lanes;
                continue;
            }
            let mut r0 = 0;
            while r0 < g {
                let gb = QK_ROWS.min(g - r0);
                let (qr, pr) = (q.add(r0 * hdp), part.add(r0 * lanes * lanes));
                if pairs {
                    // SAFETY: as for `pack` above; `T` is bf16 (`u16`), and
                    // `qp` holds the group's `hd / 2` pairs a head.
                    #[cfg(target_arch = "x86_64")]
                    pairs::qk_keys(
                        gb,
                        qp.add(r0 * hd / 2),
                        hd,
                        base.cast::<u16>(),
                        koff,
                        pr,
                        lanes * lanes,
                    );
                } else {
                    with_rows!(
                        gb,
                        qk_keys::<S, T>(qr, hdp, hd, base, koff, pr, lanes * lanes)
                    );
                }
                r0 += gb;
            }
            let ks = scales.map(|_| S::load(sc.ks.as_ptr().add(b)));
            for r in 0..g {
                let dst = s.add(r * DECODE_TILE + b);
                let dots = S::reduce(part.add(r * lanes * lanes));
                S::store(dst, ks.map_or(dots, |k| S::mul(dots, k)));
                for kk in nb..lanes {
                    *dst.add(kk) = f32::NEG_INFINITY;
                }
            }
            b += lanes;
        }
        // Online softmax per head.
        let nv = nk.div_ceil(lanes);
        let (m, l, alpha) = (
            sc.stats.as_mut_ptr(),
            sc.stats.as_mut_ptr().add(g),
            sc.stats.as_mut_ptr().add(2 * g),
        );
        for r in 0..g {
            let row = s.add(r * DECODE_TILE);
            let mut vmax = S::splat(f32::NEG_INFINITY);
            for v in 0..nv {
                vmax = S::max(vmax, S::load(row.add(v * lanes)));
            }
            let m_old = *m.add(r);
            let m_new = m_old.max(hmax::<S>(vmax));
            let shift = S::splat(m_new);
            let mut sum = S::zero();
            for v in 0..nv {
                let e = exp::<S>(S::sub(S::load(row.add(v * lanes)), shift));
                S::store(row.add(v * lanes), e);
                sum = S::add(sum, e);
            }
            // The first tile has m_old = −∞: α = 0 and l, O start from 0.
            let a = if m_old == f32::NEG_INFINITY {
                0.0
            } else {
                (m_old - m_new).exp()
            };
            *alpha.add(r) = a;
            *l.add(r) = *l.add(r) * a + hsum::<S>(sum);
            *m.add(r) = m_new;
        }
        // int8 rows: P·diag(sv), so that P·V̂ is P·V.
        if scales.is_some() {
            for r in 0..g {
                let row = s.add(r * DECODE_TILE);
                for v in 0..nv {
                    let x = S::mul(
                        S::load(row.add(v * lanes)),
                        S::load(sc.vs.as_ptr().add(v * lanes)),
                    );
                    S::store(row.add(v * lanes), x);
                }
            }
        }
        // O = α·O + P·V, value dims in lanes.
        if pairs_pv {
            // SAFETY: as for `pack` above (AVX-512 BW comes with the BF16
            // CPUs, see `cpu.rs`); `s` holds whole vectors of probabilities
            // up to `nk`, zeros past it; `o` is `[g][vd]` (vdp = vd).
            #[cfg(target_arch = "x86_64")]
            pairs::pv_tile(
                s,
                DECODE_TILE,
                nk,
                base.cast::<u16>(),
                &sc.voff,
                vd,
                g,
                o,
                alpha,
                &mut sc.pp,
            );
        } else {
            pv_tile::<S, T>(s, nk, base, &sc.voff, vd, vdp, g, o, alpha);
        }
        j0 = j1;
    }

    if pairs_pv {
        // SAFETY: AVX-512 F is here (`pairs_pv`); `o` is `[g][vd]`.
        #[cfg(target_arch = "x86_64")]
        pairs::unpermute(o, g, vd);
    }
    let stats = &sc.stats;
    match sink {
        Sink::Out(out) => {
            for r in 0..g {
                let inv = 1.0 / stats[g + r];
                let h = p.kvh * g + r;
                // SAFETY: this piece is the only writer of (row, head h).
                let dst = out.get().add((seq.row * qh + h) * vd);
                for c in 0..vd {
                    *dst.add(c) = *o.add(r * vdp + c) * inv;
                }
            }
        }
        Sink::Part(dst) => {
            std::ptr::copy_nonoverlapping(stats.as_ptr(), dst, 2 * g);
            for r in 0..g {
                std::ptr::copy_nonoverlapping(o.add(r * vdp), dst.add(2 * g + r * vd), vd);
            }
        }
    }
}

#[path = "decode_lanes.rs"]
mod lanes;
#[cfg(target_arch = "x86_64")]
#[path = "decode_pairs.rs"]
mod pairs;
use lanes::{hmax, hsum, pv_tile, qk_keys, DecSimd, KvElem};

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
