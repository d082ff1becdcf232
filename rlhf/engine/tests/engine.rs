//! Correctness of the generation engine on tiny models against the plain reference decode
//! (full recomputation, no paging) and the model layer's log-prob function, plus the engine
//! actor through the runtime with two trainer ranks.

use std::path::PathBuf;

use rtrun_rlhf_engine::{
    EngineActor, EngineActorConfig, EngineConfig, EngineError, FinishReason, GenerationOutput,
    GenerationRequest, LlmEngine, LogprobMode, SamplingParams, WakeTarget, WeightBucket,
    WeightState, reference_generate,
};
use rtrun_rlhf_model::tch::{Kind, Tensor};
use rtrun_rlhf_model::{CausalLm, ModelConfig, ModelFamily, ResponseBatch, SaveOptions, tiny};

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

fn model(family: ModelFamily, seed: u64) -> CausalLm {
    tiny::tiny_model(&tiny::tiny_config(family), seed).unwrap()
}

fn engine(model: CausalLm, config: EngineConfig) -> LlmEngine {
    LlmEngine::new(model, None, config).unwrap()
}

fn config(num_blocks: usize, block_size: usize) -> EngineConfig {
    EngineConfig { num_gpu_blocks: Some(num_blocks), block_size, ..EngineConfig::default() }
}

/// Deterministic pseudo-random prompts of the given lengths (ids 3.. avoid the special tokens).
fn prompts(lengths: &[usize], salt: u64) -> Vec<Vec<u32>> {
    let mut state = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    lengths
        .iter()
        .map(|&len| {
            (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    3 + (state % 300) as u32
                })
                .collect()
        })
        .collect()
}

fn requests(prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<GenerationRequest> {
    prompts.iter().map(|p| GenerationRequest::new(p.clone(), params.clone())).collect()
}

/// The reference outputs, one request at a time (no padding anywhere).
fn reference(model: &CausalLm, requests: &[GenerationRequest]) -> Vec<GenerationOutput> {
    requests
        .iter()
        .map(|r| reference_generate(model, std::slice::from_ref(r)).unwrap().remove(0))
        .collect()
}

/// Equal tokens and finish reasons, log-probs equal up to float rounding (a different batch or
/// a prefix-cache hit changes the order of floating-point sums, nothing else).
fn assert_same(a: &[GenerationOutput], b: &[GenerationOutput]) {
    assert_eq!(token_ids(a), token_ids(b));
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.prompt_token_ids, y.prompt_token_ids);
        for (s, t) in x.samples.iter().zip(&y.samples) {
            assert_eq!(s.finish_reason, t.finish_reason);
            assert_eq!(s.log_probs.len(), t.log_probs.len());
            for (p, q) in s.log_probs.iter().zip(&t.log_probs) {
                assert!((p - q).abs() < 1e-5, "{p} vs {q}");
            }
        }
    }
}

fn token_ids(outputs: &[GenerationOutput]) -> Vec<Vec<Vec<u32>>> {
    outputs.iter().map(|o| o.samples.iter().map(|s| s.token_ids.clone()).collect()).collect()
}

#[test]
fn greedy_outputs_equal_the_reference_decode_at_several_batch_sizes_and_prompt_lengths() {
    for family in [ModelFamily::Llama, ModelFamily::Qwen2, ModelFamily::Qwen3] {
        let model_a = model(family, 11);
        let oracle = model(family, 11);
        let lengths = [1, 5, 16, 17, 33, 47, 2, 9];
        let all = requests(&prompts(&lengths, 1), &SamplingParams::greedy(20));
        let expected = reference(&oracle, &all);
        let mut engine = engine(model_a, config(256, 16));
        for batch in [1, 3, 8] {
            let outputs = engine.generate(all[..batch].to_vec()).unwrap();
            assert_eq!(
                token_ids(&outputs),
                token_ids(&expected[..batch]),
                "{family:?} batch {batch}"
            );
            for (o, e) in outputs.iter().zip(&expected) {
                assert_eq!(o.prompt_token_ids, e.prompt_token_ids);
                assert_eq!(o.samples[0].finish_reason, FinishReason::Length);
                for (a, b) in o.samples[0].log_probs.iter().zip(&e.samples[0].log_probs) {
                    assert!((a - b).abs() < 1e-4, "{a} vs {b}");
                }
            }
        }
    }
}

/// The static-shape decode step (batch-size buckets, fixed-width block tables, the scratch
/// block for padding rows) gives the tokens of today's step on the CPU: greedy and seeded
/// sampling, three model families, 1 to 13 sequences of mixed lengths (so steps run at buckets
/// 1 to 16 with padding, as requests finish at different lengths), contexts that cross block
/// boundaries (widths 1 to 8 blocks of 4 slots), prefix-cache hits and `n` samples.
#[test]
fn the_static_decode_step_gives_the_tokens_of_the_paged_step() {
    let sampled = SamplingParams {
        temperature: 0.8,
        top_k: Some(40),
        top_p: 0.9,
        n: 2,
        max_tokens: 19,
        seed: Some(99),
        ..SamplingParams::default()
    };
    for family in [ModelFamily::Llama, ModelFamily::Qwen2, ModelFamily::Qwen3] {
        for params in [SamplingParams::greedy(23), sampled.clone()] {
            let lengths = [3, 11, 1, 7, 13, 5, 2, 9, 4, 6, 12, 8, 10];
            let mut all = requests(&prompts(&lengths, 3), &params);
            // Different lengths: sequences leave the batch one by one.
            for (i, request) in all.iter_mut().enumerate() {
                request.params.max_tokens = params.max_tokens - i as u32;
            }
            // Two requests share a prompt (a prefix-cache hit on the second).
            all.push(all[4].clone());
            let run = |static_decode: bool| {
                let config = EngineConfig { static_decode: Some(static_decode), ..config(256, 4) };
                let mut engine = engine(model(family, 21), config);
                let outputs = engine.generate(all.clone()).unwrap();
                (outputs, engine.stats().static_decode.steps)
            };
            let ((found, static_steps), (expected, none)) = (run(true), run(false));
            assert_same(&found, &expected);
            // Every decode step ran static (the generation's longest sample decodes 22 or 18
            // steps after its prefill); without it none did.
            assert!(static_steps >= params.max_tokens as u64 - 1, "{static_steps} static steps");
            assert_eq!(none, 0);
        }
    }
}

/// More decodes than the largest bucket (256) run the paged step, with the same tokens.
#[test]
fn decodes_beyond_the_largest_bucket_run_the_paged_step() {
    let all = requests(&prompts(&[3; 260], 8), &SamplingParams::greedy(4));
    let run = |static_decode: bool| {
        let config = EngineConfig {
            static_decode: Some(static_decode),
            max_num_seqs: 300,
            ..config(600, 4)
        };
        let mut engine = engine(model(ModelFamily::Qwen2, 3), config);
        let outputs = engine.generate(all.clone()).unwrap();
        (outputs, engine.stats().static_decode.steps)
    };
    let ((found, static_steps), (expected, _)) = (run(true), run(false));
    assert_eq!(token_ids(&found), token_ids(&expected));
    assert_eq!(static_steps, 0, "260 decodes have no bucket");
}

/// Sliding windows shorter than the prompts and the generations (Qwen2's on one layer, Mistral's
/// on both): the engine's masks over the paged cache and the decode lanes equal the training
/// forward's, token for token, in one batch of mixed lengths.
#[test]
fn sliding_window_models_decode_as_the_reference_does() {
    let window = |size, layers: &[bool]| {
        Some(rtrun_rlhf_model::SlidingWindow { size, layers: layers.to_vec() })
    };
    for model_config in [
        ModelConfig {
            sliding_window: window(5, &[false, true]),
            ..tiny::tiny_config(ModelFamily::Qwen2)
        },
        ModelConfig {
            sliding_window: window(7, &[true, true]),
            ..tiny::tiny_config(ModelFamily::Mistral)
        },
    ] {
        let model_a = tiny::tiny_model(&model_config, 9).unwrap();
        let oracle = tiny::tiny_model(&model_config, 9).unwrap();
        let all = requests(&prompts(&[3, 6, 19, 33, 12], 1), &SamplingParams::greedy(20));
        let expected = reference(&oracle, &all);
        let outputs = engine(model_a, config(256, 16)).generate(all).unwrap();
        assert_eq!(token_ids(&outputs), token_ids(&expected), "{:?}", model_config.family);
    }
}

/// Projections of at least 8M multiply-adds run on oneDNN in the engine and on MKL in the
/// reference decode: the tokens stay identical (batch 16 decodes `[16, 256] x [256, 2048]` and
/// prefills far larger products).
#[test]
fn greedy_outputs_equal_the_reference_decode_where_projections_run_on_onednn() {
    let config = ModelConfig {
        hidden_size: 256,
        intermediate_size: 2048,
        ..tiny::tiny_config(ModelFamily::Qwen2)
    };
    let all = requests(
        &prompts(&[12, 30, 7, 21, 16, 9, 25, 14, 5, 18, 11, 27, 8, 20, 13, 24], 3),
        &SamplingParams::greedy(12),
    );
    let expected = reference(&tiny::tiny_model(&config, 13).unwrap(), &all);
    let mut engine = engine(tiny::tiny_model(&config, 13).unwrap(), self::config(256, 16));
    assert_same(&engine.generate(all).unwrap(), &expected);
}

/// The CPU runner looks RoPE rows up in a table of the model's `max_position_embeddings`
/// positions; a sequence that runs past them gets its rows computed, the same values.
#[test]
fn positions_past_the_rope_table_give_the_reference_outputs() {
    let config =
        ModelConfig { max_position_embeddings: 16, ..tiny::tiny_config(ModelFamily::Qwen2) };
    let all = requests(&prompts(&[5, 14, 21], 4), &SamplingParams::greedy(9));
    let expected = reference(&tiny::tiny_model(&config, 17).unwrap(), &all);
    let mut engine = engine(tiny::tiny_model(&config, 17).unwrap(), self::config(64, 4));
    assert_same(&engine.generate(all).unwrap(), &expected);
}

#[test]
fn preemption_by_recompute_and_chunked_prefill_keep_outputs_identical() {
    let oracle = model(ModelFamily::Qwen2, 5);
    let all = requests(&prompts(&[10, 12, 7, 14, 9, 11, 8, 13], 2), &SamplingParams::greedy(22));
    let expected = reference(&oracle, &all);
    // 12 blocks of 4 slots: each sample needs up to 9, so sequences must preempt each other;
    // a token budget of 6 also chunks every prefill, and a tiny group area gives every
    // prefill chunk its own attention group.
    let small =
        EngineConfig { max_num_batched_tokens: 6, max_prefill_group_area: 8, ..config(12, 4) };
    let mut engine = engine(model(ModelFamily::Qwen2, 5), small);
    let outputs = engine.generate(all).unwrap();
    assert_eq!(token_ids(&outputs), token_ids(&expected));
    let stats = engine.stats();
    assert!(stats.num_preemptions > 0, "{stats:?}");
    assert_eq!(stats.num_running, 0);
    assert_eq!(stats.kv_blocks_used, 0);
}

#[test]
fn log_probs_equal_the_model_layers_response_log_probs() {
    let cases = [
        SamplingParams::greedy(12),
        SamplingParams {
            temperature: 1.0,
            seed: Some(9),
            max_tokens: 12,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.7,
            top_k: Some(20),
            seed: Some(4),
            max_tokens: 12,
            logprob_mode: LogprobMode::Raw,
            ..SamplingParams::default()
        },
    ];
    let oracle = model(ModelFamily::Llama, 3);
    let mut engine = engine(model(ModelFamily::Llama, 3), config(128, 8));
    for params in cases {
        let outputs = engine.generate(requests(&prompts(&[6, 19, 3], 3), &params)).unwrap();
        for output in &outputs {
            let sample = &output.samples[0];
            let sequence: Vec<i64> = output
                .prompt_token_ids
                .iter()
                .chain(&sample.token_ids)
                .map(|&t| i64::from(t))
                .collect();
            let len = sequence.len() as i64;
            let r = sample.token_ids.len() as i64;
            let batch = ResponseBatch {
                input_ids: Tensor::from_slice(&sequence).view([1, len]),
                attention_mask: Tensor::ones(
                    [1, len],
                    (Kind::Int64, rtrun_rlhf_model::tch::Device::Cpu),
                ),
                action_mask: Tensor::ones(
                    [1, r],
                    (Kind::Int64, rtrun_rlhf_model::tch::Device::Cpu),
                ),
            };
            let expected =
                Vec::<f32>::try_from(oracle.response_log_probs(&batch).unwrap().view(-1)).unwrap();
            assert_eq!(sample.log_probs.len(), expected.len());
            for (a, b) in sample.log_probs.iter().zip(&expected) {
                assert!((a - b).abs() < 1e-4, "{params:?}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn seeded_sampling_reproduces_exactly_and_does_not_depend_on_the_batch() {
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: Some(50),
        n: 3,
        max_tokens: 16,
        seed: Some(1234),
        ..SamplingParams::default()
    };
    let mine = requests(&prompts(&[8, 21], 4), &params);
    let alone =
        engine(model(ModelFamily::Qwen2, 8), config(256, 16)).generate(mine.clone()).unwrap();
    // Again, in a bigger batch with other requests before and after, on a fresh engine.
    let mut others =
        requests(&prompts(&[5, 30, 12], 5), &SamplingParams { seed: Some(7), ..params.clone() });
    let mut mixed = vec![others.remove(0), mine[1].clone(), others.remove(0), mine[0].clone()];
    mixed.extend(others);
    let together = engine(model(ModelFamily::Qwen2, 8), config(256, 16)).generate(mixed).unwrap();
    let again =
        engine(model(ModelFamily::Qwen2, 8), config(256, 16)).generate(mine.clone()).unwrap();
    assert_eq!(alone, again, "the same batch reproduces bit for bit");
    assert_same(&alone, &[together[3].clone(), together[1].clone()]);
    let samples = &alone[0].samples;
    assert!(
        samples[0].token_ids != samples[1].token_ids
            || samples[1].token_ids != samples[2].token_ids
    );
    // The reference decode draws the same numbers, so it samples the same tokens.
    let expected = reference(&model(ModelFamily::Qwen2, 8), &mine);
    assert_eq!(token_ids(&alone), token_ids(&expected));
}

/// A Qwen2-style tiny model with a 12-token vocabulary.
fn small_vocab_model() -> CausalLm {
    let config = ModelConfig { vocab_size: 12, ..tiny::tiny_config(ModelFamily::Qwen2) };
    tiny::tiny_model(&config, 21).unwrap()
}

#[test]
fn empirical_top_k_top_p_distribution_matches_the_truncated_softmax() {
    let prompt = vec![3u32, 7, 1, 10];
    let (temperature, top_k, top_p) = (1.5f32, 6u32, 0.8f32);
    // The truncated softmax, computed independently from the model's plain forward.
    let oracle = small_vocab_model();
    let ids =
        Tensor::from_slice(&prompt.iter().map(|&t| i64::from(t)).collect::<Vec<_>>()).view([1, 4]);
    let logits = oracle.forward(&ids, &ids.ones_like(), None).unwrap().get(0).get(3);
    let logits = Vec::<f32>::try_from(logits.to_kind(Kind::Float)).unwrap();
    let scaled: Vec<f64> = logits.iter().map(|&l| f64::from(l) / f64::from(temperature)).collect();
    let z: f64 = scaled.iter().map(|s| s.exp()).sum();
    let mut order: Vec<(usize, f64)> = scaled.iter().map(|s| s.exp() / z).enumerate().collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1));
    order.truncate(top_k as usize);
    let mass: f64 = order.iter().map(|o| o.1).sum();
    let mut expected = vec![0.0; 12];
    let mut cumulative = 0.0;
    for &(token, p) in &order {
        expected[token] = p;
        cumulative += p;
        if cumulative >= f64::from(top_p) * mass {
            break;
        }
    }
    let kept: f64 = expected.iter().sum();
    expected.iter_mut().for_each(|p| *p /= kept);
    assert!(expected.iter().filter(|&&p| p > 0.0).count() >= 2, "{expected:?}");

    let n = 4000u32;
    let params = SamplingParams {
        temperature,
        top_k: Some(top_k),
        top_p,
        n,
        max_tokens: 1,
        seed: Some(99),
        ..SamplingParams::default()
    };
    let mut engine = engine(small_vocab_model(), config(512, 4));
    let output = engine.generate(vec![GenerationRequest::new(prompt, params)]).unwrap().remove(0);
    let mut counts = [0u32; 12];
    for sample in &output.samples {
        counts[sample.token_ids[0] as usize] += 1;
    }
    for (token, (&count, &p)) in counts.iter().zip(&expected).enumerate() {
        let observed = f64::from(count) / f64::from(n);
        if p == 0.0 {
            assert_eq!(count, 0, "token {token} is outside top-k/top-p but was sampled");
        } else {
            let sigma = (p * (1.0 - p) / f64::from(n)).sqrt();
            assert!((observed - p).abs() < 5.0 * sigma + 1e-3, "token {token}: {observed} vs {p}");
        }
    }
}

#[test]
fn sleep_and_wake_give_identical_outputs_and_asleep_calls_are_refused() {
    let all = requests(&prompts(&[7, 18, 4], 6), &SamplingParams::greedy(10));
    let original = model(ModelFamily::Llama, 13);
    let bucket = WeightBucket::from_model(&original).unwrap();
    let mut engine = engine(original, config(64, 8));
    let before = engine.generate(all.clone()).unwrap();

    engine.sleep(1).unwrap();
    assert_eq!(engine.stats().weights, WeightState::Offloaded);
    assert!(!engine.stats().kv_cache_allocated);
    assert!(matches!(engine.generate(all.clone()), Err(EngineError::Asleep { .. })));
    engine.wake_up(&[WakeTarget::Weights]).unwrap();
    assert!(matches!(
        engine.generate(all.clone()),
        Err(EngineError::Asleep { part: "kv cache", .. })
    ));
    engine.wake_up(&[WakeTarget::KvCache]).unwrap();
    assert_eq!(engine.generate(all.clone()).unwrap(), before);

    // Level 2 drops the weights: they come back zeroed until a weight update refills them.
    engine.sleep(2).unwrap();
    assert_eq!(engine.stats().weights, WeightState::Discarded);
    assert!(engine.update_weights(&bucket).is_err(), "updates need resident weights");
    engine.wake_up(&[]).unwrap();
    engine.update_weights(&bucket).unwrap();
    assert_eq!(engine.generate(all).unwrap(), before);
    assert!(matches!(engine.sleep(3), Err(EngineError::InvalidArgument(_))));
}

#[test]
fn update_weights_gives_the_outputs_of_the_new_weights_and_bad_buckets_change_nothing() {
    let all = requests(&prompts(&[9, 25, 3], 7), &SamplingParams::greedy(12));
    let mut engine = engine(model(ModelFamily::Qwen2, 1), config(64, 8));
    let old = engine.generate(all.clone()).unwrap();
    let new_model = model(ModelFamily::Qwen2, 2);
    let mut bucket = WeightBucket::from_model(&new_model).unwrap();

    // A bucket with one bad tensor is refused whole.
    let mut bad = bucket.clone();
    bad.tensors[3].shape.push(1);
    assert!(matches!(engine.update_weights(&bad), Err(EngineError::InvalidWeight { .. })));
    let mut unknown = bucket.clone();
    unknown.tensors[0].name = "model.nonexistent.weight".into();
    assert!(engine.update_weights(&unknown).is_err());
    assert_same(&engine.generate(all.clone()).unwrap(), &old);

    // Sent in two buckets, as trainers do.
    let second = WeightBucket { tensors: bucket.tensors.split_off(bucket.tensors.len() / 2) };
    engine.update_weights(&bucket).unwrap();
    engine.update_weights(&second).unwrap();
    let updated = engine.generate(all.clone()).unwrap();
    assert_eq!(token_ids(&updated), token_ids(&reference(&new_model, &all)));
    assert_ne!(token_ids(&updated), token_ids(&old));
    assert_eq!(engine.stats().weight_updates, 2);

    // bf16 buckets (half the bytes) land as the new weights rounded to bf16.
    let third = model(ModelFamily::Qwen2, 3);
    for bucket in WeightBucket::split_model(&third, 20_000, Some(Kind::BFloat16)).unwrap() {
        engine.update_weights(&bucket).unwrap();
    }
    for (name, expected) in third.named_parameters() {
        let found = engine.model().params.get(name).unwrap();
        assert!(found.equal(&expected.to_kind(Kind::BFloat16).to_kind(Kind::Float)), "{name}");
    }
}

#[test]
fn weights_arriving_mid_request_tag_the_tokens_they_sample_and_need_the_engine_to_allow_it() {
    let all = requests(&prompts(&[9, 25, 3], 8), &SamplingParams::greedy(12));
    let new_model = model(ModelFamily::Qwen2, 6);
    let bucket = WeightBucket::from_model(&new_model).unwrap();

    // An engine of the synchronous loop refuses an update while requests run.
    let mut strict = engine(model(ModelFamily::Qwen2, 5), config(64, 8));
    let id = strict.add_request(all[0].clone()).unwrap();
    strict.step().unwrap();
    let err = strict.update_weights(&bucket).unwrap_err();
    assert!(matches!(err, EngineError::Busy { .. }), "{err}");
    strict.run_until_idle().unwrap();
    let out = strict.take_output(id).unwrap();
    assert_eq!(out.samples[0].weight_versions, vec![0; 12]);

    // A partial-rollout engine takes the update between two steps: the running requests go
    // on, every token before it is tagged 0 and every token after it 1.
    let partial = EngineConfig { weight_updates_in_flight: true, ..config(64, 8) };
    let mut engine = engine(model(ModelFamily::Qwen2, 5), partial);
    let ids: Vec<_> = all.iter().map(|r| engine.add_request(r.clone()).unwrap()).collect();
    for _ in 0..4 {
        engine.step().unwrap();
    }
    engine.update_weights(&bucket).unwrap();
    engine.set_weight_version(1);
    engine.run_until_idle().unwrap();
    let before_switch = engine.weight_version();
    assert_eq!(before_switch, 1);
    for id in ids {
        let sample = &engine.take_output(id).unwrap().samples[0];
        assert_eq!(sample.weight_versions.len(), sample.token_ids.len());
        let old = sample.weight_versions.iter().filter(|&&v| v == 0).count();
        // One token per step once prefilled (every prompt fits one step's budget here).
        assert_eq!(old, 4, "{:?}", sample.weight_versions);
        assert!(sample.weight_versions.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(sample.weight_versions.iter().filter(|&&v| v == 1).count(), 8);
    }
}

#[test]
fn shared_prefixes_hit_the_prefix_cache_with_identical_outputs() {
    let prefix = prompts(&[48], 8).remove(0);
    let suffixes = prompts(&[3, 5, 1, 7], 9);
    let shared: Vec<Vec<u32>> =
        suffixes.iter().map(|s| prefix.iter().chain(s).copied().collect()).collect();
    let all = requests(&shared, &SamplingParams::greedy(8));
    let expected = reference(&model(ModelFamily::Llama, 17), &all);
    let mut cached = engine(model(ModelFamily::Llama, 17), config(128, 8));
    // The first request fills the cache; the others reuse its 6 full prefix blocks.
    let first = cached.generate(all[..1].to_vec()).unwrap();
    let rest = cached.generate(all[1..].to_vec()).unwrap();
    let stats = cached.stats();
    assert!(stats.cached_prompt_tokens >= 3 * 48, "{stats:?}");
    assert!(stats.prefix_hit_rate > 0.5, "{stats:?}");
    assert_eq!(token_ids(&[first, rest].concat()), token_ids(&expected));
    // n samples of one prompt share its blocks too.
    let params = SamplingParams { n: 4, ..SamplingParams::greedy(8) };
    let outputs = cached.generate(vec![GenerationRequest::new(shared[2].clone(), params)]).unwrap();
    assert!(outputs[0].samples.iter().all(|s| s.token_ids == expected[2].samples[0].token_ids));

    let uncached_config = EngineConfig { enable_prefix_caching: false, ..config(128, 8) };
    let mut uncached = engine(model(ModelFamily::Llama, 17), uncached_config);
    assert_eq!(token_ids(&uncached.generate(all).unwrap()), token_ids(&expected));
    assert_eq!(uncached.stats().cached_prompt_tokens, 0);
}

#[test]
fn stop_tokens_stop_strings_and_bad_requests() {
    let config_tiny = tiny::tiny_config(ModelFamily::Qwen2);
    let tokenizer = tiny::tiny_tokenizer().unwrap();
    let mut engine = LlmEngine::new(
        tiny::tiny_model(&config_tiny, 31).unwrap(),
        Some(tiny::tiny_tokenizer().unwrap()),
        config(128, 8),
    )
    .unwrap();
    let prompt = tokenizer.encode("the quick brown fox", false).unwrap();
    let full = engine
        .generate(vec![GenerationRequest::new(prompt.clone(), SamplingParams::greedy(16))])
        .unwrap()
        .remove(0)
        .samples
        .remove(0);

    let stop_token = full.token_ids[4];
    let params = SamplingParams { stop_token_ids: vec![stop_token], ..SamplingParams::greedy(16) };
    let stopped = engine.generate(vec![GenerationRequest::new(prompt.clone(), params)]).unwrap();
    let sample = &stopped[0].samples[0];
    assert_eq!(sample.finish_reason, FinishReason::StopToken(stop_token));
    assert_eq!(sample.token_ids.last(), Some(&stop_token));
    assert!(full.token_ids.starts_with(&sample.token_ids));

    let text = tokenizer.decode(&full.token_ids[5..7], false).unwrap();
    let stop = text.chars().take(2).collect::<String>();
    let params = SamplingParams {
        stop: vec!["\u{1}never".into(), stop.clone()],
        ..SamplingParams::greedy(16)
    };
    let stopped = engine.generate(vec![GenerationRequest::new(prompt.clone(), params)]).unwrap();
    let sample = &stopped[0].samples[0];
    assert_eq!(sample.finish_reason, FinishReason::StopString(1));
    assert!(full.token_ids.starts_with(&sample.token_ids));
    assert!(sample.token_ids.len() <= 7);
    assert!(tokenizer.decode(&sample.token_ids, false).unwrap().contains(&stop));

    // Hostile requests are refused before anything is queued.
    let too_big = GenerationRequest::new(vec![3, 384], SamplingParams::greedy(4));
    let err =
        engine.generate(vec![GenerationRequest::new(prompt, SamplingParams::greedy(4)), too_big]);
    assert!(err.unwrap_err().to_string().contains("found 384"));
    assert!(
        engine.generate(vec![GenerationRequest::new(vec![], SamplingParams::greedy(4))]).is_err()
    );
    let huge = GenerationRequest::new(vec![5; 4000], SamplingParams::greedy(4));
    assert!(engine.generate(vec![huge]).is_err());
    let stats = engine.stats();
    assert_eq!((stats.num_waiting, stats.num_running, stats.outputs_waiting), (0, 0, 0));
    let mut no_tokenizer = self::engine(model(ModelFamily::Qwen2, 31), config(16, 8));
    let params = SamplingParams { stop: vec!["x".into()], ..SamplingParams::greedy(4) };
    assert!(no_tokenizer.generate(vec![GenerationRequest::new(vec![4], params)]).is_err());
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rtrun-engine-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn engine_actor_routes_two_ranks_through_the_runtime() {
    rtrun::init().expect("runtime starts");
    let dir = temp_dir("actor");
    let family_config = tiny::tiny_config(ModelFamily::Llama);
    let saved = tiny::write_tiny_model(&dir, &family_config, 23, &SaveOptions::default()).unwrap();
    let actor =
        EngineActor::remote(EngineActorConfig { model_dir: dir.clone(), engine: config(128, 8) })
            .unwrap();

    let params = SamplingParams::greedy(6);
    let rank0 = requests(&prompts(&[4, 11, 6], 10), &params);
    let rank1 = requests(&prompts(&[9, 2], 11), &params);
    actor.add_requests(0u32, rank0[..2].to_vec()).get().unwrap().unwrap();
    actor.add_requests(1u32, rank1.clone()).get().unwrap().unwrap();
    actor.add_requests(0u32, rank0[2..].to_vec()).get().unwrap().unwrap();
    let out1 = actor.get_responses(1u32).get().unwrap().unwrap();
    let out0 = actor.get_responses(0u32).get().unwrap().unwrap();
    assert_eq!(token_ids(&out0), token_ids(&reference(&saved, &rank0)));
    assert_eq!(token_ids(&out1), token_ids(&reference(&saved, &rank1)));
    assert!(actor.get_responses(2u32).get().unwrap().unwrap().is_empty());
    let bad = vec![GenerationRequest::new(vec![999], params.clone())];
    assert!(actor.add_requests(0u32, bad).get().unwrap().is_err());

    // Weight sync through the runtime: sleep, wake the weights, update, wake the cache.
    let new_model = model(ModelFamily::Llama, 24);
    actor.sleep(2u32).get().unwrap().unwrap();
    actor.wake_up(vec!["weights".to_owned()]).get().unwrap().unwrap();
    actor.update_weights(WeightBucket::from_model(&new_model).unwrap()).get().unwrap().unwrap();
    actor.wake_up(vec!["kv_cache".to_owned()]).get().unwrap().unwrap();
    actor.reset_prefix_cache().get().unwrap().unwrap();
    assert!(actor.wake_up(vec!["gpu".to_owned()]).get().unwrap().is_err());
    let generated = actor.generate(rank1.clone()).get().unwrap().unwrap();
    assert_eq!(token_ids(&generated), token_ids(&reference(&new_model, &rank1)));
    let stats = actor.stats().get().unwrap().unwrap();
    assert_eq!(stats.requests_finished, 7);
    assert_eq!(stats.weight_updates, 1);
    assert!(stats.generated_tokens_per_second > 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn streamed_requests_come_back_by_tag_as_they_finish_through_the_runtime() {
    rtrun::init().expect("runtime starts");
    let dir = temp_dir("stream");
    let family_config = tiny::tiny_config(ModelFamily::Llama);
    let saved = tiny::write_tiny_model(&dir, &family_config, 29, &SaveOptions::default()).unwrap();
    let partial = EngineConfig { weight_updates_in_flight: true, ..config(128, 8) };
    let actor =
        EngineActor::remote(EngineActorConfig { model_dir: dir.clone(), engine: partial }).unwrap();
    // Short and long answers: the short ones finish in the first call, the long one later.
    let short = requests(&prompts(&[4, 7], 13), &SamplingParams::greedy(2));
    let long = requests(&prompts(&[5], 14), &SamplingParams::greedy(10));
    let tagged: Vec<(u64, GenerationRequest)> =
        vec![(70, short[0].clone()), (71, long[0].clone()), (72, short[1].clone())];
    actor.stream_add(tagged).get().unwrap().unwrap();
    // A bad request is refused whole; nothing of it is queued.
    let bad = vec![
        (80, short[0].clone()),
        (81, GenerationRequest::new(vec![999], SamplingParams::greedy(2))),
    ];
    assert!(actor.stream_add(bad).get().unwrap().is_err());
    let first = actor.stream_step(3u32).get().unwrap().unwrap();
    assert_eq!(first.steps, 3);
    assert_eq!(first.unfinished, 1);
    let mut tags: Vec<u64> = first.finished.iter().map(|(tag, _)| *tag).collect();
    tags.sort_unstable();
    assert_eq!(tags, vec![70, 72]);
    for (tag, output) in &first.finished {
        let expected = reference(&saved, &short[(*tag - 70) as usize / 2..][..1]);
        assert_eq!(token_ids(std::slice::from_ref(output)), token_ids(&expected));
    }
    actor.set_weight_version(3u64).get().unwrap().unwrap();
    let mut rest = actor.stream_step(100u32).get().unwrap().unwrap();
    assert_eq!((rest.unfinished, rest.finished.len(), rest.weight_version), (0, 1, 3));
    assert!(rest.steps < 100, "stops once nothing is left to run");
    let (tag, output) = rest.finished.remove(0);
    assert_eq!(tag, 71);
    // Same weights, so the same tokens; the version tags say which call sampled them.
    assert_eq!(token_ids(std::slice::from_ref(&output)), token_ids(&reference(&saved, &long)));
    let versions = &output.samples[0].weight_versions;
    assert_eq!(versions[..3], [0, 0, 0]);
    assert!(versions[3..].iter().all(|&v| v == 3), "{versions:?}");
    // Aborting drops what is still running.
    actor.stream_add(vec![(90, long[0].clone())]).get().unwrap().unwrap();
    actor.stream_step(1u32).get().unwrap().unwrap();
    assert_eq!(actor.stream_abort().get().unwrap().unwrap(), 1);
    let idle = actor.stream_step(5u32).get().unwrap().unwrap();
    assert_eq!((idle.steps, idle.unfinished, idle.finished.len()), (0, 0, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failing_step_aborts_its_requests_and_leaves_the_engine_usable() {
    let original = model(ModelFamily::Qwen2, 41);
    let good = WeightBucket::from_model(&original).unwrap();
    let mut engine = engine(original, config(64, 8));
    let all = requests(&prompts(&[5, 9], 12), &SamplingParams::greedy(6));
    let before = engine.generate(all.clone()).unwrap();
    // NaN weights make every logit NaN: sampling refuses them and the step fails.
    let mut poisoned = good.clone();
    let norm = poisoned.tensors.iter_mut().find(|t| t.name == "model.norm.weight").unwrap();
    let nan = Tensor::full([64], f64::NAN, (Kind::Float, rtrun_rlhf_model::tch::Device::Cpu));
    *norm = rtrun_rlhf_engine::NamedTensor::from_tensor("model.norm.weight", &nan).unwrap();
    engine.update_weights(&poisoned).unwrap();
    let queued = engine.add_request(all[0].clone()).unwrap();
    let err = engine.generate(all.clone()).unwrap_err();
    assert!(matches!(err, EngineError::Sampling(_)), "{err}");
    let stats = engine.stats();
    assert_eq!((stats.num_waiting, stats.num_running, stats.kv_blocks_used), (0, 0, 0));
    // The request queued before the failure is answered, as aborted.
    let aborted = engine.take_output(queued).unwrap();
    assert_eq!(aborted.samples[0].finish_reason, FinishReason::Aborted);
    engine.update_weights(&good).unwrap();
    assert_same(&engine.generate(all).unwrap(), &before);
}

#[test]
fn a_bf16_engine_generates_and_a_mismatched_dtype_is_refused() {
    let config_tiny = tiny::tiny_config(ModelFamily::Llama);
    let bf16 = || {
        CausalLm::new_random(&config_tiny, rtrun_rlhf_model::tch::Device::Cpu, Kind::BFloat16, 3)
            .unwrap()
    };
    let refused = LlmEngine::new(bf16(), None, config(32, 8));
    assert!(matches!(refused, Err(EngineError::InvalidConfig(_))));
    let bf16_config = EngineConfig { dtype: "bf16".into(), ..config(32, 8) };
    let mut engine = LlmEngine::new(bf16(), None, bf16_config).unwrap();
    let params = SamplingParams { seed: Some(5), max_tokens: 8, ..SamplingParams::default() };
    let outputs = engine.generate(requests(&prompts(&[6, 13], 13), &params)).unwrap();
    for sample in outputs.iter().flat_map(|o| &o.samples) {
        assert_eq!(sample.token_ids.len(), 8);
        assert!(sample.log_probs.iter().all(|l| l.is_finite() && *l <= 0.0));
    }
}

/// Greedy outputs equal Hugging Face `generate`'s (with its KV cache) on the parity checkpoints,
/// all prompts batched in one engine run: `tests/hf/hf_greedy.json` holds transformers' tokens
/// (`tests/hf/make_hf_greedy.py` wrote them).
#[test]
fn greedy_outputs_equal_hugging_face_generate_on_the_parity_checkpoints() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/hf/hf_greedy.json")).unwrap(),
    )
    .unwrap();
    let new_tokens = golden["transformers_new_tokens"].as_u64().unwrap() as u32;
    let params = SamplingParams { min_tokens: new_tokens, ..SamplingParams::greedy(new_tokens) };
    let ids = |value: &serde_json::Value| -> Vec<u32> {
        value.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    for (name, cases) in golden["models"].as_object().unwrap() {
        let dir = root.join("../model/parity").join(name);
        let model =
            CausalLm::from_pretrained(&dir, rtrun_rlhf_model::tch::Device::Cpu, Kind::Float)
                .unwrap();
        let cases = cases.as_array().unwrap();
        let batch: Vec<GenerationRequest> = cases
            .iter()
            .map(|c| GenerationRequest::new(ids(&c["prompt"]), params.clone()))
            .collect();
        let outputs = engine(model, config(64, 4)).generate(batch).unwrap();
        for (case, output) in cases.iter().zip(&outputs) {
            assert_eq!(
                output.samples[0].token_ids,
                ids(&case["tokens"]),
                "{name}: prompt {:?}",
                ids(&case["prompt"])
            );
        }
    }
}
