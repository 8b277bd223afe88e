//! # CUDA kernels (feature `cuda`)
//!
//! Caracal's GPU path, first piece: weights uploaded once in their stored
//! dtype and multiplied by small batches of f32 activations (decode GEMV).
//!
//! Nothing here links against CUDA at build time. `cudarc` loads `libcuda`
//! and `libnvrtc` with `dlopen` on first use, and the kernels are CUDA C++
//! source strings compiled at run time by NVRTC for the device that was
//! opened (`--gpu-architecture=compute_XY`), once per [`CudaDevice`]. A
//! machine without a driver, without NVRTC or without a device gets
//! [`CudaError::Unavailable`] from [`CudaDevice::open`] — never a panic —
//! so callers (and the tests) can fall back or skip.
//!
//! Types:
//! - [`CudaDevice`]: one device, its context, the stream every kernel runs
//!   on (the context's default stream, so cudarc does no per-launch event
//!   bookkeeping), the compiled kernels, and upload/download helpers.
//! - [`DeviceMatrix`] ([`gemv`]): a [`crate::Matrix`] copied to device memory
//!   in its stored layout, with `out = x · Wᵀ` for BF16, MXFP4 and Q8_0.
//! - [`CudaError`] / [`CudaResult`]: what can go wrong.
//!
//! Layout assumptions shared by the kernels: activations and outputs are f32
//! row-major (`x: [n, cols]`, `out: [n, rows]`); weights are `[rows, cols]`
//! exactly as [`crate::Matrix`] stores them (see [`gemv`] for each dtype);
//! `cols` is a multiple of 32 for every dtype.
//!
//! Running the GPU tests: `cargo test -p caracal-kernels --features cuda cuda`.
//! Without a device they print `SKIPPED: no CUDA device (…)` and pass; set
//! `CARACAL_REQUIRE_CUDA=1` to make a missing device a failure instead.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError,
    ValidAsZeroBits,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

pub mod gemv;
#[cfg(test)]
mod tests;

pub use gemv::{DeviceMatrix, LaunchPlan};

/// Everything the CUDA path can report.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA on this machine: the driver library or NVRTC cannot be
    /// loaded, the driver cannot initialise, or there is no such device.
    #[error("CUDA unavailable: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed in {op}: {source}")]
    Driver {
        /// The operation that made the call.
        op: &'static str,
        /// The driver's error code.
        #[source]
        source: DriverError,
    },
    /// NVRTC rejected the kernel source (the message carries its log).
    #[error("NVRTC could not compile the kernels: {0}")]
    Compile(String),
    /// A kernel name that the compiled module does not contain.
    #[error("kernel `{0}` is not in the compiled module")]
    MissingKernel(String),
    /// A buffer or matrix whose size does not fit the operation.
    #[error("shape mismatch in {op}: {detail}")]
    Shape {
        /// The operation that noticed it.
        op: &'static str,
        /// What was expected and what was found.
        detail: String,
    },
    /// A weight dtype that has no GPU kernel.
    #[error("unsupported dtype {dtype} for {op}")]
    DType {
        /// The operation that was asked.
        op: &'static str,
        /// The dtype's name.
        dtype: String,
    },
}

/// Result alias for the CUDA path.
pub type CudaResult<T> = std::result::Result<T, CudaError>;

/// Wraps a driver error with the operation that hit it.
pub(crate) fn driver(op: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { op, source }
}

/// Runs `f`, turning a panic (cudarc panics when a library or a symbol is
/// missing) into [`CudaError::Unavailable`].
fn no_panic<T>(what: &str, f: impl FnOnce() -> CudaResult<T>) -> CudaResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(CudaError::Unavailable(format!("{what}: {msg}")))
        }
    }
}

/// One CUDA device with Caracal's kernels compiled and loaded.
///
/// Shared as `Arc<CudaDevice>` by every [`DeviceMatrix`] uploaded to it. All
/// work goes to one stream ([`CudaDevice::stream`], the context's default
/// stream), so operations run in the order they are issued; methods that
/// return host data wait for that stream. cudarc's cross-stream event
/// tracking is off: code that runs work on another stream of this context
/// must synchronise with this one itself.
pub struct CudaDevice {
    /// The primary context of the device (cudarc binds it to each calling thread).
    ctx: Arc<CudaContext>,
    /// The stream every copy and kernel of this device runs on.
    stream: Arc<CudaStream>,
    /// Every kernel of the module by name, resolved once at open.
    functions: HashMap<String, CudaFunction>,
    /// The device's marketing name (e.g. "NVIDIA H200"), for logs and benches.
    name: String,
    /// `(major, minor)` compute capability the kernels were compiled for.
    compute_capability: (i32, i32),
    /// Streaming multiprocessors; sizes the launch grids.
    sm_count: usize,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaDevice({}, sm_{}{}, {} SMs)",
            self.name, self.compute_capability.0, self.compute_capability.1, self.sm_count
        )
    }
}

impl CudaDevice {
    /// Opens device `ordinal`, compiles every kernel with NVRTC for its
    /// architecture and loads them. Takes NVRTC's compile time (about a
    /// second or two); do it once per process and share the `Arc`.
    ///
    /// Returns [`CudaError::Unavailable`] when libcuda or libnvrtc cannot be
    /// loaded, the driver does not initialise, or the device does not exist.
    pub fn open(ordinal: usize) -> CudaResult<Arc<CudaDevice>> {
        // SAFETY: only tries to dlopen the candidate library names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "the CUDA driver library (libcuda.so) cannot be loaded".into(),
            ));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "NVRTC (libnvrtc.so) cannot be loaded; put its directory on LD_LIBRARY_PATH".into(),
            ));
        }
        let count = no_panic("cuInit", || {
            CudaContext::device_count()
                .map_err(|e| CudaError::Unavailable(format!("cuInit / cuDeviceGetCount: {e}")))
        })?;
        if count <= 0 {
            return Err(CudaError::Unavailable(
                "the driver reports 0 devices".into(),
            ));
        }
        if ordinal >= count as usize {
            return Err(CudaError::Unavailable(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        no_panic("opening the device", || Self::open_checked(ordinal))
    }

    /// [`CudaDevice::open`] once the libraries are known to load.
    fn open_checked(ordinal: usize) -> CudaResult<Arc<CudaDevice>> {
        let ctx = CudaContext::new(ordinal).map_err(driver("CudaContext::new"))?;
        // SAFETY: every buffer and kernel of this device uses the one stream
        // below, so stream order already sequences all uses; the per-buffer
        // events cudarc would otherwise create on each allocation add nothing.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let name = ctx.name().map_err(driver("cuDeviceGetName"))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(driver("compute capability"))?;
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(driver("multiprocessor count"))?
            .max(1) as usize;
        let ptx = compile_kernels(&format!(
            "compute_{}{}",
            compute_capability.0, compute_capability.1
        ))?;
        let module = ctx.load_module(ptx).map_err(driver("cuModuleLoadData"))?;
        let mut functions = HashMap::new();
        for kernel in gemv::kernel_names() {
            let f = module
                .load_function(&kernel)
                .map_err(|_| CudaError::MissingKernel(kernel.clone()))?;
            functions.insert(kernel, f);
        }
        Ok(Arc::new(CudaDevice {
            ctx,
            stream,
            functions,
            name,
            compute_capability,
            sm_count,
        }))
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(major, minor)` compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// The cudarc context (for code that launches its own kernels).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all of this device's work is issued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A compiled kernel by name.
    pub(crate) fn function(&self, name: &str) -> CudaResult<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::MissingKernel(name.to_string()))
    }

    /// Copies `host` into a new device buffer (waits for the copy).
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> CudaResult<CudaSlice<T>> {
        self.stream
            .clone_htod(host)
            .map_err(driver("host-to-device copy"))
    }

    /// A new device buffer of `len` zeros.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> CudaResult<CudaSlice<T>> {
        self.stream.alloc_zeros(len).map_err(driver("alloc_zeros"))
    }

    /// Copies a device buffer (or view) back into a new host vector, after
    /// everything queued before it on the stream has run.
    pub fn download<T: DeviceRepr, S: DevicePtr<T>>(&self, device: &S) -> CudaResult<Vec<T>> {
        self.stream
            .clone_dtoh(device)
            .map_err(driver("device-to-host copy"))
    }

    /// Copies a device buffer (or view) into `host`, whose length must equal it.
    pub fn download_into<T: DeviceRepr, S: DevicePtr<T>>(
        &self,
        device: &S,
        host: &mut [T],
    ) -> CudaResult<()> {
        if host.len() != device.len() {
            return Err(CudaError::Shape {
                op: "CudaDevice::download_into",
                detail: format!(
                    "device buffer has {} elements, host slice {}",
                    device.len(),
                    host.len()
                ),
            });
        }
        self.stream
            .memcpy_dtoh(device, host)
            .map_err(driver("device-to-host copy"))
    }

    /// Waits until every operation queued on the stream has finished.
    pub fn synchronize(&self) -> CudaResult<()> {
        self.stream
            .synchronize()
            .map_err(driver("stream synchronize"))
    }
}

/// Compiles every kernel of the crate with NVRTC for `arch` (e.g.
/// `compute_90`). Needs libnvrtc but no device.
pub(crate) fn compile_kernels(arch: &str) -> CudaResult<Ptx> {
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some("caracal_kernels.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(gemv::source(), opts)
        .map_err(|e| CudaError::Compile(compile_message(&e)))
}

/// NVRTC's log (the useful part of a compile error) as text.
fn compile_message(e: &CompileError) -> String {
    match e {
        CompileError::CompileError {
            nvrtc,
            options,
            log,
        } => format!(
            "{nvrtc:?} with options {options:?}:\n{}",
            log.to_string_lossy()
        ),
        other => format!("{other:?}"),
    }
}
