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
//! Inside a step the other workers would still fall asleep between kernels
//! (a decode step of a small model is a few hundred parallel calls of tens of
//! microseconds each) and every call would pay a futex wake-up for them. So
//! [`on_pool`] also keeps the other workers of the pool spinning for the
//! length of `f`: each runs a helper that takes pending pool work
//! (`rayon::yield_now`) until `f` returns, as llama.cpp's threads spin on a
//! barrier between operators. Between steps the workers sleep as usual. A
//! helper that lands on the thread running `f` (or on a thread that already
//! spins) returns at once, so no helper can wait on the work it sits under.
//!
//! [`serial`] runs a closure with the weight-streaming kernels (GEMV, MXFP4,
//! Q8_0 and the widened-tile GEMM) kept on the calling thread. Grouped work
//! such as the routed experts of a MoE step spreads whole experts over the
//! pool and runs each one serially, instead of splitting every small expert
//! matmul over all threads in turn. The kernels cut their work into the same
//! pieces either way and only run them one after another, so results are
//! bit-identical with or without [`serial`].

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

thread_local! {
    /// Depth of [`serial`] calls active on this thread.
    static SERIAL: Cell<u32> = const { Cell::new(0) };
    /// Whether this thread runs an [`on_pool`] helper (or the closure of one).
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` on this thread's value in `key`, taken out for the call (a
/// nested call on the same thread gets a fresh one; a panic in `f` drops it).
pub(crate) fn with_local<T: Default, R>(
    key: &'static std::thread::LocalKey<std::cell::Cell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    key.with(|c| {
        let mut v = c.take();
        let r = f(&mut v);
        c.set(v);
        r
    })
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

/// Runs `f` on a worker of the global rayon pool and returns its result,
/// with the pool's other workers spinning for pool work until `f` returns
/// (see the module docs). From a thread that already is a worker, `f` runs in
/// place (that is what `rayon::scope` does with its closure); a nested call
/// adds no helpers.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| {
        if BUSY.with(Cell::get) {
            return f();
        }
        // Helpers are detached (`rayon::spawn`, not the scope's): one that picked up
        // unrelated pool work (say a vision encode injected from another thread)
        // finishes it on its own time instead of holding up the return of `f`.
        let done = Arc::new(AtomicBool::new(false));
        for _ in 1..rayon::current_num_threads() {
            let done = Arc::clone(&done);
            rayon::spawn(move || spin_until(&done));
        }
        struct Stop(Arc<AtomicBool>);
        impl Drop for Stop {
            fn drop(&mut self) {
                // Also when `f` panics: the helpers stop and the thread is free again.
                self.0.store(true, Ordering::Release);
                BUSY.with(|b| b.set(false));
            }
        }
        BUSY.with(|b| b.set(true));
        let _stop = Stop(done);
        f()
    })
}

/// Idle polls of an [`on_pool`] helper between two `sched_yield`s: a few tens
/// of microseconds of spinning, so a helper that shares its core with
/// another runnable thread (more pool threads than cores, a busy machine)
/// hands the core over instead of burning its whole time slice, while a
/// helper on a core of its own pays one cheap syscall now and then.
/// Default 256.
const SPINS_PER_YIELD: u32 = 256;

/// An [`on_pool`] helper: runs pending pool work until `done`. Returns at once
/// on a thread that is already busy with the closure or another helper.
fn spin_until(done: &AtomicBool) {
    if BUSY.with(Cell::get) {
        return;
    }
    BUSY.with(|b| b.set(true));
    let mut idle = 0u32;
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle = 0;
            continue;
        }
        idle += 1;
        if idle.is_multiple_of(SPINS_PER_YIELD) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    BUSY.with(|b| b.set(false));
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
    fn on_pool_helpers_take_the_work_and_stop_with_the_closure() {
        use rayon::prelude::*;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        pool.install(|| {
            for round in 0..200u64 {
                // Many short parallel calls, as in a decode step; the helpers run pieces.
                let sum = on_pool(|| {
                    (0..50u64)
                        .map(|i| {
                            (0..64u64)
                                .into_par_iter()
                                .map(|j| i * j + round)
                                .sum::<u64>()
                        })
                        .sum::<u64>()
                });
                let want: u64 = (0..50u64)
                    .map(|i| (0..64u64).map(|j| i * j + round).sum::<u64>())
                    .sum();
                assert_eq!(sum, want);
            }
        });
    }

    #[test]
    fn a_panicking_closure_stops_the_helpers() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let r = pool.install(|| std::panic::catch_unwind(|| on_pool(|| panic!("boom"))));
        assert!(r.is_err(), "the panic reaches the caller");
        // The pool is still usable and its helpers are not stuck spinning.
        assert_eq!(pool.install(|| on_pool(|| 7)), 7);
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
