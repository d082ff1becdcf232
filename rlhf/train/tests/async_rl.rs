//! Streamed rollouts end to end on the embedded runtime with real worker processes:
//! `rollout.mode: async` (the engines generate while the policy trains, samples bounded by
//! `rollout.max_staleness`) and `rollout.partial_threshold` (a step goes on once a share of
//! its groups finished; the rest carry on into the next step).

use std::path::{Path, PathBuf};

use rtrun_rlhf::TrainConfig;
use rtrun_rlhf::trainer::NoProgress;
use rtrun_rlhf_telemetry::StepMetrics;

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rtrun-async-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn metrics(run_dir: &Path) -> Vec<StepMetrics> {
    rtrun_rlhf_telemetry::jsonl::read_jsonl(&run_dir.join("metrics.jsonl")).unwrap()
}

/// The shipped GRPO example (`deploy/examples/rlhf/grpo.yaml`) for `steps` steps, evaluated
/// before and after, with `sets` applied.
fn example(run_dir: &Path, steps: u64, sets: &[&str]) -> TrainConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/rlhf/grpo.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut overrides = vec![
        format!("run_dir={}", run_dir.display()),
        format!("train.max_steps={steps}"),
        "eval.every_steps=0".to_owned(),
        "checkpoint.every_steps=0".to_owned(),
        "cluster.threads_per_worker=1".to_owned(),
    ];
    overrides.extend(sets.iter().map(|s| s.to_string()));
    TrainConfig::from_yaml(&text, &path.display().to_string(), &overrides).unwrap()
}

fn get(r: &StepMetrics, name: &str) -> f64 {
    r.get(name).unwrap_or_else(|| panic!("`{name}` missing at step {}", r.step()))
}

/// Async GRPO with `max_staleness: 1` learns the task (the held-out reward rises), and every
/// step's samples, by the weight versions recorded with their tokens, were sampled by the
/// policy it trained or the one before; most were sampled while the policy trained.
#[test]
fn an_async_run_learns_and_never_trains_on_samples_older_than_its_bound() {
    let dir = scratch("async");
    let config = example(&dir, 128, &["rollout.mode=async", "rollout.max_staleness=1"]);
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    trainer.roles.kill();
    assert_eq!(report.steps, 128);
    let (before, after) = (report.baseline.mean_reward, report.final_result.mean_reward);
    assert!(after > before + 0.05, "held-out reward {before} -> {after}");
    let steps: Vec<_> = metrics(&dir).into_iter().filter(|r| r.step() > 0).collect();
    assert_eq!(steps.len(), 128);
    let mut behind = 0;
    for r in &steps {
        // Step s trains the policy of version s - 1.
        let policy = r.step() - 1;
        let oldest = get(r, "rollout/oldest_version") as u64;
        assert!(oldest <= policy && policy - oldest <= 1, "step {}: oldest {oldest}", r.step());
        assert!(get(r, "rollout/max_staleness") <= 1.0);
        assert_eq!(get(r, "rollout/groups"), 16.0);
        // The correction is on: truncated importance weights near 1 for one step of lag.
        let weight = get(r, "tis/weight_mean");
        assert!(weight > 0.5 && weight < 2.0, "step {}: {weight}", r.step());
        behind += usize::from(policy > oldest);
    }
    assert!(behind > 100, "only {behind} of 128 steps trained on samples generated while training");
    // Nothing was generated beyond what the bound allows (AReaL's rule), so nothing was dropped.
    let dropped: f64 = steps.iter().map(|r| get(r, "async/stale_dropped_groups")).sum();
    assert_eq!(dropped, 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Async GRPO through the TransferDock (`train.pipeline: dock`): the rollout thread writes
/// each finished group into a dock slot, the `reward` and `ref_log_prob` stages score groups as
/// they arrive while the policy trains on earlier ones, and the run learns within the same
/// staleness bound, every trained row scored by the dock's stages.
#[test]
fn an_async_run_streams_groups_through_the_dock_whose_stages_score_them_while_the_policy_trains() {
    let dir = scratch("async-dock");
    let sets = [
        "rollout.mode=async",
        "rollout.max_staleness=1",
        "train.pipeline=dock",
        "train.dock_groups_per_batch=2",
        "logging.samples_per_step=2",
    ];
    let config = example(&dir, 96, &sets);
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    trainer.roles.kill();
    assert_eq!(report.steps, 96);
    let (before, after) = (report.baseline.mean_reward, report.final_result.mean_reward);
    assert!(after > before + 0.04, "held-out reward {before} -> {after}");
    let steps: Vec<_> = metrics(&dir).into_iter().filter(|r| r.step() > 0).collect();
    assert_eq!(steps.len(), 96);
    let (mut behind, mut scored, mut referenced) = (0, 0.0, 0.0);
    let (mut generating, mut scoring) = (0, 0);
    for r in &steps {
        let policy = r.step() - 1;
        // The versions travelled through the dock with the tokens.
        let oldest = get(r, "rollout/oldest_version") as u64;
        assert!(oldest <= policy && policy - oldest <= 1, "step {}: oldest {oldest}", r.step());
        assert_eq!(get(r, "rollout/groups"), 16.0);
        let weight = get(r, "tis/weight_mean");
        assert!(weight > 0.5 && weight < 2.0, "step {}: {weight}", r.step());
        behind += usize::from(policy > oldest);
        scored += get(r, "pipeline/reward/rows");
        referenced += get(r, "pipeline/ref_log_prob/rows");
        assert_eq!(get(r, "pipeline/actor_train/rows"), 128.0);
        // Generation and scoring of later groups while this step trained: the rollout
        // thread's last poll, or the reward stage's last batch, ended after training began.
        let train_start = get(r, "pipeline/actor_train/start_s");
        generating += usize::from(get(r, "pipeline/rollout/end_s") > train_start);
        scoring += usize::from(get(r, "pipeline/reward/end_s") > train_start);
    }
    eprintln!("of 96 steps, generating while training: {generating}, scoring: {scoring}");
    assert!(behind > 70, "only {behind} of 96 steps trained on samples generated while training");
    // How often depends on timing (the rollout may finish the groups the bound allows before
    // training starts): 58-96 steps generated, alone and beside other tests.
    assert!(generating >= 20, "the rollout overlapped training in only {generating} of 96 steps");
    assert!(scoring >= 10, "the reward stage overlapped training in only {scoring} of 96 steps");
    // Every trained row was scored by the dock's stages, and at most the dock's 2 steps of
    // slots more (scored ahead, untrained when the run ended).
    let trained = 96.0 * 128.0;
    for (name, rows) in [("reward", scored), ("ref_log_prob", referenced)] {
        assert!((trained..=trained + 256.0).contains(&rows), "{name}: {rows} rows");
    }
    let dropped: f64 = steps.iter().map(|r| get(r, "async/stale_dropped_groups")).sum();
    assert_eq!(dropped, 0.0);
    // The step holds every row, so it logs samples as the sequential step does.
    let samples = std::fs::read_to_string(dir.join("samples.jsonl")).unwrap();
    let samples: Vec<serde_json::Value> =
        samples.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(samples.len(), 2 * 96);
    assert!(samples.iter().all(|s| s["prompt"].is_string() && s["reward"].is_number()));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A partial rollout (`partial_threshold: 0.5`): a step trains once half its groups finished,
/// the rest carry on generating into the next step with the new weights (their tokens tagged
/// with both versions), and every prompt is trained on once.
#[test]
fn a_partial_rollout_carries_unfinished_groups_into_the_next_step() {
    let dir = scratch("partial");
    let config = example(
        &dir,
        24,
        &[
            "rollout.partial_threshold=0.5",
            "rollout.max_new_tokens=64",
            "warmup.steps=20",
            "rollout.prompts_per_step=8",
            "train.train_batch_size=32",
            "train.micro_batch_size=32",
        ],
    );
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    trainer.roles.kill();
    assert_eq!(report.steps, 24);
    let steps: Vec<_> = metrics(&dir).into_iter().filter(|r| r.step() > 0).collect();
    let (mut carried, mut mixed, mut trained) = (0.0, 0.0, 0.0);
    // Carried at most `partial_max_carry` (2) steps: no token lags the policy by more.
    for r in &steps {
        assert!(get(r, "rollout/max_staleness") <= 2.0, "{r:?}");
    }
    let mut previous_out = 0.0;
    for r in &steps {
        let groups = get(r, "rollout/groups");
        assert!((4.0..=8.0).contains(&groups), "step {}: {groups} groups", r.step());
        assert_eq!(get(r, "partial/carried_in_groups"), previous_out, "step {}", r.step());
        previous_out = get(r, "partial/carried_out_groups");
        carried += previous_out;
        mixed += get(r, "rollout/mixed_version_groups");
        trained += groups;
        assert!(get(r, "tis/weight_mean").is_finite());
    }
    assert!(carried > 0.0, "no group was carried into a next step");
    assert!(mixed > 0.0, "no carried group took new weights mid-response");
    // Every prompt drawn was trained on once, except those still running at the end.
    let consumed = get(steps.last().unwrap(), "consumed_prompts");
    assert_eq!(trained + previous_out, consumed);
    std::fs::remove_dir_all(&dir).unwrap();
}
