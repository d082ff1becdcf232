//! Multi-turn tool use end to end: the walkthrough checkpoint warmed up to call the calculator
//! (Qwen2.5's tool-call format), GRPO with `tools.enabled: [calculator]` on the embedded runtime
//! with real worker processes and engines.

use std::path::{Path, PathBuf};

use rtrun_rlhf::TrainConfig;
use rtrun_rlhf::demo::walkthrough::{WalkthroughConfig, WalkthroughFiles, write_walkthrough};
use rtrun_rlhf::trainer::NoProgress;
use rtrun_rlhf_telemetry::StepMetrics;

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rtrun-tools-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn walkthrough(dir: &Path) -> WalkthroughFiles {
    tch::set_num_threads(1);
    let config = WalkthroughConfig {
        train_problems: 600,
        test_problems: 32,
        vocab_size: 400,
        warmup: rtrun_rlhf::config::WarmupConfig { steps: 150, batch_size: 32, lr: 3e-3 },
        tool_calls: true,
        ..WalkthroughConfig::default()
    };
    write_walkthrough(&dir.join("walkthrough"), &config).unwrap()
}

/// The shipped `deploy/examples/rlhf/grpo-tools.yaml` on `files`, two small steps, `sets`
/// applied.
fn config(run_dir: &Path, files: &WalkthroughFiles, sets: &[&str]) -> TrainConfig {
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/rlhf/grpo-tools.yaml");
    let mut overrides = vec![
        format!("run_dir={}", run_dir.display()),
        format!("policy.pretrain={}", files.model_dir.display()),
        format!("data.prompt_data={}", files.train_data.display()),
        format!("data.eval_data={}", files.test_data.display()),
        "seed=3".to_owned(),
        "rollout.prompts_per_step=8".to_owned(),
        "rollout.n_samples_per_prompt=4".to_owned(),
        "train.max_steps=2".to_owned(),
        "train.train_batch_size=32".to_owned(),
        "train.micro_batch_size=16".to_owned(),
        "eval.every_steps=0".to_owned(),
        "checkpoint.every_steps=0".to_owned(),
        // The engine's log-probs are checked against the policy's every step.
        "algo.old_logprobs=policy".to_owned(),
        "cluster.num_cpus=16".to_owned(),
        "engine.threads=1".to_owned(),
        "cluster.threads_per_worker=1".to_owned(),
    ];
    overrides.extend(sets.iter().map(|s| s.to_string()));
    TrainConfig::load(&example, &overrides).unwrap()
}

fn metrics(run_dir: &Path) -> Vec<StepMetrics> {
    rtrun_rlhf_telemetry::jsonl::read_jsonl(&run_dir.join("metrics.jsonl")).unwrap()
}

/// The warmed-up policy calls the calculator; the engine's log-probs of every model token,
/// each turn generated from the whole conversation so far, equal the policy's log-probs of the
/// assembled multi-turn sequence (so the contexts are exactly what training sees); the tool's
/// tokens carry no log-prob and no loss; the held-out answers (which call the tool too) score
/// at least as well as the same checkpoint without tools.
#[test]
fn a_policy_calls_the_calculator_and_its_multi_turn_samples_train_with_tool_tokens_masked() {
    let dir = scratch("grpo");
    let files = walkthrough(&dir);
    let run = dir.join("run");
    let (trainer, report) =
        rtrun_rlhf::run::run(&config(&run, &files, &[]), &mut NoProgress).unwrap();
    trainer.roles.kill();
    assert_eq!(report.steps, 2);
    let steps: Vec<_> = metrics(&run).into_iter().filter(|r| r.step() > 0).collect();
    for r in &steps {
        let get = |name: &str| r.get(name).unwrap_or_else(|| panic!("{name} in {r:?}"));
        assert!(get("tools/calls_per_sample") > 0.5, "{r:?}");
        assert!(get("tools/turns_per_sample") > 1.5, "{r:?}");
        let gap = get("engine_logprob_gap");
        assert!(gap < 1e-4, "step {}: engine and policy log-probs differ by {gap}", r.step());
        assert!(get("policy_loss").is_finite());
    }
    let with_tools = report.final_result;

    // The same checkpoint without tools: its answers stop after the call, unanswered.
    let plain = dir.join("plain");
    let mut no_tools = config(&plain, &files, &["train.max_steps=1"]);
    no_tools.tools.enabled.clear();
    let (trainer, plain_report) = rtrun_rlhf::run::run(&no_tools, &mut NoProgress).unwrap();
    trainer.roles.kill();
    eprintln!(
        "held-out accuracy: tools {:.3} (baseline {:.3}), no tools {:.3}",
        with_tools.accuracy, report.baseline.accuracy, plain_report.baseline.accuracy
    );
    assert!(with_tools.accuracy >= plain_report.baseline.accuracy);
    assert!(report.baseline.accuracy > 0.0, "the warmed-up policy answers through the tool");
    std::fs::remove_dir_all(&dir).unwrap();
}
