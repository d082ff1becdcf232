//! The RL maths the trainer uses. Placeholder enums until `rtrun-rlhf-algo` (branch
//! issue-8-algo) is merged; then this module re-exports that crate.

use serde::{Deserialize, Serialize};

/// Advantage estimators, named as OpenRLHF's `--advantage_estimator`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// GAE with a critic.
    Gae,
    /// REINFORCE++.
    Reinforce,
    /// RLOO.
    Rloo,
    /// REINFORCE with a group-mean baseline.
    ReinforceBaseline,
    /// GRPO.
    GroupNorm,
    /// Dr. GRPO.
    DrGrpo,
}

impl AdvantageEstimator {
    /// Whether it needs several samples per prompt.
    pub fn is_group_based(self) -> bool {
        matches!(self, Self::Rloo | Self::ReinforceBaseline | Self::GroupNorm | Self::DrGrpo)
    }
}

/// KL estimators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// log-ratio.
    K1,
    /// half squared log-ratio.
    K2,
    /// Schulman's unbiased low-variance estimator.
    K3,
}
