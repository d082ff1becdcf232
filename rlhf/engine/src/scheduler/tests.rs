//! Scheduler tests. The property tests drive the scheduler with a deterministic "model" whose
//! K/V lives in a simulated paged cache read and written only through the block tables, and
//! compare every output with a plain, unpaged reference decode: a wrong block table, a prefix
//! hit on K/V nobody computed, or a visible preemption changes the tokens.

use super::*;
use crate::rng::{mix64, token_uniform};
use crate::sampling::Sampler;
use proptest::prelude::*;

const VOCAB: u32 = 12;
const ROOT_STATE: u64 = 0x5EED;

/// The "K/V" of position `p` is a hash of the previous position's K/V and token `p`, so it
/// depends on the whole prefix, like a transformer's.
fn kv_step(previous: u64, token: u32) -> u64 {
    mix64(previous ^ u64::from(token).wrapping_mul(0x9E37_79B9))
}

/// Logits computed from the last position's K/V.
fn logits(state: u64) -> Vec<f32> {
    (0..VOCAB).map(|v| (mix64(state ^ u64::from(v)) >> 40) as f32 / (1u64 << 22) as f32).collect()
}

/// The paged model: a flat slot array indexed through block tables.
struct PagedModel {
    slots: Vec<Option<u64>>,
    block_size: usize,
    sampler: Sampler,
}

impl PagedModel {
    fn new(config: &SchedulerConfig) -> Self {
        let n = config.blocks.num_blocks * config.blocks.block_size;
        Self { slots: vec![None; n], block_size: config.blocks.block_size, sampler: Sampler::new() }
    }

    fn slot(&self, table: &[BlockId], position: usize) -> usize {
        table[position / self.block_size].0 as usize * self.block_size + position % self.block_size
    }

    fn read(&self, table: &[BlockId], position: usize) -> u64 {
        self.slots[self.slot(table, position)].expect("read a slot nobody wrote")
    }

    /// Runs one step and reports sampled tokens. Chunks run in order, which is a valid order
    /// for the write-before-read contract.
    fn step(&mut self, scheduler: &mut Scheduler, output: &SchedulerOutput) {
        for chunk in &output.chunks {
            let tokens = scheduler.sequence_tokens(chunk.sequence).unwrap().to_vec();
            let table = scheduler.block_table(chunk.sequence).unwrap().to_vec();
            let positions = chunk.start..chunk.start + chunk.num_tokens;
            for (position, &token) in
                tokens[positions.clone()].iter().enumerate().map(|(i, t)| (i + positions.start, t))
            {
                let previous =
                    if position == 0 { ROOT_STATE } else { self.read(&table, position - 1) };
                let slot = self.slot(&table, position);
                self.slots[slot] = Some(kv_step(previous, token));
            }
            if chunk.sample {
                let state = self.read(&table, tokens.len() - 1);
                let context = scheduler.sampling_context(chunk.sequence).unwrap();
                let uniform =
                    token_uniform(context.seed, context.sample_index, context.output_position);
                let sampled = self.sampler.sample(&logits(state), context.params, uniform).unwrap();
                scheduler.on_step_output(chunk.sequence, sampled.token, sampled.logprob).unwrap();
            }
        }
    }
}

/// The unpaged reference decode of one sample.
fn reference(
    prompt: &[u32],
    params: &SamplingParams,
    seed: u64,
    sample_index: u32,
) -> SampleOutput {
    let mut sampler = Sampler::new();
    let mut state = prompt.iter().fold(ROOT_STATE, |s, &t| kv_step(s, t));
    let (mut token_ids, mut logprobs) = (Vec::new(), Vec::new());
    loop {
        let uniform = token_uniform(seed, sample_index, token_ids.len());
        let sampled = sampler.sample(&logits(state), params, uniform).unwrap();
        token_ids.push(sampled.token);
        logprobs.push(sampled.logprob);
        state = kv_step(state, sampled.token);
        let past_min = token_ids.len() >= params.min_tokens as usize;
        if past_min && params.stop_token_ids.contains(&sampled.token) {
            let finish_reason = FinishReason::StopToken(sampled.token);
            return SampleOutput {
                sample_index,
                weight_versions: vec![0; token_ids.len()],
                token_ids,
                logprobs: Some(logprobs),
                finish_reason,
                num_preemptions: 0,
            };
        }
        if token_ids.len() >= params.max_tokens as usize {
            let finish_reason = FinishReason::Length;
            return SampleOutput {
                sample_index,
                weight_versions: vec![0; token_ids.len()],
                token_ids,
                logprobs: Some(logprobs),
                finish_reason,
                num_preemptions: 0,
            };
        }
    }
}

#[derive(Debug, Clone)]
struct Arrival {
    step: usize,
    prompt: Vec<u32>,
    params: SamplingParams,
}

/// Runs `arrivals` to completion; returns outputs by request, the number of steps, and the
/// scheduler's final stats. Checks the per-step invariants on the way.
fn run(
    config: &SchedulerConfig,
    arrivals: &[Arrival],
    reset_every: Option<usize>,
) -> (HashMap<RequestId, RequestOutput>, SchedulerStats) {
    let mut scheduler = Scheduler::new(config.clone()).unwrap();
    let mut model = PagedModel::new(config);
    let mut outputs = HashMap::new();
    let mut next = 0;
    let step_limit = 20_000;
    for step in 0..step_limit {
        while next < arrivals.len() && arrivals[next].step <= step {
            let a = &arrivals[next];
            scheduler
                .add_request(RequestId(next as u64), a.prompt.clone(), a.params.clone())
                .unwrap();
            next += 1;
        }
        if next == arrivals.len() && !scheduler.has_unfinished() {
            return (outputs, scheduler.stats());
        }
        if reset_every.is_some_and(|every| step % every == every - 1) {
            scheduler.reset_prefix_cache();
        }
        let output = scheduler.schedule().unwrap();
        assert!(output.num_batched_tokens <= config.max_num_batched_tokens);
        assert!(scheduler.num_running() <= config.max_num_seqs);
        if scheduler.has_unfinished() {
            assert!(
                !output.is_empty() || next < arrivals.len(),
                "no progress with unfinished requests (deadlock)"
            );
        }
        model.step(&mut scheduler, &output);
        scheduler.block_manager().check_invariants().unwrap();
        for finished in scheduler.take_finished() {
            outputs.insert(finished.request_id, finished);
        }
    }
    panic!("requests still unfinished after {step_limit} steps (starvation)");
}

fn params_strategy() -> impl Strategy<Value = SamplingParams> {
    (
        1u32..4,
        prop::bool::ANY,
        1u32..14,
        prop::option::of(0u32..VOCAB),
        prop::option::of(1u32..6),
        0.3f32..=1.0,
    )
        .prop_map(|(n, greedy, max_tokens, stop, top_k, top_p)| SamplingParams {
            n,
            temperature: if greedy { 0.0 } else { 1.0 },
            top_k,
            top_p,
            max_tokens,
            min_tokens: max_tokens.min(2),
            stop_token_ids: stop.into_iter().collect(),
            seed: Some(u64::from(max_tokens) * 31 + u64::from(n)),
            ..SamplingParams::default()
        })
}

fn workload() -> impl Strategy<Value = (SchedulerConfig, Vec<Arrival>)> {
    (1usize..5, 1usize..40, 1usize..6, 0usize..12).prop_flat_map(
        |(block_size, budget, max_seqs, spare_blocks)| {
            let arrival = (
                0usize..30,
                0usize..3,
                prop::collection::vec(0u32..VOCAB, 1..14),
                params_strategy(),
            )
                .prop_map(|(step, shared, suffix, params)| {
                    // A third of the prompts share a long common prefix, to exercise prefix hits.
                    let mut prompt: Vec<u32> =
                        if shared == 0 { (0..9).map(|t| t % VOCAB).collect() } else { Vec::new() };
                    prompt.extend(suffix);
                    Arrival { step, prompt, params }
                });
            prop::collection::vec(arrival, 1..10).prop_map(move |mut arrivals| {
                arrivals.sort_by_key(|a| a.step);
                let largest = arrivals
                    .iter()
                    .map(|a| (a.prompt.len() + a.params.max_tokens as usize).div_ceil(block_size))
                    .max()
                    .unwrap_or(1);
                let config = SchedulerConfig {
                    max_num_batched_tokens: budget,
                    max_num_seqs: max_seqs,
                    watermark: 0.0,
                    blocks: BlockManagerConfig {
                        num_blocks: largest + spare_blocks,
                        block_size,
                        enable_prefix_caching: true,
                    },
                    seed: 1,
                };
                (config, arrivals)
            })
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every request finishes (no deadlock or starvation when the largest request fits), the
    /// block budget holds, and outputs equal the unpaged, unpreempted reference decode.
    #[test]
    fn outputs_match_reference_decode_under_any_workload((config, arrivals) in workload(), reset in prop::option::of(2usize..9)) {
        let (outputs, stats) = run(&config, &arrivals, reset);
        prop_assert_eq!(outputs.len(), arrivals.len());
        for (index, arrival) in arrivals.iter().enumerate() {
            let output = &outputs[&RequestId(index as u64)];
            prop_assert_eq!(output.prompt_len, arrival.prompt.len());
            prop_assert_eq!(output.samples.len(), arrival.params.n as usize);
            for sample in &output.samples {
                let mut expected = reference(&arrival.prompt, &arrival.params, arrival.params.seed.unwrap(), sample.sample_index);
                expected.num_preemptions = sample.num_preemptions;
                prop_assert_eq!(sample, &expected);
            }
        }
        prop_assert_eq!(stats.blocks.used_blocks, 0);
        prop_assert_eq!(stats.num_running + stats.num_waiting, 0);
    }
}

fn small_config(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: 64,
        max_num_seqs: 16,
        watermark: 0.0,
        blocks: BlockManagerConfig { num_blocks, block_size, enable_prefix_caching: true },
        seed: 3,
    }
}

#[test]
fn scarce_blocks_force_preemptions_that_stay_invisible() {
    let config = small_config(8, 2);
    let params = SamplingParams { max_tokens: 10, seed: Some(9), ..SamplingParams::default() };
    let arrivals: Vec<Arrival> = (0..4)
        .map(|i| Arrival { step: 0, prompt: vec![i, i + 1, i + 2], params: params.clone() })
        .collect();
    let (outputs, stats) = run(&config, &arrivals, None);
    assert!(stats.num_preemptions > 0, "the workload was meant to preempt");
    let preempted: u32 = outputs.values().flat_map(|o| &o.samples).map(|s| s.num_preemptions).sum();
    assert_eq!(u64::from(preempted), stats.num_preemptions);
    for (index, arrival) in arrivals.iter().enumerate() {
        let sample = &outputs[&RequestId(index as u64)].samples[0];
        assert_eq!(sample.token_ids, reference(&arrival.prompt, &params, 9, 0).token_ids);
    }
}

#[test]
fn samples_of_one_request_share_prompt_blocks_and_differ() {
    let mut scheduler = Scheduler::new(small_config(64, 4)).unwrap();
    let params = SamplingParams { n: 4, max_tokens: 8, seed: Some(1), ..SamplingParams::default() };
    scheduler.add_request(RequestId(0), (0..10).collect(), params).unwrap();
    let output = scheduler.schedule().unwrap();
    assert_eq!(output.chunks.len(), 4);
    assert_eq!(output.chunks[0].start, 0);
    assert!(output.chunks[1..].iter().all(|c| c.start == 8 && c.num_tokens == 2 && c.sample));
    let first = scheduler.block_table(output.chunks[0].sequence).unwrap().to_vec();
    for chunk in &output.chunks[1..] {
        assert_eq!(scheduler.block_table(chunk.sequence).unwrap()[..2], first[..2]);
    }
    assert_eq!(scheduler.stats().cached_prompt_tokens, 24);
}

#[test]
fn finish_reasons_stop_strings_and_abort() {
    let mut scheduler = Scheduler::new(small_config(64, 4)).unwrap();
    let stop = SamplingParams {
        stop_token_ids: vec![5],
        min_tokens: 2,
        max_tokens: 3,
        ..SamplingParams::default()
    };
    let strings = SamplingParams {
        stop: vec!["x".into(), "yz".into()],
        max_tokens: 9,
        ..SamplingParams::default()
    };
    scheduler.add_request(RequestId(1), vec![1, 2], stop).unwrap();
    scheduler.add_request(RequestId(2), vec![1, 2], strings).unwrap();
    scheduler.add_request(RequestId(3), vec![1, 2], SamplingParams::default()).unwrap();
    let (a, b) = (
        SequenceId { request: RequestId(1), sample_index: 0 },
        SequenceId { request: RequestId(2), sample_index: 0 },
    );
    scheduler.schedule().unwrap();
    assert_eq!(
        scheduler.on_step_output(a, 5, -0.1).unwrap(),
        None,
        "min_tokens holds the stop token back"
    );
    assert_eq!(scheduler.on_step_output(a, 5, -0.1), Err(SchedulerError::NotAwaitingToken(a)));
    assert_eq!(scheduler.on_step_output(b, 7, -0.2).unwrap(), None);
    scheduler.schedule().unwrap();
    assert_eq!(scheduler.on_step_output(a, 5, -0.3).unwrap(), Some(FinishReason::StopToken(5)));
    let found = scheduler.on_step_output_with(b, 8, -0.4, |out| {
        assert_eq!(out, [7, 8]);
        Some(StopStringMatch { stop_index: 1, keep_tokens: 1 })
    });
    assert_eq!(found.unwrap(), Some(FinishReason::StopString(1)));
    scheduler.abort(RequestId(3)).unwrap();
    assert_eq!(scheduler.abort(RequestId(3)), Err(SchedulerError::UnknownRequest(RequestId(3))));
    let finished = scheduler.take_finished();
    assert_eq!(finished.len(), 3);
    assert_eq!(finished[0].samples[0].token_ids, [5, 5]);
    assert_eq!(finished[1].samples[0].token_ids, [7]);
    assert_eq!(finished[1].samples[0].logprobs, Some(vec![-0.2]));
    assert_eq!(finished[2].samples[0].finish_reason, FinishReason::Aborted);
    assert!(!scheduler.has_unfinished());
    assert_eq!(scheduler.block_manager().stats().used_blocks, 0);
}

#[test]
fn hostile_requests_are_rejected() {
    let mut scheduler = Scheduler::new(small_config(4, 2)).unwrap();
    let id = RequestId(0);
    assert_eq!(
        scheduler.add_request(id, vec![], SamplingParams::default()),
        Err(SchedulerError::EmptyPrompt(id))
    );
    let too_long = SamplingParams { max_tokens: 7, ..SamplingParams::default() };
    assert_eq!(
        scheduler.add_request(id, vec![1, 2], too_long),
        Err(SchedulerError::RequestTooLarge { request: id, needed: 5, usable: 4 })
    );
    let bad = SamplingParams { top_p: 2.0, ..SamplingParams::default() };
    assert!(matches!(
        scheduler.add_request(id, vec![1], bad),
        Err(SchedulerError::InvalidParams { .. })
    ));
    scheduler.add_request(id, vec![1], SamplingParams::greedy(1)).unwrap();
    assert_eq!(
        scheduler.add_request(id, vec![1], SamplingParams::greedy(1)),
        Err(SchedulerError::DuplicateRequest(id))
    );
    let unknown = SequenceId { request: RequestId(9), sample_index: 0 };
    assert_eq!(
        scheduler.on_step_output(unknown, 1, 0.0),
        Err(SchedulerError::UnknownSequence(unknown))
    );
    let bad_config = SchedulerConfig { max_num_seqs: 0, ..SchedulerConfig::default() };
    assert!(matches!(Scheduler::new(bad_config), Err(SchedulerError::InvalidConfig(_))));
}

#[test]
fn chunked_prefill_respects_the_token_budget_and_decodes_go_first() {
    let mut config = small_config(64, 4);
    config.max_num_batched_tokens = 5;
    let mut scheduler = Scheduler::new(config).unwrap();
    scheduler.add_request(RequestId(0), vec![1, 2], SamplingParams::greedy(4)).unwrap();
    scheduler.add_request(RequestId(1), (0..12).collect(), SamplingParams::greedy(4)).unwrap();
    let first = scheduler.schedule().unwrap();
    assert_eq!(first.num_batched_tokens, 5);
    assert_eq!(
        (first.chunks[1].start, first.chunks[1].num_tokens, first.chunks[1].sample),
        (0, 3, false)
    );
    scheduler.on_step_output(first.chunks[0].sequence, 3, 0.0).unwrap();
    let second = scheduler.schedule().unwrap();
    assert_eq!(second.chunks[0].kind, ChunkKind::Decode);
    assert_eq!(
        (second.chunks[1].kind, second.chunks[1].start, second.chunks[1].num_tokens),
        (ChunkKind::Prefill, 3, 4)
    );
    assert_eq!(second.decodes().count(), 1);
    assert_eq!(second.prefills().count(), 1);
}

/// Guards the property test's power: its workloads must actually preempt and hit the prefix
/// cache, or the equality with the reference would prove little.
#[test]
fn random_workloads_exercise_preemption_and_prefix_hits() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut preemptions, mut cached, mut resets_hit) = (0, 0, 0);
    for _ in 0..100 {
        let (config, arrivals) = workload().new_tree(&mut runner).unwrap().current();
        let (_, stats) = run(&config, &arrivals, Some(5));
        preemptions += stats.num_preemptions;
        cached += stats.cached_prompt_tokens;
        resets_hit += stats.blocks.prefix_cache_resets;
    }
    assert!(preemptions > 50, "only {preemptions} preemptions");
    assert!(cached > 500, "only {cached} cached prompt tokens");
    assert!(resets_hit > 0);
}
