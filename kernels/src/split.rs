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
/// place: waking a worker costs more than a small GEMV. More ranges than
/// threads come in whole rounds (a multiple of the thread count), so equal
/// ranges give every thread the same share: 5 ranges on 2 threads left one
/// idle for a fifth of the product (a decode batch's q/k/v and o
/// projections). Inside [`crate::threads::serial`] the same ranges run in
/// turn on the caller.
pub(crate) fn for_row_ranges(
    rows: usize,
    row_bytes: usize,
    min_task_bytes: usize,
    f: impl Fn(usize, usize) + Sync,
) {
    let threads = rayon::current_num_threads().max(1);
    let (chunk, tasks) = ranges(rows, row_bytes, min_task_bytes, threads);
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

/// `(rows per range, ranges)` of [`for_row_ranges`] on `threads` threads.
fn ranges(rows: usize, row_bytes: usize, min_task_bytes: usize, threads: usize) -> (usize, usize) {
    let min_rows = (min_task_bytes / row_bytes.max(1)).max(1);
    let chunk = rows.div_ceil(threads * 4).max(min_rows).max(1);
    let tasks = rows.div_ceil(chunk);
    if tasks <= threads || tasks.is_multiple_of(threads) {
        return (chunk, tasks);
    }
    let chunk = rows.div_ceil(tasks.next_multiple_of(threads));
    (chunk, rows.div_ceil(chunk))
}

#[cfg(test)]
mod tests {
    use super::{for_row_ranges, ranges};

    #[test]
    fn more_ranges_than_threads_come_in_whole_rounds() {
        // A decode batch of 8 on 2 threads: q/k/v (60 panels) and o (36)
        // gave 5 and 3 ranges before.
        let panel = 16 * 576 * 8;
        assert_eq!(ranges(60, panel, 1 << 20, 2), (10, 6));
        assert_eq!(ranges(36, panel, 1 << 20, 2), (9, 4));
        // Already whole rounds, a single range, or fewer ranges than
        // threads: unchanged.
        assert_eq!(ranges(192, panel, 1 << 20, 2), (24, 8));
        assert_eq!(ranges(60, 16 * 576, 1 << 20, 2), (113, 1));
        assert_eq!(ranges(3, 1, 1, 8), (1, 3));
        for threads in 1..=6 {
            for rows in 1..400 {
                let (chunk, tasks) = ranges(rows, 64, 4096, threads);
                let what = format!("rows {rows}, threads {threads}: {tasks} x {chunk}");
                // `tasks` ranges of `chunk` rows (the last one shorter) cover the rows.
                assert!(
                    chunk >= 1 && (tasks - 1) * chunk < rows && tasks * chunk >= rows,
                    "{what}"
                );
                assert!(tasks <= threads || tasks.is_multiple_of(threads), "{what}");
            }
        }
    }
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
