//! `train.zero_stage` and `train.gradient_checkpointing` as a user runs them: the real `train`
//! driver with its DP worker processes on the walkthrough's Hugging Face checkpoint. SFT, DPO,
//! GRPO and PPO with a critic give, at stages 1, 2 and 3 on 1, 2 and 4 ranks (and stage 3 with
//! activation checkpointing on 2), the metrics and final weights of today's data parallelism
//! (stage 0) on the same ranks; a stage-3 save from 4 ranks resumes on 2; bad settings and
//! saves are errors naming the key or file.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{run_to_end, train, walkthrough};
use rtrun_rlhf::demo::walkthrough::WalkthroughFiles;
use rtrun_rlhf_model::CausalLm;
use rtrun_rlhf_telemetry::StepMetrics;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rtrun-zero-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `mode: sft | dpo` over the walkthrough's problems or pairs, on 2 ranks unless `--set`.
fn stage_config(dir: &Path, files: &WalkthroughFiles, mode: &str) -> PathBuf {
    let path = dir.join(format!("{mode}.yaml"));
    let data = match mode {
        "sft" => format!(
            "{{train_data: {}, eval_data: {}, input_key: question, output_key: answer, apply_chat_template: true, max_len: 160}}",
            files.train_data.display(),
            files.test_data.display()
        ),
        _ => format!(
            "{{train_data: {}, eval_data: {}, input_key: question, chosen_key: chosen, rejected_key: rejected, apply_chat_template: true, max_len: 160}}",
            files.preference_train.display(),
            files.preference_test.display()
        ),
    };
    let yaml = format!(
        "mode: {mode}\nseed: 5\n\
         model: {{pretrain: {}}}\n\
         data: {data}\n\
         cluster: {{replicas: 2, threads_per_worker: 1}}\n\
         train: {{max_steps: 3, batch_size: 12, micro_batch_size: 4, packing: true, lr: 0.002, lr_warmup_ratio: 0.1}}\n\
         dpo: {{beta: 0.1}}\n\
         eval: {{every_steps: 3}}\n",
        files.model_dir.display(),
    );
    std::fs::write(&path, yaml).unwrap();
    path
}

/// GRPO (or, with `ppo`, PPO with a critic and GAE) on the walkthrough checkpoint and its
/// GSM8K-format prompts, two ranks per trained and reference role.
fn rl_config(dir: &Path, files: &WalkthroughFiles, ppo: bool) -> PathBuf {
    let path = dir.join(if ppo { "ppo.yaml" } else { "grpo.yaml" });
    let algo = if ppo {
        "{advantage_estimator: gae, init_kl_coef: 0.01}"
    } else {
        "{advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, init_kl_coef: 0.01}"
    };
    let yaml = format!(
        "seed: 3\n\
         policy: {{pretrain: {}}}\n\
         data: {{prompt_data: {}, eval_data: {}, input_key: question, label_key: answer, apply_chat_template: true, max_prompt_len: 128}}\n\
         cluster: {{num_cpus: 16, threads_per_worker: 1, actor_replicas: 2, ref_replicas: 2, critic_replicas: 2}}\n\
         rollout: {{prompts_per_step: 4, n_samples_per_prompt: 3, max_new_tokens: 10}}\n\
         algo: {algo}\n\
         train: {{max_steps: 2, train_batch_size: 12, micro_batch_size: 2, actor_lr: 0.0005, critic_lr: 0.0005}}\n\
         reward: {{kind: rule, name: math_answer}}\n\
         eval: {{every_steps: 0}}\n",
        files.model_dir.display(),
        files.train_data.display(),
        files.test_data.display(),
    );
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Runs the driver expecting it to fail; returns its stderr.
fn run_to_failure(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "train should have failed");
    stderr
}

/// Every step's metrics but timings and throughput.
fn comparable(run_dir: &Path) -> Vec<(u64, Vec<(String, f64)>)> {
    let records: Vec<StepMetrics> =
        rtrun_rlhf_telemetry::jsonl::read_jsonl(&run_dir.join("metrics.jsonl")).unwrap();
    records
        .into_iter()
        .map(|m| {
            let values = m
                .scalars()
                .iter()
                .filter(|(name, _)| {
                    !name.starts_with("time/")
                        && !name.starts_with("pipeline/")
                        && name != "wall_time"
                        && name != "tokens_per_s"
                })
                .cloned()
                .collect();
            (m.step(), values)
        })
        .collect()
}

/// Every metric of `b` equals `a`'s within `tolerance` relative (to 1 at least).
fn assert_same_metrics(a: &Path, b: &Path, tolerance: f64, what: &str) {
    let (a, b) = (comparable(a), comparable(b));
    assert_eq!(a.len(), b.len(), "{what}: steps");
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        for (name, v) in y {
            let u = x.iter().find(|(n, _)| n == name).map(|(_, u)| *u);
            let u = u.unwrap_or_else(|| panic!("{what}: step {step} `{name}` missing"));
            assert!(
                (u - v).abs() <= tolerance * u.abs().max(1.0),
                "{what}: step {step} `{name}`: {u} (stage 0) vs {v}"
            );
        }
    }
}

/// ‖a − b‖ / ‖b‖ over every weight of two exported checkpoints.
fn weight_gap(a: &Path, b: &Path) -> f64 {
    let load =
        |dir: &Path| CausalLm::from_pretrained(dir, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let (a, b) = (load(a), load(b));
    let (mut gap, mut norm) = (0.0, 0.0);
    for ((na, ta), (nb, tb)) in a.named_parameters().zip(b.named_parameters()) {
        assert_eq!(na, nb);
        gap += (ta - tb).square().sum(tch::Kind::Double).double_value(&[]);
        norm += tb.square().sum(tch::Kind::Double).double_value(&[]);
    }
    (gap / norm).sqrt()
}

/// Runs `config` at stage 0 and at each of `variants` (`--set`s) on the same ranks; each
/// gives stage 0's metrics (within `tolerance`) and final weights (1e-6; 1e-5 with
/// checkpointing or in RL).
fn every_variant_equals_stage_zero(
    dir: &Path,
    config: &Path,
    base: &[&str],
    variants: &[&[&str]],
    tolerance: f64,
) {
    let baseline = dir.join("stage0");
    run_to_end(&mut train(config, &baseline, base));
    for (index, variant) in variants.iter().enumerate() {
        let run = dir.join(format!("variant{index}"));
        let mut sets = base.to_vec();
        sets.extend_from_slice(variant);
        run_to_end(&mut train(config, &run, &sets));
        let what = format!("{} {variant:?}", config.display());
        assert_same_metrics(&baseline, &run, tolerance, &what);
        let gap = weight_gap(&run.join("final_policy"), &baseline.join("final_policy"));
        // Checkpointing sums a layer output's gradient in another order; in RL (tolerance above
        // 1e-5) the second step's rollouts come from synced weights that already differ by
        // rounding: both carry a little further into the final weights.
        let loose = tolerance > 1e-5 || variant.iter().any(|s| s.contains("checkpointing=true"));
        let bound = if loose { 1e-5 } else { 1e-6 };
        assert!(gap < bound, "{what}: final weights differ by {gap:e}");
    }
}

const STAGE_1: &[&str] = &["train.zero_stage=1"];
const STAGE_2: &[&str] = &["train.zero_stage=2"];
const STAGE_3: &[&str] = &["train.zero_stage=3"];
const FSDP_CHECKPOINTED: &[&str] = &["train.zero_stage=fsdp", "train.gradient_checkpointing=true"];

/// Stages 1, 2 and 3 against stage 0 on each of `ranks` (`--set`s that give every role that
/// many ranks), plus stage 3 with checkpointing on 2 ranks.
fn stages_on_ranks(dir: &Path, config: &Path, ranks: &[&[&str]], tolerance: f64) {
    for (index, ranks) in ranks.iter().enumerate() {
        let mut variants = vec![STAGE_1, STAGE_2, STAGE_3];
        if ranks.iter().any(|s| s.ends_with("=2")) {
            variants.push(FSDP_CHECKPOINTED);
        }
        every_variant_equals_stage_zero(
            &dir.join(index.to_string()),
            config,
            ranks,
            &variants,
            tolerance,
        );
    }
}

const ONE: &[&str] = &["cluster.replicas=1"];
const TWO: &[&str] = &["cluster.replicas=2"];
const FOUR: &[&str] = &["cluster.replicas=4"];
const RL_ONE: &[&str] =
    &["cluster.actor_replicas=1", "cluster.ref_replicas=1", "cluster.critic_replicas=1"];
const RL_TWO: &[&str] =
    &["cluster.actor_replicas=2", "cluster.ref_replicas=2", "cluster.critic_replicas=2"];
const RL_FOUR: &[&str] =
    &["cluster.actor_replicas=4", "cluster.ref_replicas=4", "cluster.critic_replicas=4"];

#[test]
fn sft_gives_stage_zeros_numbers_at_every_stage_on_one_two_and_four_ranks() {
    let dir = scratch("sft");
    let files = walkthrough(&dir);
    let config = stage_config(&dir, &files, "sft");
    stages_on_ranks(&dir, &config, &[ONE, TWO, FOUR], 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dpo_gives_stage_zeros_numbers_at_every_stage_on_one_two_and_four_ranks() {
    let dir = scratch("dpo");
    let files = walkthrough(&dir);
    let config = stage_config(&dir, &files, "dpo");
    stages_on_ranks(&dir, &config, &[ONE, TWO, FOUR], 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

// The engines sample from the synced weights, which differ from stage 0's by rounding after
// the first step: the RL tolerance allows for that, not for a fault.

#[test]
fn grpo_gives_stage_zeros_numbers_at_every_stage_on_one_and_two_ranks() {
    let dir = scratch("grpo12");
    let files = walkthrough(&dir);
    stages_on_ranks(&dir, &rl_config(&dir, &files, false), &[RL_ONE, RL_TWO], 1e-4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn grpo_gives_stage_zeros_numbers_at_every_stage_on_four_ranks() {
    let dir = scratch("grpo4");
    let files = walkthrough(&dir);
    stages_on_ranks(&dir, &rl_config(&dir, &files, false), &[RL_FOUR], 1e-4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ppo_with_a_critic_gives_stage_zeros_numbers_at_every_stage_on_one_and_two_ranks() {
    let dir = scratch("ppo12");
    let files = walkthrough(&dir);
    stages_on_ranks(&dir, &rl_config(&dir, &files, true), &[RL_ONE, RL_TWO], 1e-4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ppo_with_a_critic_gives_stage_zeros_numbers_at_every_stage_on_four_ranks() {
    let dir = scratch("ppo4");
    let files = walkthrough(&dir);
    stages_on_ranks(&dir, &rl_config(&dir, &files, true), &[RL_FOUR], 1e-4);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// PPO rewarded by a reward-model role (a fresh scalar head on the walkthrough's shape) whose
/// two frozen ranks hold half the model each at stage 3, beside a sharded policy, reference and
/// critic.
#[test]
fn a_sharded_reward_model_role_scores_as_a_whole_one() {
    let dir = scratch("rm");
    let files = walkthrough(&dir);
    let rm_dir = dir.join("reward-model");
    let config = rtrun_rlhf_model::ModelConfig::from_dir(&files.model_dir).unwrap();
    let rm = rtrun_rlhf_model::ScalarHeadModel::new_random(
        &config,
        tch::Device::Cpu,
        tch::Kind::Float,
        3,
    )
    .unwrap();
    rm.save_pretrained(&rm_dir, &Default::default()).unwrap();
    let ppo = rl_config(&dir, &files, true);
    let reward = format!("reward.model_dir={}", rm_dir.display());
    let base: &[&str] = &["reward.kind=model", &reward, "cluster.reward_replicas=2"];
    every_variant_equals_stage_zero(&dir.join("runs"), &ppo, base, &[STAGE_3], 1e-4);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A stage-3 SFT run on 4 ranks, killed after its step-2 checkpoint, resumes on 2 ranks and
/// ends as an uninterrupted stage-3 run on 2 ranks does (its steps 3-4 on 2 ranks).
#[test]
fn a_stage_three_save_from_four_ranks_resumes_on_two() {
    let dir = scratch("resume");
    let files = walkthrough(&dir);
    let config = stage_config(&dir, &files, "sft");
    let sets = [
        "train.max_steps=4",
        "checkpoint.every_steps=1",
        "eval.every_steps=2",
        "train.zero_stage=3",
    ];
    let straight = dir.join("straight");
    let mut two = sets.to_vec();
    two.push("cluster.replicas=2");
    run_to_end(&mut train(&config, &straight, &two));

    let resumed = dir.join("resumed");
    let mut four = sets.to_vec();
    four.push("cluster.replicas=4");
    let mut child = train(&config, &resumed, &four).stderr(Stdio::null()).spawn().unwrap();
    let marker = resumed.join("checkpoints/step_000002/trainer_state.json");
    rtrun_tests::kill_once_written(&mut child, &marker, Duration::from_secs(100));
    let shards = std::fs::read_dir(resumed.join("checkpoints/step_000002/model"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("zero-shard"))
        .count();
    assert_eq!(shards, 4, "each of the 4 ranks saved its shard");
    // The kill may land after a later checkpoint: resume from step 2's, removing newer ones.
    for entry in std::fs::read_dir(resumed.join("checkpoints")).unwrap() {
        let path = entry.unwrap().path();
        if !path.ends_with("step_000002") {
            std::fs::remove_dir_all(path).unwrap();
        }
    }
    let stderr = run_to_end(&mut train(&config, &resumed, &two));
    assert_eq!(rtrun_tests::resumed_from(&stderr), Some(2), "{stderr}");
    let (a, b) = (comparable(&straight), comparable(&resumed));
    let later = |runs: Vec<(u64, Vec<(String, f64)>)>| -> Vec<(u64, Vec<(String, f64)>)> {
        runs.into_iter().filter(|(s, _)| *s > 2).collect()
    };
    let (a, b) = (later(a), later(b));
    assert_eq!(a.len(), 2);
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        for ((name, u), (_, v)) in x.iter().zip(y) {
            assert!((u - v).abs() <= 1e-5 * u.abs().max(1.0), "step {step} `{name}`: {u} vs {v}");
        }
    }
    let gap = weight_gap(&resumed.join("final_policy"), &straight.join("final_policy"));
    assert!(gap < 1e-5, "resumed on 2 ranks: final weights differ by {gap:e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_stages_and_saves_are_errors_naming_the_key_or_file() {
    let dir = scratch("bad");
    let files = walkthrough(&dir);
    let config = stage_config(&dir, &files, "sft");
    let stderr = run_to_failure(&mut train(&config, &dir.join("five"), &["train.zero_stage=5"]));
    assert!(stderr.contains("train.zero_stage") && stderr.contains("0, 1, 2 or 3"), "{stderr}");
    let grpo = rl_config(&dir, &files, false);
    let stderr = run_to_failure(&mut train(
        &grpo,
        &dir.join("dock"),
        &["train.zero_stage=3", "train.pipeline=dock"],
    ));
    assert!(stderr.contains("train.zero_stage") && stderr.contains("dock"), "{stderr}");

    // A stage-3 save without its shard manifest (a save cut short): its checksums name the
    // missing file and the resume falls back to the previous checkpoint.
    let run = dir.join("cut");
    let sets = ["train.max_steps=2", "checkpoint.every_steps=1", "train.zero_stage=3"];
    run_to_end(&mut train(&config, &run, &sets));
    let step = run.join("checkpoints/step_000002");
    std::fs::remove_file(step.join("model/zero-manifest.json")).unwrap();
    let more = ["train.max_steps=3", "checkpoint.every_steps=1", "train.zero_stage=3"];
    let stderr = run_to_end(&mut train(&config, &run, &more));
    assert!(stderr.contains("zero-manifest.json is missing"), "{stderr}");
    assert_eq!(rtrun_tests::resumed_from(&stderr), Some(1), "{stderr}");
    // Without checksums to check (a save from before them) the shard loader refuses it.
    let step = run.join("checkpoints/step_000003");
    for file in ["model/zero-manifest.json", "checksums.json"] {
        std::fs::remove_file(step.join(file)).unwrap();
    }
    for older in ["step_000001", "step_000002"] {
        let _ = std::fs::remove_dir_all(run.join("checkpoints").join(older));
    }
    let more = ["train.max_steps=4", "checkpoint.every_steps=1", "train.zero_stage=3"];
    let stderr = run_to_failure(&mut train(&config, &run, &more));
    assert!(stderr.contains("zero-manifest.json") && stderr.contains("incomplete"), "{stderr}");
    // And a stage-0 save resumed at stage 3 says which stage it needs.
    let zero = dir.join("zero");
    run_to_end(&mut train(&config, &zero, &["train.max_steps=2", "checkpoint.every_steps=1"]));
    let stderr = run_to_failure(&mut train(
        &config,
        &zero,
        &["train.max_steps=3", "checkpoint.every_steps=1", "train.zero_stage=3"],
    ));
    assert!(stderr.contains("zero_stage 0 save"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
