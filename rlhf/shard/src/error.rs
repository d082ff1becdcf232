//! Errors of sharded training.

use std::path::PathBuf;

/// What went wrong in sharded training.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// A setting or a model that sharding cannot work with.
    #[error("{0}")]
    Config(String),
    /// A collective failed (a rank died, timed out, or ran other collectives).
    #[error("{what}: {source}")]
    Collective {
        /// What was being done (`gathering model.layers.3`).
        what: String,
        /// The collective's error, naming the group, rank and peer.
        #[source]
        source: rtrun::collective::CollectiveError,
    },
    /// A sharded checkpoint that cannot be loaded as it is.
    #[error("sharded checkpoint {path}: {message}")]
    Checkpoint {
        /// The file or directory at fault.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A tensor operation failed.
    #[error(transparent)]
    Model(#[from] rtrun_rlhf_model::ModelError),
    /// The gradient all-reduce of stage 0 failed.
    #[error(transparent)]
    Algo(#[from] rtrun_rlhf_algo::AlgoError),
}

impl From<tch::TchError> for ShardError {
    fn from(e: tch::TchError) -> Self {
        ShardError::Model(e.into())
    }
}

impl From<ShardError> for rtrun_rlhf_model::ModelError {
    /// Hooks report through the model's error type; the message keeps the cause.
    fn from(e: ShardError) -> Self {
        match e {
            ShardError::Model(m) => m,
            other => rtrun_rlhf_model::ModelError::Hook(other.to_string()),
        }
    }
}

/// Results of this crate.
pub type Result<T, E = ShardError> = std::result::Result<T, E>;
