//! The error type of the RLHF application's library.

use std::path::{Path, PathBuf};

/// What went wrong in the trainer.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A config key has a bad value (or is unknown).
    #[error("config key `{key}`: {message}")]
    Config {
        /// The dotted key path, e.g. `rollout.n_samples_per_prompt`.
        key: String,
        /// What was expected and what was found.
        message: String,
    },
    /// A config file could not be parsed.
    #[error("{file}: {message}")]
    ConfigFile {
        /// The file.
        file: String,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A dataset or record was malformed.
    #[error("data: {0}")]
    Data(String),
    /// A checkpoint cannot be resumed from (a file changed since it was saved, or is missing).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A model operation failed.
    #[error("model: {0}")]
    Model(#[from] rtrun_rlhf_model::ModelError),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Tensor(#[from] tch::TchError),
    /// An RL maths routine rejected its inputs.
    #[error("algo: {0}")]
    Algo(#[from] rtrun_rlhf_algo::AlgoError),
    /// Sharded training failed (a collective, a lost rank, a sharded checkpoint).
    #[error("sharding: {0}")]
    Shard(#[from] rtrun_rlhf_shard::ShardError),
    /// A runtime call failed (actor died, task failed, ...).
    #[error("runtime: {0}")]
    Runtime(#[from] rtrun::Error),
    /// A role reported an error.
    #[error("role `{role}`: {message}")]
    Role {
        /// The role (`actor`, `ref`, `critic`, `reward`, `engine`).
        role: String,
        /// The role's message.
        message: String,
    },
    /// A placement spec was invalid.
    #[error("placement: {0}")]
    Placement(String),
    /// A rank's worker process died (killed, crashed, failed constructor).
    #[error("{rank} died: {reason}")]
    RankDied {
        /// The rank, as [`crate::trainer::calls::RankName`] writes it:
        /// `vllm_engine rank 0 (actor-3)`.
        rank: String,
        /// Why, as the runtime reports it (exit status, signal).
        reason: String,
    },
    /// A rank's call failed: the rank's own error, or the runtime's.
    #[error("{rank}: {message}")]
    RankFailed {
        /// The rank, e.g. `actor rank 1 (actor-2)`.
        rank: String,
        /// What went wrong.
        message: String,
    },
    /// Ranks did not answer a call within `cluster.call_timeout_s`.
    #[error(
        "{ranks} did not answer `{call}` within cluster.call_timeout_s = {timeout_s} s (waited {elapsed_s:.1} s)"
    )]
    Stalled {
        /// The late ranks, e.g. `vllm_engine rank 0 (actor-3)`.
        ranks: String,
        /// The call they were given.
        call: String,
        /// The deadline.
        timeout_s: f64,
        /// How long the trainer waited.
        elapsed_s: f64,
    },
}

impl TrainError {
    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        TrainError::Io { path: path.to_path_buf(), source }
    }

    /// A bad value for `key`.
    pub fn config(key: &str, message: impl Into<String>) -> Self {
        TrainError::Config { key: key.to_owned(), message: message.into() }
    }

    /// An error reported by role `role`.
    pub fn role(role: &str, message: impl std::fmt::Display) -> Self {
        TrainError::Role { role: role.to_owned(), message: message.to_string() }
    }
}

/// Results of this crate.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
