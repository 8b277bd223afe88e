//! Running model steps on the rayon pool.
//!
//! Every kernel parallelises with rayon. A parallel call made from a thread
//! outside the pool (the CLI's main thread, the scheduler's actor thread)
//! injects a job and blocks on a latch until a worker picks it up and finishes:
//! a round trip of tens of microseconds, paid by each of the few hundred
//! kernel calls in one decode step of a small model. A call made from a
//! worker thread instead pushes onto that worker's own deque and keeps
//! working. [`on_pool`] moves a whole forward pass onto a worker, so the
//! round trip is paid once per step instead of once per kernel.

/// Runs `f` on a worker of the global rayon pool and returns its result.
/// From a thread that already is a worker, `f` runs in place (that is what
/// `rayon::scope` does with its closure).
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

#[cfg(test)]
mod tests {
    use super::on_pool;

    #[test]
    fn on_pool_runs_the_closure_on_a_worker_and_returns_its_value() {
        let (value, on_worker) = on_pool(|| (41 + 1, rayon::current_thread_index().is_some()));
        assert_eq!(value, 42);
        assert!(on_worker, "the closure must run on a pool worker");
    }

    #[test]
    fn on_pool_nests_in_place() {
        let outer = on_pool(|| {
            let me = rayon::current_thread_index();
            on_pool(|| rayon::current_thread_index() == me)
        });
        assert!(outer, "a nested call runs on the same worker");
    }
}
