//! The KV page pool: fixed-size pages of cache rows, addressed by a block table.
//!
//! One [`KvPool`] holds the cache of every attention layer of a model. A page
//! id indexes the same page in each layer's buffer (as vLLM's block tables
//! do), so a sequence needs one block table for all its layers. A page holds
//! `page_size` token rows of `width` values, stored as f32, bf16 or int8
//! ([`KvDtype`]); readers widen the rows back to f32, so attention always
//! accumulates in f32. For GQA a row is
//! `[k: kv_heads·head_dim | v: kv_heads·head_dim]`; for MLA it is the
//! compressed latent `[c_kv: kv_lora_rank | k_pe: qk_rope_head_dim]`.
//!
//! # int8 rows
//!
//! An int8 row is cut into **segments** of `segment` values (a GQA head's K
//! or V; for MLA a common divisor of `kv_lora_rank` and `qk_rope_head_dim`,
//! so the latent and the rope part never share a scale), each stored as
//! `round(x / s)` in `[-127, 127]` with its own f32 scale `s = max|x| / 127`
//! (symmetric, per token and segment, as LMDeploy's int8 KV cache). A
//! value comes back within `s / 2` of what was written. The scales of a
//! page sit apart from its values, segment-major (`[page][segment][slot]`),
//! so the scales of one head over a page's keys are one contiguous run: a
//! decode kernel reads a key's values and, once per page, one line of its
//! head's scales. A segment holding a non-finite value reads back as NaN.
//!
//! The pool only owns memory and a free list. Who may use which page (radix
//! sharing, reference counts, eviction) is decided by the session memory.

use crate::dtype::{bf16_slice_to_f32, f32_to_bf16};
use crate::error::{Error, Result};

/// How KV rows are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// bf16: rows are rounded to nearest-even on write, widened on read.
    #[default]
    Bf16,
    /// f32: rows are kept exactly.
    F32,
    /// int8 with an f32 scale per token and segment (see the module docs):
    /// about half the bytes of bf16.
    Int8,
}

impl KvDtype {
    /// Bytes of one stored row of `width` values cut into segments of
    /// `segment` values (only int8 rows store the segments' scales).
    pub fn row_bytes(self, width: usize, segment: usize) -> usize {
        match self {
            KvDtype::Bf16 => 2 * width,
            KvDtype::F32 => 4 * width,
            KvDtype::Int8 => width + 4 * width.div_ceil(segment.max(1)),
        }
    }

    /// `bf16`, `f32` or `int8`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::F32 => "f32",
            KvDtype::Int8 => "int8",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<KvDtype, String> {
        match s {
            "bf16" => Ok(KvDtype::Bf16),
            "f32" => Ok(KvDtype::F32),
            "int8" => Ok(KvDtype::Int8),
            other => Err(format!("KV cache dtype {other:?} is not bf16, f32 or int8")),
        }
    }
}

/// Values per int8 scale of rows made of two parts of `a` and `b` values
/// (MLA's latent and rope parts): their greatest common divisor, so that
/// no segment spans both parts (1 when both are 0).
pub fn common_segment(a: usize, b: usize) -> usize {
    if b == 0 {
        a.max(1)
    } else {
        common_segment(b, a % b)
    }
}

/// One layer's rows in their stored dtype.
enum LayerBuf {
    F32(Aligned<f32>),
    Bf16(Aligned<u16>),
    /// Values `[page][slot][width]` and scales `[page][segment][slot]`.
    Int8 {
        q: Aligned<i8>,
        scale: Aligned<f32>,
    },
}

/// A zeroed buffer whose first element starts a cache line, so a head's
/// 64 int8 or 128 bf16 bytes of a row fill one or two lines instead of
/// straddling two or three (large allocations come back 16 bytes past a
/// page): a decode kernel's cost is the lines it waits for.
struct Aligned<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

/// Cache line bytes.
const LINE: usize = 64;

impl<T: Copy + Default> Aligned<T> {
    fn zeroed(len: usize) -> Aligned<T> {
        let pad = LINE / size_of::<T>();
        let buf = vec![T::default(); len + pad];
        let start = buf.as_ptr().align_offset(LINE).min(pad);
        Aligned { buf, start, len }
    }
}

impl<T> std::ops::Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T> std::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// One layer's whole buffer in its stored dtype, for kernels that read rows
/// in place (offsets from [`KvPool::row_offset`] and, for int8,
/// [`KvPool::scale_offset`]).
#[derive(Clone, Copy)]
pub(crate) enum LayerRows<'a> {
    /// f32 rows.
    F32(&'a [f32]),
    /// bf16 rows (the raw bits).
    Bf16(&'a [u16]),
    /// int8 rows and their segments' scales.
    Int8 { q: &'a [i8], scale: &'a [f32] },
}

/// Page-structured storage for the KV rows of every attention layer.
pub struct KvPool {
    /// Tokens per page (a power of two is not required).
    pub page_size: usize,
    /// Values per token row.
    pub width: usize,
    /// Values per int8 scale (divides `width`).
    segment: usize,
    /// How values are stored.
    dtype: KvDtype,
    /// One buffer per attention layer, `num_pages · page_size · width` long.
    layers: Vec<LayerBuf>,
    /// Pages not handed out, popped from the back.
    free: Vec<u32>,
    /// Total pages.
    num_pages: usize,
}

impl KvPool {
    /// A pool of `num_pages` pages of f32 rows for `layers` attention layers.
    pub fn new(layers: usize, num_pages: usize, page_size: usize, width: usize) -> KvPool {
        KvPool::with_dtype(layers, num_pages, page_size, width, KvDtype::F32)
    }

    /// A pool of `num_pages` pages of `dtype` rows for `layers` attention
    /// layers; int8 rows get one scale per row (see [`KvPool::with_layout`]).
    pub fn with_dtype(
        layers: usize,
        num_pages: usize,
        page_size: usize,
        width: usize,
        dtype: KvDtype,
    ) -> KvPool {
        KvPool::with_layout(layers, num_pages, page_size, width, width.max(1), dtype)
    }

    /// A pool of `num_pages` pages of `dtype` rows of `width` values, int8
    /// rows cut into segments of `segment` values with a scale each.
    ///
    /// # Panics
    /// If `page_size` is 0, or `segment` is 0 or does not divide `width`.
    pub fn with_layout(
        layers: usize,
        num_pages: usize,
        page_size: usize,
        width: usize,
        segment: usize,
        dtype: KvDtype,
    ) -> KvPool {
        assert!(page_size > 0, "page_size must be positive");
        assert!(
            segment > 0 && width.is_multiple_of(segment),
            "KV segments of {segment} values do not divide rows of {width}"
        );
        let len = num_pages * page_size * width;
        KvPool {
            page_size,
            width,
            segment,
            dtype,
            layers: (0..layers)
                .map(|_| match dtype {
                    KvDtype::F32 => LayerBuf::F32(Aligned::zeroed(len)),
                    KvDtype::Bf16 => LayerBuf::Bf16(Aligned::zeroed(len)),
                    KvDtype::Int8 => LayerBuf::Int8 {
                        q: Aligned::zeroed(len),
                        scale: Aligned::zeroed(len / segment),
                    },
                })
                .collect(),
            free: (0..num_pages as u32).rev().collect(),
            num_pages,
        }
    }

    /// Hands page allocation to someone else (session memory): the pool's
    /// own free list is emptied, so [`KvPool::ensure_capacity`] only checks
    /// that the caller reserved enough pages.
    pub fn externally_allocated(mut self) -> KvPool {
        self.free.clear();
        self
    }

    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Pages not handed out.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// How rows are stored.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Values per int8 scale.
    pub fn segment(&self) -> usize {
        self.segment
    }

    /// Bytes one token occupies over all layers (what a page budget counts).
    pub fn bytes_per_token(&self) -> usize {
        self.layers.len() * self.dtype.row_bytes(self.width, self.segment)
    }

    /// Bytes the pool's buffers hold.
    pub fn nbytes(&self) -> usize {
        self.num_pages * self.page_size * self.bytes_per_token()
    }

    /// Number of attention layers the pool serves.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Takes one free page.
    pub fn alloc(&mut self) -> Result<u32> {
        self.free
            .pop()
            .ok_or(Error::OutOfPages { needed: 1, free: 0 })
    }

    /// Returns a page to the free list.
    pub fn release(&mut self, page: u32) {
        debug_assert!(!self.free.contains(&page), "page {page} released twice");
        self.free.push(page);
    }

    /// Grows `block_table` until it covers `tokens` positions.
    pub fn ensure_capacity(&mut self, block_table: &mut Vec<u32>, tokens: usize) -> Result<()> {
        let needed = tokens
            .div_ceil(self.page_size)
            .saturating_sub(block_table.len());
        if needed > self.free.len() {
            return Err(Error::OutOfPages {
                needed,
                free: self.free.len(),
            });
        }
        for _ in 0..needed {
            block_table.push(self.alloc()?);
        }
        Ok(())
    }

    /// `layer`'s buffer in its stored dtype.
    pub(crate) fn layer_rows(&self, layer: usize) -> LayerRows<'_> {
        match &self.layers[layer] {
            LayerBuf::F32(b) => LayerRows::F32(b),
            LayerBuf::Bf16(b) => LayerRows::Bf16(b),
            LayerBuf::Int8 { q, scale } => LayerRows::Int8 { q, scale },
        }
    }

    /// Offset of token `pos`'s row inside a layer buffer.
    #[inline]
    pub(crate) fn row_offset(&self, block_table: &[u32], pos: usize) -> usize {
        let page = block_table[pos / self.page_size] as usize;
        (page * self.page_size + pos % self.page_size) * self.width
    }

    /// Offset of the scale of token `pos`'s first segment inside a layer's
    /// int8 scales; segment `s`'s scale is `s · page_size` further on.
    #[inline]
    pub(crate) fn scale_offset(&self, block_table: &[u32], pos: usize) -> usize {
        let page = block_table[pos / self.page_size] as usize;
        page * self.page_size * (self.width / self.segment) + pos % self.page_size
    }

    /// Calls `f(pos, row offset, scale offset)` for every position of
    /// `range` in order ([`KvPool::row_offset`], [`KvPool::scale_offset`]),
    /// a page at a time rather than a division per row.
    #[inline]
    pub(crate) fn for_each_row(
        &self,
        block_table: &[u32],
        range: std::ops::Range<usize>,
        mut f: impl FnMut(usize, usize, usize),
    ) {
        let (ps, segs) = (self.page_size, self.width / self.segment);
        let mut pos = range.start;
        while pos < range.end {
            let slot0 = pos % ps;
            let first = block_table[pos / ps] as usize * ps;
            let n = (ps - slot0).min(range.end - pos);
            for i in 0..n {
                let slot = slot0 + i;
                f(pos + i, (first + slot) * self.width, first * segs + slot);
            }
            pos += n;
        }
    }

    /// The cache row of token `pos` in `layer` of an f32 pool.
    ///
    /// # Panics
    /// If the pool does not store f32 (use [`KvPool::read_row`]).
    #[inline]
    pub fn row(&self, layer: usize, block_table: &[u32], pos: usize) -> &[f32] {
        let o = self.row_offset(block_table, pos);
        match &self.layers[layer] {
            LayerBuf::F32(b) => &b[o..o + self.width],
            _ => panic!("KvPool::row on a {} pool (use read_row)", self.dtype.name()),
        }
    }

    /// The cache row of token `pos` in `layer` of an f32 pool, for writing.
    ///
    /// # Panics
    /// If the pool does not store f32 (use [`KvPool::write_row`]).
    #[inline]
    pub fn row_mut(&mut self, layer: usize, block_table: &[u32], pos: usize) -> &mut [f32] {
        let o = self.row_offset(block_table, pos);
        let dtype = self.dtype;
        match &mut self.layers[layer] {
            LayerBuf::F32(b) => &mut b[o..o + self.width],
            _ => panic!("KvPool::row_mut on a {} pool (use write_row)", dtype.name()),
        }
    }

    /// Token `pos`'s row of `layer` as f32: the stored slice of an f32 pool,
    /// or the bf16 / int8 row widened into `buf` (`width` long).
    #[inline]
    pub fn read_row<'a>(
        &'a self,
        layer: usize,
        block_table: &[u32],
        pos: usize,
        buf: &'a mut [f32],
    ) -> &'a [f32] {
        let o = self.row_offset(block_table, pos);
        let out = &mut buf[..self.width];
        match &self.layers[layer] {
            LayerBuf::F32(b) => return &b[o..o + self.width],
            LayerBuf::Bf16(b) => bf16_slice_to_f32(&b[o..o + self.width], out),
            LayerBuf::Int8 { q, scale } => {
                let so = self.scale_offset(block_table, pos);
                let seg = self.segment;
                let segs = out
                    .chunks_exact_mut(seg)
                    .zip(q[o..o + self.width].chunks_exact(seg));
                for (s, (dst, src)) in segs.enumerate() {
                    let sc = scale[so + s * self.page_size];
                    for (d, &v) in dst.iter_mut().zip(src) {
                        *d = v as f32 * sc;
                    }
                }
            }
        }
        out
    }

    /// Writes token `pos`'s row of `layer` from `parts` laid end to end
    /// (`width` values in all), rounding to bf16 or int8 as the pool stores.
    ///
    /// # Panics
    /// If the parts do not add up to `width` values.
    pub fn write_row(&mut self, layer: usize, block_table: &[u32], pos: usize, parts: &[&[f32]]) {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        assert_eq!(
            total, self.width,
            "write_row: parts hold {total} values, rows {}",
            self.width
        );
        let o = self.row_offset(block_table, pos);
        let so = self.scale_offset(block_table, pos);
        let (seg, page_size) = (self.segment, self.page_size);
        let mut at = o;
        match &mut self.layers[layer] {
            LayerBuf::F32(b) => {
                for p in parts {
                    b[at..at + p.len()].copy_from_slice(p);
                    at += p.len();
                }
            }
            LayerBuf::Bf16(b) => {
                for p in parts {
                    for (d, &v) in b[at..at + p.len()].iter_mut().zip(p.iter()) {
                        *d = f32_to_bf16(v);
                    }
                    at += p.len();
                }
            }
            LayerBuf::Int8 { q, scale } => {
                // Parts cut at segment boundaries (GQA's K and V, MLA's latent
                // and rope) are read in place; others are joined first.
                let mut dst = q[o..o + total].chunks_exact_mut(seg).enumerate();
                let mut put = |x: &[f32]| {
                    if let Some((s, d)) = dst.next() {
                        scale[so + s * page_size] = quantize_segment(x, d);
                    }
                };
                if parts.iter().all(|p| p.len().is_multiple_of(seg)) {
                    parts.iter().flat_map(|p| p.chunks_exact(seg)).for_each(put);
                } else {
                    let joined: Vec<f32> = parts.iter().flat_map(|p| p.iter().copied()).collect();
                    joined.chunks_exact(seg).for_each(&mut put);
                }
            }
        }
    }

    /// Copies page `src` onto page `dst` in every layer (copy-on-write of a
    /// partially filled shared page).
    pub fn copy_page(&mut self, src: u32, dst: u32) {
        let n = self.page_size * self.width;
        let (s, d) = (src as usize * n, dst as usize * n);
        let ns = n / self.segment;
        let (ss, ds) = (src as usize * ns, dst as usize * ns);
        for buf in &mut self.layers {
            match buf {
                LayerBuf::F32(b) => b.copy_within(s..s + n, d),
                LayerBuf::Bf16(b) => b.copy_within(s..s + n, d),
                LayerBuf::Int8 { q, scale } => {
                    q.copy_within(s..s + n, d);
                    scale.copy_within(ss..ss + ns, ds);
                }
            }
        }
    }
}

/// Rounds one segment to int8 (`dst[i] = round(x[i] / s)`, half away from
/// zero) and returns its scale `s = max|x| / 127`: 0 for an all-zero
/// segment, NaN (values 0) when a value is not finite.
fn quantize_segment(x: &[f32], dst: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if !amax.is_finite() || x.iter().any(|v| v.is_nan()) {
        dst.fill(0);
        return f32::NAN;
    }
    if amax == 0.0 {
        dst.fill(0);
        return 0.0;
    }
    let inv = 127.0 / amax;
    for (d, &v) in dst.iter_mut().zip(x) {
        *d = (v * inv).round().clamp(-127.0, 127.0) as i8;
    }
    amax / 127.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_land_in_the_page_the_block_table_names() {
        let mut pool = KvPool::new(2, 4, 2, 3);
        let mut table = Vec::new();
        pool.ensure_capacity(&mut table, 3).unwrap();
        assert_eq!(table.len(), 2);
        pool.row_mut(1, &table, 2).copy_from_slice(&[1.0, 2.0, 3.0]);
        assert_eq!(pool.row(1, &table, 2), &[1.0, 2.0, 3.0]);
        assert_eq!(pool.row(0, &table, 2), &[0.0, 0.0, 0.0]);
        assert_eq!(pool.free_pages(), 2);
    }

    #[test]
    fn bf16_rows_round_on_write_widen_on_read_and_count_half_the_bytes() {
        let mut pool = KvPool::with_dtype(2, 3, 2, 4, KvDtype::Bf16);
        let f32_pool = KvPool::new(2, 3, 2, 4);
        assert_eq!(pool.bytes_per_token(), 2 * 4 * 2);
        assert_eq!(f32_pool.bytes_per_token(), 2 * 4 * 4);
        assert_eq!(pool.nbytes(), 3 * 2 * 16);
        let mut table = Vec::new();
        pool.ensure_capacity(&mut table, 4).unwrap();
        let (a, b) = ([1.0f32, 1.0 + 1.0 / 256.0], [-3.3f32, 1e-3]);
        pool.write_row(1, &table, 3, &[&a, &b]);
        let mut buf = [0.0; 4];
        let got = pool.read_row(1, &table, 3, &mut buf).to_vec();
        let want: Vec<f32> = a
            .iter()
            .chain(&b)
            .map(|&v| crate::dtype::bf16_to_f32(f32_to_bf16(v)))
            .collect();
        assert_eq!(got, want);
        // Round to nearest even: 1 + 2^-8 is halfway and rounds down to 1.
        assert_eq!(got[1], 1.0);
        pool.copy_page(table[1], table[0]);
        assert_eq!(pool.read_row(1, &table, 1, &mut buf), &want[..]);
    }

    #[test]
    fn int8_rows_come_back_within_half_a_step_of_their_segment_and_count_their_scales() {
        // Rows of 8 values in segments of 4 (two "heads"), pages of 3.
        let mut pool = KvPool::with_layout(2, 4, 3, 8, 4, KvDtype::Int8);
        assert_eq!(pool.bytes_per_token(), 2 * (8 + 2 * 4));
        assert_eq!(KvDtype::Int8.row_bytes(384, 64), 384 + 6 * 4);
        let mut table = Vec::new();
        pool.ensure_capacity(&mut table, 7).unwrap();
        let rows: Vec<Vec<f32>> = (0..7)
            .map(|p| {
                (0..8)
                    .map(|i| ((p * 8 + i) as f32 * 0.77).sin() * (1.0 + 30.0 * (i / 4) as f32))
                    .collect()
            })
            .collect();
        for (p, r) in rows.iter().enumerate() {
            // Parts that cut across a segment.
            pool.write_row(1, &table, p, &[&r[..3], &r[3..]]);
        }
        let mut buf = [0.0; 8];
        for (p, r) in rows.iter().enumerate() {
            let got = pool.read_row(1, &table, p, &mut buf).to_vec();
            for seg in 0..2 {
                let want = &r[seg * 4..seg * 4 + 4];
                let step = want.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
                for (g, w) in got[seg * 4..seg * 4 + 4].iter().zip(want) {
                    // Half a step, plus f32 rounding of the product.
                    assert!(
                        (g - w).abs() <= 0.5 * step * (1.0 + 1e-5),
                        "{p}/{seg}: {g} vs {w}"
                    );
                }
                // The largest value of a segment is exact up to rounding.
                let big = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!(got[seg * 4..seg * 4 + 4]
                    .iter()
                    .any(|g| (g.abs() - big).abs() <= big * 1e-6));
            }
        }
        // Layer 0 was not written; copy-on-write copies values and scales.
        assert_eq!(pool.read_row(0, &table, 2, &mut buf), &[0.0; 8]);
        let before = pool.read_row(1, &table, 4, &mut buf).to_vec();
        pool.copy_page(table[1], table[0]);
        assert_eq!(pool.read_row(1, &table, 1, &mut buf), &before[..]);
        // A non-finite value spoils only its segment.
        let mut bad = rows[0].clone();
        bad[5] = f32::INFINITY;
        pool.write_row(1, &table, 0, &[&bad]);
        let got = pool.read_row(1, &table, 0, &mut buf).to_vec();
        assert!(got[4..].iter().all(|v| v.is_nan()));
        assert!(got[..4].iter().all(|v| v.is_finite()));
        bad[5] = f32::NAN;
        pool.write_row(1, &table, 0, &[&bad]);
        assert!(pool.read_row(1, &table, 0, &mut buf)[4..]
            .iter()
            .all(|v| v.is_nan()));
        assert_eq!("int8".parse::<KvDtype>(), Ok(KvDtype::Int8));
        assert!("fp4"
            .parse::<KvDtype>()
            .unwrap_err()
            .contains("bf16, f32 or int8"));
    }

    #[test]
    #[should_panic(expected = "do not divide")]
    fn int8_segments_must_divide_the_row() {
        KvPool::with_layout(1, 1, 4, 10, 4, KvDtype::Int8);
    }

    #[test]
    fn row_walks_name_the_offsets_of_single_lookups() {
        let mut pool = KvPool::with_layout(1, 9, 4, 12, 4, KvDtype::Int8);
        let mut table = Vec::new();
        pool.ensure_capacity(&mut table, 30).unwrap();
        table.reverse();
        for (a, z) in [(0, 30), (3, 4), (5, 13), (8, 8), (7, 29)] {
            let mut seen = Vec::new();
            pool.for_each_row(&table, a..z, |p, o, s| seen.push((p, o, s)));
            let want: Vec<_> = (a..z)
                .map(|p| (p, pool.row_offset(&table, p), pool.scale_offset(&table, p)))
                .collect();
            assert_eq!(seen, want, "{a}..{z}");
        }
    }

    #[test]
    fn layer_buffers_start_on_a_cache_line() {
        for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::Int8] {
            let pool = KvPool::with_layout(2, 64, 16, 384, 64, dtype);
            for layer in 0..2 {
                let (p, n) = match pool.layer_rows(layer) {
                    LayerRows::F32(b) => (b.as_ptr() as usize, b.len()),
                    LayerRows::Bf16(b) => (b.as_ptr() as usize, b.len()),
                    LayerRows::Int8 { q, scale } => {
                        assert_eq!(scale.as_ptr() as usize % LINE, 0);
                        (q.as_ptr() as usize, q.len())
                    }
                };
                assert_eq!((p % LINE, n), (0, 64 * 16 * 384), "{dtype:?}");
            }
        }
    }

    #[test]
    fn exhausted_pool_reports_pages_needed() {
        let mut pool = KvPool::new(1, 1, 4, 1);
        let mut table = Vec::new();
        let err = pool.ensure_capacity(&mut table, 9).unwrap_err();
        assert!(matches!(err, Error::OutOfPages { needed: 3, free: 1 }));
    }
}
