//! MXFP4 prefill: the panel GEMM ([`mxfp4::panel::Panels`]) against the
//! row-layout int8 kernel ([`mxfp4::matmul_mxfp4_q8`]) in one run, on the
//! projection shapes of SmolLM2-135M (hidden 576, MLP 1536, 3 KV heads of 64)
//! at 512 rows and at decode-batch sizes, on pools of 1 and 2 threads.
//!
//! Prints one line per (shape, rows, threads): GFLOP/s (2·rows·cols·n per
//! call) of each kernel, the median of `REPS` timed batches, and their
//! ratio. The machine may be shared: run it a few times and compare the
//! ratios, which are taken within one run.
//!
//! `cargo bench -p caracal-kernels --bench mxfp4_prefill [-- [sweep] N...]`
//! (optional row counts replace the default list; `sweep` adds the panel
//! GEMM's GFLOP/s per tile height for n ≥ 64).

use std::hint::black_box;
use std::time::Instant;

use caracal_kernels::mxfp4;
use caracal_kernels::mxfp4::panel::{PanelKernel, Panels};
use caracal_kernels::testing::values;

/// Timed batches per measurement (the median is reported).
const REPS: usize = 7;

/// Median seconds per call of `f`, each batch lasting at least ~40 ms.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    f();
    let once = t.elapsed().as_secs_f64().max(1e-7);
    let iters = ((0.04 / once) as usize).clamp(1, 10_000);
    let mut samples: Vec<f64> = (0..REPS)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() / iters as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[REPS / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sweep = args.iter().any(|a| a == "sweep");
    let args: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let ns = if args.is_empty() {
        vec![1, 2, 4, 8, 16, 64, 512]
    } else {
        args
    };
    // [out features × in features]: q/o, k/v, gate/up, down.
    let shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536)];
    println!(
        "{:>12} {:>5} {:>3} {:>12} {:>12} {:>7}",
        "shape", "rows", "thr", "rows GF/s", "panel GF/s", "ratio"
    );
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        pool.install(|| {
            for &(rows, cols) in &shapes {
                let w = values(1, rows * cols);
                let (blocks, scales) = mxfp4::quantize(&w, rows, cols).expect("cols is 32·k");
                let panels = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
                for &n in &ns {
                    let x = values(2, n * cols);
                    let mut out = vec![0.0f32; n * rows];
                    let flops = 2.0 * (rows * cols * n) as f64;
                    let old = time(|| {
                        mxfp4::matmul_mxfp4_q8(
                            black_box(&x),
                            n,
                            &blocks,
                            &scales,
                            rows,
                            cols,
                            &mut out,
                        )
                    });
                    let new = time(|| panels.matmul(black_box(&x), n, &mut out));
                    // The AMX build against the VNNI one it replaces, where both run.
                    let vnni = (PanelKernel::best() == PanelKernel::Amx).then(|| {
                        let k = PanelKernel::Avx512Vnni;
                        time(|| panels.matmul_with(k, black_box(&x), n, &mut out))
                    });
                    let sweep: Vec<String> = if sweep && n >= 64 {
                        [4, 6, 8, 10, 12]
                            .iter()
                            .map(|&mr| {
                                let t = time(|| {
                                    panels.matmul_tiled(
                                        PanelKernel::best(),
                                        mr,
                                        black_box(&x),
                                        n,
                                        &mut out,
                                    )
                                });
                                format!("mr{mr} {:.0}", flops / t / 1e9)
                            })
                            .collect()
                    } else {
                        Vec::new()
                    };
                    let vs_vnni = vnni.map_or(String::new(), |v| {
                        format!("vnni {:.1} GF/s, amx {:.2}x", flops / v / 1e9, v / new)
                    });
                    println!(
                        "{:>12} {:>5} {:>3} {:>12.1} {:>12.1} {:>6.2}x  {} {}",
                        format!("{rows}x{cols}"),
                        n,
                        threads,
                        flops / old / 1e9,
                        flops / new / 1e9,
                        old / new,
                        vs_vnni,
                        sweep.join(" ")
                    );
                }
            }
            cold_decode(threads);
        });
    }
}

/// Bytes of weight copies the cold-decode runs rotate through: above the
/// 480 MB L3 of the Xeon this runs on, so no call finds its weights in cache.
const COLD_BYTES: usize = 640_000_000;

/// Decode (n = 1, and a batch of 8) on a [4096 × 4096] weight streamed from
/// DRAM: enough copies ([`COLD_BYTES`]) rotate that no call finds its weights in cache. Prints
/// GB/s of weight bytes (17/32 per weight) of each kernel.
fn cold_decode(threads: usize) {
    let (rows, cols) = (4096, 4096);
    let w = values(1, rows * cols);
    let (blocks, scales) = mxfp4::quantize(&w, rows, cols).expect("cols is 32·k");
    let panels = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
    let bytes = (rows * cols * 17 / 32) as f64;
    let copies = (COLD_BYTES / bytes as usize).max(2);
    let rowl: Vec<(Vec<u8>, Vec<u8>)> = vec![(blocks, scales); copies];
    let pan: Vec<Panels> = vec![panels; copies];
    let x = values(2, cols);
    let mut out = vec![0.0f32; rows];
    let mut k = 0;
    let old = time(|| {
        k = (k + 1) % copies;
        let (b, s) = &rowl[k];
        mxfp4::matmul_mxfp4_q8(black_box(&x), 1, b, s, rows, cols, &mut out)
    });
    let new = time(|| {
        k = (k + 1) % copies;
        pan[k].matmul(black_box(&x), 1, &mut out)
    });
    println!(
        "{:>12} {:>5} {:>3} {:>9.1} GB/s {:>7.1} GB/s {:>6.2}x  (DRAM-cold decode)",
        "4096x4096",
        1,
        threads,
        bytes / old / 1e9,
        bytes / new / 1e9,
        old / new
    );
    // A decode batch of 8 rows on the same cold weights: the AMX tile against
    // the VNNI one, where both run.
    if PanelKernel::best() == PanelKernel::Amx {
        let n = 8;
        let x = values(3, n * cols);
        let mut out = vec![0.0f32; n * rows];
        let mut run = |kernel| {
            time(|| {
                k = (k + 1) % copies;
                pan[k].matmul_with(kernel, black_box(&x), n, &mut out)
            })
        };
        let vnni = run(PanelKernel::Avx512Vnni);
        let amx = run(PanelKernel::Amx);
        println!(
            "{:>12} {:>5} {:>3} vnni {:>5.1} GB/s, amx {:>5.1} GB/s {:>6.2}x  (DRAM-cold decode batch)",
            "4096x4096",
            n,
            threads,
            bytes / vnni / 1e9,
            bytes / amx / 1e9,
            vnni / amx
        );
    }
}
