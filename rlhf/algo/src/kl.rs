//! The KL penalty against the reference policy: the k1/k2/k3 estimators, per-token rewards with
//! the penalty folded in (KL in the reward), the KL loss term (KL in the loss, GRPO style), and
//! the fixed and adaptive coefficient controllers — as OpenRLHF v0.11 defines them.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{AlgoError, Result};
use crate::loss::{LossAggregation, aggregate_loss};
use crate::masked::{expect_rank, expect_same_shape};

/// Every per-token KL estimate is clamped to `[-KL_CLAMP, KL_CLAMP]` (OpenRLHF: ±10).
pub const KL_CLAMP: f64 = 10.0;

/// How the per-token KL between the policy and the reference is estimated from the log-ratio
/// `r = log π(a) − log π_ref(a)` of the sampled token (Schulman, "Approximating KL divergence").
/// Serialised in lowercase as OpenRLHF's `--algo.kl.estimator`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    /// `r`: unbiased, can be negative; the default and the usual choice for KL in the reward.
    #[default]
    K1,
    /// `r²/2`: non-negative, biased.
    K2,
    /// `e^(−r) − 1 + r`: non-negative and unbiased; the usual choice for KL in the loss.
    K3,
}

impl std::str::FromStr for KlEstimator {
    type Err = AlgoError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "k1" => Ok(Self::K1),
            "k2" => Ok(Self::K2),
            "k3" => Ok(Self::K3),
            other => Err(AlgoError::Config(format!(
                "unknown kl estimator `{other}`, expected one of k1, k2, k3"
            ))),
        }
    }
}

/// Per-token KL estimate between `log_probs` and `ref_log_probs` (same shape, any rank),
/// computed in `f32` and clamped to ±[`KL_CLAMP`].
pub fn approx_kl(
    log_probs: &Tensor,
    ref_log_probs: &Tensor,
    estimator: KlEstimator,
) -> Result<Tensor> {
    expect_same_shape("ref_log_probs", ref_log_probs, &log_probs.size())?;
    let log_ratio =
        log_probs.f_to_kind(Kind::Float)?.f_sub(&ref_log_probs.f_to_kind(Kind::Float)?)?;
    let estimate = match estimator {
        KlEstimator::K1 => log_ratio,
        KlEstimator::K2 => log_ratio.f_square()?.f_div_scalar(2.0)?,
        KlEstimator::K3 => log_ratio.f_neg()?.f_exp()?.f_sub_scalar(1.0)?.f_add(&log_ratio)?,
    };
    Ok(estimate.f_clamp(-KL_CLAMP, KL_CLAMP)?)
}

/// The KL term of the actor loss when the KL is in the loss instead of the reward: the
/// aggregated (by default token-mean) estimate. The caller multiplies it by the controller's
/// coefficient and adds it to the policy loss.
pub fn kl_loss(
    log_probs: &Tensor,
    ref_log_probs: &Tensor,
    action_mask: &Tensor,
    estimator: KlEstimator,
    aggregation: LossAggregation,
) -> Result<Tensor> {
    let kl = approx_kl(log_probs, ref_log_probs, estimator)?;
    aggregate_loss(&kl, action_mask, aggregation)
}

/// Per-token rewards with the KL penalty in the reward: `R_t = −β·KL_t`, plus the scalar
/// reward of each sequence (clamped to `clip_range` when given; OpenRLHF's default is ±10) at
/// its last response token (the last position where `action_mask` is set; a row with an empty
/// mask gets it at the last column, as in OpenRLHF). A coefficient `β ≤ 0` means no penalty.
///
/// Shapes: `scalar_rewards` `[B]`, `kl` and `action_mask` `[B, T]`; the result is `[B, T]` f32.
pub fn per_token_rewards(
    scalar_rewards: &Tensor,
    kl_coef: f64,
    kl: &Tensor,
    action_mask: &Tensor,
    clip_range: Option<(f64, f64)>,
) -> Result<Tensor> {
    let shape = expect_rank("kl", kl, 2)?;
    expect_same_shape("action_mask", action_mask, &shape)?;
    expect_same_shape("scalar_rewards", scalar_rewards, &shape[..1])?;
    if let Some((low, high)) = clip_range
        && low > high
    {
        return Err(AlgoError::Config(format!(
            "reward clip range must have low <= high, found ({low}, {high})"
        )));
    }
    let kl = kl.f_to_kind(Kind::Float)?;
    let mut reward = scalar_rewards.f_to_kind(Kind::Float)?.f_to_device(kl.device())?;
    if let Some((low, high)) = clip_range {
        reward = reward.f_clamp(low, high)?;
    }
    let kl_reward = kl.f_mul_scalar(-kl_coef.max(0.0))?;
    // The last set position of each row is T − 1 − (the first set position of the flipped row).
    let mask = action_mask.f_to_device(kl.device())?.f_to_kind(Kind::Int64)?;
    let last_index = mask.f_fliplr()?.f_argmax(1, true)?.f_neg()?.f_add_scalar(shape[1] - 1)?;
    let last_reward = kl.f_zeros_like()?.f_scatter(1, &last_index, &reward.f_unsqueeze(1)?)?;
    Ok(last_reward.f_add(&kl_reward)?)
}

/// The KL settings of a run, named and defaulted as OpenRLHF's `--algo.kl.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlConfig {
    /// Initial (and, without `target`, fixed) coefficient β.
    pub init_coef: f64,
    /// The estimator.
    pub estimator: KlEstimator,
    /// Put the KL in the actor loss (GRPO) instead of the per-token reward.
    pub use_loss: bool,
    /// Target KL of the adaptive controller; `None` keeps β fixed.
    pub target: Option<f64>,
    /// Horizon (in samples) of the adaptive controller.
    pub horizon: u64,
}

impl Default for KlConfig {
    fn default() -> Self {
        KlConfig {
            init_coef: 0.01,
            estimator: KlEstimator::K1,
            use_loss: false,
            target: None,
            horizon: 10_000,
        }
    }
}

/// The largest relative step of the adaptive controller's error term (Ziegler et al.: ±0.2).
pub const ADAPTIVE_KL_ERROR_CLIP: f64 = 0.2;

/// The KL coefficient β and how it evolves. Serialisable so a checkpoint keeps its value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum KlController {
    /// β never changes.
    Fixed {
        /// β.
        value: f64,
    },
    /// β follows a target KL (Ziegler et al. 2019): with `e = clip(KL/target − 1, ±0.2)`,
    /// `β ← β·(1 + e·n_steps/horizon)` after each step that saw `n_steps` samples.
    Adaptive {
        /// Current β.
        value: f64,
        /// Target KL.
        target: f64,
        /// Horizon in samples.
        horizon: u64,
    },
}

impl KlController {
    /// The controller `config` describes: adaptive when it names a target, fixed otherwise.
    pub fn from_config(config: &KlConfig) -> Result<Self> {
        match config.target {
            None => Ok(KlController::Fixed { value: config.init_coef }),
            Some(target) => Self::adaptive(config.init_coef, target, config.horizon),
        }
    }

    /// An adaptive controller; `target` must be positive and `horizon` non-zero.
    pub fn adaptive(init_coef: f64, target: f64, horizon: u64) -> Result<Self> {
        if !(target > 0.0 && target.is_finite()) {
            return Err(AlgoError::Config(format!(
                "adaptive kl target must be a positive number, found {target}"
            )));
        }
        if horizon == 0 {
            return Err(AlgoError::Config(
                "adaptive kl horizon must be at least 1, found 0".into(),
            ));
        }
        Ok(KlController::Adaptive { value: init_coef, target, horizon })
    }

    /// The current coefficient β.
    pub fn value(&self) -> f64 {
        match self {
            KlController::Fixed { value } | KlController::Adaptive { value, .. } => *value,
        }
    }

    /// Feeds the KL measured over the last step, which saw `n_steps` samples (OpenRLHF passes
    /// rollout batch size × samples per prompt). A fixed controller ignores it.
    pub fn update(&mut self, current_kl: f64, n_steps: u64) {
        if let KlController::Adaptive { value, target, horizon } = self {
            let error =
                (current_kl / *target - 1.0).clamp(-ADAPTIVE_KL_ERROR_CLIP, ADAPTIVE_KL_ERROR_CLIP);
            *value *= 1.0 + error * n_steps as f64 / *horizon as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::masked::tests::{assert_close, t2};

    #[test]
    fn estimators_match_hand_computed_values() {
        // r = logπ − logπref = [0.5, −1.0, 0.0, 12.0 − 0.0].
        let lp = t2(&[&[-1.0, -2.0, -0.3, 12.0]]);
        let rp = t2(&[&[-1.5, -1.0, -0.3, 0.0]]);
        // k1 = r, with 12 clamped to 10.
        assert_close(&approx_kl(&lp, &rp, KlEstimator::K1).unwrap(), &[0.5, -1.0, 0.0, 10.0]);
        // k2 = r²/2: 0.125, 0.5, 0, 72 → clamped 10.
        assert_close(&approx_kl(&lp, &rp, KlEstimator::K2).unwrap(), &[0.125, 0.5, 0.0, 10.0]);
        // k3 = e^(−r) − 1 + r: e^(−0.5) − 0.5 = 0.6065307 − 0.5 = 0.1065307;
        // e^(1) − 2 = 0.7182818; 1 − 1 + 0 = 0; e^(−12) + 11 = 11.000006 → clamped 10.
        assert_close(
            &approx_kl(&lp, &rp, KlEstimator::K3).unwrap(),
            &[0.106_530_66, 0.718_281_83, 0.0, 10.0],
        );
        // A large negative r: k3 = e^(20) − 21 ≫ 10 → 10; k1 = −20 → −10.
        let (a, b) = (t2(&[&[-20.0]]), t2(&[&[0.0]]));
        assert_close(&approx_kl(&a, &b, KlEstimator::K3).unwrap(), &[10.0]);
        assert_close(&approx_kl(&a, &b, KlEstimator::K1).unwrap(), &[-10.0]);
    }

    #[test]
    fn per_token_rewards_put_the_clipped_reward_on_the_last_action() {
        // β = 0.1; row 0 has 3 actions (last at t = 2), row 1 has 1 action (t = 0), row 2 has
        // an interior hole (last set at t = 3).
        let kl = t2(&[&[1.0, 2.0, 3.0, 0.0], &[0.5, 0.0, 0.0, 0.0], &[1.0, 0.0, 1.0, 1.0]]);
        let mask = t2(&[&[1.0, 1.0, 1.0, 0.0], &[1.0, 0.0, 0.0, 0.0], &[1.0, 0.0, 1.0, 1.0]]);
        let r = Tensor::from_slice(&[2.0f32, 15.0, -0.5]);
        let out = per_token_rewards(&r, 0.1, &kl, &mask, Some((-10.0, 10.0))).unwrap();
        // Row 0: −0.1·[1, 2, 3, 0] + [0, 0, 2, 0] = [−0.1, −0.2, 1.7, 0].
        // Row 1: reward 15 clipped to 10: [−0.05 + 10, 0, 0, 0].
        // Row 2: [−0.1, 0, −0.1, −0.1 − 0.5].
        assert_close(&out, &[-0.1, -0.2, 1.7, 0.0, 9.95, 0.0, 0.0, 0.0, -0.1, 0.0, -0.1, -0.6]);
        // β ≤ 0 means no penalty; no clip range leaves 15 as is.
        let out = per_token_rewards(&r, -1.0, &kl, &mask, None).unwrap();
        assert_close(&out, &[0.0, 0.0, 2.0, 0.0, 15.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5]);
    }

    #[test]
    fn per_token_rewards_reject_mismatched_shapes() {
        let kl = t2(&[&[1.0, 2.0]]);
        let err = per_token_rewards(&Tensor::from_slice(&[1.0f32, 2.0]), 0.1, &kl, &kl, None)
            .unwrap_err();
        assert!(err.to_string().contains("`scalar_rewards` should have shape [1]"), "{err}");
    }

    #[test]
    fn kl_loss_is_the_token_mean_of_the_estimate() {
        // k1 per token: [0.5, −1.0 | 2.0, (masked 7)] → mean over 3 tokens = 1.5/3 = 0.5.
        let lp = t2(&[&[0.5, -1.0], &[2.0, 7.0]]);
        let rp = t2(&[&[0.0, 0.0], &[0.0, 0.0]]);
        let mask = t2(&[&[1.0, 1.0], &[1.0, 0.0]]);
        let loss = kl_loss(&lp, &rp, &mask, KlEstimator::K1, LossAggregation::TokenMean).unwrap();
        assert_close(&loss, &[0.5]);
    }

    #[test]
    fn adaptive_controller_follows_the_target() {
        let config =
            KlConfig { init_coef: 0.1, target: Some(0.05), horizon: 1000, ..KlConfig::default() };
        let mut ctl = KlController::from_config(&config).unwrap();
        // KL 0.06: e = 0.06/0.05 − 1 = 0.2 (at the clip); mult = 1 + 0.2·100/1000 = 1.02;
        // β = 0.1·1.02 = 0.102.
        ctl.update(0.06, 100);
        assert!((ctl.value() - 0.102).abs() < 1e-12, "{}", ctl.value());
        // KL 0.5: e = 9 clipped to 0.2; mult = 1 + 0.2·500/1000 = 1.1; β = 0.102·1.1 = 0.1122.
        ctl.update(0.5, 500);
        assert!((ctl.value() - 0.1122).abs() < 1e-12, "{}", ctl.value());
        // KL 0.045: e = 0.9 − 1 = −0.1; mult = 1 − 0.1·1000/1000 = 0.9; β = 0.1122·0.9 = 0.10098.
        ctl.update(0.045, 1000);
        assert!((ctl.value() - 0.10098).abs() < 1e-12, "{}", ctl.value());
        // KL 0: e = −1 clipped to −0.2; mult = 1 − 0.2·250/1000 = 0.95; β = 0.095931.
        ctl.update(0.0, 250);
        assert!((ctl.value() - 0.095_931).abs() < 1e-12, "{}", ctl.value());
    }

    #[test]
    fn fixed_controller_never_moves_and_bad_settings_are_errors() {
        let mut ctl = KlController::from_config(&KlConfig::default()).unwrap();
        ctl.update(100.0, 1_000_000);
        assert_eq!(ctl.value(), 0.01);
        assert!(KlController::adaptive(0.1, 0.0, 10).is_err());
        assert!(KlController::adaptive(0.1, 0.1, 0).is_err());
    }

    #[test]
    fn estimator_names_are_openrlhf_names() {
        assert_eq!(serde_json::to_string(&KlEstimator::K3).unwrap(), "\"k3\"");
        let parsed: KlEstimator = serde_json::from_str("\"k2\"").unwrap();
        assert_eq!(parsed, KlEstimator::K2);
        assert!(serde_json::from_str::<KlEstimator>("\"k4\"").is_err());
        assert_eq!("k1".parse::<KlEstimator>().unwrap(), KlEstimator::K1);
        let err = "kl".parse::<KlEstimator>().unwrap_err();
        assert!(err.to_string().contains("expected one of k1, k2, k3"), "{err}");
    }
}
