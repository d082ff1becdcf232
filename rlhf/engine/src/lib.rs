//! Pure cores of rtrun's vLLM-like generation engine: the paged-KV [`block`] manager with prefix
//! caching, the continuous-batching [`scheduler`], [`sampling`] maths on logits rows, the
//! [`params`] that travel with every request, and the per-rank [`routing`] of finished outputs.
//!
//! Nothing here does I/O, reads a clock or touches a tensor: the engine actor feeds these state
//! machines events (requests, sampled tokens, aborts) and executes the decisions they return
//! (which token positions to run through the model, which blocks hold their K/V). That keeps the
//! hard parts — admission, preemption by recompute, block sharing — property-testable without a
//! model.
//!
//! Contract with the model forward (the part that plugs in later): within one step, the K/V of
//! every scheduled token of a layer is written into its slot before any attention of that layer
//! reads the cache. The scheduler relies on it: a sequence admitted in a step may share, through
//! the prefix cache, full blocks whose K/V another sequence computes in the same step.
#![forbid(unsafe_code)]

pub mod block;
pub mod params;
pub mod rng;
pub mod routing;
pub mod sampling;
pub mod scheduler;

pub use block::{
    BlockError, BlockHash, BlockId, BlockManager, BlockManagerConfig, BlockManagerStats,
};
pub use params::{LogprobMode, SamplingParams, SamplingParamsError};
pub use routing::{RequestRouter, RoutingError};
pub use sampling::{SampledToken, Sampler, SamplingError};
pub use scheduler::{
    ChunkKind, FinishReason, RequestOutput, SampleOutput, ScheduledChunk, Scheduler,
    SchedulerConfig, SchedulerError, SchedulerOutput, SchedulerStats,
};

use serde::{Deserialize, Serialize};

/// Identifier of a generation request (one prompt, `n` samples), unique within one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// One sample of a request: each sample is its own sequence with its own block table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SequenceId {
    /// The request the sample belongs to.
    pub request: RequestId,
    /// Index of the sample within the request, `0..n`.
    pub sample_index: u32,
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request {}", self.0)
    }
}

impl std::fmt::Display for SequenceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request {} sample {}", self.request.0, self.sample_index)
    }
}
