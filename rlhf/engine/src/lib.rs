//! rtrun's vLLM-like generation engine, in two layers.
//!
//! **Pure cores** (no I/O, no clock, no tensors): the paged-KV [`block`] manager with prefix
//! caching, the continuous-batching [`scheduler`], [`sampling`] maths on logits rows, the
//! [`params`] that travel with every request, seeded per-token randomness ([`rng`]) and the
//! per-rank [`routing`] of finished outputs. The engine feeds these state machines events
//! (requests, sampled tokens, aborts) and executes the decisions they return, which keeps the
//! hard parts — admission, preemption by recompute, block sharing — property-testable without a
//! model.
//!
//! **Engine** (on `tch` and [`rtrun_rlhf_model`]): the model [`runner`] (paged KV cache
//! tensors, attention through block tables, the tensor-parallel seam), [`LlmEngine`] (the step
//! loop scheduler → runner → sampler → scheduler, stop strings, sleep / wake, weight updates,
//! stats), the [`mod@reference`] decode used as test oracle and benchmark anchor, and
//! [`EngineActor`], the engine as an rtrun actor serving several trainer ranks.
//!
//! Contract between scheduler and runner: within one step, the K/V of every scheduled token of a
//! layer is written into its slot before any attention of that layer reads the cache. The
//! scheduler relies on it: a sequence admitted in a step may share, through the prefix cache,
//! full blocks whose K/V another sequence computes in the same step.
//!
//! ```no_run
//! use rtrun_rlhf_engine::{EngineConfig, GenerationRequest, LlmEngine, SamplingParams};
//! use rtrun_rlhf_model::{ModelFamily, tiny};
//!
//! let model = tiny::tiny_model(&tiny::tiny_config(ModelFamily::Qwen2), 7)?;
//! let mut engine = LlmEngine::new(model, None, EngineConfig::default())?;
//! let outputs = engine.generate(vec![GenerationRequest::new(
//!     vec![1, 17, 42],
//!     SamplingParams { temperature: 0.8, seed: Some(3), n: 4, ..SamplingParams::default() },
//! )])?;
//! assert_eq!(outputs[0].samples.len(), 4);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
// Denied, not forbidden: the CUDA IPC receive (`weight_ipc`) wraps mapped device memory.
#![deny(unsafe_code)]

pub mod actor;
pub mod api;
pub mod block;
pub mod config;
pub mod engine;
pub mod error;
pub mod params;
pub mod reference;
pub mod rng;
pub mod routing;
pub mod runner;
pub mod sampling;
pub mod scheduler;
pub mod tp;
pub mod weight_ipc;
pub mod weight_sync;

pub use actor::{EngineActor, EngineActorConfig, EngineActorRef};
pub use api::{
    GeneratedSample, GenerationOutput, GenerationRequest, NamedTensor, StreamPoll, WeightBucket,
};
pub use config::EngineConfig;
pub use engine::{EngineStats, LlmEngine, WakeTarget, WeightState};
pub use error::EngineError;
pub use reference::reference_generate;
pub use weight_ipc::IpcWeightBucket;
pub use weight_sync::{WeightMeta, WeightSyncGroup};

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
