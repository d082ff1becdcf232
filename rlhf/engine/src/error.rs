//! The error type of the engine layer (model runner, [`crate::LlmEngine`], weight updates).

use rtrun_rlhf_model::ModelError;
use thiserror::Error;

use crate::routing::RoutingError;
use crate::sampling::SamplingError;
use crate::scheduler::SchedulerError;

/// Errors of the engine.
#[derive(Debug, Error)]
pub enum EngineError {
    /// The engine configuration is unusable.
    #[error("invalid engine config: {0}")]
    InvalidConfig(String),
    /// A request was rejected before it was queued (nothing of it runs).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The scheduler refused an operation.
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    /// Sampling failed on a logits row (non-finite logits, usually broken weights).
    #[error("sampling failed: {0}")]
    Sampling(#[from] SamplingError),
    /// Per-rank routing of outputs failed.
    #[error(transparent)]
    Routing(#[from] RoutingError),
    /// The model (loading, a forward pass) failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// libtorch reported an error.
    #[error("libtorch error: {0}")]
    Torch(#[from] tch::TchError),
    /// A weight of an update bucket does not fit the model; nothing of the bucket was applied.
    #[error("weight `{name}`: {message}")]
    InvalidWeight {
        /// The weight's name.
        name: String,
        /// What was wrong.
        message: String,
    },
    /// The operation needs a part of the engine that is asleep.
    #[error("{operation} needs the {part} awake, but it is asleep (call wake_up first)")]
    Asleep {
        /// What was attempted.
        operation: &'static str,
        /// `"weights"` or `"kv cache"`.
        part: &'static str,
    },
    /// The operation needs the engine idle but sequences are mid-generation.
    #[error("{operation} needs an idle engine, found {running} running sequences")]
    Busy {
        /// What was attempted.
        operation: &'static str,
        /// Sequences holding KV blocks.
        running: usize,
    },
    /// `sleep` got a level other than 1 or 2, or `wake_up` an unknown tag.
    #[error("{0}")]
    InvalidArgument(String),
    /// The scheduler produced an empty step while requests were unfinished (a bug: the step
    /// loop would spin forever, so the engine aborts them instead).
    #[error("the scheduler made no progress with {0} unfinished requests; they were aborted")]
    Stalled(usize),
    /// A rank of a tensor-parallel engine failed (a collective broke, or the rank's process
    /// died or refused a command); the whole engine's step fails with it.
    #[error("tensor-parallel rank {rank}: {message}")]
    TensorParallel {
        /// The rank that failed (or whose collective broke).
        rank: usize,
        /// What happened, with the rank's node where known.
        message: String,
    },
    /// A chunk's positions reach past its sequence's block table (a scheduler/runner mismatch).
    #[error("{sequence}: chunk needs {needed} kv slots, its block table covers {covered}")]
    BlockTableTooShort {
        /// The sequence.
        sequence: crate::SequenceId,
        /// Slots the chunk's last position needs.
        needed: usize,
        /// Slots the table covers.
        covered: usize,
    },
}
