//! CPU feature detection, done once per process, for every kernel.
//!
//! Kernels come in up to three builds of one algorithm: portable Rust (the
//! only one off x86-64, and the test oracle of the others), AVX2 + FMA
//! (8 f32 lanes) and AVX-512F (16 f32 lanes). [`Isa`] names those builds;
//! [`Isa::best`] is the widest this CPU runs. A few kernels need one more
//! feature, read from [`features`]: the bf16/f16 GEMV's AVX2 build needs F16C
//! (`gemm` asks for it), and the int8 kernels of MXFP4 and Q8_0 need AVX-512
//! F, BW and VNNI together ([`Features::avx512_vnni`]).
//!
//! Detection runs on first use and is cached in a `OnceLock`; a kernel handed
//! an [`Isa`] may only run it when [`Isa::supported`] says so (the `unsafe`
//! calls into `#[target_feature]` code rely on that).

use std::sync::OnceLock;

/// The x86-64 features kernels branch on (all `false` off x86-64).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    /// AVX2 and FMA: the 8-lane f32 builds.
    pub avx2_fma: bool,
    /// F16C: the AVX2 build widens f16 weights with `vcvtph2ps`.
    pub f16c: bool,
    /// AVX-512F: the 16-lane f32 builds.
    pub avx512f: bool,
    /// AVX-512 F, BW and VNNI together: the int8 dot products of the MXFP4
    /// and Q8_0 kernels with int8 activations.
    pub avx512_vnni: bool,
    /// AVX-512 F, BW and BF16 together: `vdpbf16ps`, the bf16 pair dot
    /// products of attention over bf16 KV rows.
    pub avx512_bf16: bool,
    /// An AMD CPU (cpuid vendor `AuthenticAMD`): [`prefetch`] hints streamed
    /// weights non-temporally there.
    pub amd: bool,
}

impl Features {
    /// Asks the CPU.
    fn detect() -> Features {
        #[cfg(target_arch = "x86_64")]
        {
            Features {
                avx2_fma: is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
                f16c: is_x86_feature_detected!("f16c"),
                avx512f: is_x86_feature_detected!("avx512f"),
                avx512_vnni: is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni"),
                avx512_bf16: is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512bf16"),
                amd: {
                    // Leaf 0: the vendor string in ebx, edx, ecx.
                    let v = std::arch::x86_64::__cpuid(0);
                    [v.ebx, v.edx, v.ecx]
                        .iter()
                        .flat_map(|r| r.to_le_bytes())
                        .eq(*b"AuthenticAMD")
                },
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Features::default()
    }
}

/// The features of this CPU, detected on first call.
pub fn features() -> Features {
    static FEATURES: OnceLock<Features> = OnceLock::new();
    *FEATURES.get_or_init(Features::detect)
}

/// The instruction set one build of a kernel is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust, no explicit SIMD.
    Portable,
    /// AVX2 + FMA, 8 f32 lanes.
    Avx2,
    /// AVX-512F, 16 f32 lanes.
    Avx512,
}

impl Isa {
    /// Every instruction set, widest first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Portable];

    /// Whether this CPU runs builds of `self`.
    pub fn supported(self) -> bool {
        let f = features();
        match self {
            Isa::Portable => true,
            Isa::Avx2 => f.avx2_fma,
            Isa::Avx512 => f.avx512f,
        }
    }

    /// The widest instruction set this CPU runs.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .find(|i| i.supported())
            .expect("Portable is always supported")
    }

    /// f32 lanes of one vector (the portable builds use 8, like AVX2).
    pub fn lanes(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2 | Isa::Portable => 8,
        }
    }
}

/// Hints the first `len` bytes of `bytes` (at most), one prefetch per
/// 64-byte line: for weights about to be streamed from DRAM whose start the
/// hardware prefetcher would otherwise wait for (a MoE layer's routed
/// experts, a few tens of KiB each, chosen per token and read once).
///
/// On AMD CPUs the hints are non-temporal (`prefetchnta`): a routed expert
/// comes back only after dozens of tokens, and lines hinted into L2 leave
/// through L3 (a victim cache there) and evict the layers' dense weights.
/// `examples/k3_sparse_vs_dense` (896 experts, 5 MB of experts a token;
/// Zen 5, 2 threads), four interleaved rounds: sparse / all-active
/// 0.73–0.80 with L2 hints (`prefetcht1`, `prefetcht2` the same) →
/// 0.80–0.83 non-temporal, sparse decode 1,550–1,610 → 1,690–1,800 tok/s.
/// Elsewhere they go to L2 ([`prefetch_span`]). A hint: no effect on
/// results; nothing off x86-64.
pub fn prefetch(bytes: &[u8], len: usize) {
    let len = len.min(bytes.len());
    #[cfg(target_arch = "x86_64")]
    if features().amd {
        hint_lines::<{ std::arch::x86_64::_MM_HINT_NTA }>(bytes.as_ptr(), len);
        return;
    }
    prefetch_span(bytes.as_ptr(), len);
}

/// Hints every 64-byte line that `[p, p + bytes)` touches into L2: for data
/// about to be read from DRAM or L3 (a decode piece's KV rows, scattered page
/// by page; a routed expert's weights), issued ahead so the misses overlap.
/// An L1 hint holds one of the core's few L1 fill buffers until its line
/// arrives, so a burst of them (a block of keys' K and V rows is 64 lines)
/// stalled the kernel at the hint itself; L2 hints queue deeper, and the
/// loads that follow hit L2 (the 8-sequence decode attention step 13–20%
/// faster at 128 keys, equal at 1,024). A hint: never faults, any address;
/// nothing off x86-64.
#[inline(always)]
pub(crate) fn prefetch_span(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    hint_lines::<{ std::arch::x86_64::_MM_HINT_T1 }>(p, bytes);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

/// One `prefetch` with hint `H` per 64-byte line of `[p, p + bytes)`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn hint_lines<const H: i32>(p: *const u8, bytes: usize) {
    let end = p as usize + bytes;
    let mut at = p as usize & !63;
    while at < end {
        // SAFETY: prefetching never faults, whatever the address.
        unsafe { std::arch::x86_64::_mm_prefetch::<H>(at as *const i8) };
        at += 64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_is_supported_and_no_wider_set_is() {
        let best = Isa::best();
        assert!(best.supported());
        let wider = Isa::ALL.iter().take_while(|&&i| i != best);
        assert!(wider.clone().all(|i| !i.supported()), "{best:?}");
        assert!(Isa::Portable.supported());
    }

    #[test]
    fn detection_agrees_with_the_standard_library() {
        let f = features();
        assert_eq!(f, features(), "detected once, same answer");
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(f.avx512f, is_x86_feature_detected!("avx512f"));
            assert_eq!(f.f16c, is_x86_feature_detected!("f16c"));
        }
        if f.avx512_vnni {
            assert!(f.avx512f);
        }
    }

    #[test]
    fn vendor_agrees_with_the_kernel() {
        // Linux names the cpuid vendor in /proc/cpuinfo; elsewhere nothing
        // to compare with.
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            return;
        };
        let Some(vendor) = info
            .lines()
            .find_map(|l| l.strip_prefix("vendor_id"))
            .and_then(|rest| rest.split(':').nth(1))
        else {
            return;
        };
        assert_eq!(features().amd, vendor.trim() == "AuthenticAMD", "{vendor}");
    }

    #[test]
    fn hints_read_nothing_out_of_range() {
        // A hint past the end or at a dangling start never faults.
        let v = vec![7u8; 1000];
        prefetch(&v, 1 << 20);
        prefetch(&v[..0], 64);
        prefetch_span(std::ptr::null(), 4096);
        assert_eq!(v.iter().map(|&b| b as usize).sum::<usize>(), 7000);
    }
}
