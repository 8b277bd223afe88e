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
//!
//! [`serial`] runs a closure with the weight-streaming kernels (GEMV, MXFP4,
//! Q8_0 and the widened-tile GEMM) kept on the calling thread. Grouped work
//! such as the routed experts of a MoE step spreads whole experts over the
//! pool and runs each one serially, instead of splitting every small expert
//! matmul over all threads in turn. The kernels cut their work into the same
//! pieces either way and only run them one after another, so results are
//! bit-identical with or without [`serial`].

use std::cell::Cell;

thread_local! {
    /// Depth of [`serial`] calls active on this thread.
    static SERIAL: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f` with the kernels it calls kept on this thread (see the module
/// docs). Nests; the setting ends with `f`, also when `f` panics.
pub fn serial<R>(f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            SERIAL.with(|s| s.set(s.get() - 1));
        }
    }
    SERIAL.with(|s| s.set(s.get() + 1));
    let _reset = Reset;
    f()
}

/// Whether the calling thread is inside [`serial`].
pub fn is_serial() -> bool {
    SERIAL.with(|s| s.get() > 0)
}

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
    fn serial_nests_and_resets() {
        assert!(!super::is_serial());
        let inner = super::serial(|| super::serial(super::is_serial) && super::is_serial());
        assert!(inner);
        assert!(!super::is_serial());
        let r = std::panic::catch_unwind(|| super::serial(|| panic!("boom")));
        assert!(r.is_err());
        assert!(!super::is_serial(), "a panic ends the serial section");
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
