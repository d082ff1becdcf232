//! [`EngineActor`]: the engine as an rtrun actor (what OpenRLHF calls a vLLM engine actor).
//!
//! Several trainer ranks share one engine: each submits with
//! [`add_requests`](EngineActor::add_requests) and collects with
//! [`get_responses`](EngineActor::get_responses), which runs everything queued (all ranks'
//! requests form one continuous batch) and returns exactly that rank's outputs in its
//! submission order ([`RequestRouter`]). [`generate`](EngineActor::generate) is the one-call
//! form. Errors cross the runtime as strings.
//!
//! A tensor-parallel engine (`engine.tensor_parallel_size: N`) is an [`rtrun::ActorGroup`] of N
//! engine actors ([`EngineActor::create_group`]). Each loads the checkpoint, keeps its shard
//! and joins the group's ring; rank 0 is the engine callers talk to (generation, sleep, wake-up,
//! prefix cache) and steps the others through [`EngineActor::tp_command`], one call per step.
//! Weight updates go to every rank, each with its own shard.

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
use crate::tp::{Follower, Followers, RankCommand, TensorParallel, TpLayout};
use crate::weight_sync::{WeightMeta, WeightSyncGroup};
use rtrun::collective::Communicator;

/// How to build an [`EngineActor`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineActorConfig {
    /// A Hugging Face directory: `config.json`, `*.safetensors` and optionally
    /// `tokenizer.json` (needed for stop strings).
    pub model_dir: PathBuf,
    /// The engine's configuration (device and dtype select how the model is loaded).
    pub engine: EngineConfig,
}

/// What an engine actor is in its group.
#[derive(Debug)]
enum Role {
    /// The engine: the whole model, or rank 0 of a tensor-parallel engine.
    Engine(Box<LlmEngine>),
    /// Rank 0 of a tensor-parallel engine until `attach_ranks` gives it the other ranks.
    Unattached(Box<Rank0Parts>),
    /// Another rank of a tensor-parallel engine.
    Follower(Box<Follower>),
    /// Rank 0 whose engine could not be built from its attached ranks.
    Failed(String),
}

/// What rank 0 builds its engine from once its ranks are attached.
#[derive(Debug)]
struct Rank0Parts {
    model: CausalLm,
    tp: TensorParallel,
    tokenizer: Option<TextTokenizer>,
    config: EngineConfig,
}

/// The engine plus the per-rank routing of its outputs.
#[derive(Debug)]
struct EngineActorState {
    role: Role,
    /// This actor's rank in its tensor-parallel engine (0 without one).
    tp_rank: usize,
    router: RequestRouter<GenerationOutput>,
    /// Engine request id → router request id, for requests submitted through `add_requests`.
    routed: HashMap<RequestId, RequestId>,
    /// The weight-sync group, once joined.
    weight_sync: Option<Communicator>,
    /// Engine request id → the caller's tag, for requests submitted through `stream_add`.
    streamed: HashMap<RequestId, u64>,
    /// Streamed requests that finished, waiting for `stream_step` to return them.
    stream_done: Vec<(u64, GenerationOutput)>,
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
    /// With `tensor_parallel_size` above 1 the actor must be a member of an actor group of that
    /// size ([`EngineActor::create_group`]): it keeps its rank's shard and joins the group.
    pub fn load(config: EngineActorConfig) -> Result<Self, EngineError> {
        let device = config.engine.torch_device()?;
        let kind = config.engine.torch_kind()?;
        let world = config.engine.tensor_parallel_size;
        if world <= 1 {
            let model = CausalLm::from_pretrained(&config.model_dir, device, kind)?;
            let engine = LlmEngine::new(model, load_tokenizer(&config)?, config.engine)?;
            return Ok(Self::from_engine(engine));
        }
        let (rank, comm) = join_tp_group(world)?;
        // The whole checkpoint passes through host memory once; the device gets the shard.
        let whole = CausalLm::from_pretrained(&config.model_dir, tch::Device::Cpu, kind)?;
        let layout = TpLayout::new(whole.config(), world)?;
        let model = crate::tp::shard_model(&whole, &layout, rank, device, kind)?;
        drop(whole);
        let tp = TensorParallel::new(comm);
        let role = match rank {
            0 => Role::Unattached(Box::new(Rank0Parts {
                model,
                tp,
                tokenizer: load_tokenizer(&config)?,
                config: config.engine,
            })),
            _ => Role::Follower(Box::new(Follower::new(model, tp, &config.engine)?)),
        };
        Ok(Self::with_role(role, rank))
    }

    /// Wraps an engine built in this process.
    pub fn from_engine(engine: LlmEngine) -> Self {
        Self::with_role(Role::Engine(Box::new(engine)), 0)
    }

    fn with_role(role: Role, tp_rank: usize) -> Self {
        Self {
            state: Mutex::new(EngineActorState {
                role,
                tp_rank,
                router: RequestRouter::new(),
                routed: HashMap::new(),
                weight_sync: None,
                streamed: HashMap::new(),
                stream_done: Vec::new(),
            }),
        }
    }

    /// Creates one engine of `config.engine.tensor_parallel_size` ranks as the actor group
    /// `name` (`options(rank, group_options)` gives each rank its placement) and attaches its
    /// ranks to rank 0. Returns the group; rank 0 is the engine's handle.
    pub fn create_group(
        name: &str,
        config: &EngineActorConfig,
        mut options: impl FnMut(usize, rtrun::ActorOptions) -> rtrun::Result<rtrun::ActorOptions>,
    ) -> Result<rtrun::ActorGroup<EngineActor>, EngineError> {
        let world = config.engine.tensor_parallel_size.max(1);
        let failed = |e: rtrun::Error| EngineError::TensorParallel {
            rank: 0,
            message: format!("creating the engine group `{name}`: {e}"),
        };
        let group = rtrun::ActorGroup::create(name, world, Default::default(), |rank, base| {
            EngineActor::remote_with(options(rank, base)?, config.clone())
        })
        .map_err(failed)?;
        if world > 1 {
            let members = group.members();
            let others: Vec<EngineActorRef> = members[1..].to_vec();
            let attach = members[0].attach_ranks(others).get().map_err(failed)?;
            attach.map_err(|message| EngineError::TensorParallel { rank: 0, message })?;
        }
        Ok(group)
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

/// The tokenizer of the checkpoint, when it has one.
fn load_tokenizer(config: &EngineActorConfig) -> Result<Option<TextTokenizer>, EngineError> {
    match config.model_dir.join("tokenizer.json").is_file() {
        true => Ok(Some(TextTokenizer::from_dir(&config.model_dir)?)),
        false => Ok(None),
    }
}

/// This actor's rank in its engine's group of `world`, and the group's communicator.
fn join_tp_group(world: usize) -> Result<(usize, Communicator), EngineError> {
    let not_member = |found: String| {
        EngineError::InvalidConfig(format!(
            "tensor_parallel_size {world} needs the engine actor to be a member of an actor group \
             of {world} (EngineActor::create_group), found {found}"
        ))
    };
    let context = rtrun::context().map_err(|e| not_member(e.to_string()))?;
    let membership = context.group.ok_or_else(|| not_member("no group".into()))?;
    if membership.world_size != world {
        return Err(not_member(format!("a group of {}", membership.world_size)));
    }
    let rank = membership.rank;
    let config = rtrun::collective::CollectiveConfig::from_membership(&membership);
    let comm = Communicator::init(config).map_err(|e| EngineError::TensorParallel {
        rank,
        message: format!("joining the engine's group: {e}"),
    })?;
    Ok((rank, comm))
}

/// Rank 0's link to the other ranks' actors.
#[derive(Debug)]
struct ActorFollowers {
    ranks: Vec<EngineActorRef>,
    /// The node each rank runs on, for errors.
    nodes: Vec<String>,
    pending: Vec<rtrun::ObjectRef<Result<(), String>>>,
}

impl ActorFollowers {
    fn failed(&self, index: usize, message: impl std::fmt::Display) -> EngineError {
        EngineError::TensorParallel {
            rank: index + 1,
            message: format!(
                "{} (on node {}): {message}",
                self.ranks[index].id(),
                self.nodes[index]
            ),
        }
    }

    fn wait_all(&mut self) -> Result<(), EngineError> {
        let pending = std::mem::take(&mut self.pending);
        let mut first = Ok(());
        for (index, answer) in pending.into_iter().enumerate() {
            let result = match answer.get() {
                Ok(Ok(())) => Ok(()),
                Ok(Err(message)) => Err(self.failed(index, message)),
                Err(error) => Err(self.failed(index, error)),
            };
            if first.is_ok() {
                first = result;
            }
        }
        first
    }
}

impl Followers for ActorFollowers {
    fn len(&self) -> usize {
        self.ranks.len()
    }

    fn start(&mut self, command: &RankCommand) -> Result<(), EngineError> {
        self.pending = self.ranks.iter().map(|rank| rank.tp_command(command.clone())).collect();
        Ok(())
    }

    fn finish(&mut self) -> Result<(), EngineError> {
        self.wait_all()
    }

    fn update_weights(&mut self, buckets: &[WeightBucket]) -> Result<(), EngineError> {
        crate::tp::follower::check_bucket_count(self.ranks.len(), buckets.len())?;
        self.pending = self
            .ranks
            .iter()
            .zip(buckets)
            .map(|(rank, b)| rank.update_weights(b.clone()))
            .collect();
        self.wait_all()
    }
}

impl EngineActorState {
    /// The engine, on rank 0 of an attached or single-rank engine.
    fn engine(&mut self) -> Result<&mut LlmEngine, String> {
        match &mut self.role {
            Role::Engine(engine) => Ok(engine),
            Role::Unattached(_) => Err("rank 0 of a tensor-parallel engine has no ranks attached \
                 yet (EngineActor::create_group attaches them)"
                .into()),
            Role::Follower(_) => Err(format!(
                "this is rank {} of a tensor-parallel engine: call its rank 0",
                self.tp_rank
            )),
            Role::Failed(message) => Err(message.clone()),
        }
    }

    /// The model shard (or whole model) this actor holds.
    fn model(&self) -> Option<&CausalLm> {
        match &self.role {
            Role::Engine(engine) => Some(engine.model()),
            Role::Unattached(parts) => Some(&parts.model),
            Role::Follower(follower) => Some(follower.model()),
            Role::Failed(_) => None,
        }
    }

    /// Runs a weight update on this rank's model, whatever its role.
    fn update<T>(
        &mut self,
        operation: &'static str,
        update: impl FnOnce(&CausalLm) -> Result<T, EngineError>,
    ) -> Result<T, String> {
        match &mut self.role {
            Role::Engine(engine) => engine.update_with(operation, update),
            Role::Follower(follower) => follower.update(operation, update),
            Role::Unattached(parts) => update(&parts.model),
            Role::Failed(message) => return Err(message.clone()),
        }
        .map_err(|e| e.to_string())
    }

    /// Hands every finished routed output to the router.
    fn route_completed(&mut self) -> Result<(), EngineError> {
        let Role::Engine(engine) = &mut self.role else { return Ok(()) };
        for (engine_id, output) in engine.take_completed() {
            if let Some(tag) = self.streamed.remove(&engine_id) {
                self.stream_done.push((tag, output));
                continue;
            }
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
        let result = state.engine()?.generate(requests).map_err(|e| e.to_string());
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
        let engine = state.engine()?;
        let mut engine_ids = Vec::with_capacity(requests.len());
        for request in requests {
            match engine.add_request(request) {
                Ok(id) => engine_ids.push(id),
                Err(error) => {
                    // Undo: run nothing of this call. The requests are only queued, so aborting
                    // them is immediate; their aborted outputs are dropped.
                    engine.abort_requests(&engine_ids);
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
        let run = state.engine()?.run_until_idle();
        state.route_completed().map_err(|e| e.to_string())?;
        run.map_err(|e| e.to_string())?;
        Ok(state.router.take_finished(actor_rank).into_iter().map(|(_, output)| output).collect())
    }

    /// Queues requests whose outputs [`stream_step`](Self::stream_step) returns by `tag` as they
    /// finish (the streaming form of generation, for partial and asynchronous rollouts). All
    /// are validated first, so on an error none is queued.
    pub fn stream_add(&mut self, requests: Vec<(u64, GenerationRequest)>) -> Result<(), String> {
        let state = self.state();
        let engine = state.engine()?;
        let mut added = Vec::with_capacity(requests.len());
        for (tag, request) in requests {
            match engine.add_request(request) {
                Ok(id) => added.push((id, tag)),
                Err(error) => {
                    let ids: Vec<RequestId> = added.iter().map(|&(id, _)| id).collect();
                    engine.abort_requests(&ids);
                    return Err(error.to_string());
                }
            }
        }
        state.streamed.extend(added);
        Ok(())
    }

    /// Runs at most `max_steps` engine steps (fewer when nothing is left to run) and returns the
    /// streamed requests that finished, by tag. Requests still running stay in the engine:
    /// weights that arrive before the next call apply to their remaining tokens (with
    /// `weight_updates_in_flight`). On a failed step the error is returned and the unfinished
    /// requests are aborted; their outputs (reason `aborted`) come with the next call.
    pub fn stream_step(&mut self, max_steps: u32) -> Result<crate::StreamPoll, String> {
        let state = self.state();
        let engine = state.engine()?;
        let mut steps = 0;
        let mut run = Ok(());
        while steps < max_steps && engine.has_unfinished() {
            steps += 1;
            if let Err(error) = engine.step() {
                run = Err(error.to_string());
                break;
            }
        }
        let weight_version = engine.weight_version();
        state.route_completed().map_err(|e| e.to_string())?;
        run?;
        Ok(crate::StreamPoll {
            finished: std::mem::take(&mut state.stream_done),
            unfinished: state.streamed.len(),
            steps,
            weight_version,
        })
    }

    /// Aborts every streamed request still unfinished and forgets the finished ones nobody
    /// took; returns how many were dropped.
    pub fn stream_abort(&mut self) -> Result<usize, String> {
        let state = self.state();
        let ids: Vec<RequestId> = state.streamed.keys().copied().collect();
        state.engine()?.abort_requests(&ids);
        let dropped = ids.len() + state.stream_done.len();
        state.streamed.clear();
        state.stream_done.clear();
        Ok(dropped)
    }

    /// Tags every token sampled from now on with the policy version `version` (called after
    /// each weight sync; the engine starts at 0).
    pub fn set_weight_version(&mut self, version: u64) -> Result<(), String> {
        self.state().engine()?.set_weight_version(version);
        Ok(())
    }

    /// 1: free the KV cache and offload the weights to host memory; 2: also drop the weights
    /// (every rank of a tensor-parallel engine).
    pub fn sleep(&mut self, level: u32) -> Result<(), String> {
        self.state().engine()?.sleep(level).map_err(|e| e.to_string())
    }

    /// Wakes `"weights"` and/or `"kv_cache"` (empty: both, weights first) on every rank.
    pub fn wake_up(&mut self, tags: Vec<String>) -> Result<(), String> {
        let targets = tags
            .iter()
            .map(|tag| WakeTarget::from_str(tag))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        self.state().engine()?.wake_up(&targets).map_err(|e| e.to_string())
    }

    /// Copies a bucket of weights into this rank's model (a tensor-parallel rank gets its own
    /// shard, [`crate::tp::reshard::engine_buckets`]); on rank 0 it also resets the prefix
    /// cache.
    pub fn update_weights(&mut self, bucket: WeightBucket) -> Result<(), String> {
        self.state()
            .update("update_weights", |model| crate::engine::weights::apply_bucket(model, &bucket))
            .map(drop)
    }

    /// Joins the weight-sync group (policy rank 0 plus every engine rank that takes this
    /// group's weights); every member must be called at about the same time, since this waits
    /// for the rendezvous.
    pub fn join_weight_sync(&mut self, group: WeightSyncGroup) -> Result<(), String> {
        let comm = group.join().map_err(|e| e.to_string())?;
        self.state().weight_sync = Some(comm);
        Ok(())
    }

    /// Receives the weights `metas` describes from the weight-sync group's rank 0 in place and
    /// resets the prefix cache (called together with the policy's `broadcast_weights`). On a
    /// tensor-parallel rank `metas` describes the rank's shard in the engine layout.
    pub fn receive_weights(
        &mut self,
        metas: Vec<WeightMeta>,
        bucket_bytes: usize,
    ) -> Result<(), String> {
        let guard = self.state();
        let state = &mut *guard;
        let mut comm =
            state.weight_sync.take().ok_or("receive_weights needs join_weight_sync first")?;
        let result = state.update("receive_weights", |model| {
            crate::weight_sync::receive_weights(&mut comm, model, &metas, bucket_bytes)
        });
        state.weight_sync = Some(comm);
        result.map(drop)
    }

    /// Copies a weight bucket the policy exported by CUDA IPC into the model in place (the
    /// policy keeps the bucket's buffer until every engine has returned).
    pub fn receive_ipc_bucket(&mut self, bucket: crate::IpcWeightBucket) -> Result<u64, String> {
        self.state()
            .update("receive_ipc_bucket", |model| crate::weight_ipc::receive_bucket(model, &bucket))
    }

    /// The CUDA caching allocator's statistics of this engine's device (`None` on the CPU);
    /// `reset_peak` starts a new peak after reading.
    pub fn cuda_memory(
        &self,
        reset_peak: bool,
    ) -> Result<Option<rtrun_rlhf_model::cuda::CudaMemory>, String> {
        let state = self.shared_state();
        let Some(model) = state.model() else { return Ok(None) };
        Ok(rtrun_rlhf_model::cuda::memory_on(model.params.device(), reset_peak))
    }

    /// Forgets every cached prefix.
    pub fn reset_prefix_cache(&mut self) -> Result<(), String> {
        self.state().engine()?.reset_prefix_cache();
        Ok(())
    }

    /// Counters, throughput and cache usage (of rank 0 for a tensor-parallel engine).
    pub fn stats(&self) -> Result<EngineStats, String> {
        let mut state = self.shared_state();
        Ok(state.engine()?.stats())
    }

    /// Rank 0 of a tensor-parallel engine: takes the other ranks (in rank order) and builds
    /// the engine. Each rank reports its node, which errors then name.
    pub fn attach_ranks(&mut self, ranks: Vec<EngineActorRef>) -> Result<(), String> {
        let state = self.state();
        let failed = Role::Failed("attaching its ranks failed".into());
        let parts = match std::mem::replace(&mut state.role, failed) {
            Role::Unattached(parts) => parts,
            other => {
                state.role = other;
                return Err("attach_ranks is for rank 0 of a tensor-parallel engine".into());
            }
        };
        let nodes = ranks
            .iter()
            .map(|rank| match rank.whereabouts().get() {
                Ok(Ok(node)) => node,
                Ok(Err(e)) => format!("unknown ({e})"),
                Err(e) => format!("unknown ({e})"),
            })
            .collect();
        let followers = Box::new(ActorFollowers { ranks, nodes, pending: Vec::new() });
        let Rank0Parts { model, tp, tokenizer, config } = *parts;
        let engine = LlmEngine::tensor_parallel(model, tp, followers, tokenizer, config)
            .map_err(|e| e.to_string())?;
        state.role = Role::Engine(Box::new(engine));
        Ok(())
    }

    /// A tensor-parallel rank other than 0: runs one command of rank 0 (a step, a sleep, a
    /// wake-up).
    pub fn tp_command(&mut self, command: RankCommand) -> Result<(), String> {
        let state = self.state();
        let rank = state.tp_rank;
        match &mut state.role {
            Role::Follower(follower) => follower.handle(&command).map_err(|e| e.to_string()),
            _ => Err(format!("tp_command is for ranks above 0, this is rank {rank}")),
        }
    }

    /// The node this rank runs on (its id and IP), for errors that name it.
    pub fn whereabouts(&self) -> Result<String, String> {
        let context = rtrun::context().map_err(|e| e.to_string())?;
        Ok(format!("{} ({})", context.node_id, context.node_ip))
    }
}
