//! GPU GEMV bench: `out[n, rows] = x · Wᵀ` with weights on the device in
//! their stored dtype (BF16, Q8_0, MXFP4), batches n = 1 and n = 8.
//!
//! For each dtype and shape it prints µs per call (CUDA events around
//! `CALLS` back-to-back launches after `WARMUP` calls, and wall time with a
//! stream sync around the same loop), the effective bandwidth in weight bytes
//! (data + scales) per second, and max |gpu − cpu| of one call against
//! `Matrix::matmul` (f32 activation mode). Every call reads its weights from
//! HBM, not L2: the loop rotates through enough uploaded copies of the matrix
//! (≥ `ROTATE_BYTES`) that none is still cached when it comes round again.
//! Besides the automatic launch plan it times every rows-per-warp choice,
//! with staged and direct activations (`rt1` … `rt4dx`, effective GB/s), to guide
//! the defaults.
//!
//! Run: `cargo run --release -p caracal-kernels --features cuda --example cuda_gemv_bench`.
//! Without a device (or without the `cuda` feature) it prints a `SKIPPED:`
//! line and exits 0.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!(
        "SKIPPED: no CUDA device (built without the `cuda` feature; \
         rebuild with `--features cuda`)"
    );
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = bench::run() {
        eprintln!("cuda_gemv_bench failed: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod bench {
    use std::error::Error;
    use std::sync::Arc;
    use std::time::Instant;

    use caracal_kernels::cuda::{CudaDevice, CudaError, DeviceMatrix};
    use caracal_kernels::dtype::f32_to_bf16;
    use caracal_kernels::testing::values;
    use caracal_kernels::{DType, Matrix};
    use cudarc::driver::{sys::CUevent_flags, CudaSlice};

    /// Timed calls per measurement.
    const CALLS: usize = 200;
    /// Untimed calls before each measurement.
    const WARMUP: usize = 20;
    /// Weight bytes the timed loop rotates through (H200 L2 is 50 MB).
    const ROTATE_BYTES: usize = 256 << 20;

    /// A `[rows, cols]` weight of `dtype` with values ≈ ±0.05.
    fn weight(dtype: DType, rows: usize, cols: usize) -> Result<Matrix, Box<dyn Error>> {
        let w: Vec<f32> = values(rows as u64 * 31 + cols as u64, rows * cols)
            .into_iter()
            .map(|v| v * 0.05)
            .collect();
        Ok(match dtype {
            DType::BF16 => {
                let bits: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
                Matrix::from_bf16(rows, cols, &bits)
            }
            DType::Mxfp4 => Matrix::quantize_mxfp4(rows, cols, &w)?,
            DType::Q8_0 => Matrix::from_f32(rows, cols, &w).to_q8_0()?,
            DType::F32 | DType::F16 => return Err(format!("no GPU kernel for {dtype}").into()),
        })
    }

    /// Mean µs per call of `CALLS` calls cycling over `copies`: from CUDA
    /// events (`None` if the driver refuses them) and from wall time around
    /// the loop with a stream sync.
    fn time_calls(
        dev: &Arc<CudaDevice>,
        copies: &[DeviceMatrix],
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(Option<f64>, f64), Box<dyn Error>> {
        for i in 0..WARMUP {
            copies[i % copies.len()].matmul_device(x, n, y)?;
        }
        dev.synchronize()?;
        let ctx = dev.context();
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let events = ctx
            .new_event(flags)
            .and_then(|start| ctx.new_event(flags).map(|end| (start, end)))
            .ok();
        let wall = Instant::now();
        let started = events
            .as_ref()
            .is_some_and(|(start, _)| start.record(dev.stream()).is_ok());
        for i in 0..CALLS {
            copies[i % copies.len()].matmul_device(x, n, y)?;
        }
        let ended = events
            .as_ref()
            .is_some_and(|(_, end)| end.record(dev.stream()).is_ok());
        dev.synchronize()?;
        let wall_us = wall.elapsed().as_secs_f64() * 1e6 / CALLS as f64;
        let event_us = match &events {
            Some((start, end)) if started && ended => start
                .elapsed_ms(end)
                .ok()
                .map(|ms| ms as f64 * 1e3 / CALLS as f64),
            _ => None,
        };
        Ok((event_us, wall_us))
    }

    /// Benches one dtype and shape at n = 1 and n = 8.
    fn bench_case(
        dev: &Arc<CudaDevice>,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<(), Box<dyn Error>> {
        let m = weight(dtype, rows, cols)?;
        let bytes = m.nbytes();
        let ncopies = ROTATE_BYTES.div_ceil(bytes).max(2);
        let mut copies = (0..ncopies)
            .map(|_| DeviceMatrix::upload(dev, &m))
            .collect::<Result<Vec<_>, _>>()?;
        for n in [1usize, 8] {
            let x = values(n as u64 + 5, n * cols);
            let xd = dev.upload(&x)?;
            let mut yd = dev.zeros::<f32>(n * rows)?;
            // Accuracy of one call against the CPU path.
            copies[0].matmul_device(&xd, n, &mut yd)?;
            let gpu = dev.download(&yd)?;
            let cpu = m.forward(&x);
            let max_err = gpu
                .iter()
                .zip(&cpu)
                .map(|(g, c)| (g - c).abs())
                .fold(0.0f32, f32::max);
            let (ev, wall) = time_calls(dev, &copies, &xd, n, &mut yd)?;
            let plan = copies[0].plan(n)?;
            let us = ev.unwrap_or(wall);
            let ev_text = ev.map_or("n/a".to_string(), |v| format!("{v:.2}"));
            let mut line = format!(
                "{dtype:>5} [{rows:>5} x {cols:>5}] n={n}: {ev_text:>8} us/call (events), \
                 {wall:8.2} us (wall), {:7.1} GB/s, max|gpu-cpu| {max_err:.2e}, \
                 auto rt{}{} grid {}; GB/s by kernel:",
                bytes as f64 / (us * 1e3),
                plan.rows_per_warp,
                if plan.direct_x { "dx" } else { "" },
                plan.grid
            );
            for dx in [false, true] {
                for rt in [1, 2, 4] {
                    for c in copies.iter_mut() {
                        c.set_rows_per_warp(Some(rt))?;
                        c.set_direct_x(Some(dx));
                    }
                    let (ev_rt, wall_rt) = time_calls(dev, &copies, &xd, n, &mut yd)?;
                    let tag = if dx { "dx" } else { "" };
                    line.push_str(&format!(
                        " | rt{rt}{tag} {:6.1}",
                        bytes as f64 / (ev_rt.unwrap_or(wall_rt) * 1e3)
                    ));
                }
            }
            for c in copies.iter_mut() {
                c.set_rows_per_warp(None)?;
                c.set_direct_x(None);
            }
            println!("{line}");
        }
        Ok(())
    }

    /// Opens the device (or prints the skip line) and runs every case.
    pub fn run() -> Result<(), Box<dyn Error>> {
        let t = Instant::now();
        let dev = match CudaDevice::open(0) {
            Ok(d) => d,
            Err(CudaError::Unavailable(why)) => {
                println!("SKIPPED: no CUDA device ({why})");
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        };
        println!(
            "{} (sm_{}{}, {} SMs); device open + NVRTC compile {:.2} s; {CALLS} calls per \
             figure after {WARMUP} warm-up, rotating over >= {} MB of weight copies",
            dev.name(),
            dev.compute_capability().0,
            dev.compute_capability().1,
            dev.sm_count(),
            t.elapsed().as_secs_f64(),
            ROTATE_BYTES >> 20
        );
        let shapes = [(4096, 4096), (14336, 4096), (4096, 14336)];
        for dtype in [DType::BF16, DType::Q8_0, DType::Mxfp4] {
            for &(rows, cols) in &shapes {
                bench_case(&dev, dtype, rows, cols)?;
            }
        }
        // A Kimi K3 routed expert's gate/up half: [3072, 7168] MXFP4.
        bench_case(&dev, DType::Mxfp4, 3072, 7168)?;
        Ok(())
    }
}
