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

/// Bytes of a transparent huge page on x86-64 and arm64 (4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Smallest mapping [`huge_pages_for_resident_memory`] advises: the heap,
/// the allocator's 64 MiB arenas and large mapped buffers are bigger; thread
/// stacks (2 MiB each), which huge pages would make wholly resident, are not.
const MIN_MAPPING: usize = 8 << 20;

/// What [`huge_pages_for_resident_memory`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HugePages {
    /// Bytes advised as huge-page memory (`MADV_HUGEPAGE`).
    pub advised: usize,
    /// Bytes of those now backed by huge pages (`MADV_COLLAPSE` succeeded).
    pub collapsed: usize,
}

/// Backs the process's anonymous memory — the allocator's heap and arenas,
/// where a loaded model's weights (repacked panels, routed experts) live —
/// with 2 MiB transparent huge pages: `MADV_HUGEPAGE` on every private
/// read-write anonymous mapping of at least [`MIN_MAPPING`] (its 2 MiB-aligned
/// part), so later faults there take huge pages, then `MADV_COLLAPSE` to move
/// what is resident now.
///
/// Why: with 4 KiB pages a decode step's TLB covers 8 MiB (2,048 entries)
/// of the weights it streams, and a sparse model's routed experts are read
/// at scattered addresses, so most of their pages miss the TLB. SmolLM2
/// MXFP4's single-sequence tg128 went 285 → 321 tok/s with huge-page
/// weights; the K3-shaped models measured the same within the noise
/// (README, Performance; `bench/HISTORY.md` once it moves). Call once the
/// weights are loaded. Linux only (a no-op elsewhere); kernels without
/// `MADV_COLLAPSE` (before 6.1), or a machine whose THP setting is `never`,
/// keep 4 KiB pages and report less. `CARACAL_HUGE_PAGES=0` skips it, for comparisons.
pub fn huge_pages_for_resident_memory() -> HugePages {
    let mut done = HugePages::default();
    if std::env::var("CARACAL_HUGE_PAGES").is_ok_and(|v| v == "0") {
        return done;
    }
    #[cfg(target_os = "linux")]
    {
        let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
            return done;
        };
        for (start, end) in maps
            .lines()
            .filter_map(anonymous_rw)
            .filter(|(a, b)| b - a >= MIN_MAPPING)
        {
            let (a, b) = (
                start.next_multiple_of(HUGE_PAGE),
                end / HUGE_PAGE * HUGE_PAGE,
            );
            if b <= a {
                continue;
            }
            let (ptr, len) = (a as *mut libc::c_void, b - a);
            // SAFETY: advice on whole pages of a mapping this process owns;
            // neither call changes the memory's contents.
            if unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) } == 0 {
                done.advised += len;
                // SAFETY: as above.
                if unsafe { libc::madvise(ptr, len, MADV_COLLAPSE) } == 0 {
                    done.collapsed += len;
                }
            }
        }
    }
    done
}

/// `MADV_COLLAPSE` (Linux 6.1), which the `libc` crate does not name on
/// every target.
#[cfg(target_os = "linux")]
const MADV_COLLAPSE: libc::c_int = 25;

/// `(start, end)` of a `/proc/self/maps` line that is a private, read-write,
/// anonymous mapping (no file; `[heap]` included, the stack and vdso not).
fn anonymous_rw(line: &str) -> Option<(usize, usize)> {
    let mut f = line.split_whitespace();
    let range = f.next()?;
    let perms = f.next()?;
    let (_offset, _dev, inode) = (f.next()?, f.next()?, f.next()?);
    let path = f.next().unwrap_or("");
    if perms != "rw-p" || inode != "0" || !(path.is_empty() || path == "[heap]") {
        return None;
    }
    let (a, b) = range.split_once('-')?;
    Some((
        usize::from_str_radix(a, 16).ok()?,
        usize::from_str_radix(b, 16).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_private_anonymous_rw_mappings_are_taken() {
        let lines = [
            (
                "7f0000000000-7f0004000000 rw-p 00000000 00:00 0 ",
                Some((0x7f00_0000_0000, 0x7f00_0400_0000)),
            ),
            (
                "55d0c0000000-55d0c8000000 rw-p 00000000 00:00 0                          [heap]",
                Some((0x55d0_c000_0000, 0x55d0_c800_0000)),
            ),
            ("7f0000000000-7f0004000000 r--p 00000000 00:00 0 ", None),
            (
                "7f0000000000-7f0004000000 rw-s 00000000 00:05 1234 /dev/shm/x",
                None,
            ),
            (
                "7f1000000000-7f1040000000 rw-p 00001000 08:01 5678 /models/model.safetensors",
                None,
            ),
            (
                "7ffd0000000-7ffd0021000 rw-p 00000000 00:00 0                          [stack]",
                None,
            ),
        ];
        for (line, want) in lines {
            assert_eq!(anonymous_rw(line), want, "{line}");
        }
    }

    #[test]
    fn a_large_buffer_is_advised_and_keeps_its_contents() {
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled");
        if !thp.exists() || std::env::var("CARACAL_HUGE_PAGES").is_ok_and(|v| v == "0") {
            eprintln!("skipped: no transparent huge pages here, or CARACAL_HUGE_PAGES=0");
            return;
        }
        let v: Vec<u64> = (0..(16 << 20) / 8).collect();
        let done = huge_pages_for_resident_memory();
        // A 16 MiB buffer spans at least 7 whole huge pages of its mapping.
        assert!(done.advised >= 7 * HUGE_PAGE, "{done:?}");
        assert!(done.collapsed <= done.advised);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64));
    }
}
