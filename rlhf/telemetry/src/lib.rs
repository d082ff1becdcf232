//! Run telemetry for the rtrun RLHF driver.
//!
//! - [`StepMetrics`] and [`MetricsSink`]: the named scalars of each training step;
//!   [`MetricsWriter`] records them in a run directory as JSON Lines ([`jsonl`]) and as
//!   TensorBoard event files ([`tensorboard`]), flushed every step.
//! - [`PhaseTimer`]: named phase timings per step (generate, reward, train, sync, ...),
//!   accumulated over the run.
//! - [`RunProgress`]: the driver's progress bar with live reward, KL and phase timings, or plain
//!   log lines when stderr is not a terminal.
//! - [`plot`]: line charts (the reward curve) rendered to PNG with a built-in bitmap font.
//! - [`samples`]: a few of each step's samples (prompt, response, reward) in `samples.jsonl`.
//! - [`summary`]: the end-of-run table (baseline vs final held-out reward, per-phase timings) as
//!   plain text or Markdown.
//!
//! The crate has no dependency on the runtime or on tch: it is plain file and terminal output,
//! usable from the driver process or from a trainer actor.
//!
//! # A driver's loop
//!
//! ```
//! use rtrun_rlhf_telemetry::{
//!     EvalRow, MetricsSink as _, MetricsWriter, PhaseTimer, ProgressMode, ProgressOptions,
//!     RunProgress, RunSummary, StartMode, StepMetrics, jsonl, reward_curve,
//! };
//! # fn main() -> Result<(), rtrun_rlhf_telemetry::TelemetryError> {
//! # let run_dir = std::env::temp_dir().join(format!("rtrun-telemetry-doc-{}", std::process::id()));
//! let total_steps = 3;
//! // `StartMode::Resume { next_step }` when restarting from a checkpoint.
//! let mut metrics_writer = MetricsWriter::create(&run_dir, StartMode::Overwrite)?;
//! let progress = RunProgress::new(
//!     total_steps,
//!     ProgressOptions { mode: ProgressMode::Hidden, ..ProgressOptions::default() },
//! );
//! let mut timer = PhaseTimer::new();
//! for step in 1..=total_steps {
//!     progress.set_phase("generate");
//!     let rewards = timer.time("generate", || vec![0.1 * step as f64; 8]);
//!     progress.set_phase("train");
//!     timer.time("train", || { /* PPO epochs */ });
//!     let phases = timer.finish_step();
//!
//!     let mut metrics = StepMetrics::new(step);
//!     metrics.set("reward", rewards.iter().sum::<f64>() / rewards.len() as f64)?;
//!     metrics.set("kl", 0.01)?;
//!     metrics.extend_prefixed("time/", phases.seconds())?;
//!     metrics_writer.record(&metrics)?;
//!     progress.step_done(&metrics, &phases);
//! }
//! progress.finish();
//!
//! let records = jsonl::read_jsonl(&metrics_writer.jsonl_path())?;
//! reward_curve(&records, &[("train reward", "reward")]).write_png(&run_dir.join("reward.png"))?;
//! let summary = RunSummary {
//!     title: "grpo".into(),
//!     steps: total_steps,
//!     resumed_from: None,
//!     wall_time: std::time::Duration::from_secs(1),
//!     held_out_prompts: 64,
//!     held_out: vec![EvalRow { metric: "mean reward".into(), baseline: Some(0.1), final_value: Some(0.3) }],
//!     phases: timer.totals().to_vec(),
//! };
//! assert!(summary.to_text().contains("mean reward"));
//! # std::fs::remove_dir_all(&run_dir).unwrap();
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]

mod error;
pub mod jsonl;
pub mod live;
mod metrics;
pub mod phase;
pub mod plot;
pub mod progress;
pub mod samples;
pub mod summary;
pub mod tensorboard;

pub use error::{Result, TelemetryError};
pub use metrics::{
    MetricsSink, MetricsWriter, MetricsWriterOptions, RESERVED_NAMES, StartMode, StepMetrics,
    tensorboard_tag, unix_time_now,
};
pub use phase::{PhaseTimer, PhaseTotal, StepPhases};
pub use plot::{LineChart, reward_curve};
pub use progress::{ProgressField, ProgressMode, ProgressOptions, RunProgress};
pub use summary::{EvalRow, RunSummary, Table};
