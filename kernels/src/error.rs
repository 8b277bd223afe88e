//! Errors raised by kernels and weight storage.

/// Everything that can go wrong below the model layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A buffer's length does not match the shape it is used with.
    #[error("shape mismatch in {op}: {detail}")]
    Shape {
        /// The operation that noticed the mismatch.
        op: &'static str,
        /// What was expected and what was found.
        detail: String,
    },
    /// A dtype that the operation does not support.
    #[error("unsupported dtype {dtype} for {op}")]
    DType {
        /// The operation that was asked.
        op: &'static str,
        /// The dtype's name.
        dtype: String,
    },
    /// The page pool has no free page left.
    #[error("KV page pool exhausted: {needed} pages needed, {free} free")]
    OutOfPages {
        /// Pages the request needed.
        needed: usize,
        /// Pages that were free.
        free: usize,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;
