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
//! - [`summary`]: the end-of-run table (baseline vs final held-out reward, per-phase timings) as
//!   plain text or Markdown.
//!
//! The crate has no dependency on the runtime or on tch: it is plain file and terminal output,
//! usable from the driver process or from a trainer actor.

#![forbid(unsafe_code)]

mod error;
pub mod jsonl;
mod metrics;
pub mod tensorboard;

pub use error::{Result, TelemetryError};
pub use metrics::{
    MetricsSink, MetricsWriter, MetricsWriterOptions, RESERVED_NAMES, StartMode, StepMetrics,
    unix_time_now,
};
pub mod phase;
pub mod progress;
pub mod summary;

pub use phase::{PhaseTimer, StepPhases};
pub use progress::{ProgressMode, ProgressOptions, RunProgress};
pub use summary::{EvalRow, RunSummary};
pub mod plot;

pub use plot::{LineChart, reward_curve};
