//! Reference-counted allocator of KV-cache pages.
//!
//! The KV pool ([`caracal_kernels::paged::KvPool`]) holds a fixed number of pages, each
//! `page_size` token rows for every layer. This module only does the bookkeeping: which
//! page ids are free, and how many holders each used page has. It is plain state owned by
//! SessionMemory inside the scheduler (single-threaded, no locks).
//!
//! Holders of a page are of two kinds:
//! - the radix tree ([`crate::radix::RadixCache`]), which owns one reference to every page
//!   it stores and gives it back on eviction;
//! - running requests, which own the pages they allocated and one extra reference to each
//!   cached page they reuse (taken with [`PageAllocator::retain`] after a prefix match).
//!
//! A page is free exactly when its reference count is 0. Freeing a free page or retaining
//! a free page is a caller bug: debug builds assert, release builds log it with `tracing`
//! and leave the allocator unchanged (so a bug cannot hand the same page out twice).

use thiserror::Error;

/// Errors of [`PageAllocator`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PagesError {
    /// An allocation asked for more pages than are free; nothing was allocated.
    #[error("out of KV pages: needed {needed}, free {free}")]
    OutOfPages {
        /// Pages asked for.
        needed: usize,
        /// Pages free at the time of the call.
        free: usize,
    },
}

/// Fixed pool of page ids `0..num_pages` with a reference count per page.
#[derive(Debug, Clone)]
pub struct PageAllocator {
    /// Reference count of each page, indexed by page id; 0 means free.
    refcounts: Vec<u32>,
    /// Free page ids, used as a stack: the lowest ids are handed out first after `new`,
    /// and the most recently freed page is reused first (its memory is likely warm).
    free: Vec<u32>,
}

impl PageAllocator {
    /// A pool of `num_pages` pages, all free.
    pub fn new(num_pages: u32) -> Self {
        Self {
            refcounts: vec![0; num_pages as usize],
            free: (0..num_pages).rev().collect(),
        }
    }

    /// Allocates `n` pages, each with reference count 1, all or nothing.
    ///
    /// Fails with [`PagesError::OutOfPages`] (allocating nothing) when fewer than `n` pages
    /// are free; the caller then evicts from the radix tree and retries.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<u32>, PagesError> {
        if n > self.free.len() {
            return Err(PagesError::OutOfPages {
                needed: n,
                free: self.free.len(),
            });
        }
        let pages = self.free.split_off(self.free.len() - n);
        for &p in &pages {
            debug_assert_eq!(self.refcounts[p as usize], 0, "free page {p} had holders");
            self.refcounts[p as usize] = 1;
        }
        Ok(pages)
    }

    /// Adds one holder to each page (a page listed twice gains two).
    ///
    /// Every page must be in use: retaining a free page is a bug (debug assertion; ignored
    /// with an error log in release builds).
    pub fn retain(&mut self, pages: &[u32]) {
        for &p in pages {
            match self.refcounts.get_mut(p as usize) {
                Some(rc) if *rc > 0 => *rc += 1,
                _ => {
                    debug_assert!(false, "retain of free or unknown page {p}");
                    tracing::error!(page = p, "retain of free or unknown KV page ignored");
                }
            }
        }
    }

    /// Drops one holder from each page (a page listed twice loses two) and returns how
    /// many pages became free.
    ///
    /// Releasing a free page (double free) is a bug (debug assertion; ignored with an
    /// error log in release builds).
    pub fn release(&mut self, pages: &[u32]) -> usize {
        let mut freed = 0;
        for &p in pages {
            match self.refcounts.get_mut(p as usize) {
                Some(rc) if *rc > 0 => {
                    *rc -= 1;
                    if *rc == 0 {
                        self.free.push(p);
                        freed += 1;
                    }
                }
                _ => {
                    debug_assert!(false, "double free of page {p}");
                    tracing::error!(page = p, "release of free or unknown KV page ignored");
                }
            }
        }
        freed
    }

    /// Number of free pages.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Number of pages in use (reference count > 0).
    pub fn used(&self) -> usize {
        self.refcounts.len() - self.free.len()
    }

    /// Total number of pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.refcounts.len()
    }

    /// Reference count of `page`; 0 for a free page or an id outside the pool.
    pub fn refcount(&self, page: u32) -> u32 {
        self.refcounts.get(page as usize).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_is_all_or_nothing() {
        let mut a = PageAllocator::new(4);
        let got = a.alloc(3).expect("3 of 4 pages are free");
        assert_eq!(got.len(), 3);
        assert_eq!(
            a.alloc(2),
            Err(PagesError::OutOfPages { needed: 2, free: 1 })
        );
        assert_eq!(a.free_count(), 1, "a failed alloc takes nothing");
        assert_eq!(a.used(), 3);
    }

    #[test]
    fn alloc_hands_out_distinct_pages_with_one_holder() {
        let mut a = PageAllocator::new(8);
        let mut got = a.alloc(5).expect("5 of 8 free");
        got.extend(a.alloc(3).expect("3 of 3 free"));
        let mut sorted = got.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..8).collect::<Vec<_>>());
        assert!(got.iter().all(|&p| a.refcount(p) == 1));
        assert_eq!(a.free_count(), 0);
    }

    #[test]
    fn page_is_free_only_after_last_holder_releases() {
        let mut a = PageAllocator::new(2);
        let p = a.alloc(1).expect("free");
        a.retain(&p);
        a.retain(&p);
        assert_eq!(a.refcount(p[0]), 3);
        assert_eq!(a.release(&p), 0);
        assert_eq!(a.release(&p), 0);
        assert_eq!(a.free_count(), 1);
        assert_eq!(a.release(&p), 1);
        assert_eq!(a.free_count(), 2);
        assert_eq!(a.refcount(p[0]), 0);
    }

    #[test]
    fn release_counts_pages_freed_in_one_call() {
        let mut a = PageAllocator::new(4);
        let p = a.alloc(4).expect("free");
        a.retain(&p[..1]);
        assert_eq!(a.release(&p), 3, "page 0 still has a holder");
        assert_eq!(a.release(&p[..1]), 1);
        assert_eq!(a.free_count(), 4);
    }

    #[test]
    fn freed_pages_are_reused() {
        let mut a = PageAllocator::new(2);
        let p = a.alloc(2).expect("free");
        a.release(&p[1..]);
        let q = a.alloc(1).expect("one page was freed");
        assert_eq!(q, vec![p[1]]);
    }

    #[test]
    #[should_panic(expected = "double free")]
    #[cfg(debug_assertions)]
    fn double_free_asserts_in_debug() {
        let mut a = PageAllocator::new(1);
        let p = a.alloc(1).expect("free");
        a.release(&p);
        a.release(&p);
    }

    #[test]
    #[should_panic(expected = "retain of free")]
    #[cfg(debug_assertions)]
    fn retain_of_free_page_asserts_in_debug() {
        let mut a = PageAllocator::new(1);
        a.retain(&[0]);
    }

    #[test]
    fn unknown_page_has_no_holders() {
        let a = PageAllocator::new(1);
        assert_eq!(a.refcount(7), 0);
        assert_eq!(a.num_pages(), 1);
    }
}
