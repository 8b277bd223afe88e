//! Allocator settings for the `caracal` binary.
//!
//! A forward pass allocates its activations afresh (a prefill chunk of 2,048
//! tokens holds buffers of several MiB each) and frees them at its end. With
//! glibc's defaults the large ones are `mmap`ed and unmapped every time (the
//! threshold adapts only up to the largest block freed so far) and the
//! arenas hand the top of their heaps back to the kernel as soon as 128 KiB
//! lie free there, so the next pass takes every page again as a zeroed page
//! fault: `perf stat -e page-faults` counted 134,000 faults (≈ 520 MiB of
//! fresh pages) for 8 prompts of 128 tokens and 184 decode steps of
//! SmolLM2 MXFP4. Keeping freed memory in the process instead bounds the
//! resident set by the largest pass's working set, as engines with a
//! preallocated workspace do.

/// Blocks up to this size come from the arenas, not from `mmap` (glibc's
/// largest allowed value on 64-bit). Larger ones (the KV pool, whole
/// tensors) are still mapped, and unmapped when freed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 32 << 20;

/// Free memory at a heap's top that stays with the process: above an
/// arena heap's 64 MiB, so thread arenas are never trimmed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: libc::c_int = 256 << 20;

/// Applies the settings above (glibc only; a no-op elsewhere). Call once,
/// first thing in `main`, before other threads allocate.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocator parameters; called
    // before the process starts other threads.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}
