//! Benchmark of the engine's pure cores: scheduler + block manager steps per second with 64
//! concurrent sequences (with ample and with scarce KV blocks), and the prefix-cache hit rate on
//! prompts sharing a long prefix. The "model" is a hash of the context, so the figures measure
//! scheduling overhead only.
//!
//! Run: `cargo run --release -p rtrun-rlhf-engine --example sched_bench`

use rtrun_rlhf_engine::rng::mix64;
use rtrun_rlhf_engine::{
    BlockManagerConfig, RequestId, SamplingParams, Scheduler, SchedulerConfig,
};
use std::time::Instant;

/// Runs every request to completion with a hash "model"; returns (steps, seconds).
fn drive(scheduler: &mut Scheduler) -> (u64, f64) {
    let start = Instant::now();
    let mut steps = 0;
    while scheduler.has_unfinished() {
        let output = scheduler.schedule().expect("schedule");
        steps += 1;
        for chunk in output.chunks.iter().filter(|c| c.sample) {
            let tokens =
                scheduler.sequence_tokens(chunk.sequence).expect("scheduled sequence exists");
            let token =
                (mix64(tokens.len() as u64 ^ u64::from(tokens[tokens.len() - 1])) % 32_000) as u32;
            scheduler.on_step_output(chunk.sequence, token, -1.0).expect("token report");
        }
        scheduler.take_finished();
    }
    (steps, start.elapsed().as_secs_f64())
}

fn decode_throughput(num_blocks: usize) {
    let config = SchedulerConfig {
        blocks: BlockManagerConfig { num_blocks, block_size: 16, enable_prefix_caching: true },
        ..SchedulerConfig::default()
    };
    let mut scheduler = Scheduler::new(config).expect("config");
    let params = SamplingParams { max_tokens: 512, ..SamplingParams::greedy(512) };
    for r in 0..64u64 {
        let prompt: Vec<u32> = (0..256).map(|i| (mix64(r * 1000 + i) % 32_000) as u32).collect();
        scheduler.add_request(RequestId(r), prompt, params.clone()).expect("request");
    }
    let (steps, seconds) = drive(&mut scheduler);
    let stats = scheduler.stats();
    println!(
        "64 seqs x (256 prompt + 512 generated), {num_blocks} blocks of 16: {steps} steps in {seconds:.3} s = {:.0} steps/s, {:.2} M scheduled tokens/s, {} preemptions",
        steps as f64 / seconds,
        (stats.prefill_tokens + stats.generated_tokens) as f64 / seconds / 1e6,
        stats.num_preemptions
    );
}

fn prefix_hit_rate() {
    let config = SchedulerConfig {
        blocks: BlockManagerConfig {
            num_blocks: 4096,
            block_size: 16,
            enable_prefix_caching: true,
        },
        ..SchedulerConfig::default()
    };
    let mut scheduler = Scheduler::new(config).expect("config");
    let shared: Vec<u32> = (0..1024).map(|i| (mix64(i) % 32_000) as u32).collect();
    let params = SamplingParams { n: 4, ..SamplingParams::greedy(32) };
    for r in 0..256u64 {
        let mut prompt = shared.clone();
        prompt.extend((0..64).map(|i| (mix64(r * 7919 + i + 1_000_000) % 32_000) as u32));
        scheduler.add_request(RequestId(r), prompt, params.clone()).expect("request");
    }
    let (steps, seconds) = drive(&mut scheduler);
    let stats = scheduler.stats();
    let prompt_tokens = 256 * 4 * (1024 + 64);
    println!(
        "256 prompts x n=4 sharing a 1024-token prefix (+64 own): block hit rate {:.1}%, {:.1}% of prompt tokens served from cache, {} steps in {seconds:.3} s",
        100.0 * stats.blocks.prefix_hit_rate,
        100.0 * stats.cached_prompt_tokens as f64 / prompt_tokens as f64,
        steps
    );
}

fn main() {
    decode_throughput(4096);
    decode_throughput(1024);
    prefix_hit_rate();
}
