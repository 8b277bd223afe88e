//! What the `fuzz_*` tests share: the proptest settings of a default run,
//! the long run behind `#[ignore]` (`FUZZ_SECS`), and a watchdog that turns
//! a hang into a failure naming the input.
//!
//! Default runs use few cases (`FUZZ_CASES`, else each test's own count) so
//! that every `fuzz_*` file finishes in seconds in a debug build. The long
//! run loops the same properties with fresh random seeds until `FUZZ_SECS`
//! seconds (default 60) have passed and prints how many inputs it executed:
//!
//! ```text
//! FUZZ_SECS=600 cargo test --release --test fuzz_toolcall -- --ignored --nocapture
//! ```

#![allow(dead_code)]

pub mod files;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// Settings of a default run: `cases` inputs (or `FUZZ_CASES`), no
/// regression files written into the source tree (a finding becomes a named
/// test instead), few shrink steps.
pub fn config(cases: u32) -> Config {
    let cases = std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 2_000,
        ..Config::default()
    }
}

/// Seconds a long run lasts: `FUZZ_SECS`, default 60.
pub fn soak_secs() -> u64 {
    std::env::var("FUZZ_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60)
}

/// Loops `test` over inputs of `strategy` until [`soak_secs`] have passed,
/// failing (with the shrunk input) on the first property violation or
/// panic; prints the executions. Each round is a fresh runner with a fresh
/// random seed.
pub fn soak<S: Strategy>(
    name: &str,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    let secs = soak_secs();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let execs = AtomicU64::new(0);
    let mut rounds = 0u64;
    while Instant::now() < deadline {
        let mut runner = TestRunner::new(Config {
            cases: 256,
            failure_persistence: None,
            max_shrink_iters: 10_000,
            ..Config::default()
        });
        let result = runner.run(&strategy, |v| {
            execs.fetch_add(1, Ordering::Relaxed);
            test(v)
        });
        if let Err(e) = result {
            panic!("{name}: {e}");
        }
        rounds += 1;
    }
    println!(
        "{name}: {} executions in {secs} s ({rounds} rounds of 256 cases)",
        execs.load(Ordering::Relaxed)
    );
}

/// Fails the process when one input takes longer than its limit: the
/// properties must never hang, and a hung test would otherwise just sit.
pub struct Watchdog {
    /// The input being run (its Debug text) and when it started.
    current: Arc<Mutex<Option<(String, Instant)>>>,
}

impl Watchdog {
    /// A watchdog that aborts after `limit` on one input.
    pub fn new(what: &'static str, limit: Duration) -> Watchdog {
        let current: Arc<Mutex<Option<(String, Instant)>>> = Arc::new(Mutex::new(None));
        let watched = Arc::downgrade(&current);
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            let Some(cur) = watched.upgrade() else { return };
            let stuck = cur.lock().ok().and_then(|c| {
                c.as_ref()
                    .filter(|(_, t)| t.elapsed() > limit)
                    .map(|(i, _)| i.clone())
            });
            if let Some(input) = stuck {
                eprintln!("{what}: one input ran longer than {limit:?} (a hang): {input}");
                std::process::abort();
            }
        });
        Watchdog { current }
    }

    /// Runs `f` on `input` under the watchdog.
    pub fn run<T: std::fmt::Debug, R>(&self, input: &T, f: impl FnOnce() -> R) -> R {
        let mut text = format!("{input:?}");
        if text.len() > 4000 {
            let cut = (0..=4000)
                .rev()
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(0);
            text.truncate(cut);
            text.push('…');
        }
        if let Ok(mut c) = self.current.lock() {
            *c = Some((text, Instant::now()));
        }
        let r = f();
        if let Ok(mut c) = self.current.lock() {
            *c = None;
        }
        r
    }
}

/// Largest single allocation a `fuzz_*` input may cause: 1 GiB.
pub const ALLOC_LIMIT: usize = 1 << 30;

/// The system allocator, refusing any one allocation over [`ALLOC_LIMIT`]:
/// an input that makes the code under test allocate by a corrupt size
/// aborts the run ("memory allocation of N bytes failed") instead of
/// swapping the machine. Install with `#[global_allocator]`.
pub struct LimitAlloc;

// SAFETY: defers to `System`, only refusing some requests (a null return
// is how an allocator reports failure).
unsafe impl GlobalAlloc for LimitAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: as in `dealloc`; `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
