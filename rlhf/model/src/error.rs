//! The error type of this crate: everything a caller can get wrong (a bad config file, a tensor
//! of the wrong shape, a checkpoint that misses a weight) becomes a [`ModelError`], never a panic.

use std::path::PathBuf;

/// Errors from building, loading, saving, running or training a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("i/o error on `{path}`: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (`config.json`, the shard index, …) is malformed.
    #[error("invalid json in `{path}`: {source}")]
    Json {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A config value is out of range or inconsistent with another one.
    #[error("invalid model config: {0}")]
    Config(String),
    /// A safetensors file is malformed.
    #[error("invalid safetensors file `{path}`: {message}")]
    Safetensors {
        /// The file involved.
        path: PathBuf,
        /// What was wrong with it.
        message: String,
    },
    /// A checkpoint lacks a tensor the model needs.
    #[error("checkpoint `{dir}` has no tensor `{name}`")]
    MissingTensor {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The Hugging Face name of the missing tensor.
        name: String,
    },
    /// A tensor has a shape other than the one expected.
    #[error("tensor `{name}` should have shape {expected:?}, found {found:?}")]
    Shape {
        /// What the tensor is (a parameter name or an argument name).
        name: String,
        /// The expected shape.
        expected: Vec<i64>,
        /// The shape found.
        found: Vec<i64>,
    },
    /// An input tensor is unusable (wrong dtype, rank or values).
    #[error("invalid input: {0}")]
    Input(String),
    /// The tokenizer failed to load, train, encode or save.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// An optimizer state file does not match the parameters it is loaded into.
    #[error("optimizer state mismatch: {0}")]
    OptimizerState(String),
    /// A layer-by-layer hook failed (sharded training: a collective, a lost rank).
    #[error("{0}")]
    Hook(String),
    /// libtorch reported an error.
    #[error("libtorch error: {0}")]
    Torch(#[from] tch::TchError),
}

/// Shorthand for results of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    /// Wraps an I/O error with the path it happened on.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }

    /// Wraps a JSON error with the file it came from.
    pub(crate) fn json(path: impl Into<PathBuf>, source: serde_json::Error) -> Self {
        Self::Json { path: path.into(), source }
    }
}
