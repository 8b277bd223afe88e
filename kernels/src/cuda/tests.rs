//! Tests of the CUDA path.
//!
//! Tests named `gpu_*` need a device: without one they print
//! `SKIPPED: no CUDA device (…)` and return (set `CARACAL_REQUIRE_CUDA=1` to
//! make that a failure). The others check host-side planning and validation
//! and always run.
//!
//! Reference: the CPU kernels that [`Matrix::matmul`] dispatches to in its
//! default f32-activation mode (`gemm::matmul_bf16`, `mxfp4::matmul_mxfp4`,
//! `q8::matmul_q8_0(.., Activations::F32)`), called directly so that no other
//! test changing the process-wide activation mode can affect them. That is
//! the exact product of the decoded weights up to f32 rounding.
//!
//! Tolerance: `|gpu − cpu| ≤ 1e-4 · (1 + |cpu|)` per output. Both sides form
//! the same f32 products and differ only in summation order; with the test
//! data (weights ≈ ±0.05, activations in [-1, 1), sums over ≤ 4096 terms of
//! magnitude ≤ 0.05) that order changes results by ~1e-6.

use std::sync::{Arc, OnceLock};

use super::gemv::{
    check_matrix, default_direct_x, default_rows_per_warp, plan, MAX_BATCH_PER_LAUNCH,
};
use super::{CudaDevice, CudaError, DeviceMatrix};
use crate::dtype::{f32_to_bf16, DType};
use crate::matrix::{Matrix, Storage};
use crate::q8::Activations;
use crate::testing::values;

/// Shapes `(rows, cols)` every dtype is checked at.
const SHAPES: [(usize, usize); 5] = [(1, 32), (33, 96), (4096, 4096), (1536, 576), (11008, 4096)];
/// Batch sizes every shape is checked at (16 runs as two launches of 8).
const BATCHES: [usize; 3] = [1, 3, 16];

/// The process-wide device, opened (and its kernels compiled) once; `None`
/// after printing the skip line when this machine has no usable CUDA.
fn device(test: &str) -> Option<Arc<CudaDevice>> {
    static DEVICE: OnceLock<Result<Arc<CudaDevice>, (bool, String)>> = OnceLock::new();
    let opened = DEVICE.get_or_init(|| match CudaDevice::open(0) {
        Ok(d) => Ok(d),
        Err(CudaError::Unavailable(why)) => Err((true, why)),
        Err(e) => Err((false, e.to_string())),
    });
    match opened {
        Ok(d) => Some(d.clone()),
        Err((true, why)) => {
            if std::env::var("CARACAL_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
                panic!("{test}: CARACAL_REQUIRE_CUDA=1 but no CUDA device ({why})");
            }
            println!("SKIPPED: no CUDA device ({why}) [{test}]");
            None
        }
        Err((false, e)) => panic!("{test}: opening the CUDA device failed: {e}"),
    }
}

/// A `[rows, cols]` weight of `dtype` with values ≈ ±0.05, like a real layer.
fn weight(dtype: DType, rows: usize, cols: usize, seed: u64) -> Matrix {
    let w: Vec<f32> = values(seed, rows * cols)
        .into_iter()
        .map(|v| v * 0.05)
        .collect();
    match dtype {
        DType::BF16 => {
            let bits: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
            Matrix::from_bf16(rows, cols, &bits)
        }
        DType::Mxfp4 => Matrix::quantize_mxfp4(rows, cols, &w).expect("cols is a multiple of 32"),
        DType::Q8_0 => Matrix::from_f32(rows, cols, &w)
            .to_q8_0()
            .expect("cols is a multiple of 32"),
        DType::F32 | DType::F16 => unreachable!("no GPU kernel for {dtype}"),
    }
}

/// `x · Wᵀ` on the CPU, as `Matrix::matmul` computes it with f32 activations.
fn cpu_reference(m: &Matrix, x: &[f32]) -> Vec<f32> {
    let n = x.len() / m.cols;
    let mut out = vec![0.0; n * m.rows];
    let (data, scales) = m.row_bytes();
    let scales = scales.unwrap_or_default();
    match m.dtype {
        DType::BF16 => {
            let bits: Vec<u16> = data
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            crate::gemm::matmul_bf16(x, n, &bits, m.rows, m.cols, &mut out)
        }
        DType::Mxfp4 => crate::mxfp4::matmul_mxfp4(x, n, &data, &scales, m.rows, m.cols, &mut out),
        DType::Q8_0 => {
            let q: Vec<i8> = data.iter().map(|&b| b as i8).collect();
            let d: Vec<f32> = scales
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            crate::q8::matmul_q8_0(x, n, &q, &d, m.rows, m.cols, &mut out, Activations::F32)
        }
        DType::F32 | DType::F16 => unreachable!("no GPU kernel for {}", m.dtype),
    }
    out
}

/// Largest `|gpu − cpu|`, after asserting the stated tolerance everywhere.
fn assert_close(what: &str, gpu: &[f32], cpu: &[f32]) -> f32 {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths differ");
    let mut max = 0.0f32;
    for (i, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        let err = (g - c).abs();
        assert!(
            err <= 1e-4 * (1.0 + c.abs()),
            "{what}: output {i}: gpu {g} vs cpu {c} (|diff| {err})"
        );
        max = max.max(err);
    }
    max
}

/// Checks one dtype at every shape and batch size.
fn check_dtype_against_cpu(dtype: DType, test: &str) {
    let Some(dev) = device(test) else { return };
    for (s, &(rows, cols)) in SHAPES.iter().enumerate() {
        let m = weight(dtype, rows, cols, 1000 + s as u64);
        let dm = DeviceMatrix::upload(&dev, &m).expect("upload");
        // An int8 MXFP4 matrix holds panels; its upload unpacks them.
        let from_panels = (dtype == DType::Mxfp4).then(|| {
            let m8 = m.clone().with_activations(Activations::Int8);
            DeviceMatrix::upload(&dev, &m8).expect("upload from panels")
        });
        for &n in &BATCHES {
            let x = values(7 * n as u64 + s as u64, n * cols);
            let mut gpu = vec![f32::NAN; n * rows];
            dm.matmul(&x, &mut gpu).expect("gpu matmul");
            let cpu = cpu_reference(&m, &x);
            let what = format!("{dtype} [{rows}, {cols}] n={n}");
            if let Some(dp) = &from_panels {
                let mut got = vec![f32::NAN; n * rows];
                dp.matmul(&x, &mut got).expect("gpu matmul");
                assert_eq!(got, gpu, "{what}: uploaded from panels");
            }
            let max = assert_close(&what, &gpu, &cpu);
            println!("{what}: max |gpu - cpu| = {max:e}");
        }
    }
}

#[test]
fn gpu_bf16_matmul_matches_cpu_for_every_shape_and_batch() {
    check_dtype_against_cpu(DType::BF16, "gpu_bf16");
}

#[test]
fn gpu_mxfp4_matmul_matches_cpu_for_every_shape_and_batch() {
    check_dtype_against_cpu(DType::Mxfp4, "gpu_mxfp4");
}

#[test]
fn gpu_q8_0_matmul_matches_cpu_for_every_shape_and_batch() {
    check_dtype_against_cpu(DType::Q8_0, "gpu_q8_0");
}

#[test]
fn gpu_mxfp4_nan_scale_makes_only_its_row_nan() {
    let Some(dev) = device("gpu_mxfp4_nan_scale") else {
        return;
    };
    let (rows, cols, n) = (40, 256, 3);
    let w = weight(DType::Mxfp4, rows, cols, 5);
    // Row 7, block 2 gets the E8M0 NaN scale.
    let (blocks, scales) = w.row_bytes();
    let mut scales = scales.expect("MXFP4 has scales").into_owned();
    scales[7 * (cols / 32) + 2] = crate::mxfp4::E8M0_NAN;
    let m = Matrix::mxfp4(
        rows,
        cols,
        Storage::from_bytes(&blocks),
        Storage::from_bytes(&scales),
    )
    .expect("valid layout");
    let dm = DeviceMatrix::upload(&dev, &m).expect("upload");
    let x = values(9, n * cols);
    let mut gpu = vec![0.0; n * rows];
    dm.matmul(&x, &mut gpu).expect("gpu matmul");
    let cpu = cpu_reference(&m, &x);
    for i in 0..n {
        for r in 0..rows {
            let (g, c) = (gpu[i * rows + r], cpu[i * rows + r]);
            if r == 7 {
                assert!(
                    g.is_nan() && c.is_nan(),
                    "row 7, batch {i}: gpu {g}, cpu {c}"
                );
            } else {
                assert!(
                    (g - c).abs() <= 1e-4 * (1.0 + c.abs()),
                    "row {r}: {g} vs {c}"
                );
            }
        }
    }
}

#[test]
fn gpu_every_rows_per_warp_and_activation_read_gives_the_same_result() {
    let Some(dev) = device("gpu_rows_per_warp") else {
        return;
    };
    let (rows, cols) = (100, 2080); // 2080 > one staged tile for n = 8 (1024 columns)
    for dtype in [DType::BF16, DType::Mxfp4, DType::Q8_0] {
        let m = weight(dtype, rows, cols, 11);
        for n in [1, 2, 5, 8, 9] {
            let x = values(13 + n as u64, n * cols);
            let cpu = cpu_reference(&m, &x);
            let mut dm = DeviceMatrix::upload(&dev, &m).expect("upload");
            for rt in [1, 2, 4] {
                dm.set_rows_per_warp(Some(rt))
                    .expect("1, 2 and 4 are valid");
                let mut plain = vec![f32::NAN; n * rows];
                dm.set_direct_x(Some(false));
                dm.matmul(&x, &mut plain).expect("gpu matmul");
                assert_close(&format!("{dtype} n={n} rt={rt}"), &plain, &cpu);
                // Staged or direct activations: the same products in the same order.
                let mut direct = vec![f32::NAN; n * rows];
                dm.set_direct_x(Some(true));
                dm.matmul(&x, &mut direct).expect("gpu matmul");
                let same = plain
                    .iter()
                    .zip(&direct)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{dtype} n={n} rt={rt}: direct activation reads changed the result"
                );
            }
        }
    }
}

#[test]
fn gpu_device_buffer_matmul_writes_into_a_view_and_leaves_the_rest() {
    let Some(dev) = device("gpu_device_buffer") else {
        return;
    };
    let (rows, cols, n) = (64, 512, 4);
    let m = weight(DType::Mxfp4, rows, cols, 17);
    let dm = DeviceMatrix::upload(&dev, &m).expect("upload");
    let x = values(19, n * cols);
    // x sits after 32 leading values, out after 64 sentinels and before 64 more.
    let mut x_host = vec![0.0; 32];
    x_host.extend_from_slice(&x);
    let xd = dev.upload(&x_host).expect("upload x");
    let mut out = dev
        .upload(&vec![-7.0f32; n * rows + 128])
        .expect("upload out");
    {
        let xv = xd.slice(32..);
        let mut ov = out.slice_mut(64..64 + n * rows);
        dm.matmul_device(&xv, n, &mut ov).expect("matmul_device");
    }
    let got = dev.download(&out).expect("download");
    assert!(got[..64]
        .iter()
        .chain(&got[64 + n * rows..])
        .all(|&v| v == -7.0));
    assert_close(
        "device buffers",
        &got[64..64 + n * rows],
        &cpu_reference(&m, &x),
    );
}

#[test]
fn gpu_matmul_rejects_buffers_of_the_wrong_size_and_accepts_an_empty_batch() {
    let Some(dev) = device("gpu_wrong_sizes") else {
        return;
    };
    let m = weight(DType::BF16, 8, 64, 23);
    let dm = DeviceMatrix::upload(&dev, &m).expect("upload");
    let mut out = vec![0.0; 8];
    assert!(matches!(
        dm.matmul(&[0.0; 63], &mut out),
        Err(CudaError::Shape { .. })
    ));
    assert!(matches!(
        dm.matmul(&[0.0; 64], &mut [0.0; 9]),
        Err(CudaError::Shape { .. })
    ));
    dm.matmul(&[], &mut []).expect("n = 0 is a no-op");
    let err = DeviceMatrix::upload(&dev, &Matrix::from_bf16(2, 48, &[0; 96])).unwrap_err();
    assert!(err.to_string().contains("multiple of 32"), "{err}");
}

#[test]
fn upload_check_rejects_cols_not_a_multiple_of_32_with_a_clear_message() {
    let bf16 = Matrix::from_bf16(3, 40, &[0; 120]);
    let err = check_matrix(&bf16).unwrap_err();
    assert!(err.to_string().contains("multiple of 32, got 40"), "{err}");
    // A hand-altered MXFP4 matrix (its shape is public) with 48 columns.
    let mut mx = Matrix::quantize_mxfp4(2, 64, &[0.0; 128]).expect("valid shape");
    mx.cols = 48;
    assert!(check_matrix(&mx)
        .unwrap_err()
        .to_string()
        .contains("multiple of 32, got 48"));
}

#[test]
fn upload_check_rejects_unsupported_dtypes_and_inconsistent_buffers() {
    let f32m = Matrix::from_f32(2, 32, &[0.0; 64]);
    assert!(matches!(check_matrix(&f32m), Err(CudaError::DType { .. })));
    let mut q8 = weight(DType::Q8_0, 2, 64, 3);
    assert!(check_matrix(&q8).is_ok());
    q8.rows = 3; // its buffers hold 2 rows
    assert!(matches!(check_matrix(&q8), Err(CudaError::Shape { .. })));
    assert!(check_matrix(&weight(DType::Mxfp4, 3, 96, 4)).is_ok());
    // An int8 MXFP4 matrix holds panels; the check and the upload unpack them.
    let mut mx8 = weight(DType::Mxfp4, 3, 96, 4).with_activations(Activations::Int8);
    assert!(mx8.panels().is_some() && check_matrix(&mx8).is_ok());
    mx8.rows = 4;
    assert!(matches!(check_matrix(&mx8), Err(CudaError::Shape { .. })));
    assert!(check_matrix(&weight(DType::BF16, 3, 96, 4)).is_ok());
}

#[test]
fn plan_covers_every_row_and_fits_in_shared_memory() {
    for dtype in [DType::BF16, DType::Mxfp4, DType::Q8_0] {
        for &(rows, cols) in SHAPES
            .iter()
            .chain(&[(14336, 4096), (4096, 14336), (3072, 7168)])
        {
            for n in 1..=MAX_BATCH_PER_LAUNCH {
                for (rt, dx) in [None, Some(1), Some(2), Some(4)]
                    .into_iter()
                    .flat_map(|rt| [(rt, None), (rt, Some(false)), (rt, Some(true))])
                {
                    let p = plan(dtype, rows, cols, n, 132, rt, dx).expect("plan");
                    assert_eq!(p.direct_x, dx.unwrap_or(default_direct_x(dtype)));
                    assert_eq!(p.kernel.ends_with("_dx"), p.direct_x);
                    assert!(p.template_n >= n && p.template_n <= 8);
                    assert!(
                        p.rows_per_warp * p.template_n <= 32,
                        "one lane stores each output"
                    );
                    assert!(p.grid as usize * 8 * p.rows_per_warp >= rows);
                    assert!((p.grid as usize - 1) * 8 * p.rows_per_warp < rows);
                    assert_eq!(p.kt_max % 32, 0);
                    assert!(p.kt_max as usize <= cols);
                    assert!(p.shared_mem_bytes <= 48 * 1024);
                    if p.direct_x {
                        assert_eq!((p.shared_mem_bytes, p.kt_max as usize), (0, cols));
                    } else {
                        assert_eq!(
                            p.shared_mem_bytes as usize,
                            p.template_n * p.kt_max as usize / 32 * 36 * 4
                        );
                    }
                    assert!(p.kernel.starts_with("caracal_gemv_"));
                }
            }
        }
    }
    assert!(plan(DType::BF16, 4, 64, 9, 132, None, None).is_err());
    assert!(plan(DType::BF16, 4, 64, 1, 132, Some(3), None).is_err());
    assert!(plan(DType::F16, 4, 64, 1, 132, None, None).is_err());
}

#[test]
fn default_rows_per_warp_keeps_every_sm_busy() {
    // H200: 132 SMs.
    assert_eq!(default_rows_per_warp(14336, 132), 4);
    assert_eq!(default_rows_per_warp(4096, 132), 2);
    assert_eq!(default_rows_per_warp(3072, 132), 2);
    assert_eq!(default_rows_per_warp(1536, 132), 1);
    assert_eq!(default_rows_per_warp(1, 132), 1);
}

#[test]
fn nvrtc_compiles_every_kernel_for_hopper_and_blackwell() {
    // Needs libnvrtc (on LD_LIBRARY_PATH as libnvrtc.so) but no device.
    // SAFETY: only tries to dlopen the candidate library names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        println!("SKIPPED: no CUDA device (NVRTC cannot be loaded) [nvrtc_compiles]");
        return;
    }
    for arch in ["compute_90", "compute_100"] {
        let ptx = super::compile_kernels(arch)
            .unwrap_or_else(|e| panic!("{arch}: {e}"))
            .to_src();
        for name in super::gemv::kernel_names() {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{arch}: {name} missing"
            );
        }
    }
}

#[test]
fn every_planned_kernel_is_defined_in_the_source() {
    let src = super::gemv::source();
    let names = super::gemv::kernel_names();
    assert_eq!(names.len(), 72);
    for name in &names {
        // Kernels come from CARACAL_GEMV_KERNELS(N, RT, DX, SFX): check the
        // instantiation.
        let (base, dx) = match name.strip_suffix("_dx") {
            Some(b) => (b, "true, _dx"),
            None => (name.as_str(), "false, "),
        };
        let (n, rt) = base
            .rsplit_once("_n")
            .and_then(|(_, t)| t.split_once("_r"))
            .expect("name ends with _n{N}_r{RT}[_dx]");
        assert!(
            src.contains(&format!("CARACAL_GEMV_KERNELS({n}, {rt}, {dx})")),
            "{name} not instantiated"
        );
    }
    assert!(
        !src.contains("#include"),
        "NVRTC has no standard headers here"
    );
}
