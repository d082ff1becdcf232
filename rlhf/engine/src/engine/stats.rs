//! [`EngineStats`]: what `stats()` reports (throughput, cache usage, preemptions, prefix hits).

use serde::{Deserialize, Serialize};

use super::{Counters, WeightState};
use crate::runner::static_decode::StaticDecodeStats;
use crate::scheduler::SchedulerStats;

/// A snapshot of the engine's counters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Steps that ran something.
    pub steps: u64,
    /// Requests finished (all samples done or aborted).
    pub requests_finished: u64,
    /// Prompt tokens submitted.
    pub prompt_tokens: u64,
    /// Tokens sampled.
    pub generated_tokens: u64,
    /// Prefill positions computed (recomputation after preemption included).
    pub prefill_tokens: u64,
    /// Prompt positions served by the prefix cache.
    pub cached_prompt_tokens: u64,
    /// Seconds spent inside steps.
    pub busy_seconds: f64,
    /// `generated_tokens / busy_seconds`.
    pub generated_tokens_per_second: f64,
    /// `(prefill_tokens + generated_tokens) / busy_seconds`.
    pub processed_tokens_per_second: f64,
    /// Sequences waiting for admission.
    pub num_waiting: usize,
    /// Sequences running.
    pub num_running: usize,
    /// Preemptions by recompute.
    pub num_preemptions: u64,
    /// KV blocks in the pool.
    pub kv_blocks_total: usize,
    /// KV blocks referenced by sequences.
    pub kv_blocks_used: usize,
    /// `kv_blocks_used / kv_blocks_total`.
    pub kv_cache_usage: f64,
    /// Token slots per block.
    pub block_size: usize,
    /// Prefix-cache hits over lookups, in blocks.
    pub prefix_hit_rate: f64,
    /// Prefix-cache resets (weight updates, sleeps, explicit).
    pub prefix_cache_resets: u64,
    /// Weight buckets applied.
    pub weight_updates: u64,
    /// Calls to `sleep`.
    pub sleeps: u64,
    /// Where the weights are.
    pub weights: WeightState,
    /// Whether the KV cache is allocated.
    pub kv_cache_allocated: bool,
    /// Finished outputs not taken yet.
    pub outputs_waiting: usize,
    /// Static decode steps and their CUDA graphs.
    pub static_decode: StaticDecodeStats,
}

impl EngineStats {
    pub(super) fn collect(
        scheduler: &SchedulerStats,
        counters: &Counters,
        weights: WeightState,
        kv_cache_allocated: bool,
        outputs_waiting: usize,
        block_size: usize,
        static_decode: StaticDecodeStats,
    ) -> Self {
        let per_second = |count: u64| {
            if counters.busy_seconds > 0.0 { count as f64 / counters.busy_seconds } else { 0.0 }
        };
        Self {
            steps: scheduler.steps,
            requests_finished: counters.requests_finished,
            prompt_tokens: counters.prompt_tokens,
            generated_tokens: scheduler.generated_tokens,
            prefill_tokens: scheduler.prefill_tokens,
            cached_prompt_tokens: scheduler.cached_prompt_tokens,
            busy_seconds: counters.busy_seconds,
            generated_tokens_per_second: per_second(scheduler.generated_tokens),
            processed_tokens_per_second: per_second(
                scheduler.generated_tokens + scheduler.prefill_tokens,
            ),
            num_waiting: scheduler.num_waiting,
            num_running: scheduler.num_running,
            num_preemptions: scheduler.num_preemptions,
            kv_blocks_total: scheduler.blocks.num_blocks,
            kv_blocks_used: scheduler.blocks.used_blocks,
            kv_cache_usage: scheduler.blocks.usage,
            block_size,
            prefix_hit_rate: scheduler.blocks.prefix_hit_rate,
            prefix_cache_resets: scheduler.blocks.prefix_cache_resets,
            weight_updates: counters.weight_updates,
            sleeps: counters.sleeps,
            weights,
            kv_cache_allocated,
            outputs_waiting,
            static_decode,
        }
    }
}
