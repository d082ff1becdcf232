//! [`EngineActor`]: the engine as an rtrun actor (what OpenRLHF calls a vLLM engine actor).
//!
//! Several trainer ranks share one engine: each submits with
//! [`add_requests`](EngineActor::add_requests) and collects with
//! [`get_responses`](EngineActor::get_responses), which runs everything queued (all ranks'
//! requests form one continuous batch) and returns exactly that rank's outputs in its
//! submission order ([`RequestRouter`]). [`generate`](EngineActor::generate) is the one-call
//! form. Errors cross the runtime as strings.

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard};

use rtrun_rlhf_model::{CausalLm, TextTokenizer};
use serde::{Deserialize, Serialize};

use crate::RequestId;
use crate::api::{GenerationOutput, GenerationRequest, WeightBucket};
use crate::config::EngineConfig;
use crate::engine::{EngineStats, LlmEngine, WakeTarget};
use crate::error::EngineError;
use crate::routing::RequestRouter;
use crate::weight_sync::{WeightMeta, WeightSyncGroup};

/// How to build an [`EngineActor`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineActorConfig {
    /// A Hugging Face directory: `config.json`, `*.safetensors` and optionally
    /// `tokenizer.json` (needed for stop strings).
    pub model_dir: PathBuf,
    /// The engine's configuration (device and dtype select how the model is loaded).
    pub engine: EngineConfig,
}

/// The engine plus the per-rank routing of its outputs.
#[derive(Debug)]
struct EngineActorState {
    engine: LlmEngine,
    router: RequestRouter<GenerationOutput>,
    /// Engine request id → router request id, for requests submitted through `add_requests`.
    routed: HashMap<RequestId, RequestId>,
    /// The weight-sync group, once joined.
    weight_sync: Option<rtrun::collective::Communicator>,
}

/// The generation engine actor.
#[derive(Debug)]
pub struct EngineActor {
    // Tensors are `Send` but not `Sync`; the runtime shares actors between threads, so the state
    // sits behind a mutex (uncontended: every mutating method takes `&mut self`).
    state: Mutex<EngineActorState>,
}

impl EngineActor {
    /// Loads the model (and the tokenizer when the directory has one) and allocates the cache.
    pub fn load(config: EngineActorConfig) -> Result<Self, EngineError> {
        let device = config.engine.torch_device()?;
        let kind = config.engine.torch_kind()?;
        let model = CausalLm::from_pretrained(&config.model_dir, device, kind)?;
        let tokenizer = if config.model_dir.join("tokenizer.json").is_file() {
            Some(TextTokenizer::from_dir(&config.model_dir)?)
        } else {
            None
        };
        let engine = LlmEngine::new(model, tokenizer, config.engine)?;
        Ok(Self::from_engine(engine))
    }

    /// Wraps an engine built in this process.
    pub fn from_engine(engine: LlmEngine) -> Self {
        Self {
            state: Mutex::new(EngineActorState {
                engine,
                router: RequestRouter::new(),
                routed: HashMap::new(),
                weight_sync: None,
            }),
        }
    }

    fn state(&mut self) -> &mut EngineActorState {
        // A panic while holding the lock cannot leave the engine half-updated in a way the next
        // call would not report, so a poisoned lock is taken over.
        self.state.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn shared_state(&self) -> MutexGuard<'_, EngineActorState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl EngineActorState {
    /// Hands every finished routed output to the router.
    fn route_completed(&mut self) -> Result<(), EngineError> {
        for (engine_id, output) in self.engine.take_completed() {
            match self.routed.remove(&engine_id) {
                Some(router_id) => {
                    self.router.complete(router_id, output)?;
                }
                None => tracing::warn!(%engine_id, "dropping an output nobody is waiting for"),
            }
        }
        Ok(())
    }
}

#[rtrun::actor(pub)]
impl EngineActor {
    /// Builds the actor from a model directory.
    pub fn new(config: EngineActorConfig) -> Result<Self, EngineError> {
        Self::load(config)
    }

    /// Generates for a batch and returns the outputs in order (queued requests of other ranks
    /// progress meanwhile and stay queued for their owners).
    pub fn generate(
        &mut self,
        requests: Vec<GenerationRequest>,
    ) -> Result<Vec<GenerationOutput>, String> {
        let state = self.state();
        let result = state.engine.generate(requests).map_err(|e| e.to_string());
        state.route_completed().map_err(|e| e.to_string())?;
        result
    }

    /// Queues requests of trainer rank `actor_rank`; all of them are validated first, so on an
    /// error none is queued.
    pub fn add_requests(
        &mut self,
        actor_rank: u32,
        requests: Vec<GenerationRequest>,
    ) -> Result<(), String> {
        let state = self.state();
        let mut engine_ids = Vec::with_capacity(requests.len());
        for request in requests {
            match state.engine.add_request(request) {
                Ok(id) => engine_ids.push(id),
                Err(error) => {
                    // Undo: run nothing of this call. The requests are only queued, so aborting
                    // them is immediate; their aborted outputs are dropped.
                    state.engine.abort_requests(&engine_ids);
                    return Err(error.to_string());
                }
            }
        }
        let router_ids = state.router.register(actor_rank, engine_ids.len());
        state.routed.extend(engine_ids.into_iter().zip(router_ids));
        Ok(())
    }

    /// Runs every queued request (of every rank) to completion and returns `actor_rank`'s
    /// outputs in its submission order. If a step fails, the error is returned and the
    /// unfinished requests are aborted; their outputs (reason `aborted`) come with the next call.
    pub fn get_responses(&mut self, actor_rank: u32) -> Result<Vec<GenerationOutput>, String> {
        let state = self.state();
        let run = state.engine.run_until_idle();
        state.route_completed().map_err(|e| e.to_string())?;
        run.map_err(|e| e.to_string())?;
        Ok(state.router.take_finished(actor_rank).into_iter().map(|(_, output)| output).collect())
    }

    /// 1: free the KV cache and offload the weights to host memory; 2: also drop the weights.
    pub fn sleep(&mut self, level: u32) -> Result<(), String> {
        self.state().engine.sleep(level).map_err(|e| e.to_string())
    }

    /// Wakes `"weights"` and/or `"kv_cache"` (empty: both, weights first).
    pub fn wake_up(&mut self, tags: Vec<String>) -> Result<(), String> {
        let targets = tags
            .iter()
            .map(|tag| WakeTarget::from_str(tag))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        self.state().engine.wake_up(&targets).map_err(|e| e.to_string())
    }

    /// Copies a bucket of weights into the model and resets the prefix cache.
    pub fn update_weights(&mut self, bucket: WeightBucket) -> Result<(), String> {
        self.state().engine.update_weights(&bucket).map(|_| ()).map_err(|e| e.to_string())
    }

    /// Joins the weight-sync group (policy rank 0 plus every engine); every member must be
    /// called at about the same time, since this waits for the rendezvous.
    pub fn join_weight_sync(&mut self, group: WeightSyncGroup) -> Result<(), String> {
        let comm = group.join().map_err(|e| e.to_string())?;
        self.state().weight_sync = Some(comm);
        Ok(())
    }

    /// Receives the weights `metas` describes from the weight-sync group's rank 0 in place and
    /// resets the prefix cache (called together with the policy's `broadcast_weights`).
    pub fn receive_weights(
        &mut self,
        metas: Vec<WeightMeta>,
        bucket_bytes: usize,
    ) -> Result<(), String> {
        let guard = self.state();
        let state = &mut *guard;
        let comm =
            state.weight_sync.as_mut().ok_or("receive_weights needs join_weight_sync first")?;
        state
            .engine
            .receive_weights(comm, &metas, bucket_bytes)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Copies a weight bucket the policy exported by CUDA IPC into the model in place (the
    /// policy keeps the bucket's buffer until every engine has returned).
    pub fn receive_ipc_bucket(&mut self, bucket: crate::IpcWeightBucket) -> Result<u64, String> {
        self.state().engine.receive_ipc_bucket(&bucket).map_err(|e| e.to_string())
    }

    /// The CUDA caching allocator's statistics of this engine's device (`None` on the CPU);
    /// `reset_peak` starts a new peak after reading.
    pub fn cuda_memory(
        &self,
        reset_peak: bool,
    ) -> Result<Option<rtrun_rlhf_model::cuda::CudaMemory>, String> {
        let device = self.shared_state().engine.model().params.device();
        Ok(rtrun_rlhf_model::cuda::memory_on(device, reset_peak))
    }

    /// Forgets every cached prefix.
    pub fn reset_prefix_cache(&mut self) -> Result<(), String> {
        self.state().engine.reset_prefix_cache();
        Ok(())
    }

    /// Counters, throughput and cache usage.
    pub fn stats(&self) -> EngineStats {
        self.shared_state().engine.stats()
    }
}
