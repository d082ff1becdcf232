//! Tensor-parallel engines (ranks on threads of this process, a real CPU ring between them)
//! against the whole-model engine: greedy tokens identical, log-probs within 1e-5 (float32),
//! on the tiny models, the ~25M benchmark model and GQA layouts that replicate kv heads; and
//! sleep / wake-up, prefix caching and weight updates by shard on every rank.

use std::time::{Duration, Instant};

use rtrun_rlhf_engine::tp::{ThreadFollowers, TpLayout, reshard};
use rtrun_rlhf_engine::{
    EngineActor, EngineActorConfig, EngineConfig, GenerationOutput, GenerationRequest, LlmEngine,
    NamedTensor, SamplingParams, WeightBucket,
};
use rtrun_rlhf_model::tch::{Device, Kind, Tensor};
use rtrun_rlhf_model::{CausalLm, ModelConfig, ModelFamily, ResponseBatch, SaveOptions, tiny};

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

/// A second model with `model`'s weights.
fn copy(model: &CausalLm) -> CausalLm {
    let copy = CausalLm::uninitialised(model.config(), model.params.device(), model.params.kind())
        .unwrap();
    for (name, t) in model.named_parameters() {
        copy.params.copy_into(name, t).unwrap();
    }
    copy
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn config() -> EngineConfig {
    EngineConfig { num_gpu_blocks: Some(96), block_size: 8, ..EngineConfig::default() }
}

fn tp_engine(model: &CausalLm, world: usize) -> LlmEngine {
    ThreadFollowers::engine(model, None, config(), world, free_port()).unwrap()
}

/// Deterministic prompts of the given lengths (ids 3.. avoid the special tokens).
fn prompts(lengths: &[usize], vocab: u32, salt: u64) -> Vec<Vec<u32>> {
    let mut state = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    lengths
        .iter()
        .map(|&len| (0..len).map(|_| 3 + (next() % (vocab as u64 - 3)) as u32).collect())
        .collect()
}

fn requests(prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<GenerationRequest> {
    prompts.iter().map(|p| GenerationRequest::new(p.clone(), params.clone())).collect()
}

/// Same tokens, log-probs within `tol`.
fn assert_same(whole: &[GenerationOutput], split: &[GenerationOutput], tol: f32, what: &str) {
    assert_eq!(whole.len(), split.len());
    for (i, (a, b)) in whole.iter().zip(split).enumerate() {
        for (s, (x, y)) in a.samples.iter().zip(&b.samples).enumerate() {
            assert_eq!(x.token_ids, y.token_ids, "{what}: request {i} sample {s}");
            for (p, q) in x.log_probs.iter().zip(&y.log_probs) {
                assert!((p - q).abs() <= tol, "{what}: request {i} log-prob {p} vs {q}");
            }
        }
    }
}

/// Generates greedily and at temperature 1 (seeded) with the whole model and with `worlds`
/// ranks; outputs must agree.
fn check_exact(model: &CausalLm, worlds: &[usize], what: &str) {
    let vocab = model.config().vocab_size as u32;
    let prompts = prompts(&[5, 17, 9, 30, 3, 12], vocab, 7);
    let greedy = requests(&prompts, &SamplingParams::greedy(12));
    let sampled = requests(
        &prompts[..3],
        &SamplingParams {
            temperature: 1.0,
            seed: Some(11),
            n: 2,
            max_tokens: 10,
            ..SamplingParams::default()
        },
    );
    let mut whole = LlmEngine::new(copy(model), None, config()).unwrap();
    let want_greedy = whole.generate(greedy.clone()).unwrap();
    let want_sampled = whole.generate(sampled.clone()).unwrap();
    for &world in worlds {
        let mut split = tp_engine(model, world);
        assert_eq!(split.tensor_parallel_size(), world);
        let got = split.generate(greedy.clone()).unwrap();
        assert_same(&want_greedy, &got, 1e-5, &format!("{what} tp={world} greedy"));
        let got = split.generate(sampled.clone()).unwrap();
        assert_same(&want_sampled, &got, 1e-5, &format!("{what} tp={world} sampled"));
    }
}

#[test]
fn tiny_models_generate_the_same_tokens_at_tp_2_and_4() {
    for family in [ModelFamily::Llama, ModelFamily::Qwen2, ModelFamily::Qwen3] {
        let model = tiny::tiny_model(&tiny::tiny_config(family), 3).unwrap();
        check_exact(&model, &[2, 4], &format!("{family:?}"));
    }
}

/// A Qwen3-shaped model whose second layer slides over 6 keys: the window holds at every rank.
#[test]
fn a_sliding_window_model_generates_the_same_tokens_at_tp_2() {
    let config = ModelConfig {
        sliding_window: Some(rtrun_rlhf_model::SlidingWindow {
            size: 6,
            layers: vec![false, true],
        }),
        ..tiny::tiny_config(ModelFamily::Qwen3)
    };
    let model = tiny::tiny_model(&config, 3).unwrap();
    check_exact(&model, &[2], "sliding window");
}

#[test]
fn the_25m_model_generates_the_same_tokens_at_tp_2_and_4() {
    let model = tiny::tiny_model(&tiny::bench_config_25m(), 5).unwrap();
    check_exact(&model, &[2, 4], "25M");
}

#[test]
fn gqa_layouts_that_replicate_kv_heads_generate_the_same_tokens() {
    let gqa = |heads, kv_heads| ModelConfig {
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        hidden_size: 96,
        head_dim: 16,
        intermediate_size: 192,
        ..tiny::tiny_config(ModelFamily::Llama)
    };
    // 6 query / 3 kv heads at TP 2: kv head 1 is read by both ranks.
    let model = tiny::tiny_model(&gqa(6, 3), 9).unwrap();
    assert!(TpLayout::new(model.config(), 2).unwrap().replicates_kv());
    check_exact(&model, &[2, 3], "6q/3kv");
    // 6 query heads cannot split four ways: a config error naming both numbers.
    let err = ThreadFollowers::engine(&model, None, config(), 4, free_port()).unwrap_err();
    assert!(
        err.to_string().contains("tensor_parallel_size 4")
            && err.to_string().contains("6 query heads"),
        "{err}"
    );
    // 12 query / 3 kv heads at TP 4 and 8 query / 2 kv heads at TP 4: fewer kv heads than ranks.
    let model = tiny::tiny_model(&gqa(12, 3), 9).unwrap();
    check_exact(&model, &[4], "12q/3kv");
    let model = tiny::tiny_model(&gqa(8, 2), 9).unwrap();
    assert!(TpLayout::new(model.config(), 4).unwrap().replicates_kv());
    check_exact(&model, &[4], "8q/2kv");
}

#[test]
fn sleep_wake_prefix_caching_and_shard_updates_work_on_every_rank() {
    let config_ = tiny::tiny_config(ModelFamily::Llama);
    let model = tiny::tiny_model(&config_, 3).unwrap();
    let updated = tiny::tiny_model(&config_, 4).unwrap();
    let vocab = config_.vocab_size as u32;
    // A shared 16-token prefix: the second round hits the prefix cache.
    let prefix = prompts(&[16], vocab, 1).remove(0);
    let prompts: Vec<Vec<u32>> = prompts(&[4, 6, 8], vocab, 2)
        .into_iter()
        .map(|tail| prefix.iter().chain(&tail).copied().collect())
        .collect();
    let greedy = requests(&prompts, &SamplingParams::greedy(8));
    let mut whole = LlmEngine::new(copy(&model), None, config()).unwrap();
    let before = whole.generate(greedy.clone()).unwrap();
    let mut split = tp_engine(&model, 2);
    assert_same(&before, &split.generate(greedy.clone()).unwrap(), 1e-5, "first round");
    let hits = split.stats().cached_prompt_tokens;
    assert_same(&before, &split.generate(greedy.clone()).unwrap(), 1e-5, "cached round");
    assert!(split.stats().cached_prompt_tokens > hits, "the second round hits the cache");
    split.reset_prefix_cache();
    for level in [1, 2] {
        split.sleep(level).unwrap();
        split.wake_up(&[]).unwrap();
        if level == 2 {
            // Released weights come back zeroed: the whole model's shard restores them.
            update_by_shard(&mut split, &model, 2);
        }
        assert_same(&before, &split.generate(greedy.clone()).unwrap(), 1e-5, "after a wake-up");
    }
    // New weights, each rank given its shard (packed q/k/v and gate/up on the engine side).
    whole.update_weights(&whole_bucket(&updated)).unwrap();
    let after = whole.generate(greedy.clone()).unwrap();
    update_by_shard(&mut split, &updated, 2);
    let got = split.generate(greedy).unwrap();
    assert_same(&after, &got, 1e-5, "after an update");
    // The policy's own log-probs of what the updated TP = 2 engine generated (a training
    // forward of the whole model), token by token.
    let mut worst = 0f32;
    for output in &got {
        let sample = &output.samples[0];
        let sequence: Vec<i64> = output
            .prompt_token_ids
            .iter()
            .chain(&sample.token_ids)
            .map(|&t| i64::from(t))
            .collect();
        let (len, r) = (sequence.len() as i64, sample.token_ids.len() as i64);
        let ones = |n| Tensor::ones([1, n], (Kind::Int64, Device::Cpu));
        let batch = ResponseBatch {
            input_ids: Tensor::from_slice(&sequence).view([1, len]),
            attention_mask: ones(len),
            action_mask: ones(r),
        };
        let policy =
            Vec::<f32>::try_from(updated.response_log_probs(&batch).unwrap().view(-1)).unwrap();
        for (a, b) in sample.log_probs.iter().zip(&policy) {
            worst = worst.max((a - b).abs());
        }
    }
    eprintln!("TP = 2 engine vs the policy's forward after a sync: max |Δ log-prob| {worst:.2e}");
    assert!(worst <= 1e-5, "engine and policy log-probs differ by {worst}");
}

/// The whole model as one bucket.
fn whole_bucket(model: &CausalLm) -> WeightBucket {
    let tensors =
        model.named_parameters().map(|(n, t)| NamedTensor::from_tensor(n, t).unwrap()).collect();
    WeightBucket { tensors }
}

/// Every rank's shard of `model` into `engine`, each rank its own bucket.
fn update_by_shard(engine: &mut LlmEngine, model: &CausalLm, world: usize) {
    let layout = TpLayout::new(model.config(), world).unwrap();
    let buckets =
        reshard::engine_buckets(&layout, &model.named_parameters().collect::<Vec<_>>(), usize::MAX)
            .unwrap();
    let by_rank: Vec<WeightBucket> = buckets.into_iter().map(|mut b| b.remove(0)).collect();
    engine.update_weights_by_rank(&by_rank).unwrap();
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("rtrun-tp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A TP = 2 engine as two actor processes: the same tokens as the whole model, sleep and
/// wake-up on both ranks, each rank updated with its own shard; then a rank killed mid-run
/// fails generation with an error naming the rank and its node, instead of hanging.
#[test]
fn an_engine_of_two_actor_processes_matches_the_whole_model_and_fails_cleanly() {
    rtrun::init().expect("runtime starts");
    let dir = temp_dir("actor");
    let family = tiny::tiny_config(ModelFamily::Qwen2);
    let saved = tiny::write_tiny_model(&dir, &family, 23, &SaveOptions::default()).unwrap();
    let engine = EngineConfig { tensor_parallel_size: 2, ..config() };
    let actor_config = EngineActorConfig { model_dir: dir.clone(), engine };
    let group = EngineActor::create_group("tp-test", &actor_config, |_, o| Ok(o)).unwrap();
    let (rank0, rank1) = (&group.members()[0], &group.members()[1]);
    let vocab = family.vocab_size as u32;
    let greedy = requests(&prompts(&[4, 11, 6, 20], vocab, 3), &SamplingParams::greedy(8));
    let mut whole = LlmEngine::new(copy(&saved), None, config()).unwrap();
    let want = whole.generate(greedy.clone()).unwrap();
    assert_same(&want, &rank0.generate(greedy.clone()).get().unwrap().unwrap(), 1e-5, "actors");
    // Rank 1 is not the engine's handle.
    let refused = rank1.generate(greedy.clone()).get().unwrap().unwrap_err();
    assert!(refused.contains("rank 1") && refused.contains("rank 0"), "{refused}");

    rank0.sleep(1).get().unwrap().unwrap();
    rank0.wake_up(vec![]).get().unwrap().unwrap();
    let updated = tiny::tiny_model(&family, 24).unwrap();
    whole.update_weights(&whole_bucket(&updated)).unwrap();
    let want = whole.generate(greedy.clone()).unwrap();
    let layout = TpLayout::new(&family, 2).unwrap();
    let params: Vec<_> = updated.named_parameters().collect();
    let buckets = reshard::engine_buckets(&layout, &params, usize::MAX).unwrap();
    let whole_bytes = whole_bucket(&updated).num_bytes();
    for (member, mut buckets) in group.members().iter().zip(buckets) {
        let bucket = buckets.remove(0);
        // Each rank receives its shard plus the replicated parts, less than the whole model.
        assert!(bucket.num_bytes() < whole_bytes);
        member.update_weights(bucket).get().unwrap().unwrap();
    }
    assert_same(&want, &rank0.generate(greedy.clone()).get().unwrap().unwrap(), 1e-5, "updated");

    rank1.kill().unwrap();
    let started = Instant::now();
    let err = rank0.generate(greedy).get().unwrap().unwrap_err();
    eprintln!("rank 1 killed: {err}");
    assert!(err.contains("tensor-parallel rank 1") && err.contains("on node"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(50), "failed after {:?}", started.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}
