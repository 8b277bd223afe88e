//! GGUF: read llama.cpp model files and import them as Hugging Face folders.
//!
//! GGUF is llama.cpp's single-file model format: a little-endian header, a list of
//! typed metadata key/values (hyper-parameters, the tokenizer, the chat template),
//! a list of tensor descriptions, and then the tensor data, each tensor starting at a
//! multiple of `general.alignment` (default 32) bytes. Tensors are stored in one of
//! ggml's block-quantised formats. The spec is llama.cpp's `docs/gguf.md`; the block
//! layouts are ggml's `ggml-common.h` and the reference dequantisers in
//! `ggml-quants.c` (mirrored in numpy by the PyPI `gguf` package's `gguf/quants.py`).
//!
//! Submodules:
//! - [`reader`]: [`GgufFile`] memory-maps a file and parses the header, the metadata
//!   and the tensor table ([`TensorInfo`]). Versions 2 and 3 are accepted (they differ
//!   only in that v3 may be big-endian, which is rejected).
//! - [`value`]: the metadata value types ([`GgufValue`], arrays included).
//! - [`quants`]: [`GgmlType`] and [`dequantize`], which turns F32/F16/BF16/F64/I8/I16/
//!   I32, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q8_1, the K-quants Q2_K..Q8_K and MXFP4 into f32,
//!   bit-exactly as ggml does, in parallel over blocks.
//! - [`import`]: [`import_gguf`] converts a `llama`-architecture GGUF into an HF
//!   `LlamaForCausalLM` folder (`model.safetensors`, `config.json`, `tokenizer.json`,
//!   `tokenizer_config.json`, `generation_config.json`), undoing llama.cpp's Q/K row
//!   permutation.
//! - [`tokenizer`]: rebuilds an HF `tokenizer.json` from the `tokenizer.ggml.*` keys.
//! - [`info`]: [`gguf_info`] summarises any GGUF for the CLI's `inspect`.
//!
//! The module only depends on `caracal_kernels` for bf16 rounding, and has its own
//! error type [`GgufError`].

use std::path::PathBuf;

pub mod import;
pub mod info;
pub mod quants;
pub mod reader;
pub mod tokenizer;
pub mod value;

#[cfg(test)]
mod smollm_tests;
#[cfg(test)]
mod test_writer;

pub use import::{import_gguf, ImportOptions, ImportReport, LlamaHparams, OutDtype};
pub use info::{gguf_info, GgufInfo, TypeCount};
pub use quants::{dequantize, dequantize_into, GgmlType};
pub use reader::{GgufFile, TensorInfo};
pub use value::{GgufArray, GgufValue, GgufValueType};

/// Everything that can go wrong while reading, dequantising or importing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// A file could not be opened, mapped, created or written.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying OS error.
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file (magic {0:#010x}, expected 0x46554747 \"GGUF\")")]
    BadMagic(u32),
    /// A GGUF version other than 2 or 3 (v1 used 32-bit counts).
    #[error("GGUF version {0} is not supported (only 2 and 3)")]
    UnsupportedVersion(u32),
    /// The file is a big-endian GGUF (v3 allows it); only little-endian is read.
    #[error("big-endian GGUF files are not supported")]
    BigEndian,
    /// The file ends before a field that the header says is there.
    #[error("file truncated: needed {needed} bytes for {what} at offset {offset}, file has {len}")]
    Truncated {
        /// What was being read.
        what: String,
        /// Byte offset of the read.
        offset: usize,
        /// Bytes the read needed.
        needed: usize,
        /// Total file length.
        len: usize,
    },
    /// A string in the file is not valid UTF-8.
    #[error("invalid UTF-8 in {0}")]
    InvalidUtf8(String),
    /// A metadata value type id outside the spec's 0..=12.
    #[error("unknown metadata value type {type_id} for key {key:?}")]
    UnknownValueType {
        /// The key whose value could not be read.
        key: String,
        /// The type id found.
        type_id: u32,
    },
    /// A tensor type id this reader does not know (so its byte size is unknown).
    #[error("tensor {tensor:?} has unknown ggml type id {type_id}")]
    UnknownGgmlType {
        /// Tensor name.
        tensor: String,
        /// The type id found.
        type_id: u32,
    },
    /// The header asks for more than the reader allows (metadata values,
    /// array nesting): a corrupt or hostile file, refused before allocating.
    #[error("{what} exceeds the reader's limit of {limit}")]
    Limit {
        /// What was being counted.
        what: String,
        /// The bound in force.
        limit: usize,
    },
    /// `general.alignment` is zero, not a power of two, or not an integer.
    #[error("invalid general.alignment {0}")]
    BadAlignment(u64),
    /// A tensor description is inconsistent (dims, offset, size, bounds).
    #[error("tensor {tensor:?}: {reason}")]
    BadTensor {
        /// Tensor name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// [`dequantize`] was asked for a type it has no dequantiser for.
    #[error("dequantisation of {0} is not supported")]
    UnsupportedType(GgmlType),
    /// [`dequantize`] got a byte buffer or element count that does not fit the type.
    #[error("{ggml_type}: {reason}")]
    SizeMismatch {
        /// The type being dequantised.
        ggml_type: GgmlType,
        /// What does not fit.
        reason: String,
    },
    /// A metadata key the import needs is absent.
    #[error("missing metadata key {0:?}")]
    MissingKey(String),
    /// A metadata key holds a value of the wrong type.
    #[error("metadata key {key:?} should be {expected}, found {found}")]
    WrongType {
        /// The key.
        key: String,
        /// What the import expected.
        expected: &'static str,
        /// The value type found.
        found: String,
    },
    /// The import only handles `general.architecture = llama`.
    #[error("architecture {0:?} is not supported by the importer (only \"llama\")")]
    UnsupportedArchitecture(String),
    /// The import only rebuilds byte-level BPE tokenizers (`tokenizer.ggml.model = gpt2`).
    #[error("tokenizer model {0:?} is not supported (only \"gpt2\" byte-level BPE)")]
    UnsupportedTokenizer(String),
    /// The `tokenizer.ggml.*` keys are inconsistent (lengths, merges, ids).
    #[error("tokenizer metadata: {0}")]
    BadTokenizer(String),
    /// A tensor name the llama name map does not know.
    #[error("tensor {0:?} has no Hugging Face llama name")]
    UnknownTensorName(String),
    /// A tensor the import needs is absent.
    #[error("missing tensor {0:?}")]
    MissingTensor(String),
    /// Writing `model.safetensors` failed.
    #[error("safetensors: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),
    /// Writing a JSON file failed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

/// Result alias of the `gguf` module.
pub type Result<T> = std::result::Result<T, GgufError>;
