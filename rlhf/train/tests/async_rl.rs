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

/// A small GRPO run on the reverse-digits task: `steps` steps of 4 prompts × 4 samples.
fn config(run_dir: &Path, steps: u64, extra: &str) -> TrainConfig {
    let yaml = format!(
        "seed: 11\nrun_dir: {}\n\
         data: {{synthetic: {{kind: reverse_digits, min_digits: 2, max_digits: 3, train_size: 128, eval_size: 16}}}}\n\
         model: {{hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 64}}\n\
         warmup: {{steps: 40, batch_size: 16, lr: 0.003}}\n\
         rollout: {{prompts_per_step: 4, n_samples_per_prompt: 4, temperature: 1.0}}\n\
         algo: {{advantage_estimator: group_norm, init_kl_coef: 0.0}}\n\
         reward: {{kind: rule, name: char_match}}\n\
         train: {{max_steps: {steps}, train_batch_size: 16, micro_batch_size: 8, actor_lr: 0.002}}\n\
         eval: {{every_steps: 0}}\n{extra}",
        run_dir.display()
    );
    TrainConfig::from_yaml(
        &yaml,
        "test.yaml",
        &["cluster.num_cpus=16".into(), "cluster.threads_per_worker=1".into()],
    )
    .expect("test config parses")
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

#[test]
fn an_async_run_learns_and_never_trains_on_samples_older_than_its_bound() {
    let dir = scratch("async");
    let n: u64 = std::env::var("STEPS").map(|s| s.parse().unwrap()).unwrap_or(60);
    let mode = std::env::var("MODE").unwrap_or("async".into());
    let sets: Vec<String> = std::env::var("SETS").unwrap_or_default().split_whitespace().map(String::from).collect();
    let mut all = vec![format!("rollout.mode={mode}")];
    all.extend(sets);
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let config = example(&dir, n, &all);
    let started = std::time::Instant::now();
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    eprintln!("{:?}", started.elapsed());
    
    let steps: Vec<_> = metrics(&dir).into_iter().filter(|r| r.step() > 0).collect();
    for r in steps.iter().step_by(10) {
        eprintln!("{r:?}");
    }
    eprintln!("baseline {:?} final {:?}", report.baseline, report.final_result);
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}
