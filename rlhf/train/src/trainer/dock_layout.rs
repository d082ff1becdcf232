//! The TransferDock layout of a `train.pipeline: dock` step: its columns, its stages'
//! consumers and the dock's sampling, shared by the role set that creates the dock actor and
//! the pipeline that runs the stages.

use rtrun_rlhf_dock::{ColumnKind, DockConfig, SampleOrder, SamplingConfig};

use crate::config::{RolloutMode, TrainConfig};

/// Prompt token ids (the driver writes them).
pub const PROMPTS: &str = "prompts";
/// Response token ids (`rollout`).
pub const RESPONSES: &str = "responses";
/// The engine's per-token sampling log-probs (`rollout`).
pub const ENGINE_LOG_PROBS: &str = "engine_log_probs";
/// The weight version that sampled each response token (`rollout.mode: async`'s rollout).
pub const VERSIONS: &str = "versions";
/// One reward per row (`reward`).
pub const RM_SCORES: &str = "rm_scores";
/// The reference's per-token log-probs (`ref_log_prob`).
pub const REF_LOG_PROB: &str = "ref_log_prob";
/// The policy's per-token log-probs before the update (`old_log_prob`).
pub const OLD_LOG_PROB: &str = "old_log_prob";
/// Per-token advantages (`compute_advantage`).
pub const ADVANTAGES: &str = "advantages";
/// Per-token returns (`compute_advantage`).
pub const RETURNS: &str = "returns";

/// The stages' consumers, in pipeline order.
pub const STAGES: [&str; 6] =
    ["rollout", "reward", "ref_log_prob", "old_log_prob", "compute_advantage", "actor_train"];

/// The dock of a run in dock mode: every column and every stage's consumer, and one step's
/// rows; with `rollout.mode: async`, `max_staleness + 1` steps' (the most finished groups the
/// rollout may hold at once, see [`crate::trainer::stream`]), each group a slot that is freed
/// once it is trained on or dropped.
pub fn dock_config(config: &TrainConfig) -> DockConfig {
    let rollout = &config.rollout;
    let groups = match rollout.mode {
        RolloutMode::Async => (rollout.staleness() as usize + 1) * rollout.prompts_per_step,
        RolloutMode::Sync => rollout.prompts_per_step,
    };
    let mut dock = DockConfig::new(groups, rollout.n_samples_per_prompt)
        .with_column(PROMPTS, ColumnKind::TokenIds)
        .with_column(RESPONSES, ColumnKind::TokenIds)
        .with_column(ENGINE_LOG_PROBS, ColumnKind::Floats)
        .with_column(VERSIONS, ColumnKind::TokenIds)
        .with_column(RM_SCORES, ColumnKind::Scalars)
        .with_column(REF_LOG_PROB, ColumnKind::Floats)
        .with_column(OLD_LOG_PROB, ColumnKind::Floats)
        .with_column(ADVANTAGES, ColumnKind::Floats)
        .with_column(RETURNS, ColumnKind::Floats)
        .with_sampling(SamplingConfig {
            order: SampleOrder::Ascending,
            seed: config.seed,
            // `train.dock_groups_per_batch` need not divide the step's prompts.
            allow_short_final_batch: true,
        });
    for stage in STAGES {
        dock = dock.with_consumer(stage);
    }
    dock
}
