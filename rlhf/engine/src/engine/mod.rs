//! [`LlmEngine`]: the synchronous generation engine. Each step runs the loop
//! scheduler → model runner → sampler → scheduler: the scheduler picks the chunks, the runner
//! computes their logits through the paged KV cache, the sampler draws one token per sampled
//! row (seeded per request, sample and position, so outputs do not depend on batching), and the
//! scheduler records it, applying stop tokens, stop strings (through the tokenizer) and
//! `max_tokens`.
//!
//! Requests are queued with [`LlmEngine::add_request`] and run by [`LlmEngine::step`];
//! [`LlmEngine::generate`] does both for a batch and returns its outputs in order. Outputs of
//! requests not collected by `generate` wait in the engine until [`LlmEngine::take_output`].

mod stats;
pub mod stop;
pub mod weights;

pub use stats::EngineStats;
pub use weights::WeightState;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use rtrun_rlhf_model::{CausalLm, TextTokenizer};
use serde::{Deserialize, Serialize};

use crate::api::{GeneratedSample, GenerationOutput, GenerationRequest, WeightBucket};
use crate::block::BlockManagerConfig;
use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::params::SamplingParams;
use crate::rng::token_uniform;
use crate::runner::ModelRunner;
use crate::runner::batch::{ChunkView, StepBatch};
use crate::sampling::device::RowSampling;
use crate::sampling::{SampledToken, Sampler, SamplingError};
use crate::scheduler::{RequestOutput, Scheduler, SchedulerConfig};
use crate::tp::{Followers, RankCommand};
use crate::{RequestId, SequenceId};
use weights::WeightResidency;

/// What [`LlmEngine::wake_up`] brings back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WakeTarget {
    /// The weights (woken first).
    Weights,
    /// The KV cache.
    KvCache,
}

impl std::str::FromStr for WakeTarget {
    type Err = EngineError;

    fn from_str(tag: &str) -> Result<Self, EngineError> {
        match tag {
            "weights" => Ok(WakeTarget::Weights),
            "kv_cache" => Ok(WakeTarget::KvCache),
            other => Err(EngineError::InvalidArgument(format!(
                "wake_up tags should be `weights` or `kv_cache`, found `{other}`"
            ))),
        }
    }
}

/// Counters the engine keeps beyond the scheduler's.
#[derive(Debug, Default)]
struct Counters {
    busy_seconds: f64,
    prompt_tokens: u64,
    requests_finished: u64,
    weight_updates: u64,
    sleeps: u64,
}

/// Logits per step from which the host sampler splits its rows over the intra-op threads (as
/// libtorch's element-wise operators do from ~32k elements per thread): the 27M-parameter
/// benchmark model's 64 rows of 8192 took 0.2 ms per step on one thread.
const PARALLEL_SAMPLING_FLOATS: usize = 65536;

/// The generation engine.
#[derive(Debug)]
pub struct LlmEngine {
    config: EngineConfig,
    runner: ModelRunner,
    scheduler: Scheduler,
    /// Scratch buffers of the host sampler, one per intra-op thread that samples rows at once.
    samplers: Vec<Mutex<Sampler>>,
    tokenizer: Option<TextTokenizer>,
    num_blocks: usize,
    next_request_id: u64,
    /// Prompts of unfinished requests (outputs repeat them).
    unfinished: HashMap<RequestId, Vec<u32>>,
    completed: HashMap<RequestId, GenerationOutput>,
    weights: WeightResidency,
    shapes: Vec<Vec<i64>>,
    counters: Counters,
    /// The other ranks of a tensor-parallel engine.
    followers: Option<Box<dyn Followers>>,
}

impl LlmEngine {
    /// An engine over `model` (which must live on `config.device` in `config.dtype`), with an
    /// optional tokenizer for stop strings, and its KV cache allocated.
    pub fn new(
        model: CausalLm,
        tokenizer: Option<TextTokenizer>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        Self::build(model, None, tokenizer, config)
    }

    /// Rank 0 of a tensor-parallel engine: `model` is its shard ([`crate::tp::shard_model`]),
    /// `tp` its group and `followers` the link to the other ranks, which run every step this
    /// engine runs ([`crate::tp::Follower`]).
    pub fn tensor_parallel(
        model: CausalLm,
        tp: crate::tp::TensorParallel,
        followers: Box<dyn Followers>,
        tokenizer: Option<TextTokenizer>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        if tp.rank() != 0 || tp.world_size() != followers.len() + 1 {
            return Err(EngineError::InvalidArgument(format!(
                "rank 0 of a tensor-parallel engine needs rank 0 of the group and a link to the \
                 {} other ranks, found rank {} and {} followers",
                tp.world_size().saturating_sub(1),
                tp.rank(),
                followers.len()
            )));
        }
        let mut engine = Self::build(model, Some(tp), tokenizer, config)?;
        engine.followers = Some(followers);
        Ok(engine)
    }

    fn build(
        model: CausalLm,
        tp: Option<crate::tp::TensorParallel>,
        tokenizer: Option<TextTokenizer>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        let (runner, shapes, num_blocks) = weights::rank_runner(model, tp, &config)?;
        let scheduler = Scheduler::new(SchedulerConfig {
            max_num_batched_tokens: config.max_num_batched_tokens,
            max_num_seqs: config.max_num_seqs,
            watermark: config.watermark,
            blocks: BlockManagerConfig {
                num_blocks,
                block_size: config.block_size,
                enable_prefix_caching: config.enable_prefix_caching,
            },
            seed: config.seed,
        })?;
        Ok(Self {
            config,
            runner,
            scheduler,
            samplers: (0..tch::get_num_threads().max(1))
                .map(|_| Mutex::new(Sampler::new()))
                .collect(),
            tokenizer,
            num_blocks,
            next_request_id: 0,
            unfinished: HashMap::new(),
            completed: HashMap::new(),
            weights: WeightResidency::Resident,
            shapes,
            counters: Counters::default(),
            followers: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The model (its weights may be asleep).
    pub fn model(&self) -> &CausalLm {
        self.runner.model()
    }

    /// The tokenizer, if the engine has one.
    pub fn tokenizer(&self) -> Option<&TextTokenizer> {
        self.tokenizer.as_ref()
    }

    /// KV blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Queues a request and returns its id; nothing runs until [`LlmEngine::step`].
    pub fn add_request(&mut self, request: GenerationRequest) -> Result<RequestId, EngineError> {
        let vocab = self.model().config().vocab_size;
        if let Some(&bad) = request.prompt_token_ids.iter().find(|&&t| i64::from(t) >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "prompt token ids should be below the vocabulary size {vocab}, found {bad}"
            )));
        }
        if !request.params.stop.is_empty() && self.tokenizer.is_none() {
            return Err(EngineError::InvalidRequest(
                "stop strings need a tokenizer, and this engine has none".into(),
            ));
        }
        let id = RequestId(self.next_request_id);
        self.scheduler.add_request(id, request.prompt_token_ids.clone(), request.params)?;
        self.next_request_id += 1;
        self.counters.prompt_tokens += request.prompt_token_ids.len() as u64;
        self.unfinished.insert(id, request.prompt_token_ids);
        Ok(id)
    }

    /// Whether requests are queued or running.
    pub fn has_unfinished(&self) -> bool {
        !self.unfinished.is_empty()
    }

    /// Runs one step; returns the requests that finished in it. Their outputs wait for
    /// [`LlmEngine::take_output`]. On an error every unfinished request is aborted (their
    /// outputs, reason `aborted`, can still be taken), so a failure never wedges the engine.
    pub fn step(&mut self) -> Result<Vec<RequestId>, EngineError> {
        if !self.has_unfinished() {
            return Ok(Vec::new());
        }
        self.require_awake("generation")?;
        let started = Instant::now();
        let result = self.step_inner();
        self.counters.busy_seconds += started.elapsed().as_secs_f64();
        match result {
            Ok(()) => Ok(self.collect_finished()),
            Err(error) => {
                self.abort_all();
                Err(error)
            }
        }
    }

    /// Runs steps until every queued request finished.
    pub fn run_until_idle(&mut self) -> Result<(), EngineError> {
        while self.has_unfinished() {
            self.step()?;
        }
        Ok(())
    }

    /// Takes the output of a finished request.
    pub fn take_output(&mut self, id: RequestId) -> Option<GenerationOutput> {
        self.completed.remove(&id)
    }

    /// Takes every finished output, by request id.
    pub fn take_completed(&mut self) -> Vec<(RequestId, GenerationOutput)> {
        let mut outputs: Vec<_> = self.completed.drain().collect();
        outputs.sort_by_key(|(id, _)| *id);
        outputs
    }

    /// Generates for a batch of requests and returns their outputs in order. Other queued
    /// requests progress too; their outputs stay in the engine. Requests are validated before
    /// any is queued, so an invalid one leaves the engine unchanged.
    pub fn generate(
        &mut self,
        requests: Vec<GenerationRequest>,
    ) -> Result<Vec<GenerationOutput>, EngineError> {
        self.require_awake("generate")?;
        let mut ids = Vec::with_capacity(requests.len());
        for request in requests {
            match self.add_request(request) {
                Ok(id) => ids.push(id),
                Err(error) => {
                    self.abort_requests(&ids);
                    return Err(error);
                }
            }
        }
        let wanted: BTreeSet<RequestId> = ids.iter().copied().collect();
        while wanted.iter().any(|id| !self.completed.contains_key(id)) && self.has_unfinished() {
            if let Err(error) = self.step() {
                self.abort_requests(&ids);
                return Err(error);
            }
        }
        Ok(ids.iter().filter_map(|id| self.completed.remove(id)).collect())
    }

    /// Sleep level 1 frees the KV cache and offloads the weights to host memory; level 2 frees
    /// the KV cache and releases the weights (a weight update must follow the wake-up). The
    /// prefix cache is reset either way. Queued requests stay queued.
    pub fn sleep(&mut self, level: u32) -> Result<(), EngineError> {
        if !(1..=2).contains(&level) {
            return Err(EngineError::InvalidArgument(format!(
                "sleep level should be 1 or 2, found {level}"
            )));
        }
        self.require_idle("sleep")?;
        self.scheduler.reset_prefix_cache();
        self.on_every_rank(RankCommand::Sleep(level), |engine| {
            weights::sleep_rank(&mut engine.runner, &mut engine.weights, level)
        })?;
        self.counters.sleeps += 1;
        tracing::debug!(level, "engine asleep");
        Ok(())
    }

    /// Wakes the weights and/or the KV cache (an empty list wakes both); weights always first.
    pub fn wake_up(&mut self, targets: &[WakeTarget]) -> Result<(), EngineError> {
        self.on_every_rank(RankCommand::WakeUp(targets.to_vec()), |engine| {
            let (runner, weights) = (&mut engine.runner, &mut engine.weights);
            weights::wake_rank(runner, weights, &engine.shapes, engine.num_blocks, targets)
        })
    }

    /// Runs `local` on this rank and `command` on every other rank of a tensor-parallel engine
    /// at the same time (just `local` without one). When a rank fails, its error (naming the
    /// rank and its node) is the one returned: this rank's is then usually a broken collective.
    fn on_every_rank<T>(
        &mut self,
        command: RankCommand,
        local: impl FnOnce(&mut Self) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let Some(mut followers) = self.followers.take() else {
            return local(self);
        };
        let result = match followers.start(&command) {
            Ok(()) => {
                let mine = local(self);
                match (followers.finish(), mine) {
                    (Err(theirs), _) => Err(theirs),
                    (Ok(()), mine) => mine,
                }
            }
            Err(error) => Err(error),
        };
        self.followers = Some(followers);
        result
    }

    /// Ranks of the engine (1 without tensor parallelism).
    pub fn tensor_parallel_size(&self) -> usize {
        self.runner.shard().world_size
    }

    /// Copies a bucket of weights into the model (all-or-nothing per bucket) and resets the
    /// prefix cache, whose K/V the old weights computed. Needs resident weights and no running
    /// sequence. Returns the number of tensors updated.
    pub fn update_weights(&mut self, bucket: &WeightBucket) -> Result<usize, EngineError> {
        self.update_with("update_weights", |model| weights::apply_bucket(model, bucket))
    }

    /// A tensor-parallel engine's update by rank: `buckets[r]` is rank `r`'s shard
    /// ([`crate::tp::reshard::engine_buckets`]); rank 0 applies its own and hands every other
    /// rank its bucket. Without tensor parallelism `buckets` is the one bucket of rank 0.
    pub fn update_weights_by_rank(
        &mut self,
        buckets: &[WeightBucket],
    ) -> Result<usize, EngineError> {
        let (mine, theirs) = buckets.split_first().ok_or_else(|| {
            EngineError::InvalidArgument("update_weights_by_rank needs rank 0's bucket".into())
        })?;
        let updated = self.update_weights(mine)?;
        match self.followers.as_mut() {
            Some(followers) => followers.update_weights(theirs)?,
            None if theirs.is_empty() => {}
            None => {
                return Err(EngineError::InvalidArgument(format!(
                    "{} buckets for an engine of one rank",
                    buckets.len()
                )));
            }
        }
        Ok(updated)
    }

    /// A weight update of any transport: needs resident weights and no running sequence
    /// (unless `weight_updates_in_flight`: then running sequences continue with the new
    /// weights, keeping the K/V the old ones computed), runs `update` on the model, then resets
    /// the prefix cache (whose K/V the old weights computed) and counts the update.
    pub fn update_with<T>(
        &mut self,
        operation: &'static str,
        update: impl FnOnce(&CausalLm) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        self.weights.require_resident(operation)?;
        if !self.config.weight_updates_in_flight {
            self.require_idle(operation)?;
        }
        let out = update(self.runner.model());
        // Even a failed update may have written some weights.
        self.runner.weights_changed();
        let out = out?;
        self.scheduler.reset_prefix_cache();
        self.counters.weight_updates += 1;
        Ok(out)
    }

    /// Receives the weights `metas` describes from rank 0 of the weight-sync group `comm` into
    /// the model in place, then resets the prefix cache; the conditions of
    /// [`LlmEngine::update_weights`] apply. Returns the bytes received.
    pub fn receive_weights(
        &mut self,
        comm: &mut rtrun::collective::Communicator,
        metas: &[crate::weight_sync::WeightMeta],
        bucket_bytes: usize,
    ) -> Result<usize, EngineError> {
        self.update_with("receive_weights", |model| {
            crate::weight_sync::receive_weights(comm, model, metas, bucket_bytes)
        })
    }

    /// Copies a bucket the policy exported by CUDA IPC into the model in place, then resets
    /// the prefix cache; the conditions of [`LlmEngine::update_weights`] apply. Returns the
    /// bytes copied.
    pub fn receive_ipc_bucket(
        &mut self,
        bucket: &crate::weight_ipc::IpcWeightBucket,
    ) -> Result<u64, EngineError> {
        self.update_with("receive_ipc_bucket", |model| {
            crate::weight_ipc::receive_bucket(model, bucket)
        })
    }

    /// Tags every token sampled from now on with `version` (the trainer's policy version of
    /// the weights it just sent); outputs carry each token's version.
    pub fn set_weight_version(&mut self, version: u64) {
        self.scheduler.set_weight_version(version);
    }

    /// The version new tokens are tagged with (0 until [`LlmEngine::set_weight_version`]).
    pub fn weight_version(&self) -> u64 {
        self.scheduler.weight_version()
    }

    /// Forgets every cached prefix block (K/V computed by earlier weights).
    pub fn reset_prefix_cache(&mut self) {
        self.scheduler.reset_prefix_cache();
    }

    /// Counters, throughput and cache usage.
    pub fn stats(&self) -> EngineStats {
        EngineStats::collect(
            &self.scheduler.stats(),
            &self.counters,
            self.weights.state(),
            self.runner.has_kv_cache(),
            self.completed.len(),
            self.config.block_size,
            self.runner.static_decode_stats(),
        )
    }

    fn require_awake(&self, operation: &'static str) -> Result<(), EngineError> {
        self.weights.require_resident(operation)?;
        if !self.runner.has_kv_cache() {
            return Err(EngineError::Asleep { operation, part: "kv cache" });
        }
        Ok(())
    }

    fn require_idle(&self, operation: &'static str) -> Result<(), EngineError> {
        match self.scheduler.num_running() {
            0 => Ok(()),
            running => Err(EngineError::Busy { operation, running }),
        }
    }

    fn step_inner(&mut self) -> Result<(), EngineError> {
        let output = self.scheduler.schedule()?;
        if output.is_empty() {
            return Err(EngineError::Stalled(self.unfinished.len()));
        }
        let block_size = self.config.block_size;
        let batch = {
            let mut views = Vec::with_capacity(output.chunks.len());
            for chunk in &output.chunks {
                let unknown = || crate::scheduler::SchedulerError::UnknownSequence(chunk.sequence);
                views.push(ChunkView {
                    sequence: chunk.sequence,
                    tokens: self.scheduler.sequence_tokens(chunk.sequence).ok_or_else(unknown)?,
                    start: chunk.start,
                    num_tokens: chunk.num_tokens,
                    block_table: self.scheduler.block_table(chunk.sequence).ok_or_else(unknown)?,
                    sample: chunk.sample,
                });
            }
            StepBatch::build(block_size, self.config.max_prefill_group_area, &views)?
        };
        let command = match self.followers.is_some() {
            true => RankCommand::Step(batch.clone()),
            false => RankCommand::Step(StepBatch::default()),
        };
        // On a GPU every row is sampled on the device (`sampling::device`): only the chosen
        // tokens and their log-probs cross to the host, not `[rows, vocab]` logits. On the CPU
        // the host sampler stays the one path: it is exact in f64 and the tests' oracle.
        if self.runner.device().is_cuda() {
            // Owned: the step below borrows the engine mutably.
            let contexts: Vec<(SamplingParams, f64)> = self
                .sampling_contexts(&batch.sampled)?
                .into_iter()
                .map(|(params, uniform)| (params.clone(), uniform))
                .collect();
            let picked = self.on_every_rank(command, |engine| {
                let rows: Vec<RowSampling<'_>> = contexts
                    .iter()
                    .map(|(params, uniform)| RowSampling { params, uniform: *uniform })
                    .collect();
                engine.runner.execute_sampled(&batch, &rows)
            })?;
            for (&sequence, sampled) in batch.sampled.iter().zip(picked) {
                self.record(sequence, sampled)?;
            }
            return Ok(());
        }
        let logits = self.on_every_rank(command, |engine| engine.runner.execute_logits(&batch))?;
        let sampled = crate::runner::cpu_kernels::with_floats(logits, |logits| {
            self.sample_rows(&batch.sampled, logits)
        })??;
        for (&sequence, sampled) in batch.sampled.iter().zip(sampled) {
            self.record(sequence, sampled?)?;
        }
        Ok(())
    }

    /// Each of `sequences`' sampling parameters and the uniform number of its next token.
    fn sampling_contexts(
        &self,
        sequences: &[SequenceId],
    ) -> Result<Vec<(&SamplingParams, f64)>, EngineError> {
        sequences
            .iter()
            .map(|&sequence| {
                let unknown = crate::scheduler::SchedulerError::UnknownSequence(sequence);
                let context = self.scheduler.sampling_context(sequence).ok_or(unknown)?;
                let uniform =
                    token_uniform(context.seed, context.sample_index, context.output_position);
                Ok((context.params, uniform))
            })
            .collect()
    }

    /// Samples row `i` of `logits` (`[rows, vocab]`) for `sequences[i]`, the rows split over
    /// the intra-op threads from [`PARALLEL_SAMPLING_FLOATS`] logits on; each row's draw
    /// depends only on its request's seed and position, so the split changes no result.
    fn sample_rows(
        &self,
        sequences: &[SequenceId],
        logits: &[f32],
    ) -> Result<Vec<Result<SampledToken, EngineError>>, EngineError> {
        let vocab = logits.len().checked_div(sequences.len()).unwrap_or(0);
        let contexts = self.sampling_contexts(sequences)?;
        let results: Vec<OnceLock<Result<SampledToken, SamplingError>>> =
            sequences.iter().map(|_| OnceLock::new()).collect();
        let grain = PARALLEL_SAMPLING_FLOATS.div_ceil(vocab.max(1));
        let samplers = &self.samplers;
        crate::runner::cpu_kernels::parallel_for(sequences.len(), grain, |begin, end| {
            // A sampler's scratch buffers per chunk: the engine's own ones while free.
            let mut own = None;
            let mut shared = samplers.iter().find_map(|s| s.try_lock().ok());
            let sampler = match shared.as_deref_mut() {
                Some(sampler) => sampler,
                None => own.insert(Sampler::new()),
            };
            for row in begin..end {
                let (params, uniform) = contexts[row];
                let sampled =
                    sampler.sample(&logits[row * vocab..(row + 1) * vocab], params, uniform);
                let _ = results[row].set(sampled);
            }
        })?;
        // `parallel_for` returns once every chunk ran, so every row holds its result.
        let sampled =
            results.into_iter().enumerate().map(|(row, result)| match result.into_inner() {
                Some(result) => result.map_err(EngineError::from),
                None => Err(EngineError::InvalidArgument(format!(
                    "row {row} of the step was not sampled"
                ))),
            });
        Ok(sampled.collect())
    }

    /// Appends a sampled token to its sequence (and applies the request's stop strings).
    fn record(&mut self, sequence: SequenceId, sampled: SampledToken) -> Result<(), EngineError> {
        let unknown = crate::scheduler::SchedulerError::UnknownSequence(sequence);
        let stop = {
            let context = self.scheduler.sampling_context(sequence).ok_or(unknown)?;
            (!context.params.stop.is_empty()).then(|| context.params.stop.clone())
        };
        let tokenizer = self.tokenizer.as_ref();
        self.scheduler.on_step_output_with(sequence, sampled.token, sampled.logprob, |output| {
            match (tokenizer, &stop) {
                (Some(tokenizer), Some(stop)) => stop::find_stop_string(tokenizer, stop, output),
                _ => None,
            }
        })?;
        Ok(())
    }

    fn collect_finished(&mut self) -> Vec<RequestId> {
        let finished = self.scheduler.take_finished();
        let mut ids = Vec::with_capacity(finished.len());
        for output in finished {
            ids.push(output.request_id);
            let prompt = self.unfinished.remove(&output.request_id).unwrap_or_default();
            self.counters.requests_finished += 1;
            self.completed.insert(output.request_id, convert_output(prompt, output));
        }
        ids
    }

    /// Aborts every unfinished request; their outputs (reason `aborted`) become takeable.
    fn abort_all(&mut self) {
        let ids: Vec<RequestId> = self.unfinished.keys().copied().collect();
        for id in ids {
            if let Err(error) = self.scheduler.abort(id) {
                tracing::warn!(%id, %error, "abort after a failed step");
            }
        }
        self.collect_finished();
    }

    /// Aborts the given requests where still unfinished and discards their outputs (used to
    /// undo a partly queued batch).
    pub fn abort_requests(&mut self, ids: &[RequestId]) {
        for id in ids {
            if self.unfinished.contains_key(id) {
                let _ = self.scheduler.abort(*id);
            }
        }
        self.collect_finished();
        for id in ids {
            self.completed.remove(id);
        }
    }
}

/// The engine's output form of a finished request.
fn convert_output(prompt_token_ids: Vec<u32>, output: RequestOutput) -> GenerationOutput {
    let mut samples = output.samples;
    samples.sort_by_key(|s| s.sample_index);
    GenerationOutput {
        prompt_token_ids,
        samples: samples
            .into_iter()
            .map(|s| GeneratedSample {
                token_ids: s.token_ids,
                log_probs: s.logprobs.unwrap_or_default(),
                weight_versions: s.weight_versions,
                finish_reason: s.finish_reason,
            })
            .collect(),
    }
}
