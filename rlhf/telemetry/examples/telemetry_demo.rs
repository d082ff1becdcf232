//! Demonstrates the telemetry crate the way the RLHF driver uses it: a synthetic 30-step run
//! writes `metrics.jsonl`, a TensorBoard event file and `reward.png` into the directory given as
//! the first argument, shows progress, and prints the summary table.
//!
//! `cargo run -p rtrun-rlhf-telemetry --example telemetry_demo -- /tmp/run [STOP [RESUME]]`
//!
//! With `STOP` the run ends after that step (as if killed); with `RESUME` as well it continues
//! the directory's run from step `RESUME`, as a driver restarting from a checkpoint would.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use rtrun_rlhf_telemetry::{
    EvalRow, MetricsSink as _, MetricsWriter, PhaseTimer, ProgressOptions, RunProgress, RunSummary,
    StartMode, StepMetrics, jsonl, reward_curve,
};

const STEPS: u64 = 30;
const EVAL_EVERY: u64 = 5;

/// A synthetic 30-step run through the telemetry crate, as the RLHF driver uses it: writes
/// `metrics.jsonl`, a TensorBoard event file and `reward.png` into RUN_DIR, shows progress and
/// prints the summary table.
#[derive(Parser)]
struct Args {
    /// The run directory to write.
    run_dir: PathBuf,
    /// End the run after this step, as if it were killed.
    #[arg(default_value_t = STEPS)]
    stop_after_step: u64,
    /// Continue the directory's run from this step, as a driver restarting from a checkpoint
    /// would (the default starts afresh).
    resume_from_step: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    let Args { run_dir: dir, stop_after_step: stop, resume_from_step: resume } = Args::parse();
    let started = std::time::Instant::now();
    let (mode, first_step) = match resume {
        Some(next_step) => (StartMode::Resume { next_step }, next_step.max(1)),
        None => (StartMode::Overwrite, 1),
    };
    let mut writer = MetricsWriter::create(&dir, mode)?;
    let options = ProgressOptions { start_step: first_step - 1, ..ProgressOptions::default() };
    let progress = RunProgress::new(STEPS, options);
    let mut timer = PhaseTimer::new();
    let held_out = |step: u64| 0.2 + 0.6 * (1.0 - (-(step as f64) / 12.0).exp());
    let baseline = held_out(0);

    for step in first_step..=stop.min(STEPS) {
        // Synthetic phases: the numbers stand in for generation, reward and training work.
        progress.set_phase("generate");
        timer.record("generate", Duration::from_millis(400 + 10 * step));
        timer.time("reward", || std::thread::sleep(Duration::from_millis(2)));
        progress.set_phase("train");
        timer.record("train", Duration::from_millis(250));
        let phases = timer.finish_step();

        let mut metrics = StepMetrics::new(step);
        metrics.set("reward", held_out(step) - 0.05 + 0.02 * ((step * 7) % 5) as f64)?;
        metrics.set("kl", 0.001 * step as f64)?;
        if step % EVAL_EVERY == 0 {
            metrics.set("eval/reward", held_out(step))?;
        }
        metrics.extend_prefixed("time/", phases.seconds())?;
        writer.record(&metrics)?;
        progress.step_done(&metrics, &phases);
    }
    progress.finish();

    let records = jsonl::read_jsonl(&writer.jsonl_path())?;
    let chart =
        reward_curve(&records, &[("train reward", "reward"), ("held-out reward", "eval/reward")]);
    chart.write_png(&dir.join("reward.png"))?;
    let summary = RunSummary {
        title: "telemetry demo".into(),
        steps: STEPS,
        resumed_from: None,
        wall_time: started.elapsed(),
        held_out_prompts: 64,
        held_out: vec![EvalRow {
            metric: "mean reward".into(),
            baseline: Some(baseline),
            final_value: Some(held_out(STEPS)),
        }],
        phases: timer.totals().to_vec(),
    };
    println!("{}", summary.to_text());
    println!(
        "wrote {}, {:?} and reward.png",
        writer.jsonl_path().display(),
        writer.event_file_path()
    );
    Ok(())
}
