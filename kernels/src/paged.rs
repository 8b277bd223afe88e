//! The KV page pool: fixed-size pages of cache rows, addressed by a block table.
//!
//! One [`KvPool`] holds the cache of every attention layer of a model. A page
//! id indexes the same page in each layer's buffer (as vLLM's block tables
//! do), so a sequence needs one block table for all its layers. A page holds
//! `page_size` token rows of `width` f32 values: for GQA a row is
//! `[k: kv_heads·head_dim | v: kv_heads·head_dim]`; for MLA it is the
//! compressed latent `[c_kv: kv_lora_rank | k_pe: qk_rope_head_dim]`.
//!
//! The pool only owns memory and a free list. Who may use which page (radix
//! sharing, reference counts, eviction) is decided by the session memory.

use crate::error::{Error, Result};

/// Page-structured storage for the KV rows of every attention layer.
pub struct KvPool {
    /// Tokens per page (a power of two is not required).
    pub page_size: usize,
    /// f32 values per token row.
    pub width: usize,
    /// One buffer per attention layer, `num_pages · page_size · width` long.
    layers: Vec<Vec<f32>>,
    /// Pages not handed out, popped from the back.
    free: Vec<u32>,
    /// Total pages.
    num_pages: usize,
}

impl KvPool {
    /// A pool of `num_pages` pages for `layers` attention layers.
    pub fn new(layers: usize, num_pages: usize, page_size: usize, width: usize) -> KvPool {
        assert!(page_size > 0, "page_size must be positive");
        KvPool {
            page_size,
            width,
            layers: (0..layers)
                .map(|_| vec![0.0; num_pages * page_size * width])
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

    /// Offset of token `pos`'s row inside a layer buffer.
    #[inline]
    fn row_offset(&self, block_table: &[u32], pos: usize) -> usize {
        let page = block_table[pos / self.page_size] as usize;
        (page * self.page_size + pos % self.page_size) * self.width
    }

    /// The cache row of token `pos` in `layer`.
    #[inline]
    pub fn row(&self, layer: usize, block_table: &[u32], pos: usize) -> &[f32] {
        let o = self.row_offset(block_table, pos);
        &self.layers[layer][o..o + self.width]
    }

    /// The cache row of token `pos` in `layer`, for writing.
    #[inline]
    pub fn row_mut(&mut self, layer: usize, block_table: &[u32], pos: usize) -> &mut [f32] {
        let o = self.row_offset(block_table, pos);
        &mut self.layers[layer][o..o + self.width]
    }

    /// Copies page `src` onto page `dst` in every layer (copy-on-write of a
    /// partially filled shared page).
    pub fn copy_page(&mut self, src: u32, dst: u32) {
        let n = self.page_size * self.width;
        for buf in &mut self.layers {
            let (s, d) = (src as usize * n, dst as usize * n);
            buf.copy_within(s..s + n, d);
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
    fn exhausted_pool_reports_pages_needed() {
        let mut pool = KvPool::new(1, 1, 4, 1);
        let mut table = Vec::new();
        let err = pool.ensure_capacity(&mut table, 9).unwrap_err();
        assert!(matches!(err, Error::OutOfPages { needed: 3, free: 1 }));
    }
}
