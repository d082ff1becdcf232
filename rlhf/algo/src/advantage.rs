//! Advantage estimators: GAE with a critic, the REINFORCE family (returns-to-go), and the group
//! baselines over the n samples of a prompt (GRPO, Dr.GRPO, REINFORCE-baseline, RLOO), with the
//! global whitening OpenRLHF v0.11 applies to some of them.
//!
//! Batches are `[B, T]` (sequences × response tokens) with an action mask; the rows of a batch
//! are **prompt-major**: the n samples of a prompt are consecutive rows, so row `i` belongs to
//! prompt `i / n`. Everything is computed in `f32` without autograd (these are targets).

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{AlgoError, Result};
use crate::kl::per_token_rewards;
use crate::masked::{expect_rank, expect_same_shape, masked_whiten};

/// The `ε` added to the group standard deviation of GRPO's normalisation.
pub const GROUP_NORM_EPS: f64 = 1e-9;

/// How advantages are estimated. Serialised as OpenRLHF's `--algo.advantage.estimator` names:
/// `gae`, `reinforce`, `rloo`, `reinforce_baseline`, `group_norm`, `dr_grpo`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// Generalised advantage estimation with a critic (PPO); the default.
    #[default]
    Gae,
    /// REINFORCE++: returns-to-go of the per-token rewards, globally whitened.
    Reinforce,
    /// REINFORCE leave-one-out: `r_i − (Σ_j r_j − r_i)/(n − 1)` within each prompt group.
    Rloo,
    /// REINFORCE++-baseline: `r − mean(group)`, then globally whitened.
    ReinforceBaseline,
    /// GRPO: `(r − mean(group)) / (std(group) + 1e-9)` with the unbiased std.
    GroupNorm,
    /// Dr.GRPO: `r − mean(group)`, not whitened.
    DrGrpo,
}

impl AdvantageEstimator {
    /// Every estimator, in OpenRLHF's order.
    pub const ALL: [AdvantageEstimator; 6] = [
        Self::Gae,
        Self::Reinforce,
        Self::Rloo,
        Self::ReinforceBaseline,
        Self::GroupNorm,
        Self::DrGrpo,
    ];

    /// The OpenRLHF name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gae => "gae",
            Self::Reinforce => "reinforce",
            Self::Rloo => "rloo",
            Self::ReinforceBaseline => "reinforce_baseline",
            Self::GroupNorm => "group_norm",
            Self::DrGrpo => "dr_grpo",
        }
    }

    /// Whether the estimator needs a critic's values (only GAE does).
    pub fn needs_critic(self) -> bool {
        self == Self::Gae
    }

    /// Whether the estimator uses a baseline over the n samples of a prompt (and so needs
    /// `n_samples_per_prompt > 1` and forces γ = 1).
    pub fn is_group_baseline(self) -> bool {
        matches!(self, Self::Rloo | Self::ReinforceBaseline | Self::GroupNorm | Self::DrGrpo)
    }

    /// Whether the advantages are whitened over the whole batch afterwards.
    pub fn whitens(self) -> bool {
        matches!(self, Self::Gae | Self::Reinforce | Self::ReinforceBaseline)
    }
}

impl std::fmt::Display for AdvantageEstimator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for AdvantageEstimator {
    type Err = AlgoError;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|e| e.name() == s).ok_or_else(|| {
            AlgoError::Config(format!(
                "unknown advantage estimator `{s}`, expected one of gae, reinforce, rloo, \
                 reinforce_baseline, group_norm, dr_grpo"
            ))
        })
    }
}

/// The advantage settings of a run, named and defaulted as OpenRLHF's `--algo.advantage.*`
/// (plus `--reward.clip_range`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdvantageConfig {
    /// The estimator.
    pub estimator: AdvantageEstimator,
    /// Discount γ (forced to 1 for the group estimators, as OpenRLHF does).
    pub gamma: f64,
    /// GAE's λ.
    pub lambd: f64,
    /// Whiten by the mean only, without dividing by the standard deviation.
    pub no_std_norm: bool,
    /// Range the (shaped) scalar reward is clamped to before it enters the per-token rewards;
    /// `None` leaves it unclamped.
    pub reward_clip_range: Option<(f64, f64)>,
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        AdvantageConfig {
            estimator: AdvantageEstimator::Gae,
            gamma: 1.0,
            lambd: 1.0,
            no_std_norm: false,
            reward_clip_range: Some((-10.0, 10.0)),
        }
    }
}

/// What [`compute_advantages`] needs about a batch of `B` sequences with `T` response tokens.
#[derive(Debug, Clone, Copy)]
pub struct AdvantageInputs<'a> {
    /// One scalar reward per sequence, `[B]`, prompt-major.
    pub scalar_rewards: &'a Tensor,
    /// Which response tokens are real, `[B, T]`.
    pub action_mask: &'a Tensor,
    /// Per-token KL to the reference, `[B, T]`, when the KL is in the reward; `None` for no
    /// penalty (KL in the loss, or no reference model).
    pub kl: Option<&'a Tensor>,
    /// The critic's values, `[B, T]`; required by GAE and ignored otherwise.
    pub values: Option<&'a Tensor>,
}

/// Advantages and returns of a batch, all `[B, T]` f32.
#[derive(Debug)]
pub struct Advantages {
    /// The advantages the policy loss uses.
    pub advantages: Tensor,
    /// The critic's regression targets (GAE) or the returns-to-go (REINFORCE family).
    pub returns: Tensor,
    /// The per-token rewards after group shaping, clipping and the KL penalty (for logging:
    /// their row sums are OpenRLHF's `return` metric).
    pub token_rewards: Tensor,
}

/// OpenRLHF's `compute_advantages_and_returns` for one batch: group-baseline shaping of the
/// scalar rewards, per-token rewards with the KL penalty `kl_coef`, then GAE or returns-to-go,
/// then global whitening for `gae`, `reinforce` and `reinforce_baseline`.
pub fn compute_advantages(
    config: &AdvantageConfig,
    n_samples_per_prompt: usize,
    kl_coef: f64,
    inputs: AdvantageInputs<'_>,
) -> Result<Advantages> {
    let shape = expect_rank("action_mask", inputs.action_mask, 2)?;
    let mask = inputs.action_mask.f_to_kind(Kind::Float)?;
    let shaped =
        shape_group_rewards(config.estimator, inputs.scalar_rewards, n_samples_per_prompt)?;
    let zero_kl;
    let kl = match inputs.kl {
        Some(kl) => kl,
        None => {
            zero_kl = mask.f_zeros_like()?;
            &zero_kl
        }
    };
    let token_rewards = per_token_rewards(&shaped, kl_coef, kl, &mask, config.reward_clip_range)?;
    let (advantages, returns) = if config.estimator == AdvantageEstimator::Gae {
        let values = inputs.values.ok_or_else(|| {
            AlgoError::Config("the gae estimator needs critic values, found none".into())
        })?;
        expect_same_shape("values", values, &shape)?;
        gae(values, &token_rewards, &mask, config.gamma, config.lambd)?
    } else {
        let gamma = if config.estimator.is_group_baseline() && config.gamma != 1.0 {
            tracing::warn!(
                estimator = config.estimator.name(),
                gamma = config.gamma,
                "gamma is forced to 1 for group-baseline estimators"
            );
            1.0
        } else {
            config.gamma
        };
        let returns = cumulative_returns(&token_rewards, &mask, gamma)?;
        (returns.f_detach_copy()?, returns)
    };
    let advantages = if config.estimator.whitens() {
        masked_whiten(&advantages, &mask, config.no_std_norm)?
    } else {
        advantages
    };
    Ok(Advantages { advantages, returns, token_rewards })
}

/// Shapes the scalar rewards `[B]` (prompt-major, `n` samples per prompt) with the estimator's
/// group baseline; estimators without one return the rewards unchanged (as f32).
pub fn shape_group_rewards(
    estimator: AdvantageEstimator,
    scalar_rewards: &Tensor,
    n_samples_per_prompt: usize,
) -> Result<Tensor> {
    let shape = expect_rank("scalar_rewards", scalar_rewards, 1)?;
    let rewards = scalar_rewards.f_to_kind(Kind::Float)?;
    if !estimator.is_group_baseline() {
        return Ok(rewards);
    }
    let n = n_samples_per_prompt as i64;
    if n < 2 {
        return Err(AlgoError::Config(format!(
            "the {estimator} estimator needs n_samples_per_prompt > 1, found {n}"
        )));
    }
    if shape[0] % n != 0 {
        return Err(AlgoError::Config(format!(
            "{} rewards do not split into groups of n_samples_per_prompt = {n}",
            shape[0]
        )));
    }
    let groups = rewards.f_view([-1, n])?;
    let sum = groups.f_sum_dim_intlist([1i64].as_slice(), true, Kind::Float)?;
    let shaped = match estimator {
        AdvantageEstimator::Rloo => {
            // Leave-one-out mean of the other n − 1 samples.
            let baseline = sum.f_sub(&groups)?.f_div_scalar((n - 1) as f64)?;
            groups.f_sub(&baseline)?
        }
        AdvantageEstimator::ReinforceBaseline | AdvantageEstimator::DrGrpo => {
            groups.f_sub(&sum.f_div_scalar(n as f64)?)?
        }
        AdvantageEstimator::GroupNorm => {
            let mean = sum.f_div_scalar(n as f64)?;
            let std = groups.f_std_dim([1i64].as_slice(), true, true)?;
            groups.f_sub(&mean)?.f_div(&std.f_add_scalar(GROUP_NORM_EPS)?)?
        }
        AdvantageEstimator::Gae | AdvantageEstimator::Reinforce => groups,
    };
    Ok(shaped.f_view([-1])?)
}

/// Generalised advantage estimation over `[B, T]` rewards and values (both masked first; the
/// value after the last column is 0): `δ_t = R_t + γV_{t+1} − V_t`, `A_t = δ_t + γλA_{t+1}`;
/// returns `(A, A + V)`.
pub fn gae(
    values: &Tensor,
    rewards: &Tensor,
    action_mask: &Tensor,
    gamma: f64,
    lambd: f64,
) -> Result<(Tensor, Tensor)> {
    let shape = expect_rank("rewards", rewards, 2)?;
    expect_same_shape("values", values, &shape)?;
    expect_same_shape("action_mask", action_mask, &shape)?;
    let mask = action_mask.f_to_kind(Kind::Float)?.f_to_device(rewards.device())?;
    let values = values.f_to_kind(Kind::Float)?.f_to_device(rewards.device())?.f_mul(&mask)?;
    let rewards = rewards.f_to_kind(Kind::Float)?.f_mul(&mask)?;
    let steps = shape[1];
    let mut reversed = Vec::with_capacity(steps as usize);
    let mut last_advantage = rewards.f_select(1, 0)?.f_zeros_like()?;
    let mut next_value = last_advantage.f_zeros_like()?;
    for t in (0..steps).rev() {
        let value = values.f_select(1, t)?;
        let delta =
            rewards.f_select(1, t)?.f_add(&next_value.f_mul_scalar(gamma)?)?.f_sub(&value)?;
        last_advantage = delta.f_add(&last_advantage.f_mul_scalar(gamma * lambd)?)?;
        reversed.push(last_advantage.shallow_clone());
        next_value = value;
    }
    reversed.reverse();
    let advantages = Tensor::f_stack(&reversed, 1)?;
    let returns = advantages.f_add(&values)?;
    Ok((advantages, returns))
}

/// Returns-to-go of masked `[B, T]` rewards: `G_t = R_t + γ·G_{t+1}`, `G` after the end = 0.
pub fn cumulative_returns(rewards: &Tensor, action_mask: &Tensor, gamma: f64) -> Result<Tensor> {
    let shape = expect_rank("rewards", rewards, 2)?;
    expect_same_shape("action_mask", action_mask, &shape)?;
    let mask = action_mask.f_to_kind(Kind::Float)?.f_to_device(rewards.device())?;
    let rewards = rewards.f_to_kind(Kind::Float)?.f_mul(&mask)?;
    let mut reversed = Vec::with_capacity(shape[1] as usize);
    let mut running = rewards.f_select(1, 0)?.f_zeros_like()?;
    for t in (0..shape[1]).rev() {
        running = rewards.f_select(1, t)?.f_add(&running.f_mul_scalar(gamma)?)?;
        reversed.push(running.shallow_clone());
    }
    reversed.reverse();
    Ok(Tensor::f_stack(&reversed, 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::masked::tests::{assert_close, t2};

    #[test]
    fn gae_matches_hand_computation() {
        // γ = 0.9, λ = 0.8 (γλ = 0.72).
        // Row 0, all valid: R = [0, 0, 1], V = [0.5, 0.6, 0.7].
        //   t=2: δ = 1 + 0 − 0.7 = 0.3;            A = 0.3
        //   t=1: δ = 0 + 0.9·0.7 − 0.6 = 0.03;     A = 0.03 + 0.72·0.3 = 0.246
        //   t=0: δ = 0 + 0.9·0.6 − 0.5 = 0.04;     A = 0.04 + 0.72·0.246 = 0.21712
        //   returns = A + V = [0.71712, 0.846, 1.0]
        // Row 1, last token padding: R = [0, 2, (5)], V = [1, 1, (9)] → masked to 0.
        //   t=2: δ = 0;                             A = 0
        //   t=1: δ = 2 + 0.9·0 − 1 = 1;            A = 1
        //   t=0: δ = 0 + 0.9·1 − 1 = −0.1;         A = −0.1 + 0.72·1 = 0.62
        //   returns = [1.62, 2.0, 0.0]
        let rewards = t2(&[&[0.0, 0.0, 1.0], &[0.0, 2.0, 5.0]]);
        let values = t2(&[&[0.5, 0.6, 0.7], &[1.0, 1.0, 9.0]]);
        let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let (adv, ret) = gae(&values, &rewards, &mask, 0.9, 0.8).unwrap();
        assert_close(&adv, &[0.21712, 0.246, 0.3, 0.62, 1.0, 0.0]);
        assert_close(&ret, &[0.71712, 0.846, 1.0, 1.62, 2.0, 0.0]);
    }

    #[test]
    fn cumulative_returns_match_hand_computation() {
        // Row 0: R = [−0.1, −0.2, 1.7]; γ = 1: G = [1.4, 1.5, 1.7];
        //   γ = 0.5: G2 = 1.7, G1 = −0.2 + 0.85 = 0.65, G0 = −0.1 + 0.325 = 0.225.
        // Row 1: R = [0.5, 1, (9)] masked: γ = 1: G = [1.5, 1, 0]; γ = 0.5: [1.0, 1.0, 0].
        let rewards = t2(&[&[-0.1, -0.2, 1.7], &[0.5, 1.0, 9.0]]);
        let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        assert_close(
            &cumulative_returns(&rewards, &mask, 1.0).unwrap(),
            &[1.4, 1.5, 1.7, 1.5, 1.0, 0.0],
        );
        assert_close(
            &cumulative_returns(&rewards, &mask, 0.5).unwrap(),
            &[0.225, 0.65, 1.7, 1.0, 1.0, 0.0],
        );
    }

    #[test]
    fn group_baselines_match_hand_computation() {
        // Two prompts × 4 samples: [1, 0, 0, 1] and [3, 1, 2, 6].
        let r = Tensor::from_slice(&[1.0f32, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 6.0]);
        // GRPO. Group 0: mean 0.5, unbiased var = 4·0.25/3 = 1/3, std = 0.5773503;
        //   ±0.5/0.5773503 = ±0.8660254.
        // Group 1: mean 3, deviations [0, −2, −1, 3], Σd² = 14, var = 14/3, std = 2.1602469;
        //   [0, −0.9258201, −0.4629100, 1.3887301].
        assert_close(
            &shape_group_rewards(AdvantageEstimator::GroupNorm, &r, 4).unwrap(),
            &[
                0.866_025_4,
                -0.866_025_4,
                -0.866_025_4,
                0.866_025_4,
                0.0,
                -0.925_820_1,
                -0.462_910_0,
                1.388_730_1,
            ],
        );
        // RLOO: baseline_i = (Σr − r_i)/3. Group 0 (Σ = 2): 1 − 1/3 = 2/3, 0 − 2/3 = −2/3.
        // Group 1 (Σ = 12): 3 − 9/3 = 0, 1 − 11/3 = −8/3, 2 − 10/3 = −4/3, 6 − 6/3 = 4.
        let t = 2.0 / 3.0;
        assert_close(
            &shape_group_rewards(AdvantageEstimator::Rloo, &r, 4).unwrap(),
            &[t, -t, -t, t, 0.0, -8.0 / 3.0, -4.0 / 3.0, 4.0],
        );
        // Dr.GRPO and REINFORCE-baseline: r − mean: [0.5, −0.5, −0.5, 0.5, 0, −2, −1, 3].
        for estimator in [AdvantageEstimator::DrGrpo, AdvantageEstimator::ReinforceBaseline] {
            assert_close(
                &shape_group_rewards(estimator, &r, 4).unwrap(),
                &[0.5, -0.5, -0.5, 0.5, 0.0, -2.0, -1.0, 3.0],
            );
        }
        // GAE and REINFORCE leave the rewards alone.
        assert_close(
            &shape_group_rewards(AdvantageEstimator::Reinforce, &r, 4).unwrap(),
            &[1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 6.0],
        );
    }

    #[test]
    fn group_norm_of_a_constant_group_is_zero_not_nan() {
        // std = 0 → (3 − 3)/(0 + 1e-9) = 0.
        let r = Tensor::from_slice(&[3.0f32, 3.0]);
        assert_close(
            &shape_group_rewards(AdvantageEstimator::GroupNorm, &r, 2).unwrap(),
            &[0.0, 0.0],
        );
    }

    #[test]
    fn group_estimators_reject_bad_group_layouts() {
        let r = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let err = shape_group_rewards(AdvantageEstimator::Rloo, &r, 1).unwrap_err();
        assert!(
            err.to_string().contains("rloo estimator needs n_samples_per_prompt > 1, found 1"),
            "{err}"
        );
        let err = shape_group_rewards(AdvantageEstimator::GroupNorm, &r, 2).unwrap_err();
        assert!(err.to_string().contains("3 rewards do not split into groups"), "{err}");
    }

    #[test]
    fn reinforce_plus_plus_whitens_returns_to_go() {
        // β = 0.1, KL = [[1, 0, 0], [0, 0, 0]], r = [2, −1], masks [[1, 1, 1], [1, 1, 0]].
        // Token rewards: row 0 = [−0.1, 0, 2], row 1 = [0, −1, 0] (last action at t = 1).
        // Returns (γ = 1): row 0 = [1.9, 2, 2], row 1 = [−1, −1, 0].
        // Whitening over the 5 masked tokens: μ = 3.9/5 = 0.78; deviations 1.12, 1.22, 1.22,
        // −1.78, −1.78; σ² = (1.2544 + 2·1.4884 + 2·3.1684)/5 = 2.1136, σ = 1.4538225.
        // A = d/σ = [0.7703829, 0.8391671, 0.8391671, −1.2243585, −1.2243585]; the padded
        // position becomes (0 − 0.78)/σ = −0.5365166.
        let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let kl = t2(&[&[1.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
        let rewards = Tensor::from_slice(&[2.0f32, -1.0]);
        let config = AdvantageConfig {
            estimator: AdvantageEstimator::Reinforce,
            ..AdvantageConfig::default()
        };
        let inputs = AdvantageInputs {
            scalar_rewards: &rewards,
            action_mask: &mask,
            kl: Some(&kl),
            values: None,
        };
        let out = compute_advantages(&config, 1, 0.1, inputs).unwrap();
        assert_close(&out.token_rewards, &[-0.1, 0.0, 2.0, 0.0, -1.0, 0.0]);
        assert_close(&out.returns, &[1.9, 2.0, 2.0, -1.0, -1.0, 0.0]);
        assert_close(
            &out.advantages,
            &[0.770_382_9, 0.839_167_1, 0.839_167_1, -1.224_358_5, -1.224_358_5, -0.536_516_6],
        );
    }

    #[test]
    fn grpo_end_to_end_broadcasts_the_normalised_reward_and_does_not_whiten() {
        // Two samples of one prompt, r = [1, 0]: mean 0.5, unbiased std = sqrt(0.5) = 0.7071068,
        // shaped = ±0.7071068. No KL. Returns-to-go put it on every action token; γ = 0.5 in
        // the config is forced to 1 for group estimators. No whitening.
        let mask = t2(&[&[1.0, 1.0, 0.0], &[1.0, 1.0, 1.0]]);
        let rewards = Tensor::from_slice(&[1.0f32, 0.0]);
        let config = AdvantageConfig {
            estimator: AdvantageEstimator::GroupNorm,
            gamma: 0.5,
            ..AdvantageConfig::default()
        };
        let inputs = AdvantageInputs {
            scalar_rewards: &rewards,
            action_mask: &mask,
            kl: None,
            values: None,
        };
        let out = compute_advantages(&config, 2, 0.01, inputs).unwrap();
        let s = 0.5f64.sqrt();
        assert_close(&out.advantages, &[s, s, 0.0, -s, -s, -s]);
        assert_close(&out.returns, &[s, s, 0.0, -s, -s, -s]);
    }

    #[test]
    fn gae_end_to_end_needs_values_and_whitens() {
        let mask = t2(&[&[1.0, 1.0]]);
        let rewards = Tensor::from_slice(&[1.0f32]);
        let inputs = AdvantageInputs {
            scalar_rewards: &rewards,
            action_mask: &mask,
            kl: None,
            values: None,
        };
        let err = compute_advantages(&AdvantageConfig::default(), 1, 0.0, inputs).unwrap_err();
        assert!(err.to_string().contains("gae estimator needs critic values"), "{err}");
        // V = [0.25, 0.5], R = [0, 1], γ = λ = 1: A1 = 1 − 0.5 = 0.5, A0 = 0 + 0.5 − 0.25 + 0.5
        // = 0.75; returns [1, 1]; whitened: μ = 0.625, σ = 0.125 → [1, −1].
        let values = t2(&[&[0.25, 0.5]]);
        let inputs = AdvantageInputs { values: Some(&values), ..inputs };
        let out = compute_advantages(&AdvantageConfig::default(), 1, 0.0, inputs).unwrap();
        assert_close(&out.returns, &[1.0, 1.0]);
        assert_close(&out.advantages, &[1.0, -1.0]);
    }

    #[test]
    fn estimator_names_are_openrlhf_names() {
        for estimator in AdvantageEstimator::ALL {
            let json = serde_json::to_string(&estimator).unwrap();
            assert_eq!(json, format!("\"{}\"", estimator.name()));
            assert_eq!(serde_json::from_str::<AdvantageEstimator>(&json).unwrap(), estimator);
            assert_eq!(estimator.name().parse::<AdvantageEstimator>().unwrap(), estimator);
        }
        assert!("grpo".parse::<AdvantageEstimator>().is_err());
        let config: AdvantageConfig =
            serde_json::from_str(r#"{"estimator": "dr_grpo", "gamma": 0.99}"#).unwrap();
        assert_eq!(config.estimator, AdvantageEstimator::DrGrpo);
        assert_eq!(config.lambd, 1.0);
        assert!(serde_json::from_str::<AdvantageConfig>(r#"{"gama": 1}"#).is_err());
    }
}
