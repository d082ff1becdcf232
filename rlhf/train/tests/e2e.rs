//! End-to-end runs of the trainer on the embedded runtime with real worker processes: GRPO and
//! PPO steps in each colocation mode (on 8 declared, fake GPUs), the remote HTTP reward, and a
//! run killed after k steps then resumed reproducing the metrics of an uninterrupted run.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rtrun_rlhf::TrainConfig;
use rtrun_rlhf::config::{OldLogprobs, PipelineMode};
use rtrun_rlhf::placement_map::ColocationMode;
use rtrun_rlhf::trainer::{NoProgress, dock_layout};
use rtrun_rlhf_model::ScalarHeadModel;

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rtrun-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small, fast config: few prompts, a 5-step warm-up, 2 training steps.
fn small_config(run_dir: &Path, extra: &str) -> TrainConfig {
    let yaml = format!(
        "seed: 7\nrun_dir: {}\n\
         data: {{synthetic: {{kind: reverse_digits, min_digits: 2, max_digits: 4, train_size: 64, eval_size: 8}}}}\n\
         model: {{hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 64}}\n\
         warmup: {{steps: 5, batch_size: 16, lr: 0.003}}\n\
         rollout: {{prompts_per_step: 4, n_samples_per_prompt: 2}}\n\
         train: {{max_steps: 2, train_batch_size: 4, micro_batch_size: 2, actor_lr: 0.001, critic_lr: 0.001}}\n\
         eval: {{every_steps: 0}}\n{extra}",
        run_dir.display()
    );
    // Enough CPUs for every spec's bundles, whichever test of a process starts the runtime; one
    // thread per worker, since tests run side by side (`auto` assumes the run has the machine);
    // the policy recomputes the old log-probs every step, so `assert_trained` sees the
    // engine/policy gap (weight sync at work) on every step.
    TrainConfig::from_yaml(
        &yaml,
        "test.yaml",
        &[
            "cluster.num_cpus=16".into(),
            "cluster.threads_per_worker=1".into(),
            "algo.old_logprobs=policy".into(),
        ],
    )
    .expect("test config parses")
}

/// A reward model (fresh scalar head on the policy's shape) for `reward.kind: model`.
fn write_reward_model(dir: &Path, config: &TrainConfig) {
    let model_config = rtrun_rlhf::demo::warmup::policy_config(&config.model, 32);
    let rm =
        ScalarHeadModel::new_random(&model_config, tch::Device::Cpu, tch::Kind::Float, 3).unwrap();
    rm.save_pretrained(dir, &Default::default()).unwrap();
}

fn metrics(run_dir: &Path) -> Vec<rtrun_rlhf_telemetry::StepMetrics> {
    rtrun_rlhf_telemetry::jsonl::read_jsonl(&run_dir.join("metrics.jsonl")).unwrap()
}

fn assert_trained(run_dir: &Path, steps: u64) {
    let records = metrics(run_dir);
    let last = records.last().expect("metrics were written");
    assert_eq!(last.step(), steps);
    for name in
        ["reward", "policy_loss", "actor_grad_norm", "eval/reward", "time/generate", "time/train"]
    {
        assert!(
            last.get(name).is_some_and(f64::is_finite),
            "`{name}` missing or not finite in {last:?}"
        );
    }
    // The engines generate with exactly the weights the policy trains (weight sync works).
    for r in records.iter().filter(|r| r.step() > 0) {
        let gap = r.get("engine_logprob_gap").unwrap();
        assert!(gap < 1e-4, "step {}: engine and policy log-probs differ by {gap}", r.step());
    }
}

fn run_mode(spec: &str, mode: ColocationMode) {
    let dir = scratch(spec);
    let rm_dir = dir.join("rm");
    let spec_path = repo_root().join(format!("deploy/examples/rlhf/placement/{spec}.yaml"));
    let extra = format!(
        "cluster: {{num_gpus: 8, fake_gpus: true, placement_spec: {}}}\n\
         algo: {{advantage_estimator: gae, init_kl_coef: 0.01, kl_target: 0.1}}\n\
         reward: {{kind: model, model_dir: {}}}\n",
        spec_path.display(),
        rm_dir.display()
    );
    // The reward model's directory must exist when the config is checked.
    write_reward_model(&rm_dir, &small_config(&dir.join("run"), ""));
    let config = small_config(&dir.join("run"), &extra);
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 2);
    assert!(trainer.roles.critic.is_some() && trainer.roles.reward_model.is_some());
    let placements = &trainer.roles.placements;
    assert_eq!(placements.mode, mode);
    let deployment =
        placements.deployment.as_ref().expect("the spec's placement groups were created");
    assert_eq!(deployment.groups().count(), placements.spec.as_ref().unwrap().groups.len());
    assert_trained(&dir.join("run"), 2);
    let records = metrics(&dir.join("run"));
    assert!(records.last().unwrap().get("critic_loss").is_some_and(|v| v > 0.0));
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ppo_separate_placement_with_two_dp_policy_ranks() {
    run_mode("separate", ColocationMode::Separate);
}

#[test]
fn ppo_actor_and_reference_colocated() {
    run_mode("actor-ref", ColocationMode::ActorRef);
}

#[test]
fn ppo_critic_and_reward_model_colocated() {
    run_mode("critic-reward", ColocationMode::CriticReward);
}

#[test]
fn ppo_all_colocated_hybrid_engine() {
    run_mode("hybrid", ColocationMode::All);
}

#[test]
fn grpo_with_kl_loss_and_entropy_bonus() {
    let dir = scratch("grpo");
    let config = small_config(
        &dir,
        "algo: {advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, init_kl_coef: 0.01, entropy_coef: 0.01}\n",
    );
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 2);
    assert!(trainer.roles.critic.is_none(), "GRPO needs no critic");
    assert_trained(&dir, 2);
    let last = metrics(&dir).pop().unwrap();
    assert!(last.get("entropy").is_some_and(|e| e > 0.0));
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// GRPO with LoRA where users run it: the hybrid engine (every role on one GPU's share, the
/// policy's state offloaded while the engines generate), and two DP policy ranks at ZeRO-3
/// (frozen base shards gathered per layer, adapters reduced). No reference group starts (the
/// policy ranks compute the reference with their adapters off), the engines generate with the
/// merged adapters (gap below 1e-4 on every step), and the KL to the reference moves off 0.
#[test]
fn grpo_with_lora_in_the_hybrid_engine_and_at_zero_three() {
    for (spec, stage) in [
        ("hybrid", rtrun_rlhf_shard::ZeroStage::Zero),
        ("separate", rtrun_rlhf_shard::ZeroStage::Three),
    ] {
        let dir = scratch(&format!("lora-{spec}"));
        let spec_path = repo_root().join(format!("deploy/examples/rlhf/placement/{spec}.yaml"));
        let extra = format!(
            "cluster: {{num_gpus: 8, fake_gpus: true, placement_spec: {}}}\n\
             algo: {{advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, init_kl_coef: 0.01}}\n\
             policy: {{lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj, up_proj]}}}}\n",
            spec_path.display(),
        );
        let mut config = small_config(&dir, &extra);
        config.train.zero_stage = stage;
        config.train.max_steps = Some(3);
        let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
        assert_eq!(report.steps, 3, "{spec}");
        assert!(trainer.roles.reference.is_none() && trainer.roles.reference_from_policy);
        assert_trained(&dir, 3);
        let records = metrics(&dir);
        assert!(records.last().and_then(|r| r.get("kl")).is_some_and(|kl| kl > 0.0), "{spec}");
        trainer.roles.kill();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// OpenRLHF's schedule and dual-clip PPO in a run: the policy's learning rate decays step by
/// step from below the peak towards 0.1 x the peak (`train.lr_scheduler:
/// cosine_with_min_lr`; the exact values are checked in `trainer::roles`'s tests) while
/// `algo.dual_clip` bounds the loss, and the run trains.
#[test]
fn grpo_with_a_cosine_learning_rate_and_dual_clip_trains() {
    let dir = scratch("cosine");
    let mut config = small_config(
        &dir,
        "algo: {advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, dual_clip: 3}\n",
    );
    config.train.lr_scheduler = rtrun_rlhf::config::LrScheduler::CosineWithMinLr;
    config.train.max_steps = Some(4);
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 4);
    assert_trained(&dir, 4);
    let peak = config.train.actor_lr;
    let lrs: Vec<f64> = metrics(&dir).iter().filter_map(|r| r.get("actor_lr")).collect();
    assert_eq!(lrs.len(), 4);
    assert!(lrs.windows(2).all(|w| w[1] < w[0]), "the rate must fall every step: {lrs:?}");
    assert!(lrs[0] < peak && lrs[3] > 0.1 * peak, "{lrs:?} against the peak {peak}");
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `algo.policy_loss: gspo` (GSPO's sequence-level ratio, checked by hand in
/// `rtrun_rlhf_algo::loss`'s tests) trains with the paper's clip and aggregation, and its clip
/// fraction is reported; with two mini-batches per step the second is off-policy, so the
/// sequence ratios move off 1 and GSPO's small clip range catches some of them.
#[test]
fn grpo_with_gspos_sequence_ratio_trains() {
    let dir = scratch("gspo");
    let mut config = small_config(
        &dir,
        "algo: {advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, \
         policy_loss: gspo, eps_clip_low: 0.0003, eps_clip_high: 0.0004, \
         loss_agg_mode: seq-mean-token-mean}\n",
    );
    config.train.max_steps = Some(3);
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 3);
    assert_trained(&dir, 3);
    let clipped: Vec<f64> = metrics(&dir).iter().filter_map(|r| r.get("ppo_clip_ratio")).collect();
    assert_eq!(clipped.len(), 3, "one clip fraction per step");
    assert!(clipped.iter().all(|c| (0.0..=1.0).contains(c)), "{clipped:?}");
    assert!(clipped.iter().any(|c| *c > 0.0), "the off-policy mini-batch clips: {clipped:?}");
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// DAPO's overlong penalty and the running reward normalisation (their maths checked by hand
/// in `rtrun_rlhf_algo::shaping`'s tests) shape the rewards of a GRPO run: responses near the
/// budget are penalised, and the moments of every reward seen so far travel in the
/// checkpoint's state.
#[test]
fn grpo_with_the_overlong_penalty_and_reward_normalisation_trains() {
    let dir = scratch("shaping");
    let mut config = small_config(
        &dir,
        "algo: {advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, \
         overlong_penalty: {buffer_len: 2}, normalize_reward: true}\n\
         checkpoint: {every_steps: 1}\n",
    );
    config.train.max_steps = Some(3);
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 3);
    assert_trained(&dir, 3);
    let records = metrics(&dir);
    let steps: Vec<_> = records.iter().filter(|r| r.step() > 0).collect();
    let penalties: Vec<f64> = steps.iter().filter_map(|r| r.get("overlong_penalty")).collect();
    assert_eq!(penalties.len(), 3);
    // The budget is 6 tokens (4 digits, `<eos>`, one spare); past 4 a response loses reward.
    assert!(penalties.iter().all(|p| (-1.0..=0.0).contains(p)), "{penalties:?}");
    assert!(penalties.iter().any(|p| *p < 0.0), "some responses run long: {penalties:?}");
    let stds: Vec<f64> = steps.iter().filter_map(|r| r.get("reward_norm/std")).collect();
    assert_eq!(stds.len(), 3);
    // The state after step 2 holds the 16 rewards of steps 1 and 2.
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("checkpoints/step_000002/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["reward_moments"]["count"], 16.0, "{state}");
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// DAPO's dynamic sampling: with an all-or-nothing reward most groups of a barely warmed-up
/// policy score all 0 and are dropped; the step draws fresh prompts for the missing groups,
/// for at most three rounds, then fills up with dropped groups, and says so in its metrics.
#[test]
fn grpo_with_dynamic_sampling_refills_its_prompt_groups() {
    let dir = scratch("dynamic");
    let mut config = small_config(
        &dir,
        "algo: {advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, \
         dynamic_sampling: {max_gen_batches: 3}}\n\
         reward: {kind: rule, name: exact_match}\n",
    );
    config.rollout.n_samples_per_prompt = 4;
    config.train.train_batch_size = 8;
    config.train.max_steps = Some(3);
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 3);
    assert_trained(&dir, 3);
    let steps: Vec<_> = metrics(&dir).into_iter().filter(|r| r.step() > 0).collect();
    let get = |r: &rtrun_rlhf_telemetry::StepMetrics, name: &str| r.get(name).unwrap();
    let mut extra_rounds = 0.0;
    for r in &steps {
        let rounds = get(r, "dynamic_sampling/gen_batches");
        assert!((1.0..=3.0).contains(&rounds), "{r:?}");
        assert!(get(r, "dynamic_sampling/filled_groups") <= 4.0);
        extra_rounds += rounds - 1.0;
    }
    let dropped: f64 = steps.iter().map(|r| get(r, "dynamic_sampling/dropped_groups")).sum();
    assert!(dropped > 0.0, "an exact-match reward on a barely trained policy drops groups");
    // Every extra round drew fresh prompts from the loader.
    let consumed = get(steps.last().unwrap(), "consumed_prompts");
    assert!(
        consumed >= 12.0 + extra_rounds,
        "{consumed} prompts after {extra_rounds} extra rounds"
    );
    assert!(extra_rounds > 0.0, "dropped groups were generated for again");
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Sampled held-out evaluation: four answers per prompt at temperature 1, reported as the mean
/// over every answer and pass@4 (a prompt passes when any answer is right), at the baseline
/// and every step.
#[test]
fn sampled_evaluation_reports_mean_and_pass_at_k() {
    let dir = scratch("eval-k");
    let mut config = small_config(&dir, "algo: {advantage_estimator: group_norm}\n");
    config.eval.every_steps = 1;
    config.eval.n_samples = 4;
    config.eval.temperature = 1.0;
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.baseline.samples_per_prompt, 4);
    let records = metrics(&dir);
    let evaluated: Vec<_> = records.iter().filter(|r| r.get("eval/pass@4").is_some()).collect();
    assert_eq!(evaluated.len(), 3, "the baseline and both steps");
    for r in evaluated {
        let (pass, accuracy) = (r.get("eval/pass@4").unwrap(), r.get("eval/accuracy").unwrap());
        assert!(pass >= accuracy && pass <= 1.0, "pass@4 {pass} below the accuracy {accuracy}");
        assert_eq!(r.get("eval/mean@4"), r.get("eval/reward"));
    }
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `logging.samples_per_step` writes each step's first samples, as text with their rewards, to
/// `samples.jsonl`.
#[test]
fn each_steps_first_samples_are_logged_with_their_rewards() {
    let dir = scratch("samples");
    let mut config = small_config(&dir, "algo: {advantage_estimator: group_norm}\n");
    config.logging.samples_per_step = 3;
    let (trainer, _) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    let rows = rtrun_rlhf_telemetry::samples::read_samples(&dir).unwrap();
    let steps: Vec<u64> = rows.iter().map(|r| r.step).collect();
    assert_eq!(steps, [1, 1, 1, 2, 2, 2]);
    for row in &rows {
        // Reverse-digit prompts (`4071>`), char-match rewards in [0, 1], the label the reverse.
        assert!(row.prompt.ends_with('>') && (0.0..=1.0).contains(&row.reward), "{row:?}");
        let digits = row.prompt.trim_end_matches('>');
        assert_eq!(row.label, digits.chars().rev().collect::<String>());
    }
    // The two samples of a prompt come first: the first two rows share their prompt.
    assert_eq!(rows[0].prompt, rows[1].prompt);
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `reward.kind: python`: OpenRLHF's `reward_func(queries, prompts, labels)` in a file, run by
/// Python worker processes, scores exactly as the built-in rule it mirrors (the same run with
/// `exact_match` writes the same rewards); an exception in it fails the run with its traceback,
/// naming the file and line.
#[test]
fn a_python_reward_function_scores_as_the_rule_it_mirrors_and_its_errors_name_their_line() {
    let dir = scratch("python-reward");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("reward.py");
    std::fs::write(
        &path,
        "def reward_func(queries, prompts, labels):\n    \
         print('scoring', len(queries))  # goes to stderr, not the protocol\n    \
         rewards = [1.0 if q[len(p):] == l else 0.0 for q, p, l in zip(queries, prompts, labels)]\n    \
         return {'rewards': rewards, 'extra_logs': {'length': [len(q) - len(p) for q, p in zip(queries, prompts)]}}\n",
    )
    .unwrap();
    let algo = "algo: {advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3}\n";
    let run = |name: &str, reward: &str| {
        let mut config = small_config(&dir.join(name), &format!("{algo}{reward}"));
        config.reward.parallel_tasks = 2;
        let (trainer, _) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
        trainer.roles.kill();
        metrics(&dir.join(name))
    };
    let python = run("py", &format!("reward: {{kind: python, path: {}}}\n", path.display()));
    let rule = run("rule", "reward: {kind: rule, name: exact_match}\n");
    let rewards = |m: &[rtrun_rlhf_telemetry::StepMetrics]| {
        m.iter().map(|r| r.get("reward")).collect::<Vec<_>>()
    };
    assert_eq!(rewards(&python), rewards(&rule));
    // The dict's extra logs are step metrics: the mean response length in characters.
    let length = python.last().unwrap().get("reward_extra/length").unwrap();
    assert!(length > 0.0, "{length}");
    let python = rewards(&python);
    assert!(python.iter().flatten().count() >= 2);
    // An exception: the run fails naming the file, the line and the error.
    std::fs::write(
        &path,
        "def reward_func(queries, prompts, labels):\n    scale = 0\n    return [1 / scale for _ in queries]\n",
    )
    .unwrap();
    let config = small_config(
        &dir.join("bad"),
        &format!("{algo}reward: {{kind: python, path: {}}}\n", path.display()),
    );
    let err = match rtrun_rlhf::run::run(&config, &mut NoProgress) {
        Ok((trainer, _)) => {
            trainer.roles.kill();
            panic!("a reward function that raises must fail the run")
        }
        Err(e) => e.to_string(),
    };
    assert!(err.contains("reward.py\", line 3") && err.contains("ZeroDivisionError"), "{err}");
    // A function that is not there: refused when the workers start.
    let config = small_config(
        &dir.join("missing"),
        &format!("{algo}reward: {{kind: python, path: {}, function: nope}}\n", path.display()),
    );
    let err = rtrun_rlhf::run::run(&config, &mut NoProgress).err().unwrap().to_string();
    assert!(err.contains("`nope`") && err.contains("AttributeError"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every `algo.loss_agg_mode` trains (the aggregations themselves are checked by hand in
/// `rtrun_rlhf_algo::loss`'s tests): the same first rollout, aggregated four ways, gives four
/// different gradients, and the engines keep the policy's weights.
#[test]
fn every_loss_aggregation_mode_trains() {
    let mut first_norms = Vec::new();
    for mode in
        ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
    {
        let dir = scratch(&format!("agg-{mode}"));
        let config = small_config(
            &dir,
            &format!(
                "algo: {{advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, loss_agg_mode: {mode}}}\n"
            ),
        );
        let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
        assert_eq!(report.steps, 2, "{mode}");
        assert_trained(&dir, 2);
        first_norms.push(metrics(&dir)[1].get("actor_grad_norm").unwrap());
        trainer.roles.kill();
        std::fs::remove_dir_all(&dir).unwrap();
    }
    for (i, a) in first_norms.iter().enumerate() {
        for b in &first_norms[i + 1..] {
            assert!(a != b, "two modes gave the same gradient: {first_norms:?}");
        }
    }
}

/// A placement spec's `vllm_engine` bundles hold tensor-parallel engine ranks: two bundles make
/// one engine of two ranks (trained with the policy's weights on every step), and one bundle
/// for two ranks is a config error naming both numbers.
#[test]
fn tensor_parallel_engine_ranks_take_the_specs_bundles() {
    let dir = scratch("tp-spec");
    let stock = repo_root().join("deploy/examples/rlhf/placement/separate.yaml");
    let two = std::fs::read_to_string(&stock)
        .unwrap()
        .replace(
            "  vllm:\n    bundles: [{resources: {GPU: 1, CPU: 1}}]",
            "  vllm:\n    bundles: [{count: 2, resources: {GPU: 1, CPU: 1}}]",
        )
        .replace("vllm_engine: {replicas: 1,", "vllm_engine: {replicas: 2,");
    let spec = dir.join("tp.yaml");
    std::fs::write(&spec, two).unwrap();
    let extra = |spec: &Path| {
        format!(
            "cluster: {{num_gpus: 8, fake_gpus: true, placement_spec: {}}}\nengine: {{tensor_parallel_size: 2}}\n\
             algo: {{advantage_estimator: group_norm}}\n",
            spec.display()
        )
    };
    let refused = small_config(&dir.join("refused"), &extra(&stock));
    let err = rtrun_rlhf::run::run(&refused, &mut NoProgress).err().unwrap().to_string();
    assert!(
        err.contains("engine.tensor_parallel_size")
            && err.contains("2 ranks per engine")
            && err.contains("found 1"),
        "{err}"
    );
    let config = small_config(&dir.join("run"), &extra(&spec));
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 2);
    assert_eq!(trainer.roles.engine_ranks.iter().map(Vec::len).collect::<Vec<_>>(), vec![2]);
    assert_trained(&dir.join("run"), 2);
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A one-thread HTTP reward server: answers each POST with one reward per query (1 for an
/// answer equal to the label, else 0.25), OpenRLHF's `extra_logs` beside them (`exact`: 1 or
/// 0), and counts the requests it served; a GET (the start's health check) gets a 200.
fn start_reward_server() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/reward", listener.local_addr().unwrap());
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = served.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut length = 0usize;
            let mut request_line = String::new();
            let _ = reader.read_line(&mut request_line);
            let get = request_line.starts_with("GET");
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            if get {
                let mut stream = stream;
                let _ = write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
                continue;
            }
            let mut body = vec![0u8; length];
            reader.read_exact(&mut body).unwrap();
            let request: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let queries = request["query"].as_array().unwrap();
            let prompts = request["prompts"].as_array().unwrap();
            let labels = request["labels"].as_array().unwrap();
            let rewards: Vec<f64> = queries
                .iter()
                .zip(prompts)
                .zip(labels)
                .map(|((q, p), l)| {
                    let response = &q.as_str().unwrap()[p.as_str().unwrap().len()..];
                    if response == l.as_str().unwrap() { 1.0 } else { 0.25 }
                })
                .collect();
            let exact: Vec<f64> = rewards.iter().map(|&r| f64::from(u8::from(r == 1.0))).collect();
            let answer =
                serde_json::json!({ "rewards": rewards, "extra_logs": { "exact": exact } })
                    .to_string();
            // Counted before the answer leaves: counted after, the run could end (and the test
            // read the count) before this thread got to the last one.
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut stream = stream;
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    (url, served)
}

#[test]
fn remote_http_reward_scores_every_sample() {
    let (url, served) = start_reward_server();
    let dir = scratch("remote");
    let config = small_config(
        &dir,
        &format!(
            "algo: {{advantage_estimator: rloo, init_kl_coef: 0.0}}\nreward: {{kind: remote, url: \"{url}\", parallel_tasks: 2}}\n"
        ),
    );
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 2);
    assert!(trainer.roles.reference.is_none(), "no KL, no reference model");
    // Baseline eval, 2 steps and the final eval, each split into 2 tasks.
    assert!(served.load(std::sync::atomic::Ordering::SeqCst) >= 8);
    for r in metrics(&dir).iter().filter(|r| r.step() > 0) {
        let reward = r.get("reward").unwrap();
        assert!((0.25..=1.0).contains(&reward), "rewards come from the server: {reward}");
        // The server's extra logs are the step's metrics: exact answers are the 1.0 rewards.
        let exact = r.get("reward_extra/exact").unwrap();
        assert!((reward - (0.25 + 0.75 * exact)).abs() < 1e-6, "{reward} vs {exact}");
    }
    trainer.roles.kill();
    // A server that is not there is refused before any work.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let config = small_config(
        &dir.join("dead"),
        &format!("reward: {{kind: remote, url: \"http://{closed}/reward\"}}\n"),
    );
    let err = rtrun_rlhf::run::run(&config, &mut NoProgress).err().unwrap().to_string();
    assert!(err.contains("reward.url") && err.contains("cannot reach"), "{err}");
    assert!(!dir.join("dead/models").exists(), "no warm-up before the check");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Metrics that must match between runs: everything but timings and wall time.
fn comparable(run_dir: &Path) -> Vec<(u64, Vec<(String, f64)>)> {
    metrics(run_dir)
        .into_iter()
        .map(|m| {
            let values = m
                .scalars()
                .iter()
                .filter(|(name, _)| !name.starts_with("time/") && name != "wall_time")
                .cloned()
                .collect();
            (m.step(), values)
        })
        .collect()
}

/// Asserts that every metric of run `a`'s steps is run `b`'s within 1e-4 relative, except those
/// `special(step, name, a's value)` checks itself (returning true); returns the values compared.
fn assert_same_metrics(
    a: &Path,
    b: &Path,
    mut special: impl FnMut(u64, &str, Option<f64>) -> bool,
) -> usize {
    let (a, b) = (comparable(a), comparable(b));
    assert_eq!(a.len(), b.len());
    let mut checked = 0;
    for ((step, a), (_, b)) in a.iter().zip(&b) {
        for (name, y) in b {
            let x = a.iter().find(|(n, _)| n == name).map(|(_, x)| *x);
            if special(*step, name, x) {
                continue;
            }
            let x = x.unwrap_or_else(|| panic!("step {step}: `{name}` missing"));
            assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "step {step} `{name}`: {x} vs {y}");
            checked += 1;
        }
    }
    checked
}

fn train_command(config: &Path, run_dir: &Path, extra: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_train"));
    cmd.arg("--config").arg(config).arg("--set").arg(format!("run_dir={}", run_dir.display()));
    for e in extra {
        cmd.arg("--set").arg(e);
    }
    cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped());
    cmd
}

/// Runs the driver to its end; returns its stderr.
fn run_to_end(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "train failed: {stderr}");
    stderr
}

#[test]
fn killed_then_resumed_run_matches_an_uninterrupted_one() {
    let dir = scratch("resume");
    // The small PPO config as a file (the driver reads files): critic, reference, adaptive KL.
    let config_path = dir.join("ppo.yaml");
    let base = small_config(&dir.join("unused"), "");
    // JSON is YAML.
    std::fs::write(&config_path, serde_json::to_string(&base).unwrap()).unwrap();
    let settings = [
        "train.max_steps=4",
        "algo.advantage_estimator=gae",
        "algo.kl_target=0.1",
        "checkpoint.every_steps=1",
    ];

    let straight = dir.join("straight");
    run_to_end(&mut train_command(&config_path, &straight, &settings));

    // Kill the second run (SIGKILL, driver and workers) once step 2's checkpoint is complete.
    let resumed = dir.join("resumed");
    let mut child = train_command(&config_path, &resumed, &settings).spawn().unwrap();
    let marker = resumed.join("checkpoints/step_000002/trainer_state.json");
    rtrun_tests::kill_once_written(&mut child, &marker, Duration::from_secs(90));
    let stderr = run_to_end(&mut train_command(&config_path, &resumed, &settings));
    let resumed_from = rtrun_tests::resumed_from(&stderr)
        .unwrap_or_else(|| panic!("the second run did not resume: {stderr}"));
    assert!((2..4).contains(&resumed_from), "resumed from step {resumed_from}, expected 2 or 3");

    let (a, b) = (comparable(&straight), comparable(&resumed));
    assert_eq!(a.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    assert_eq!(a, b, "a resumed run must reproduce the uninterrupted run's metrics");

    // The trainer actor's worker killed (SIGKILL) instead: the driver says so and how to go
    // on, the role workers it owned end with it, and a rerun resumes identically.
    let orphaned = dir.join("trainer-killed");
    let mut child = train_command(&config_path, &orphaned, &settings).spawn().unwrap();
    let marker = orphaned.join("checkpoints/step_000002/trainer_state.json");
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while !marker.is_file() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before step 2's checkpoint");
        assert!(std::time::Instant::now() < deadline, "no {} within 90 s", marker.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid_of = |marker: &str| {
        rtrun_tests::descendant_with_env(child.id(), "RTRUN_RLHF_ROLE", marker)
            .unwrap_or_else(|| panic!("no worker marked {marker}"))
    };
    let (trainer, policy) = (pid_of("trainer:0"), pid_of("actor:0"));
    rtrun_tests::kill9(trainer);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the trainer actor stopped before the run ended")
            && stderr.contains("checkpoint.resume"),
        "{stderr}"
    );
    assert!(
        rtrun_tests::wait_until(Duration::from_secs(30), || !rtrun_tests::process_alive(policy)),
        "the policy rank outlived its trainer"
    );
    let stderr = run_to_end(&mut train_command(&config_path, &orphaned, &settings));
    assert!(rtrun_tests::resumed_from(&stderr).is_some_and(|s| s >= 2), "{stderr}");
    assert_eq!(a, comparable(&orphaned), "resumed after the trainer actor was killed");

    reruns_of_a_finished_run_and_of_bad_checkpoints(&config_path, &straight, &settings);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// What a rerun may change in a run directory: its metrics, summary and event files.
fn run_outputs(run: &Path) -> Vec<(String, Vec<u8>)> {
    let mut outputs: Vec<(String, Vec<u8>)> = std::fs::read_dir(run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
        })
        .collect();
    outputs.sort();
    outputs
}

/// Reruns of the finished 4-step run `run` (checkpoints at steps 1-4): (issue 46, items 6, 7
/// and 10; before, the first rewrote `summary.md` and added an event file, the second
/// truncated `metrics.jsonl` before failing, the third loaded flipped bits silently).
fn reruns_of_a_finished_run_and_of_bad_checkpoints(config: &Path, run: &Path, settings: &[&str]) {
    let finished = run_outputs(run);
    assert!(finished.iter().any(|(name, _)| name == "summary.md"));
    fn with<'a>(settings: &[&'a str], extra: &'a str) -> Vec<&'a str> {
        [settings, &[extra]].concat()
    }

    // 1. Rerun as it was, and with fewer steps than its checkpoint: it says so, changes nothing.
    for extra in ["train.max_steps=4", "train.max_steps=2"] {
        let out = train_command(config, run, &with(settings, extra))
            .stdout(std::process::Stdio::piped())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{extra}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(said.contains("has already finished") && said.contains("step_000004"), "{said}");
        assert!(run_outputs(run) == finished, "{extra}: a rerun of a finished run changed it");
    }

    // 2. A checkpoint whose weights are NaN (saved so, its checksums matching): the resume
    // fails, and the metrics, summary and event files are as they were.
    let step4 = run.join("checkpoints/step_000004");
    let weights = step4.join("actor/model.safetensors");
    let saved = std::fs::read(&weights).unwrap();
    let named = tch::Tensor::read_safetensors(&weights).unwrap();
    for (_, tensor) in &named {
        let _ = tensor.shallow_clone().fill_(f64::NAN);
    }
    tch::Tensor::write_safetensors(&named, &weights).unwrap();
    rtrun_rlhf::trainer::checkpoint::write_checksums(&step4).unwrap();
    let out = train_command(config, run, &with(settings, "train.max_steps=6")).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a resume from NaN weights succeeded: {stderr}");
    assert!(
        stderr.contains("holds NaN or infinite values") && stderr.contains("step_000004"),
        "{stderr}"
    );
    assert_eq!(rtrun_tests::resumed_from(&stderr), Some(4), "{stderr}");
    assert!(run_outputs(run) == finished, "a failed resume changed the run's outputs: {stderr}");

    // 3. Flipped bits in that checkpoint's weights (checksums not rewritten): it is skipped,
    // naming the file; the run resumes from step 3 and keeps steps 0-3 of its metrics.
    let mut flipped = saved;
    for byte in flipped.iter_mut().skip(4096).step_by(7) {
        *byte ^= 1;
    }
    std::fs::write(&weights, &flipped).unwrap();
    let before = comparable(run);
    // Checkpoints every 2 steps from here: steps 4 and 5, the last step saved though 5 is no
    // multiple of 2, so that a rerun with 5 steps finds the run finished.
    let every_two =
        [&with(settings, "checkpoint.every_steps=2")[..], &["train.max_steps=5"]].concat();
    let stderr = run_to_end(&mut train_command(config, run, &every_two));
    assert!(
        stderr.contains("skipping a checkpoint")
            && stderr.contains(&weights.display().to_string())
            && stderr.contains("changed since the checkpoint was saved"),
        "{stderr}"
    );
    assert_eq!(rtrun_tests::resumed_from(&stderr), Some(3), "{stderr}");
    let after = comparable(run);
    assert_eq!(after.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(after[..4], before[..4], "the steps before the resume point were rewritten");
    assert!(run.join("checkpoints/step_000005/trainer_state.json").is_file(), "no final save");
    let out = train_command(config, run, &every_two)
        .stdout(std::process::Stdio::piped())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && said.contains("has already finished"), "{said}");

    // 4. Every checkpoint bad: the run refuses with the reasons and changes nothing.
    for entry in std::fs::read_dir(run.join("checkpoints")).unwrap() {
        let dir = entry.unwrap().path();
        let _ = std::fs::remove_file(dir.join("actor/config.json"));
    }
    let outputs = run_outputs(run);
    let out = train_command(config, run, &with(settings, "train.max_steps=6")).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("no checkpoint under") && stderr.contains("is missing"), "{stderr}");
    assert!(run_outputs(run) == outputs, "a refused resume changed the run's outputs");
}

/// A custom reward function registered by name in this binary (the workers, which are this
/// binary re-run, find it too). A constant, so the test can tell its rewards from any other.
fn count_ones(_prompt: &str, _response: &str, _label: &str) -> f32 {
    0.375
}

#[linkme::distributed_slice(rtrun_rlhf::reward::REWARD_FUNCTIONS)]
static COUNT_ONES: rtrun_rlhf::reward::RewardFunction = rtrun_rlhf::reward::RewardFunction {
    name: "count_ones",
    score: count_ones,
    needs_label: false,
};

#[test]
fn custom_reward_function_registered_by_name() {
    let dir = scratch("custom");
    let config = small_config(
        &dir,
        "algo: {advantage_estimator: reinforce, init_kl_coef: 0.01, kl_estimator: k2}\nreward: {kind: custom, name: count_ones}\n",
    );
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 2);
    assert_eq!(report.final_result.mean_reward, 0.375);
    assert_trained(&dir, 2);
    for r in metrics(&dir).iter().filter(|r| r.step() > 0) {
        assert_eq!(r.get("reward"), Some(0.375));
    }
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();

    let err =
        TrainConfig::from_yaml("reward: {kind: custom, name: nope}\n", "x.yaml", &[]).unwrap_err();
    assert!(err.to_string().contains("count_ones"), "the error lists registered names: {err}");
}

#[test]
fn the_driver_rejects_bad_configs_and_addresses_with_clear_errors() {
    let config = repo_root().join("deploy/examples/rlhf/grpo.yaml");
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
            .arg("--config")
            .arg(&config)
            .args(extra)
            .env("RTRUN_CONNECT_TIMEOUT", "1")
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(run(&["--set", "rollout.top_p=2"]).contains("config key `rollout.top_p`"));
    assert!(run(&["--set", "train.actor_lrr=1"]).contains("actor_lrr"));
    // No cluster there: refused before any work (no warm-up), naming the key and address.
    let no_cluster = run(&["--address", "127.0.0.1:1"]);
    assert!(
        no_cluster.contains("config key `cluster.address`")
            && no_cluster.contains("cannot join the cluster at 127.0.0.1:1")
            && !no_cluster.contains("warm-up"),
        "{no_cluster}"
    );
    let missing = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--config", "/nonexistent/x.yaml"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/x.yaml"));
    // Detaching needs a cluster (the embedded runtime ends with its driver), attaching too.
    let detached = run(&["--detach"]);
    assert!(detached.contains("--detach needs a cluster") && !detached.contains("warm-up"));
    let attach = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--attach", "runs/grpo"])
        .env_remove("RTRUN_ADDRESS")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&attach.stderr);
    assert!(!attach.status.success() && text.contains("--attach needs the cluster"), "{text}");
}

/// Metrics of a run that both pipeline modes produce: everything but timings, wall time and
/// the dock's timeline.
fn mode_independent(run_dir: &Path) -> Vec<(u64, Vec<(String, f64)>)> {
    comparable(run_dir)
        .into_iter()
        .map(|(step, values)| {
            (step, values.into_iter().filter(|(name, _)| !name.starts_with("pipeline/")).collect())
        })
        .collect()
}

#[test]
fn grpo_dock_pipeline_streams_every_row_and_matches_the_sequential_mode() {
    let extra = "cluster: {engine_replicas: 2}\n\
                 algo: {advantage_estimator: group_norm, init_kl_coef: 0.01, kl_estimator: k3}\n";
    let dir = scratch("grpo-dock");
    let mut config = small_config(&dir.join("dock"), extra);
    config.train.pipeline = PipelineMode::Dock;
    // 4 prompts in batches of 3 groups: two batches per stage, the second one short.
    config.train.dock_groups_per_batch = 3;
    config.validate().unwrap();
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 2);
    assert!(trainer.roles.dock.is_some() && trainer.roles.reference.is_some());

    // Every stage (the two rollout ranks together) received each row of the last step once.
    let rows = config.rollout.prompts_per_step * config.rollout.n_samples_per_prompt;
    for stage in dock_layout::STAGES {
        let mut seen: Vec<usize> = trainer
            .pipeline_timelines
            .iter()
            .filter(|t| t.consumer == stage)
            .flat_map(|t| t.spans.iter().flat_map(|s| s.rows.iter().copied()))
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..rows).collect::<Vec<_>>(), "rows of stage `{stage}`");
        let batches = trainer.pipeline_timelines.iter().filter(|t| t.consumer == stage);
        let expected = if stage == "actor_train" { 1 } else { 2 };
        assert_eq!(batches.map(|t| t.spans.len()).sum::<usize>(), expected, "{stage}");
    }
    let ranks = trainer.pipeline_timelines.iter().filter(|t| t.consumer == "rollout").count();
    assert_eq!(ranks, 2, "one rollout rank per engine");

    // The step trained, the engines got the new weights, and the timeline is in the metrics.
    let records = metrics(&dir.join("dock"));
    for record in records.iter().filter(|r| r.step() > 0) {
        for name in ["reward", "policy_loss", "time/pipeline", "pipeline/concurrency"] {
            assert!(record.get(name).is_some_and(f64::is_finite), "`{name}` in {record:?}");
        }
        assert!(record.get("actor_grad_norm").is_some_and(|g| g > 0.0), "{record:?}");
        assert!(record.get("engine_logprob_gap").is_some_and(|g| g < 1e-4), "{record:?}");
        for stage in dock_layout::STAGES {
            assert_eq!(record.get(&format!("pipeline/{stage}/rows")), Some(rows as f64));
        }
    }

    // A stage whose role died ends the step with that stage's error: the other stages stop
    // instead of waiting for rows that never come.
    let mut trainer = trainer;
    trainer.config.train.max_steps = Some(3);
    trainer.roles.reference.as_ref().unwrap().kill().unwrap();
    let mut sink: Vec<rtrun_rlhf_telemetry::StepMetrics> = Vec::new();
    let error = trainer.fit(&mut sink, &mut NoProgress).unwrap_err().to_string();
    assert!(error.contains("stage `ref_log_prob`"), "{error}");
    assert!(sink.is_empty(), "no metrics for the failed step: {sink:?}");
    trainer.roles.kill();

    // The same seed without the dock: the same samples, rewards, losses and evaluations (the
    // dock always has the policy recompute the old log-probs; so does this run).
    let mut sequential = config.clone();
    sequential.run_dir = dir.join("sequential");
    sequential.train.pipeline = PipelineMode::Sequential;
    sequential.algo.old_logprobs = OldLogprobs::Policy;
    let (trainer, _) = rtrun_rlhf::run::run(&sequential, &mut NoProgress).unwrap();
    trainer.roles.kill();
    let piped = mode_independent(&dir.join("dock"));
    let plain = mode_independent(&dir.join("sequential"));
    assert_eq!(piped.len(), plain.len());
    for ((step, a), (_, b)) in piped.iter().zip(&plain) {
        let names = |v: &Vec<(String, f64)>| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(a), names(b), "step {step}");
        for ((name, x), (_, y)) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "step {step} `{name}`: {x} vs {y}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The engine's sampling log-probs as the old log-probs (`algo.old_logprobs: engine`, what
/// `auto` picks when everything is fp32) skip the policy's forward pass over each rollout and
/// change no metric: the same seed with `policy` gives the same samples and rewards and, within
/// 1e-4, the same losses; the engine/policy gap is still measured on steps 1 and 2 (the first
/// after a weight sync) and every 10th step.
#[test]
fn old_log_probs_from_the_engine_change_no_metric() {
    let extra = "algo: {advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, init_kl_coef: 0.01}\n";
    let dir = scratch("old-logprobs");
    let mut engine = small_config(&dir.join("engine"), extra);
    engine.train.max_steps = Some(11);
    engine.algo.old_logprobs = OldLogprobs::Auto;
    assert!(engine.old_logprobs_from_engine(), "auto uses the engine's log-probs in fp32");
    let mut policy = engine.clone();
    policy.run_dir = dir.join("policy");
    policy.algo.old_logprobs = OldLogprobs::Policy;
    assert!(!policy.old_logprobs_from_engine());
    for config in [&engine, &policy] {
        let (trainer, report) = rtrun_rlhf::run::run(config, &mut NoProgress).unwrap();
        assert_eq!(report.steps, 11);
        trainer.roles.kill();
    }
    let checked = assert_same_metrics(&dir.join("engine"), &dir.join("policy"), |step, name, x| {
        if name != "engine_logprob_gap" {
            return false;
        }
        let measured = step <= 2 || step == 10;
        assert_eq!(x.is_some(), measured, "step {step}: gap measured only on checks");
        assert!(x.is_none_or(|g| g < 1e-5), "step {step}: gap {x:?}");
        true
    });
    assert!(checked > 100, "compared {checked} values");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train.share_prompt`: the policy, reference and critic lay each prompt out once for the
/// responses to it (and the trained roles group those responses in their micro-batches); every
/// metric of 11 steps, GRPO and PPO with a critic, is what the padded layout gives (the sums run
/// in another order, so within 1e-4).
#[test]
fn shared_prompts_change_no_metric() {
    let grpo = "algo: {advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, init_kl_coef: 0.01}\n";
    let ppo = "algo: {advantage_estimator: gae, init_kl_coef: 0.01}\n";
    for (name, extra) in [("grpo", grpo), ("ppo", ppo)] {
        compare_shared_prompts(name, extra);
    }
}

fn compare_shared_prompts(name: &str, extra: &str) {
    let dir = scratch(&format!("share-prompt-{name}"));
    let mut shared = small_config(&dir.join("shared"), extra);
    shared.train.max_steps = Some(11);
    // Four responses per prompt, eight rows per optimizer step in micro-batches of four, two
    // epochs: micro-batches that mix prompts, before grouping.
    shared.rollout.n_samples_per_prompt = 4;
    shared.train.train_batch_size = 8;
    shared.train.micro_batch_size = 4;
    shared.train.max_epochs = 2;
    assert!(shared.train.share_prompt, "shared prompts are the default");
    let mut padded = shared.clone();
    padded.run_dir = dir.join("padded");
    padded.train.share_prompt = false;
    for config in [&shared, &padded] {
        let (trainer, report) = rtrun_rlhf::run::run(config, &mut NoProgress).unwrap();
        assert_eq!(report.steps, 11);
        assert_eq!(trainer.roles.critic.is_some(), name == "ppo", "{name}: critic");
        trainer.roles.kill();
    }
    let checked = assert_same_metrics(&dir.join("shared"), &dir.join("padded"), |_, _, _| false);
    assert!(checked > 100, "{name}: compared {checked} values");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train.micro_batch_tokens`: micro-batches packed under a token budget (rows longest first)
/// give every metric of fixed-size micro-batches, with shared prompts and padded, in another
/// number of passes (the loss is normalised by the whole batch, so the grouping is free).
#[test]
fn token_budgeted_micro_batches_change_no_metric_but_the_passes() {
    let grpo = "algo: {advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, init_kl_coef: 0.01}\n";
    for share_prompt in [true, false] {
        let dir = scratch(&format!("micro-batch-tokens-{share_prompt}"));
        let mut fixed = small_config(&dir.join("fixed"), grpo);
        fixed.train.max_steps = Some(6);
        fixed.rollout.n_samples_per_prompt = 4;
        fixed.train.train_batch_size = 8;
        fixed.train.micro_batch_size = 4;
        fixed.train.share_prompt = share_prompt;
        let mut budget = fixed.clone();
        budget.run_dir = dir.join("budget");
        // Shared prompts: everything in one pass (the fixed size takes two); padded: a row or two
        // per pass (rows of 9+ positions).
        budget.train.micro_batch_tokens = Some(if share_prompt { 10_000 } else { 16 });
        for config in [&fixed, &budget] {
            let (trainer, report) = rtrun_rlhf::run::run(config, &mut NoProgress).unwrap();
            assert_eq!(report.steps, 6);
            trainer.roles.kill();
        }
        let mut passes = (0.0, 0.0);
        let checked = assert_same_metrics(&dir.join("budget"), &dir.join("fixed"), |_, name, x| {
            if name == "actor_micro_batches" {
                passes.0 += x.unwrap_or(0.0);
                return true;
            }
            false
        });
        assert!(checked > 50, "compared {checked} values");
        let fixed_passes: f64 = comparable(&dir.join("fixed"))
            .iter()
            .flat_map(|(_, row)| row.iter().filter(|(n, _)| n == "actor_micro_batches"))
            .map(|(_, v)| *v)
            .sum();
        passes.1 = fixed_passes;
        assert!(passes.0 > 0.0 && passes.0 != passes.1, "passes {passes:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// `train --metrics-port --dashboard-port`: while the run goes, its metrics endpoint serves the
/// newest step's metrics (the same values metrics.jsonl records for that step), its phase times
/// and tokens/s, and the embedded session's runtime (its node, the role actors alive); its
/// dashboard shows the roles and the live reward and KL curves in Chromium.
#[test]
fn a_running_train_serves_its_step_metrics_and_its_session_on_the_metrics_port() {
    let dir = scratch("metrics-port");
    let config_path = dir.join("grpo.yaml");
    let base = small_config(&dir.join("unused"), "");
    std::fs::write(&config_path, serde_json::to_string(&base).unwrap()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let run_dir = dir.join("run");
    // Long enough to outlast the scrape and the browser (the checks end it): 150 steps of this
    // model ended 1.5 s after the browser's second page on a quiet machine.
    let mut cmd =
        train_command(&config_path, &run_dir, &["train.max_steps=1000", "train.num_episodes=100"]);
    let dashboard =
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    cmd.arg("--metrics-port").arg(port.to_string());
    let mut child = cmd.arg("--dashboard-port").arg(dashboard.to_string()).spawn().unwrap();
    let url = format!("http://127.0.0.1:{port}/metrics");
    let sample = |text: &str, key: &str| -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.parse().ok())
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let (step, reward, text) = loop {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before a scrape saw a step");
        assert!(Instant::now() < deadline, "no step on the metrics port within 120 s");
        if let Ok(mut response) = ureq::get(&url).call() {
            let text = response.body_mut().read_to_string().unwrap();
            let step = sample(&text, "rtrun_train_step");
            let reward = sample(&text, r#"rtrun_train_metric{name="reward"}"#);
            if let (Some(step), Some(reward)) = (step, reward) {
                break (step as u64, reward, text);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(sample(&text, "rtrun_train_total_steps"), Some(1000.0), "{text}");
    // The dashboard, in a browser, while the run goes: the roles, then the run's own page.
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("train-dashboard");
    std::fs::create_dir_all(&shots).unwrap();
    let url = |path: &str| format!("http://127.0.0.1:{dashboard}{path}");
    let actors = rtrun_tests::browse(&url("/actors"), &shots.join("actors.png"));
    assert!(actors.contains(">LmWorker<") && actors.contains(">EngineActor<"), "{actors}");
    let run_page = rtrun_tests::browse(&url("/panels/0"), &shots.join("training.png"));
    assert!(run_page.contains("Training") && run_page.contains(" of 1000"), "{run_page}");
    assert_eq!(run_page.matches("data:image/png;base64,").count(), 2, "{run_page}");
    assert!(sample(&text, "rtrun_train_tokens_per_second").is_some_and(|t| t > 0.0), "{text}");
    assert!(sample(&text, r#"rtrun_train_phase_seconds{phase="generate"}"#).is_some(), "{text}");
    assert_eq!(sample(&text, r#"rtrun_nodes{state="alive"}"#), Some(1.0), "{text}");
    assert!(sample(&text, r#"rtrun_actors{state="alive"}"#).is_some_and(|n| n >= 2.0), "{text}");
    let calls = sample(&text, r#"rtrun_actor_call_seconds_count{type="LmWorker"}"#);
    assert!(calls.is_some_and(|n| n >= 1.0), "the driver's calls to its roles: {text}");
    // Every metric the Grafana dashboard in deploy/ plots is one this scrape declares.
    let served: Vec<&str> =
        text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next()).collect();
    let dashboard = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/grafana/rtrun.json"),
    )
    .unwrap();
    let mut plotted = 0;
    for (at, _) in dashboard.match_indices("rtrun_") {
        let name: String =
            dashboard[at..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
        if name == "rtrun_" || name.starts_with("rtrun_overview") {
            continue;
        }
        let family = ["_bucket", "_total"].iter().find_map(|suffix| name.strip_suffix(suffix));
        assert!(
            served.contains(&name.as_str()) || family.is_some_and(|f| served.contains(&f)),
            "the dashboard plots {name}, not served: {served:?}"
        );
        plotted += 1;
    }
    assert!(plotted >= 20, "{plotted} metric references in the dashboard");
    // The scraped step's record, once in metrics.jsonl, holds the value the scrape served.
    let recorded = || metrics(&run_dir).into_iter().find(|m| m.step() == step);
    assert!(rtrun_tests::wait_until(Duration::from_secs(30), || recorded().is_some()));
    let at_step = recorded().unwrap();
    assert_eq!(at_step.get("reward"), Some(reward), "the scrape serves metrics.jsonl's value");
    assert!(child.try_wait().unwrap().is_none(), "the run ended before the checks did");
    child.kill().unwrap();
    child.wait().unwrap();
    // Its workers notice the driver's end within moments and stop writing the run directory.
    let removed = || std::fs::remove_dir_all(&dir).is_ok() || !dir.exists();
    assert!(rtrun_tests::wait_until(Duration::from_secs(30), removed), "{}", dir.display());
}

/// `train --print-default-config` prints a config the driver trains from as it is (here for
/// one small step), and the other modes' and the schema print too.
#[test]
fn the_printed_default_config_is_a_config_the_driver_runs() {
    let dir = scratch("print-defaults");
    let print = |args: &[&str]| {
        let out =
            std::process::Command::new(env!("CARGO_BIN_EXE_train")).args(args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let defaults = print(&["--print-default-config"]);
    assert!(
        defaults.starts_with("# The `train --mode rl` config") && defaults.contains("\nmode: rl\n")
    );
    let path = dir.join("defaults.yaml");
    std::fs::write(&path, &defaults).unwrap();
    let small = [
        "warmup.steps=5",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=2",
        "train.train_batch_size=8",
        // The file names the default micro-batch (32), which must then fit the smaller batch.
        "train.micro_batch_size=8",
        "train.max_steps=1",
        "eval.every_steps=0",
        "cluster.num_gpus=0",
    ];
    run_to_end(&mut train_command(&path, &dir.join("run"), &small));
    assert_eq!(metrics(&dir.join("run")).last().map(|m| m.step()), Some(1));
    // The run directory keeps the effective config, which reads back as what ran.
    let effective = std::fs::read_to_string(dir.join("run/config.yaml")).unwrap();
    assert!(effective.contains("train.max_steps=1"), "the header names the overrides");
    let read = TrainConfig::from_yaml(&effective, "config.yaml", &[]).unwrap();
    let sets: Vec<String> = small.iter().map(|s| s.to_string()).collect();
    let mut expected = TrainConfig::from_yaml(&defaults, "defaults.yaml", &sets).unwrap();
    expected.run_dir = dir.join("run");
    assert_eq!(read, expected);
    assert!(print(&["--print-default-config", "--mode", "dpo"]).contains("\nmode: dpo\n"));
    let schema: serde_json::Value =
        serde_json::from_str(&print(&["--print-config-schema", "--mode", "sft"])).unwrap();
    assert!(schema["properties"]["dpo"].is_object(), "{schema}");
    std::fs::remove_dir_all(&dir).unwrap();
}
