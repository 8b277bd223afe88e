//! Splitting a weight-streaming product over the rayon pool by output rows.
//!
//! Every GEMV-style kernel here (bf16/f16/f32 in `gemm`, MXFP4, Q8_0) streams
//! each weight row once and writes the output columns of its own rows, so the
//! work splits into disjoint row ranges that write disjoint elements of `out`
//! through a shared [`OutPtr`].

use rayon::prelude::*;

/// A raw output pointer shared by tasks that write disjoint elements of one
/// buffer, which outlives the parallel region (it ends before the caller
/// returns).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every task writes only the output elements of its own weight rows.
unsafe impl Send for OutPtr {}
// SAFETY: as above; no element is read or written by two tasks.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// Runs `f(r0, r1)` over disjoint ranges covering `0..rows` on the rayon
/// pool: about four ranges per thread, each streaming at least
/// `min_task_bytes` of weights (`row_bytes` per row) when possible, since a
/// rayon task costs about a microsecond. One range (or one thread) runs in
/// place: waking a worker costs more than a small GEMV. Inside
/// [`crate::threads::serial`] the same ranges run in turn on the caller.
pub(crate) fn for_row_ranges(
    rows: usize,
    row_bytes: usize,
    min_task_bytes: usize,
    f: impl Fn(usize, usize) + Sync,
) {
    let threads = rayon::current_num_threads().max(1);
    let min_rows = (min_task_bytes / row_bytes.max(1)).max(1);
    let chunk = rows.div_ceil(threads * 4).max(min_rows);
    let tasks = rows.div_ceil(chunk);
    if tasks <= 1 || threads == 1 {
        return f(0, rows);
    }
    if crate::threads::is_serial() {
        // Same ranges, one after another: results do not change.
        return (0..tasks).for_each(|t| f(t * chunk, ((t + 1) * chunk).min(rows)));
    }
    (0..tasks)
        .into_par_iter()
        .for_each(|t| f(t * chunk, ((t + 1) * chunk).min(rows)));
}

#[cfg(test)]
mod tests {
    use super::for_row_ranges;
    use std::sync::Mutex;

    #[test]
    fn ranges_cover_every_row_once_in_order_per_range() {
        for (rows, row_bytes, min) in [
            (0, 10, 1),
            (1, 10, 1),
            (1000, 10, 1),
            (1000, 64, 4096),
            (7, 1, 1),
        ] {
            let seen = Mutex::new(vec![0u32; rows]);
            for_row_ranges(rows, row_bytes, min, |r0, r1| {
                assert!(r0 <= r1 && r1 <= rows);
                let mut s = seen.lock().unwrap();
                for r in r0..r1 {
                    s[r] += 1;
                }
            });
            assert!(
                seen.into_inner().unwrap().iter().all(|&c| c == 1),
                "rows {rows}"
            );
        }
    }
}
