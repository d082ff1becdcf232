//! The crate's error type: every fallible operation of the telemetry crate returns
//! [`TelemetryError`].

use std::path::PathBuf;

/// What went wrong while recording, reading or rendering telemetry.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// A file-system operation failed.
    #[error("cannot {action} `{path}`: {source}")]
    Io {
        /// What was being done ("create", "write", "read", ...).
        action: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A file that [`crate::StartMode::New`] must create already exists.
    #[error(
        "`{path}` already exists (expected a fresh run directory; resume or overwrite instead)"
    )]
    AlreadyExists {
        /// The file that exists.
        path: PathBuf,
    },
    /// A metric name is empty, reserved or recorded twice in one step.
    #[error("invalid metric name `{name}`: {reason}")]
    InvalidMetricName {
        /// The offending name.
        name: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// A JSONL metrics file holds a line that is not a metrics record.
    #[error("`{path}` line {line}: {message}")]
    Jsonl {
        /// The JSONL file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// What was expected and what was found.
        message: String,
    },
    /// A TensorBoard event file is truncated, fails a checksum or holds a malformed protobuf.
    #[error("corrupt event record at byte {offset}: {reason}")]
    CorruptEventFile {
        /// Byte offset of the record (or field) in the file.
        offset: u64,
        /// What was expected and what was found.
        reason: String,
    },
    /// A step does not fit TensorBoard's `int64` step.
    #[error("step {step} does not fit in a signed 64-bit integer (TensorBoard's step type)")]
    StepOutOfRange {
        /// The step.
        step: u64,
    },
    /// A chart cannot be drawn with the given size or data.
    #[error("invalid chart: {reason}")]
    InvalidChart {
        /// What was expected and what was found.
        reason: String,
    },
    /// The PNG encoder failed.
    #[error("cannot encode PNG: {0}")]
    PngEncoding(#[from] png::EncodingError),
}

/// Shorthand for results of this crate.
pub type Result<T, E = TelemetryError> = std::result::Result<T, E>;

/// Builds the closure that wraps an [`std::io::Error`] with its action and path.
pub(crate) fn io_error(
    action: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> TelemetryError {
    let path = path.into();
    move |source| TelemetryError::Io { action, path, source }
}
