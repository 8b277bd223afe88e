//! The error type of the `caracal` library crate.
//!
//! Every message is one line a user can act on: it names the file, tensor,
//! key or limit that was wrong.

use std::path::PathBuf;

/// Everything that can fail while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file the checkpoint needs does not exist or cannot be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A JSON file (config, index, tokenizer config) is malformed.
    #[error("invalid {what} ({path}): {detail}")]
    BadFile {
        /// Which kind of file.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The parser's message.
        detail: String,
    },
    /// `config.json` names an architecture Caracal does not implement.
    #[error("unknown model_type `{found}`; supported: {supported}")]
    UnknownModelType {
        /// The `model_type` found.
        found: String,
        /// Comma-separated list of supported types.
        supported: String,
    },
    /// A config value is missing or out of range.
    #[error("config: {0}")]
    Config(String),
    /// A tensor the architecture needs is absent from the checkpoint.
    #[error("tensor `{name}` not found in the checkpoint")]
    MissingTensor {
        /// The tensor name.
        name: String,
    },
    /// A tensor has another shape than the config implies.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        /// The tensor name.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The stored shape.
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype this loader cannot use for it.
    #[error("tensor `{name}` has dtype {found}, expected one of {expected}")]
    TensorDType {
        /// The tensor name.
        name: String,
        /// What is accepted.
        expected: String,
        /// The stored dtype.
        found: String,
    },
    /// The prompt does not fit in the model's context window.
    #[error("prompt has {prompt} tokens, but the context length is {context} (with max_tokens {max_tokens} requested)")]
    PromptTooLong {
        /// Prompt length in tokens.
        prompt: usize,
        /// The model's maximum context.
        context: usize,
        /// Requested new tokens.
        max_tokens: usize,
    },
    /// A request parameter is invalid.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Tokenizer failure (loading, encoding or decoding).
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to render.
    #[error("chat template: {0}")]
    Template(String),
    /// A kernel-level failure (shapes, pages).
    #[error(transparent)]
    Kernel(#[from] caracal_kernels::Error),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

impl From<Error> for caracal_actors::engine::EngineError {
    fn from(e: Error) -> Self {
        use caracal_actors::engine::EngineError;
        match e {
            Error::PromptTooLong {
                prompt, context, ..
            } => EngineError::ContextExceeded {
                tokens: prompt,
                context,
            },
            Error::Kernel(k) => EngineError::Kernel(k),
            other => EngineError::InvalidInput(other.to_string()),
        }
    }
}

impl From<caracal_actors::engine::EngineError> for Error {
    fn from(e: caracal_actors::engine::EngineError) -> Self {
        use caracal_actors::engine::EngineError;
        match e {
            EngineError::ContextExceeded { tokens, context } => Error::PromptTooLong {
                prompt: tokens,
                context,
                max_tokens: 0,
            },
            EngineError::Kernel(k) => Error::Kernel(k),
            EngineError::InvalidInput(s) => Error::InvalidRequest(s),
        }
    }
}
