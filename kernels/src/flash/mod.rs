//! Tiled ("flash") causal GQA attention of a prefill chunk over the paged KV
//! cache: the fast twin of [`crate::attention::paged_attention`], with exactly
//! its contract (arguments, layouts, panics; query `i` at position
//! `start_pos + i` sees positions `0..=start_pos + i`).
//!
//! # Algorithm
//!
//! [`paged_attention`](crate::attention::paged_attention) runs one task per
//! (query, kv head) and re-reads every cached K/V row for every query. Here a
//! task is a **piece** = (kv head, block of queries, range of keys):
//!
//! 1. The `group` query heads sharing the kv head, for every query of the
//!    block, form the `rows = group·queries` rows of a query tile, stored
//!    transposed and pre-scaled, `Qᵀ[d][row] = scale·q`, padded with zero rows
//!    to a whole number of SIMD vectors. Rows sit in the SIMD lanes, so every
//!    per-row quantity (running max, running sum, mask limit) is a vector and
//!    the softmax needs no horizontal reductions.
//! 2. Keys are walked in tiles of [`KEY_TILE`] positions, read in place from
//!    their pages (one row lookup per key per tile, no copy). For a tile,
//!    `Sᵀ[key][row] = Σ_d Qᵀ[d][row]·K[key][d]` is a register-blocked
//!    outer-product kernel: `MR` row vectors × `NR` keys of accumulators, one
//!    vector load of `Qᵀ` per row vector and one broadcast of `K` per key.
//! 3. The causal mask (`key > start_pos + query` → −∞) is applied only on
//!    tiles that reach past the block's first query (the diagonal tiles).
//! 4. Online softmax per row: `m' = max(m, max_key S)`, `α = exp(m − m')`,
//!    `P = exp(S − m')`, `l = α·l + Σ_key P`, all with the vectorised
//!    polynomial exp below (a row whose keys are all masked so far keeps
//!    `m = −∞` and uses 0 as its shift, so no `−∞ − −∞`).
//! 5. `Oᵀ[c][row] = α·Oᵀ[c][row] + Σ_key P[key][row]·V[key][c]`, the same
//!    outer-product kernel with `V` broadcast from the cache rows (the
//!    rescale by `α` is folded into loading the accumulators).
//! 6. After the last tile, `out = Oᵀ / l` is scattered to `[t, q_heads·v_dim]`.
//!
//! # Parallelism
//!
//! Pieces run on the rayon pool. Query blocks hold about [`TARGET_ROWS`] rows
//! (rounded to whole SIMD vectors), shrunk when there are too few
//! (kv head × block) tasks for two per thread. When that is still too few
//! (decode: `t = 1`, three kv heads, two threads) the keys are split as well
//! (flash-decoding): each split returns its `(m, l, Oᵀ)` and a merge pass
//! combines them with weights `exp(m_s − max_s m_s)`. Scratch buffers live
//! per worker thread and are kept between calls, so nothing is allocated
//! per tile, per piece or (once grown) per call.
//!
//! # Instruction sets
//!
//! The kernels are generic over a small `Simd` trait with three
//! implementations picked at run time: AVX-512F (16 lanes, 32 registers),
//! AVX2+FMA (8 lanes, 16 registers) and portable Rust (8 lanes, the oracle
//! path off x86-64). A call whose query tile holds at most 8 rows (decode with
//! small groups) uses 8 lanes even on AVX-512 machines, to waste fewer lanes.
//!
//! The exp is Cephes' `expf`: `x = n·ln2 + r` with `|r| ≤ ln2/2`
//! (Cody–Waite split of ln 2), a degree-7 polynomial for `e^r` and an exponent
//! scale by `2^n`; relative error below 1e-6 on `[−87.3, 88]` (tested
//! against f64), exactly 0 below −87.3 (including −∞), exactly 1 at 0.

use rayon::prelude::*;

use crate::attention::AttnShape;
use crate::cpu::Isa;
use crate::paged::KvPool;
use crate::split::OutPtr;

/// Keys per tile. The `Sᵀ` tile (`KEY_TILE × rows` f32, 24 KiB at 64 rows)
/// stays in L1 next to `Qᵀ` and `Oᵀ`; a multiple of 48 so every key blocking
/// (`NR` ∈ {4, 6, 8, 12, 16}) divides full tiles. Range 48..=384, default 96.
pub const KEY_TILE: usize = 96;

/// Query-tile rows (`group · queries`) a task aims for before rounding to
/// whole SIMD vectors: more rows reuse each K/V tile more, fewer rows give
/// more tasks. Range 16..=128, default 64.
pub const TARGET_ROWS: usize = 64;

/// A key split (flash-decoding) is only made when every split keeps at
/// least this many keys, so the merge stays negligible. Default 256.
pub const MIN_SPLIT_KEYS: usize = 256;

/// Largest key blocking `NR` of any kernel; the key pointer arrays are padded
/// by this much so a partial tile can run whole `NR` blocks.
const MAX_NR: usize = 16;

/// Causal GQA attention of `t` new queries against the paged cache, tiled
/// flash-attention style (see the module docs).
///
/// Same contract as [`crate::attention::paged_attention`]: `q` is
/// `[t, q_heads·head_dim]` for positions `start_pos..start_pos + t`; query `i`
/// attends to cached positions `0..=start_pos + i`, whose K/V must already be
/// written; `out` is `[t, q_heads·v_dim]`. Panics on the same malformed
/// arguments (shape/pool mismatch, partial tokens, short block table).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_tiled(
    q: &[f32],
    pool: &KvPool,
    layer: usize,
    block_table: &[u32],
    start_pos: usize,
    shape: &AttnShape,
    scale: f32,
    out: &mut [f32],
) {
    let call = Call {
        q,
        pool,
        layer,
        block_table,
        start_pos,
        shape,
        scale,
        latent: false,
    };
    attend_with(Isa::best(), Tiles::best(&call), call, out);
}

/// Attention over an MLA latent cache in the absorbed form: every query head
/// attends to the same cached rows `[c (v_dim) | k_pe]` (the whole row is
/// the key, its first `v_dim` values the value), which is GQA with one KV
/// head shared by `heads` query heads.
///
/// `q` is `[t, heads·pool.width]` (each head `[W_UKᵀ·q_nope | q_pe]`), `out`
/// is `[t, heads·v_dim]` (each head the softmax-weighted latent `Σ p·c`).
/// Causality, tiling and accuracy as [`paged_attention_tiled`].
///
/// # Panics
/// If `v_dim` exceeds the row width, or as [`paged_attention_tiled`].
#[allow(clippy::too_many_arguments)]
pub fn latent_attention_tiled(
    q: &[f32],
    pool: &KvPool,
    layer: usize,
    block_table: &[u32],
    start_pos: usize,
    heads: usize,
    v_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    let shape = AttnShape::latent(heads, pool.width, v_dim, "latent_attention_tiled");
    let call = Call {
        q,
        pool,
        layer,
        block_table,
        start_pos,
        shape: &shape,
        scale,
        latent: true,
    };
    attend_with(Isa::best(), Tiles::best(&call), call, out);
}

/// [`paged_attention_tiled`] (`latent` false) or [`latent_attention_tiled`]
/// (`latent` true, `shape` from `AttnShape::latent`) on the f32 products
/// only: the reference of tests that compare other kernels bit-closely.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn tiled_f32(
    q: &[f32],
    pool: &KvPool,
    layer: usize,
    block_table: &[u32],
    start_pos: usize,
    shape: &AttnShape,
    latent: bool,
    scale: f32,
    out: &mut [f32],
) {
    let call = Call {
        q,
        pool,
        layer,
        block_table,
        start_pos,
        shape,
        scale,
        latent,
    };
    attend_with(Isa::best(), Tiles::Fma, call, out);
}

/// The arguments of one attention call, minus `out`.
#[derive(Clone, Copy)]
struct Call<'a> {
    /// Queries `[t, q_heads·head_dim]`.
    q: &'a [f32],
    /// The cache holding every visible K/V row.
    pool: &'a KvPool,
    /// Layer of `pool` to read.
    layer: usize,
    /// Pages of the sequence, in position order.
    block_table: &'a [u32],
    /// Position of query 0.
    start_pos: usize,
    /// Head layout.
    shape: &'a AttnShape,
    /// Score scale (usually `1/√head_dim`).
    scale: f32,
    /// MLA latent rows: one KV head, key = the whole row, value = its first
    /// `v_dim` values (see [`latent_attention_tiled`]).
    latent: bool,
}

/// Which products a call's 16-lane pieces run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tiles {
    /// f32 FMA register tiles (every instruction set).
    Fma,
    /// bf16 pair dot products ([`bf16`]): bf16 pools on CPUs with AVX-512
    /// BF16, for pieces planned on AVX-512.
    Bf16,
    /// AMX-BF16 tile products ([`amx`]): as `Bf16`, on CPUs with AMX-BF16.
    Amx,
}

impl Tiles {
    /// AMX where [`amx::usable`] says so, else bf16 where [`bf16::usable`]
    /// does, else FMA.
    fn best(call: &Call<'_>) -> Tiles {
        #[cfg(target_arch = "x86_64")]
        {
            if amx::usable(call) {
                return Tiles::Amx;
            }
            if bf16::usable(call) {
                return Tiles::Bf16;
            }
        }
        let _ = call;
        Tiles::Fma
    }
}

/// How a call is cut into pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    /// Instruction set of every piece.
    isa: Isa,
    /// Queries per block (the last block may be shorter).
    qb: usize,
    /// Query blocks: `t.div_ceil(qb)`.
    blocks: usize,
    /// Key splits per (kv head, block); 1 means no merge pass.
    splits: usize,
}

impl Plan {
    /// Plans `t` queries of `group` heads per kv head on `threads` threads,
    /// starting with the best instruction set `best`, blocks of about
    /// `target_rows` rows ([`TARGET_ROWS`], or AMX pieces' own target).
    fn new(
        best: Isa,
        t: usize,
        group: usize,
        kv_heads: usize,
        start_pos: usize,
        threads: usize,
        target_rows: usize,
    ) -> Plan {
        let blocks_for = |lanes: usize| {
            // Queries per whole number of vectors, then as many such units as
            // fit the target rows (at least one).
            let unit = lanes / gcd(group, lanes);
            let qb = (target_rows / group / unit * unit).max(unit);
            (unit, qb)
        };
        let mut isa = best;
        if isa == Isa::Avx512 && group * t.min(blocks_for(16).1) <= 8 && Isa::Avx2.supported() {
            isa = Isa::Avx2;
        }
        let (unit, mut qb) = blocks_for(isa.lanes());
        let want = 2 * threads.max(1);
        if kv_heads * t.div_ceil(qb.min(t)) < want {
            // Smaller blocks (down to one unit) for more tasks.
            let per_head = want.div_ceil(kv_heads);
            qb = qb.min(t.div_ceil(per_head).next_multiple_of(unit));
        }
        let qb = qb.min(t).max(1);
        let blocks = t.div_ceil(qb);
        let tasks = kv_heads * blocks;
        let mut splits = 1;
        if tasks < want && threads > 1 {
            let shortest = start_pos + qb;
            splits = want.div_ceil(tasks).min(shortest / MIN_SPLIT_KEYS).max(1);
        }
        Plan {
            isa,
            qb,
            blocks,
            splits,
        }
    }
}

/// The rows a query block aims for on `tiles`' products.
fn target_rows(tiles: Tiles) -> usize {
    match tiles {
        #[cfg(target_arch = "x86_64")]
        Tiles::Amx => amx::TARGET_ROWS,
        _ => TARGET_ROWS,
    }
}

/// Greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// One unit of work: a kv head, a query block and a key range.
#[derive(Clone, Copy, Debug)]
struct Piece {
    /// Kv head.
    kvh: usize,
    /// First query of the block.
    i0: usize,
    /// One past the last query of the block.
    i1: usize,
    /// First key position.
    k0: usize,
    /// One past the last key position.
    k1: usize,
}

/// Where a finished piece puts its result.
enum Sink<'a> {
    /// Normalise and scatter into the caller's `out` (no key split).
    Out(OutPtr),
    /// Store `[m: mp | l: mp | Oᵀ: v_dim·mp]` for the merge pass.
    Partial(&'a mut [f32]),
}

/// Validates the call like `paged_attention`, plans it and runs every piece
/// with instruction set `best` (or a narrower one, see [`Plan::new`]), on
/// bf16 products when `tiles` says so and the plan is for AVX-512.
fn attend_with(best: Isa, tiles: Tiles, call: Call<'_>, out: &mut [f32]) {
    let shape = call.shape;
    assert!(
        shape.kv_heads > 0 && shape.q_heads.is_multiple_of(shape.kv_heads),
        "q_heads ({}) must be a positive multiple of kv_heads ({})",
        shape.q_heads,
        shape.kv_heads
    );
    let group = shape.q_heads / shape.kv_heads;
    let (hd, vd) = (shape.head_dim, shape.v_dim);
    let qw = shape.q_heads * hd;
    let pool = call.pool;
    let width = if call.latent { hd } else { shape.row_width() };
    assert_eq!(
        pool.width, width,
        "paged_attention_tiled: pool rows have {} values, shape needs {width}",
        pool.width
    );
    assert!(qw > 0 && vd > 0, "paged_attention_tiled: empty heads");
    let t = call.q.len() / qw;
    assert_eq!(
        call.q.len(),
        t * qw,
        "paged_attention_tiled: q is not a whole number of tokens"
    );
    assert_eq!(
        out.len(),
        t * shape.q_heads * vd,
        "paged_attention_tiled: out must be [t, q_heads·v_dim]"
    );
    assert!(
        call.block_table.len() * pool.page_size >= call.start_pos + t,
        "paged_attention_tiled: block table covers {} positions, need {}",
        call.block_table.len() * pool.page_size,
        call.start_pos + t
    );
    if t == 0 {
        return;
    }
    let plan = Plan::new(
        best,
        t,
        group,
        shape.kv_heads,
        call.start_pos,
        rayon::current_num_threads(),
        target_rows(tiles),
    );
    let lanes = plan.isa.lanes();
    let mp_max = (plan.qb * group).next_multiple_of(lanes);
    let part_len = (2 + vd) * mp_max;
    // Piece index → (kv head, block, split), splits innermost so the parts
    // of one task are adjacent.
    let piece = |idx: usize| {
        let (task, s) = (idx / plan.splits, idx % plan.splits);
        let (kvh, b) = (task / plan.blocks, task % plan.blocks);
        let (i0, i1) = (b * plan.qb, ((b + 1) * plan.qb).min(t));
        let kend = call.start_pos + i1;
        let tiles = kend.div_ceil(KEY_TILE);
        let (a, z) = (s * tiles / plan.splits, (s + 1) * tiles / plan.splits);
        Piece {
            kvh,
            i0,
            i1,
            k0: a * KEY_TILE,
            k1: (z * KEY_TILE).min(kend),
        }
    };
    let tasks = shape.kv_heads * plan.blocks;
    let out_ptr = OutPtr(out.as_mut_ptr());
    let run =
        |p: Piece, sc: &mut Scratch, sink: Sink<'_>| run_tiles(plan.isa, tiles, &call, p, sc, sink);
    if plan.splits == 1 {
        (0..tasks).into_par_iter().for_each(|idx| {
            Scratch::with(|sc| run(piece(idx), sc, Sink::Out(out_ptr)));
        });
        return;
    }
    let mut parts = vec![0.0f32; tasks * plan.splits * part_len];
    parts
        .par_chunks_mut(part_len)
        .enumerate()
        .for_each(|(idx, part)| {
            Scratch::with(|sc| run(piece(idx), sc, Sink::Partial(part)));
        });
    let parts = &parts;
    (0..tasks).into_par_iter().for_each(|task| {
        let p = piece(task * plan.splits);
        let mp = ((p.i1 - p.i0) * group).next_multiple_of(lanes);
        let chunk = &parts[task * plan.splits * part_len..(task + 1) * plan.splits * part_len];
        merge_splits(&call, p, mp, chunk, part_len, out_ptr);
    });
}

/// Runs one piece planned for `isa` on `tiles`' products: bf16 and AMX
/// products run only for 16-lane plans, the others on the FMA tiles.
///
/// `tiles` must be `Fma` or what [`Tiles::best`] chose for `call`.
fn run_tiles(isa: Isa, tiles: Tiles, call: &Call<'_>, p: Piece, sc: &mut Scratch, sink: Sink<'_>) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        match tiles {
            // SAFETY: `Tiles::Amx` is only chosen where `amx::usable` holds,
            // and the plan is for 16 lanes.
            Tiles::Amx => return unsafe { amx::piece(call, p, sc, sink) },
            // SAFETY: as above, with `bf16::usable`.
            Tiles::Bf16 => return unsafe { bf16::piece(call, p, sc, sink) },
            Tiles::Fma => {}
        }
    }
    run_piece(isa, call, p, sc, sink)
}

/// Runs one piece with instruction set `isa`.
fn run_piece(isa: Isa, call: &Call<'_>, p: Piece, sc: &mut Scratch, sink: Sink<'_>) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a plan only holds Avx512 when the CPU supports AVX-512F.
        Isa::Avx512 => unsafe { piece_avx512(call, p, sc, sink) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a plan only holds Avx2 when the CPU supports AVX2 and FMA.
        Isa::Avx2 => unsafe { piece_avx2(call, p, sc, sink) },
        // SAFETY: the portable kernels need no CPU feature.
        _ => unsafe { attend_piece::<Portable>(call, p, sc, sink) },
    }
}

/// [`attend_piece`] compiled for AVX-512F.
///
/// # Safety
/// The CPU supports AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn piece_avx512(call: &Call<'_>, p: Piece, sc: &mut Scratch, sink: Sink<'_>) {
    attend_piece::<Avx512>(call, p, sc, sink)
}

/// [`attend_piece`] compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn piece_avx2(call: &Call<'_>, p: Piece, sc: &mut Scratch, sink: Sink<'_>) {
    attend_piece::<Avx2>(call, p, sc, sink)
}

/// Per-thread scratch, grown on demand and reused by every piece the
/// thread runs ([`Scratch::with`]).
#[derive(Default)]
struct Scratch {
    /// `Qᵀ [head_dim][mp]`, pre-scaled, zero in padding rows.
    qt: Vec<f32>,
    /// `Sᵀ` then `Pᵀ` of one key tile, `[KEY_TILE + MAX_NR][mp]`.
    st: Vec<f32>,
    /// Unnormalised output `Oᵀ [v_dim][mp]`.
    ot: Vec<f32>,
    /// Per row: running max, running sum, last rescale factor, and the
    /// query offset `row / group` (as f32) used by the causal mask.
    rows: Vec<f32>,
    /// K row pointers (at this kv head) of the current tile, padded.
    krows: Vec<*const f32>,
    /// V row pointers (at this kv head) of the current tile.
    vrows: Vec<*const f32>,
    /// The current tile's rows widened to f32 (bf16 pools only).
    kv: Vec<f32>,
    /// The buffers of bf16 pieces.
    #[cfg(target_arch = "x86_64")]
    bf16: bf16::Buffers,
    /// The buffers of AMX pieces.
    #[cfg(target_arch = "x86_64")]
    amx: amx::Buffers,
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

/// Index of the first 64-byte aligned element of `v` after growing it to
/// `len + 16` values (so `len` values fit from there).
fn aligned(v: &mut Vec<f32>, len: usize) -> usize {
    if v.len() < len + 16 {
        v.resize(len + 16, 0.0);
    }
    v.as_ptr().align_offset(64).min(15)
}

/// Attention of one piece: Q tile set-up, the key-tile loop, then the sink.
///
/// # Safety
/// `S`'s instruction set is supported by the CPU, `call` passed the checks
/// of [`attend_with`] and `p` is one of its pieces.
#[inline(always)]
unsafe fn attend_piece<S: Simd>(call: &Call<'_>, p: Piece, sc: &mut Scratch, sink: Sink<'_>) {
    let shape = call.shape;
    let group = shape.q_heads / shape.kv_heads;
    let (hd, vd, qh) = (shape.head_dim, shape.v_dim, shape.q_heads);
    let k_width = shape.kv_heads * hd;
    let rows = (p.i1 - p.i0) * group;
    let mp = rows.next_multiple_of(S::LANES);
    let mv = mp / S::LANES;

    let qo = aligned(&mut sc.qt, hd * mp);
    let so = aligned(&mut sc.st, (KEY_TILE + MAX_NR) * mp);
    let oo = aligned(&mut sc.ot, vd * mp);
    let ro = aligned(&mut sc.rows, 4 * mp);
    let qt = &mut sc.qt[qo..qo + hd * mp];
    for d in 0..hd {
        qt[d * mp + rows..(d + 1) * mp].fill(0.0);
    }
    for r in 0..rows {
        let (i, h) = (p.i0 + r / group, p.kvh * group + r % group);
        let src = &call.q[(i * qh + h) * hd..(i * qh + h + 1) * hd];
        for (d, &x) in src.iter().enumerate() {
            qt[d * mp + r] = x * call.scale;
        }
    }
    sc.ot[oo..oo + vd * mp].fill(0.0);
    init_rows(&mut sc.rows[ro..ro + 4 * mp], rows, group);
    let qt = sc.qt.as_ptr().add(qo);
    let st = sc.st.as_mut_ptr().add(so);
    let ot = sc.ot.as_mut_ptr().add(oo);
    let rowp = sc.rows.as_mut_ptr().add(ro);
    let (m, l, alpha, qoff) = (rowp, rowp.add(mp), rowp.add(2 * mp), rowp.add(3 * mp));

    let first_query = call.start_pos + p.i0;
    if call.pool.dtype() != crate::paged::KvDtype::F32 && sc.kv.len() < KEY_TILE * call.pool.width {
        sc.kv.resize(KEY_TILE * call.pool.width, 0.0);
    }
    let mut j0 = p.k0;
    while j0 < p.k1 {
        let j1 = (j0 + KEY_TILE).min(p.k1);
        let nk = j1 - j0;
        sc.krows.clear();
        sc.vrows.clear();
        // bf16 rows are widened into the piece's tile buffer (sized once
        // per piece, so the pointers stay valid for the tile).
        let width = call.pool.width;
        let wide = call.pool.dtype() != crate::paged::KvDtype::F32;
        for j in j0..j1 {
            let row: &[f32] = if wide {
                let slot = (j - j0) * width;
                let buf = &mut sc.kv[slot..slot + width];
                call.pool.read_row(call.layer, call.block_table, j, buf);
                std::slice::from_raw_parts(buf.as_ptr(), width)
            } else {
                call.pool.row(call.layer, call.block_table, j)
            };
            sc.krows.push(row[p.kvh * hd..(p.kvh + 1) * hd].as_ptr());
            let v = if call.latent {
                &row[..vd]
            } else {
                &row[k_width + p.kvh * vd..k_width + (p.kvh + 1) * vd]
            };
            sc.vrows.push(v.as_ptr());
        }
        let last = sc.krows[nk - 1];
        sc.krows.resize(nk + MAX_NR, last);
        qk_tile::<S>(qt, mp, mv, hd, sc.krows.as_ptr(), nk, st);
        // Diagonal tile: some key lies after the block's first query. The
        // offset is small (under KEY_TILE + qb), so exact in f32.
        let mask = (j1 - 1 > first_query).then_some((first_query as isize - j0 as isize) as f32);
        softmax_tile::<S>(st, mp, mv, nk, mask, qoff, m, l, alpha);
        pv_tile::<S>(st, mp, mv, nk, vd, sc.vrows.as_ptr(), ot, alpha);
        j0 = j1;
    }

    finish_piece(call, p, mp, m, l, ot, sink);
}

/// Hands a finished piece's rows to its sink: `Oᵀ / l` scattered into the
/// caller's `out`, or `[m | l | Oᵀ]` for the merge pass.
///
/// # Safety
/// `m`, `l` hold `mp` values and `ot` `[v_dim][mp]` (the piece's state);
/// `p` is a piece of `call`, which passed the checks of [`attend_with`].
unsafe fn finish_piece(
    call: &Call<'_>,
    p: Piece,
    mp: usize,
    m: *const f32,
    l: *const f32,
    ot: *const f32,
    sink: Sink<'_>,
) {
    let shape = call.shape;
    let group = shape.q_heads / shape.kv_heads;
    let (vd, qh) = (shape.v_dim, shape.q_heads);
    let rows = (p.i1 - p.i0) * group;
    match sink {
        Sink::Out(out) => {
            // This piece is the only writer of its (kv head, query block)
            // outputs (see `OutPtr`); `out` is `[t, q_heads·v_dim]`.
            let out = out.get();
            for r in 0..rows {
                let (i, h) = (p.i0 + r / group, p.kvh * group + r % group);
                let inv = 1.0 / *l.add(r);
                let dst = out.add((i * qh + h) * vd);
                for c in 0..vd {
                    *dst.add(c) = *ot.add(c * mp + r) * inv;
                }
            }
        }
        Sink::Partial(part) => {
            part[..mp].copy_from_slice(std::slice::from_raw_parts(m, mp));
            part[mp..2 * mp].copy_from_slice(std::slice::from_raw_parts(l, mp));
            part[2 * mp..(2 + vd) * mp].copy_from_slice(std::slice::from_raw_parts(ot, vd * mp));
        }
    }
}

/// Starts a piece's per-row state (`[m | l | α | query offset]`, `mp`
/// values each, `state.len() = 4·mp`) for `rows` real rows of `group` heads
/// per query: no key seen yet.
fn init_rows(state: &mut [f32], rows: usize, group: usize) {
    let mp = state.len() / 4;
    state[..mp].fill(f32::NEG_INFINITY);
    state[mp..3 * mp].fill(0.0);
    for (r, x) in state[3 * mp..].iter_mut().enumerate() {
        *x = if r < rows { (r / group) as f32 } else { 0.0 };
    }
}

/// Combines the key splits of one (kv head, query block) task and writes its
/// normalised output: weights `exp(m_s − max m)`, `out = Σ w_s·O_s / Σ w_s·l_s`.
fn merge_splits(call: &Call<'_>, p: Piece, mp: usize, parts: &[f32], part_len: usize, out: OutPtr) {
    let shape = call.shape;
    let group = shape.q_heads / shape.kv_heads;
    let (vd, qh) = (shape.v_dim, shape.q_heads);
    let rows = (p.i1 - p.i0) * group;
    let parts: Vec<&[f32]> = parts.chunks_exact(part_len).collect();
    let mut acc = vec![0.0f32; vd];
    for r in 0..rows {
        let mx = parts.iter().map(|s| s[r]).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        acc.fill(0.0);
        for s in &parts {
            // An empty or fully masked split has m = −∞ and weight 0.
            let w = (s[r] - mx).exp();
            if w == 0.0 {
                continue;
            }
            sum += w * s[mp + r];
            for (c, a) in acc.iter_mut().enumerate() {
                *a += w * s[(2 + c) * mp + r];
            }
        }
        let (i, h) = (p.i0 + r / group, p.kvh * group + r % group);
        let inv = 1.0 / sum;
        for (c, &a) in acc.iter().enumerate() {
            // SAFETY: (query i, head h) belongs to this task alone, and
            // `out` is `[t, q_heads·v_dim]` (checked by `attend_with`).
            unsafe { *out.get().add((i * qh + h) * vd + c) = a * inv };
        }
    }
}

/// Row vectors handled by one kernel call when `left` remain: up to 4 with
/// 32 registers, 3 with 16.
#[inline(always)]
fn row_step<S: Simd>(left: usize) -> usize {
    left.min(if S::WIDE { 4 } else { 3 })
}

/// `Sᵀ[key][row] = Σ_d Qᵀ[d][row]·K[key][d]` for the `nk` keys of a tile.
///
/// # Safety
/// `qt` is `[hd][mp]`, `st` has `(nk + MAX_NR)·mp` values, `krows` has
/// `nk + MAX_NR` pointers to `hd` readable values each.
#[inline(always)]
unsafe fn qk_tile<S: Simd>(
    qt: *const f32,
    mp: usize,
    mv: usize,
    hd: usize,
    krows: *const *const f32,
    nk: usize,
    st: *mut f32,
) {
    let mut v = 0;
    while v < mv {
        let mr = row_step::<S>(mv - v);
        let (q, s) = (qt.add(v * S::LANES), st.add(v * S::LANES));
        match (S::WIDE, mr) {
            (true, 1) => qk_block::<S, 1, 16>(q, mp, hd, krows, nk, s),
            (true, 2) => qk_block::<S, 2, 12>(q, mp, hd, krows, nk, s),
            (true, 3) => qk_block::<S, 3, 8>(q, mp, hd, krows, nk, s),
            (true, _) => qk_block::<S, 4, 6>(q, mp, hd, krows, nk, s),
            (false, 1) => qk_block::<S, 1, 12>(q, mp, hd, krows, nk, s),
            (false, 2) => qk_block::<S, 2, 6>(q, mp, hd, krows, nk, s),
            (false, _) => qk_block::<S, 3, 4>(q, mp, hd, krows, nk, s),
        }
        v += mr;
    }
}

/// [`qk_tile`] for `MR` row vectors, `NR` keys per accumulator block (the
/// last block may run past `nk` on padding pointers; those rows of `Sᵀ` are
/// never read).
///
/// # Safety
/// As [`qk_tile`], with `MR` vectors of rows at `qt` and `st`.
#[inline(always)]
unsafe fn qk_block<S: Simd, const MR: usize, const NR: usize>(
    qt: *const f32,
    mp: usize,
    hd: usize,
    krows: *const *const f32,
    nk: usize,
    st: *mut f32,
) {
    let mut n0 = 0;
    while n0 < nk {
        let kp: [*const f32; NR] = std::array::from_fn(|n| *krows.add(n0 + n));
        let mut acc = [[S::zero(); MR]; NR];
        for d in 0..hd {
            let a: [S::V; MR] = std::array::from_fn(|r| S::load(qt.add(d * mp + r * S::LANES)));
            for (n, acc_n) in acc.iter_mut().enumerate() {
                let b = S::splat(*kp[n].add(d));
                for (x, &ar) in acc_n.iter_mut().zip(&a) {
                    *x = S::fma(ar, b, *x);
                }
            }
        }
        for (n, acc_n) in acc.iter().enumerate() {
            for (r, &x) in acc_n.iter().enumerate() {
                S::store(st.add((n0 + n) * mp + r * S::LANES), x);
            }
        }
        n0 += NR;
    }
}

/// Online-softmax step for one tile: masks (when `mask` holds the first
/// query's position minus the tile's first key), updates the running max
/// `m` and sum `l`, writes the rescale factor to `alpha` and turns `Sᵀ` into
/// `Pᵀ` in place.
///
/// # Safety
/// `st` holds `nk·mp` scores; `qoff`, `m`, `l`, `alpha` hold `mp` values.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn softmax_tile<S: Simd>(
    st: *mut f32,
    mp: usize,
    mv: usize,
    nk: usize,
    mask: Option<f32>,
    qoff: *const f32,
    m: *mut f32,
    l: *mut f32,
    alpha: *mut f32,
) {
    let neg_inf = S::splat(f32::NEG_INFINITY);
    for v in 0..mv {
        let o = v * S::LANES;
        let mut tmax = neg_inf;
        if let Some(base) = mask {
            // Key jj is visible to row r iff jj <= base + r / group.
            let lim = S::add(S::splat(base), S::load(qoff.add(o)));
            for jj in 0..nk {
                let p = st.add(jj * mp + o);
                let s = S::select_gt(S::splat(jj as f32), lim, neg_inf, S::load(p));
                S::store(p, s);
                tmax = S::max(tmax, s);
            }
        } else {
            for jj in 0..nk {
                tmax = S::max(tmax, S::load(st.add(jj * mp + o)));
            }
        }
        let m_old = S::load(m.add(o));
        let m_new = S::max(m_old, tmax);
        // Rows with every key masked so far shift by 0, not by −∞.
        let shift = S::select_gt(S::splat(-f32::MAX), m_new, S::zero(), m_new);
        let a = exp::<S>(S::sub(m_old, shift));
        let (mut s0, mut s1) = (S::zero(), S::zero());
        let mut jj = 0;
        while jj + 1 < nk {
            let (p0, p1) = (st.add(jj * mp + o), st.add((jj + 1) * mp + o));
            let (e0, e1) = (
                exp::<S>(S::sub(S::load(p0), shift)),
                exp::<S>(S::sub(S::load(p1), shift)),
            );
            S::store(p0, e0);
            S::store(p1, e1);
            s0 = S::add(s0, e0);
            s1 = S::add(s1, e1);
            jj += 2;
        }
        if jj < nk {
            let p0 = st.add(jj * mp + o);
            let e0 = exp::<S>(S::sub(S::load(p0), shift));
            S::store(p0, e0);
            s0 = S::add(s0, e0);
        }
        S::store(alpha.add(o), a);
        S::store(l.add(o), S::fma(S::load(l.add(o)), a, S::add(s0, s1)));
        S::store(m.add(o), m_new);
    }
}

/// `Oᵀ[c][row] = α[row]·Oᵀ[c][row] + Σ_key Pᵀ[key][row]·V[key][c]` for one tile.
///
/// # Safety
/// `pt` holds `nk·mp` values, `ot` `[vd][mp]`, `alpha` `mp`; `vrows` has `nk`
/// pointers to `vd` readable values each.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pv_tile<S: Simd>(
    pt: *const f32,
    mp: usize,
    mv: usize,
    nk: usize,
    vd: usize,
    vrows: *const *const f32,
    ot: *mut f32,
    alpha: *const f32,
) {
    let mut v = 0;
    while v < mv {
        let mr = row_step::<S>(mv - v);
        let o = v * S::LANES;
        let (p, out, a) = (pt.add(o), ot.add(o), alpha.add(o));
        match (S::WIDE, mr) {
            (true, 1) => pv_rows::<S, 1, 16>(p, mp, nk, vd, vrows, out, a),
            (true, 2) => pv_rows::<S, 2, 8>(p, mp, nk, vd, vrows, out, a),
            (true, 3) => pv_rows::<S, 3, 8>(p, mp, nk, vd, vrows, out, a),
            (true, _) => pv_rows::<S, 4, 4>(p, mp, nk, vd, vrows, out, a),
            (false, 1) => pv_rows::<S, 1, 8>(p, mp, nk, vd, vrows, out, a),
            (false, 2) => pv_rows::<S, 2, 4>(p, mp, nk, vd, vrows, out, a),
            (false, _) => pv_rows::<S, 3, 4>(p, mp, nk, vd, vrows, out, a),
        }
        v += mr;
    }
}

/// [`pv_tile`] for `MR` row vectors: value columns in blocks of `NC`, then
/// the remaining `vd % NC` columns one at a time.
///
/// # Safety
/// As [`pv_tile`], with `MR` vectors of rows at `pt`, `ot` and `alpha`.
#[inline(always)]
unsafe fn pv_rows<S: Simd, const MR: usize, const NC: usize>(
    pt: *const f32,
    mp: usize,
    nk: usize,
    vd: usize,
    vrows: *const *const f32,
    ot: *mut f32,
    alpha: *const f32,
) {
    let mut c0 = 0;
    while c0 + NC <= vd {
        pv_block::<S, MR, NC>(pt, mp, nk, c0, vrows, ot, alpha);
        c0 += NC;
    }
    while c0 < vd {
        pv_block::<S, MR, 1>(pt, mp, nk, c0, vrows, ot, alpha);
        c0 += 1;
    }
}

/// Columns `c0..c0 + NC` of [`pv_tile`] for `MR` row vectors, accumulators
/// held in registers across the whole tile.
///
/// # Safety
/// As [`pv_rows`], with `c0 + NC <= vd`.
#[inline(always)]
unsafe fn pv_block<S: Simd, const MR: usize, const NC: usize>(
    pt: *const f32,
    mp: usize,
    nk: usize,
    c0: usize,
    vrows: *const *const f32,
    ot: *mut f32,
    alpha: *const f32,
) {
    let al: [S::V; MR] = std::array::from_fn(|r| S::load(alpha.add(r * S::LANES)));
    let mut acc: [[S::V; MR]; NC] = std::array::from_fn(|c| {
        std::array::from_fn(|r| S::mul(S::load(ot.add((c0 + c) * mp + r * S::LANES)), al[r]))
    });
    for jj in 0..nk {
        let vp = (*vrows.add(jj)).add(c0);
        let a: [S::V; MR] = std::array::from_fn(|r| S::load(pt.add(jj * mp + r * S::LANES)));
        for (c, acc_c) in acc.iter_mut().enumerate() {
            let b = S::splat(*vp.add(c));
            for (x, &ar) in acc_c.iter_mut().zip(&a) {
                *x = S::fma(ar, b, *x);
            }
        }
    }
    for (c, acc_c) in acc.iter().enumerate() {
        for (r, &x) in acc_c.iter().enumerate() {
            S::store(ot.add((c0 + c) * mp + r * S::LANES), x);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod bf16;
mod decode;
use crate::simd::*;
pub use decode::{
    decode_attention_batch, latent_decode_attention_batch, DecodeSeq, DECODE_SPLIT_KEYS,
    DECODE_TILE,
};

#[cfg(test)]
mod tests;
