//! PPO / GRPO maths on tch tensors, exactly as OpenRLHF v0.11 defines it, plus the
//! data-parallel gradient all-reduce over an [`rtrun::collective::Communicator`].
//!
//! - [`masked`]: masked sums, means, whitening and per-row normalisation.
//! - [`kl`]: the k1/k2/k3 KL estimators (clamped ±10), per-token rewards with the KL penalty,
//!   the KL loss term, and the fixed / adaptive coefficient controllers.
//! - [`advantage`]: GAE, REINFORCE++ returns-to-go, the group baselines (GRPO, Dr.GRPO,
//!   REINFORCE-baseline, RLOO) and OpenRLHF's whitening rules, behind
//!   [`compute_advantages`].
//! - [`loss`]: the clipped policy loss, the clipped value loss, entropy from logits, and the
//!   loss aggregation modes.
//! - [`shaping`]: reward shaping before advantages — DAPO's overlong penalty, running reward
//!   normalisation.
//! - [`grad`]: bucketed all-reduce (mean) of parameter gradients across DP ranks, and the
//!   broadcast of the root's parameters that makes the replicas start identical.
//!
//! Shapes: sequences × response tokens (`[B, T]`) with an action mask; group estimators expect
//! the `n` samples of a prompt in consecutive rows. Targets (advantages, returns, rewards) are
//! computed in `f32` without autograd; the losses keep autograd to their inputs.

// The one `unsafe` call (handing a tch CUDA buffer to NCCL) exists only with the `cuda` feature.
#![cfg_attr(not(feature = "cuda"), forbid(unsafe_code))]
#![cfg_attr(feature = "cuda", deny(unsafe_code))]

pub mod advantage;
pub mod error;
pub mod grad;
pub mod kl;
pub mod loss;
pub mod masked;
pub mod shaping;

pub use advantage::{
    AdvantageConfig, AdvantageEstimator, AdvantageInputs, Advantages, compute_advantages,
    cumulative_returns, gae, shape_group_rewards,
};
pub use error::{AlgoError, Result};
pub use grad::{GradientSyncConfig, GradientSyncStats, all_reduce_gradients, broadcast_parameters};
pub use kl::{KlConfig, KlController, KlEstimator, approx_kl, kl_loss, per_token_rewards};
pub use loss::{
    LossAggregation, PolicyLoss, PolicyLossConfig, RatioLevel, aggregate_loss, entropy_from_logits,
    masked_entropy, policy_loss, policy_loss_weighted, truncated_is_weight, value_loss,
};
pub use masked::{masked_mean, masked_normalize, masked_sum, masked_whiten};
pub use shaping::{RunningMoments, overlong_penalty};
