//! Training: AdamW with clipping, the learning-rate schedule, gradient accumulation and masked
//! losses; plus saving and loading model + optimizer for resume.

mod loss;
mod optimizer;
mod schedule;

use std::path::Path;

pub use loss::{masked_cross_entropy, masked_mean, masked_mean_per_row};
pub use optimizer::{AdamW, AdamWUpdate, OptimizerConfig, StepStats, clip_coefficient};
pub use schedule::ScheduleConfig;

use crate::causal_lm::CausalLm;
use crate::error::Result;
use crate::params::Parameters;
use crate::pretrained::load_into;
use crate::safetensors_io::SaveOptions;

/// File name of the optimizer state inside a training checkpoint directory.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// Saves a causal LM (Hugging Face format) and its optimizer state into `dir`.
pub fn save_training_checkpoint(
    dir: &Path,
    model: &CausalLm,
    optimizer: &AdamW,
    options: &SaveOptions,
) -> Result<()> {
    model.save_pretrained(dir, options)?;
    optimizer.save(&dir.join(OPTIMIZER_FILE))
}

/// Restores weights and optimizer state saved by [`save_training_checkpoint`] into an existing
/// model and its optimizer (built over that model's parameters).
pub fn load_training_checkpoint(
    dir: &Path,
    params: &Parameters,
    optimizer: &mut AdamW,
) -> Result<()> {
    load_into(params, dir, &[])?;
    optimizer.load(&dir.join(OPTIMIZER_FILE))
}
