//! The KV page pool: fixed-size pages of cache rows, addressed by a block table.
//!
//! One [`KvPool`] holds the cache of every attention layer of a model. A page
//! id indexes the same page in each layer's buffer (as vLLM's block tables
//! do), so a sequence needs one block table for all its layers. A page holds
//! `page_size` token rows of `width` values, stored as f32 or as bf16
//! ([`KvDtype`]; bf16 halves the bytes per token, and readers widen the
//! rows back to f32 so attention still accumulates in f32). For GQA a row is
//! `[k: kv_heads·head_dim | v: kv_heads·head_dim]`; for MLA it is the
//! compressed latent `[c_kv: kv_lora_rank | k_pe: qk_rope_head_dim]`.
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
}

impl KvDtype {
    /// Bytes per stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
        }
    }

    /// `bf16` or `f32`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::F32 => "f32",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<KvDtype, String> {
        match s {
            "bf16" => Ok(KvDtype::Bf16),
            "f32" => Ok(KvDtype::F32),
            other => Err(format!("KV cache dtype {other:?} is not bf16 or f32")),
        }
    }
}

/// One layer's rows in their stored dtype.
enum LayerBuf {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

/// One layer's whole buffer in its stored dtype, for kernels that read rows
/// in place (offsets from [`KvPool::row_offset`]).
#[derive(Clone, Copy)]
pub(crate) enum LayerRows<'a> {
    /// f32 rows.
    F32(&'a [f32]),
    /// bf16 rows (the raw bits).
    Bf16(&'a [u16]),
}

/// Page-structured storage for the KV rows of every attention layer.
pub struct KvPool {
    /// Tokens per page (a power of two is not required).
    pub page_size: usize,
    /// Values per token row.
    pub width: usize,
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

    /// A pool of `num_pages` pages of `dtype` rows for `layers` attention layers.
    pub fn with_dtype(
        layers: usize,
        num_pages: usize,
        page_size: usize,
        width: usize,
        dtype: KvDtype,
    ) -> KvPool {
        assert!(page_size > 0, "page_size must be positive");
        let len = num_pages * page_size * width;
        KvPool {
            page_size,
            width,
            dtype,
            layers: (0..layers)
                .map(|_| match dtype {
                    KvDtype::F32 => LayerBuf::F32(vec![0.0; len]),
                    KvDtype::Bf16 => LayerBuf::Bf16(vec![0; len]),
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

    /// Bytes one token occupies over all layers (what a page budget counts).
    pub fn bytes_per_token(&self) -> usize {
        self.layers.len() * self.width * self.dtype.bytes()
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
        }
    }

    /// Offset of token `pos`'s row inside a layer buffer.
    #[inline]
    pub(crate) fn row_offset(&self, block_table: &[u32], pos: usize) -> usize {
        let page = block_table[pos / self.page_size] as usize;
        (page * self.page_size + pos % self.page_size) * self.width
    }

    /// The cache row of token `pos` in `layer` of an f32 pool.
    ///
    /// # Panics
    /// If the pool stores bf16 (use [`KvPool::read_row`]).
    #[inline]
    pub fn row(&self, layer: usize, block_table: &[u32], pos: usize) -> &[f32] {
        let o = self.row_offset(block_table, pos);
        match &self.layers[layer] {
            LayerBuf::F32(b) => &b[o..o + self.width],
            LayerBuf::Bf16(_) => panic!("KvPool::row on a bf16 pool (use read_row)"),
        }
    }

    /// The cache row of token `pos` in `layer` of an f32 pool, for writing.
    ///
    /// # Panics
    /// If the pool stores bf16 (use [`KvPool::write_row`]).
    #[inline]
    pub fn row_mut(&mut self, layer: usize, block_table: &[u32], pos: usize) -> &mut [f32] {
        let o = self.row_offset(block_table, pos);
        match &mut self.layers[layer] {
            LayerBuf::F32(b) => &mut b[o..o + self.width],
            LayerBuf::Bf16(_) => panic!("KvPool::row_mut on a bf16 pool (use write_row)"),
        }
    }

    /// Token `pos`'s row of `layer` as f32: the stored slice of an f32 pool,
    /// or the bf16 row widened into `buf` (`width` long).
    #[inline]
    pub fn read_row<'a>(
        &'a self,
        layer: usize,
        block_table: &[u32],
        pos: usize,
        buf: &'a mut [f32],
    ) -> &'a [f32] {
        let o = self.row_offset(block_table, pos);
        match &self.layers[layer] {
            LayerBuf::F32(b) => &b[o..o + self.width],
            LayerBuf::Bf16(b) => {
                let out = &mut buf[..self.width];
                bf16_slice_to_f32(&b[o..o + self.width], out);
                out
            }
        }
    }

    /// Writes token `pos`'s row of `layer` from `parts` laid end to end
    /// (`width` values in all), rounding to bf16 in a bf16 pool.
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
        }
    }

    /// Copies page `src` onto page `dst` in every layer (copy-on-write of a
    /// partially filled shared page).
    pub fn copy_page(&mut self, src: u32, dst: u32) {
        let n = self.page_size * self.width;
        let (s, d) = (src as usize * n, dst as usize * n);
        for buf in &mut self.layers {
            match buf {
                LayerBuf::F32(b) => b.copy_within(s..s + n, d),
                LayerBuf::Bf16(b) => b.copy_within(s..s + n, d),
            }
        }
    }
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
    fn exhausted_pool_reports_pages_needed() {
        let mut pool = KvPool::new(1, 1, 4, 1);
        let mut table = Vec::new();
        let err = pool.ensure_capacity(&mut table, 9).unwrap_err();
        assert!(matches!(err, Error::OutOfPages { needed: 3, free: 1 }));
    }
}
