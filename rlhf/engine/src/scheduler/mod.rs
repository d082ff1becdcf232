//! The continuous-batching scheduler: a pure state machine over waiting, running and finished
//! sequences that decides, step by step, which token positions the model runs.
//!
//! Each request brings a prompt, [`SamplingParams`] and `n`; every sample is its own sequence.
//! Samples of one request are queued together and share their full prompt blocks through the
//! prefix cache: the first sample's blocks are registered as soon as they are scheduled, so the
//! following samples admitted in the same step find them (see the crate-level contract on K/V
//! writes within a step).
//!
//! One [`Scheduler::schedule`] call (vLLM v1's policy, simplified):
//! 1. Running sequences, oldest admission first, each get their next chunk: one token when
//!    decoding, up to the token budget when still prefilling. When a sequence needs a new block
//!    and none is free, the most recently admitted running sequence is preempted *by
//!    recompute*: its blocks are freed and it goes back to the front of the waiting queue with
//!    its generated tokens, to be prefilled again later (the prefix cache usually makes that
//!    cheap). Since sampling is a pure function of (seed, sample, position), recomputation is
//!    invisible in the outputs.
//! 2. If nobody was preempted, waiting sequences are admitted first-come-first-served while the
//!    budget, `max_num_seqs` and the free blocks (minus a watermark kept for decode growth) allow.
//!    The whole token list gets blocks at admission; the prefill itself may be chunked.
//!
//! Fairness: strict FCFS admission (no skipping ahead), and preemption always hits the youngest,
//! so the oldest request always progresses. Liveness: `add_request` rejects a sequence that
//! could not fit in the whole pool, so the oldest sequence alone can always complete.
//!
//! The engine reports every sampled token with [`Scheduler::on_step_output`] before calling
//! `schedule` again; a late report for a sequence preempted meanwhile is rejected (the token is
//! recomputed identically).

mod sequence;

pub use sequence::{FinishReason, RequestOutput, SampleOutput};

use crate::block::{
    BlockError, BlockId, BlockManager, BlockManagerConfig, BlockManagerStats, PrefixCacheReset,
};
use crate::params::{SamplingParams, SamplingParamsError};
use crate::rng::mix64;
use crate::{RequestId, SequenceId};
use sequence::{Sequence, SequenceStatus};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use thiserror::Error;

/// Tunables of the scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Token positions per step (prefill chunks plus decodes). Default 8192.
    pub max_num_batched_tokens: usize,
    /// Running sequences at most. Default 256 (vLLM's default).
    pub max_num_seqs: usize,
    /// Fraction of the blocks admission keeps free for running sequences to grow into, so a
    /// fresh admission does not immediately cause preemptions. In `[0, 1)`. Default 0.01.
    pub watermark: f64,
    /// The KV block pool.
    pub blocks: BlockManagerConfig,
    /// Base seed for requests that bring none (their seed is derived from it and the request
    /// id, so a whole engine run is reproducible). Default 0.
    pub seed: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            watermark: 0.01,
            blocks: BlockManagerConfig::default(),
            seed: 0,
        }
    }
}

/// Errors of the scheduler.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SchedulerError {
    /// The configuration is unusable.
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(String),
    /// The request's sampling parameters failed validation.
    #[error("{request}: {source}")]
    InvalidParams {
        /// The request.
        request: RequestId,
        /// What was wrong.
        source: SamplingParamsError,
    },
    /// A request with this id is still unfinished.
    #[error("{0} was already added and is not finished")]
    DuplicateRequest(RequestId),
    /// The prompt had no tokens.
    #[error("{0}: prompt must have at least one token, found 0")]
    EmptyPrompt(RequestId),
    /// One sample could never fit in the KV pool.
    #[error(
        "{request}: prompt plus max_tokens needs {needed} kv blocks, the pool has {usable} usable"
    )]
    RequestTooLarge {
        /// The request.
        request: RequestId,
        /// Blocks one sample needs at its longest.
        needed: usize,
        /// Blocks of the pool minus the admission watermark.
        usable: usize,
    },
    /// No unfinished request has this id.
    #[error("expected an unfinished request, found unknown {0}")]
    UnknownRequest(RequestId),
    /// No unfinished sequence has this id.
    #[error("expected an unfinished sequence, found unknown {0}")]
    UnknownSequence(SequenceId),
    /// A token was reported for a sequence that was not scheduled to sample one.
    #[error("{0} is not awaiting a sampled token")]
    NotAwaitingToken(SequenceId),
    /// The stop-string hook named a stop string or a length the request does not have.
    #[error(
        "{sequence}: stop string match must name one of {num_stop} stop strings and keep at most {num_output} tokens, found index {index} keeping {keep}"
    )]
    InvalidStopMatch {
        /// The sequence.
        sequence: SequenceId,
        /// Stop strings of the request.
        num_stop: usize,
        /// Output tokens of the sequence.
        num_output: usize,
        /// The index returned by the hook.
        index: usize,
        /// The token count returned by the hook.
        keep: usize,
    },
    /// The block manager refused an operation the scheduler had checked (a bug).
    #[error(transparent)]
    Block(#[from] BlockError),
}

/// Whether a chunk continues a prompt (or a recompute) or decodes one new token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChunkKind {
    /// Positions of the prompt, or of a preempted sequence being recomputed.
    Prefill,
    /// The single newest token of a sequence whose context is all computed.
    Decode,
}

/// One sequence's share of a step: token positions `start..start + num_tokens` to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledChunk {
    /// The sequence.
    pub sequence: SequenceId,
    /// Prefill or decode.
    pub kind: ChunkKind,
    /// First position (its K/V and everything after it up to `num_tokens` are computed now).
    pub start: usize,
    /// Number of positions.
    pub num_tokens: usize,
    /// Whether the last position's logits are sampled (then the engine must report the token).
    pub sample: bool,
}

/// What one step runs, in an order compatible with prefix sharing (a chunk only reads K/V
/// written by earlier steps or by chunks before it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerOutput {
    /// The chunks of this step.
    pub chunks: Vec<ScheduledChunk>,
    /// Sequences preempted (by recompute) in this step.
    pub preempted: Vec<SequenceId>,
    /// Total positions in `chunks`.
    pub num_batched_tokens: usize,
}

impl SchedulerOutput {
    /// Whether the step runs nothing.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// The prefill chunks.
    pub fn prefills(&self) -> impl Iterator<Item = &ScheduledChunk> {
        self.chunks.iter().filter(|c| c.kind == ChunkKind::Prefill)
    }

    /// The decode chunks.
    pub fn decodes(&self) -> impl Iterator<Item = &ScheduledChunk> {
        self.chunks.iter().filter(|c| c.kind == ChunkKind::Decode)
    }
}

/// A stop string found by the engine's stop-string hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopStringMatch {
    /// Index into the request's `stop` strings.
    pub stop_index: usize,
    /// Output tokens to keep (the engine decides whether the stop string's tokens stay).
    pub keep_tokens: usize,
}

/// What the engine needs to sample a sequence's next token.
#[derive(Debug, Clone, Copy)]
pub struct SamplingContext<'a> {
    /// The request's parameters.
    pub params: &'a SamplingParams,
    /// The request's effective seed.
    pub seed: u64,
    /// The sample index.
    pub sample_index: u32,
    /// Index of the token about to be sampled among the outputs.
    pub output_position: usize,
}

/// Counters for the engine's `stats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerStats {
    /// `schedule` calls that ran something.
    pub steps: u64,
    /// Sequences waiting.
    pub num_waiting: usize,
    /// Sequences running.
    pub num_running: usize,
    /// Preemptions so far.
    pub num_preemptions: u64,
    /// Prefill positions scheduled (recomputation included).
    pub prefill_tokens: u64,
    /// Prompt positions served by the prefix cache at admission.
    pub cached_prompt_tokens: u64,
    /// Tokens sampled.
    pub generated_tokens: u64,
    /// The KV pool.
    pub blocks: BlockManagerStats,
}

/// An unfinished request.
#[derive(Debug, Clone)]
struct RequestState {
    params: SamplingParams,
    seed: u64,
    num_unfinished: u32,
}

/// The scheduler state machine.
#[derive(Debug, Clone)]
pub struct Scheduler {
    config: SchedulerConfig,
    blocks: BlockManager,
    watermark_blocks: usize,
    requests: HashMap<RequestId, RequestState>,
    sequences: HashMap<SequenceId, Sequence>,
    waiting: VecDeque<SequenceId>,
    /// Running sequences in admission order (the last one is the preemption victim).
    running: Vec<SequenceId>,
    finished: Vec<RequestOutput>,
    admissions: u64,
    steps: u64,
    preemptions: u64,
    prefill_tokens: u64,
    cached_prompt_tokens: u64,
    generated_tokens: u64,
    /// The weight version new tokens are tagged with.
    weight_version: u64,
}

mod step;

impl Scheduler {
    /// A scheduler with an empty pool.
    pub fn new(config: SchedulerConfig) -> Result<Self, SchedulerError> {
        if config.max_num_batched_tokens == 0 || config.max_num_seqs == 0 {
            return Err(SchedulerError::InvalidConfig(format!(
                "max_num_batched_tokens and max_num_seqs must be at least 1, found {} and {}",
                config.max_num_batched_tokens, config.max_num_seqs
            )));
        }
        if !(0.0..1.0).contains(&config.watermark) {
            return Err(SchedulerError::InvalidConfig(format!(
                "watermark must be in [0, 1), found {}",
                config.watermark
            )));
        }
        let blocks = BlockManager::new(config.blocks.clone())?;
        let watermark_blocks = (config.watermark * config.blocks.num_blocks as f64).ceil() as usize;
        Ok(Self {
            config,
            blocks,
            watermark_blocks,
            requests: HashMap::new(),
            sequences: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished: Vec::new(),
            admissions: 0,
            steps: 0,
            preemptions: 0,
            prefill_tokens: 0,
            cached_prompt_tokens: 0,
            generated_tokens: 0,
            weight_version: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a request; its `n` samples wait behind everything queued before.
    pub fn add_request(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<(), SchedulerError> {
        params
            .validate()
            .map_err(|source| SchedulerError::InvalidParams { request: id, source })?;
        if self.requests.contains_key(&id) {
            return Err(SchedulerError::DuplicateRequest(id));
        }
        if prompt.is_empty() {
            return Err(SchedulerError::EmptyPrompt(id));
        }
        let needed =
            self.blocks.blocks_for_tokens(prompt.len().saturating_add(params.max_tokens as usize));
        let usable = self.blocks.num_blocks().saturating_sub(self.watermark_blocks);
        if needed > usable {
            return Err(SchedulerError::RequestTooLarge { request: id, needed, usable });
        }
        let seed = params.seed.unwrap_or_else(|| mix64(self.config.seed ^ mix64(id.0)));
        for sample_index in 0..params.n {
            let sequence = SequenceId { request: id, sample_index };
            self.sequences.insert(sequence, Sequence::new(sequence, prompt.clone()));
            self.waiting.push_back(sequence);
        }
        self.requests.insert(id, RequestState { num_unfinished: params.n, params, seed });
        Ok(())
    }

    /// Reports the token sampled for `sequence` in the last step; returns the finish reason if
    /// the sequence stopped.
    pub fn on_step_output(
        &mut self,
        sequence: SequenceId,
        token: u32,
        logprob: f32,
    ) -> Result<Option<FinishReason>, SchedulerError> {
        self.on_step_output_with(sequence, token, logprob, |_| None)
    }

    /// As [`Scheduler::on_step_output`], with the engine's stop-string hook: when the request
    /// has stop strings (and `min_tokens` is reached), `stop_strings` gets the output tokens so
    /// far and returns the match it found in their detokenised text, if any. Checked after stop
    /// token ids and before `max_tokens`.
    pub fn on_step_output_with(
        &mut self,
        sequence: SequenceId,
        token: u32,
        logprob: f32,
        stop_strings: impl FnOnce(&[u32]) -> Option<StopStringMatch>,
    ) -> Result<Option<FinishReason>, SchedulerError> {
        let request = self
            .requests
            .get(&sequence.request)
            .ok_or(SchedulerError::UnknownSequence(sequence))?;
        let params = &request.params;
        let seq =
            self.sequences.get_mut(&sequence).ok_or(SchedulerError::UnknownSequence(sequence))?;
        if !seq.awaiting_token {
            return Err(SchedulerError::NotAwaitingToken(sequence));
        }
        seq.awaiting_token = false;
        seq.tokens.push(token);
        seq.logprobs.push(logprob);
        seq.versions.push(self.weight_version);
        self.generated_tokens += 1;
        let num_output = seq.num_output_tokens();
        let past_min = num_output >= params.min_tokens as usize;
        let mut reason = None;
        if past_min && params.stop_token_ids.contains(&token) {
            reason = Some(FinishReason::StopToken(token));
        } else if past_min
            && !params.stop.is_empty()
            && let Some(found) = stop_strings(&seq.tokens[seq.prompt_len..])
        {
            // The token stays recorded even when the hook's answer is invalid.
            if found.stop_index >= params.stop.len() || found.keep_tokens > num_output {
                return Err(SchedulerError::InvalidStopMatch {
                    sequence,
                    num_stop: params.stop.len(),
                    num_output,
                    index: found.stop_index,
                    keep: found.keep_tokens,
                });
            }
            seq.tokens.truncate(seq.prompt_len + found.keep_tokens);
            seq.logprobs.truncate(found.keep_tokens);
            seq.versions.truncate(found.keep_tokens);
            reason = Some(FinishReason::StopString(found.stop_index));
        }
        if reason.is_none() && num_output >= params.max_tokens as usize {
            reason = Some(FinishReason::Length);
        }
        if let Some(reason) = &reason {
            self.finish_sequence(sequence, reason.clone())?;
        }
        Ok(reason)
    }

    /// Aborts every unfinished sample of `request`; its output (reason `Aborted` for those
    /// samples) joins the finished outputs so that the submitter still gets an answer.
    pub fn abort(&mut self, request: RequestId) -> Result<(), SchedulerError> {
        let n =
            self.requests.get(&request).ok_or(SchedulerError::UnknownRequest(request))?.params.n;
        for sample_index in 0..n {
            let sequence = SequenceId { request, sample_index };
            let unfinished = self
                .sequences
                .get(&sequence)
                .is_some_and(|s| !matches!(s.status, SequenceStatus::Finished(_)));
            if unfinished {
                self.finish_sequence(sequence, FinishReason::Aborted)?;
            }
        }
        Ok(())
    }

    /// Takes the outputs of requests whose samples have all finished, in completion order.
    pub fn take_finished(&mut self) -> Vec<RequestOutput> {
        std::mem::take(&mut self.finished)
    }

    /// Whether any request is unfinished.
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Sequences waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences admitted and holding blocks.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// All tokens (prompt then outputs) of an unfinished sequence.
    pub fn sequence_tokens(&self, sequence: SequenceId) -> Option<&[u32]> {
        self.sequences.get(&sequence).map(|s| s.tokens.as_slice())
    }

    /// The block table of a running sequence.
    pub fn block_table(&self, sequence: SequenceId) -> Option<&[BlockId]> {
        self.blocks.block_table(sequence)
    }

    /// What the engine needs to sample the next token of an unfinished sequence.
    pub fn sampling_context(&self, sequence: SequenceId) -> Option<SamplingContext<'_>> {
        let request = self.requests.get(&sequence.request)?;
        let seq = self.sequences.get(&sequence)?;
        Some(SamplingContext {
            params: &request.params,
            seed: request.seed,
            sample_index: sequence.sample_index,
            output_position: seq.num_output_tokens(),
        })
    }

    /// The block manager (read-only: tables, stats, invariants).
    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    /// Tags every token sampled from now on with `version` (the policy version of the weights).
    pub fn set_weight_version(&mut self, version: u64) {
        self.weight_version = version;
    }

    /// The version new tokens are tagged with.
    pub fn weight_version(&self) -> u64 {
        self.weight_version
    }

    /// Forgets the prefix cache (after a weight update), see [`BlockManager::reset_prefix_cache`].
    pub fn reset_prefix_cache(&mut self) -> PrefixCacheReset {
        self.blocks.reset_prefix_cache()
    }

    /// Counters and pool usage.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            steps: self.steps,
            num_waiting: self.waiting.len(),
            num_running: self.running.len(),
            num_preemptions: self.preemptions,
            prefill_tokens: self.prefill_tokens,
            cached_prompt_tokens: self.cached_prompt_tokens,
            generated_tokens: self.generated_tokens,
            blocks: self.blocks.stats(),
        }
    }

    /// Marks a sequence finished, frees its blocks, and emits the request's output when it was
    /// the last unfinished sample.
    fn finish_sequence(
        &mut self,
        sequence: SequenceId,
        reason: FinishReason,
    ) -> Result<(), SchedulerError> {
        let seq =
            self.sequences.get_mut(&sequence).ok_or(SchedulerError::UnknownSequence(sequence))?;
        match seq.status {
            SequenceStatus::Running => {
                self.running.retain(|&s| s != sequence);
                self.blocks.free(sequence)?;
            }
            SequenceStatus::Waiting => self.waiting.retain(|&s| s != sequence),
            SequenceStatus::Finished(_) => return Ok(()),
        }
        seq.status = SequenceStatus::Finished(reason);
        seq.awaiting_token = false;
        let request = self
            .requests
            .get_mut(&sequence.request)
            .ok_or(SchedulerError::UnknownSequence(sequence))?;
        request.num_unfinished -= 1;
        if request.num_unfinished == 0 {
            let with_logprobs = request.params.logprobs;
            let n = request.params.n;
            self.requests.remove(&sequence.request);
            let mut samples = Vec::with_capacity(n as usize);
            let mut prompt_len = 0;
            for sample_index in 0..n {
                if let Some(s) =
                    self.sequences.remove(&SequenceId { request: sequence.request, sample_index })
                {
                    prompt_len = s.prompt_len;
                    samples.push(s.output(with_logprobs));
                }
            }
            self.finished.push(RequestOutput { request_id: sequence.request, prompt_len, samples });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
