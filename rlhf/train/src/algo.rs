//! The RL maths the trainer uses, from `rtrun-rlhf-algo` (OpenRLHF v0.11 semantics), with the
//! glue from this crate's config to that crate's settings.

pub use rtrun_rlhf_algo::{
    AdvantageConfig, AdvantageEstimator, AdvantageInputs, KlController, KlEstimator,
    LossAggregation, PolicyLossConfig as ClipConfig, RunningMoments, approx_kl, compute_advantages,
    kl_loss, masked_entropy, overlong_penalty, policy_loss, policy_loss_weighted,
    truncated_is_weight, value_loss,
};

use crate::config::AlgoConfig;

impl AlgoConfig {
    /// The advantage settings.
    pub fn advantage_config(&self) -> AdvantageConfig {
        AdvantageConfig {
            estimator: self.advantage_estimator,
            gamma: self.gamma,
            lambd: self.lambd,
            no_std_norm: false,
            reward_clip_range: Some((-self.reward_clip, self.reward_clip)),
        }
    }

    /// The policy clip settings.
    pub fn clip_config(&self) -> ClipConfig {
        ClipConfig {
            clip_eps_low: self.eps_clip_low,
            clip_eps_high: self.eps_clip_high,
            dual_clip: self.dual_clip,
            ratio: self.policy_loss,
        }
    }

    /// The KL coefficient controller (adaptive when `kl_target` is set).
    pub fn kl_controller(&self) -> crate::Result<KlController> {
        let controller = match self.kl_target {
            Some(target) => {
                KlController::adaptive(self.init_kl_coef, target, self.kl_horizon as u64)?
            }
            None => KlController::Fixed { value: self.init_kl_coef },
        };
        Ok(controller)
    }
}
