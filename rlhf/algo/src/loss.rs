//! The PPO losses: the clipped policy loss (asymmetric ε, optional dual clip, log-ratio clamped
//! at ±20), the clipped value loss, and the entropy of the policy from its logits, with
//! OpenRLHF's loss aggregation (token mean by default). These keep autograd: call them on the
//! outputs of the model being trained.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{AlgoError, Result};
use crate::masked::{expect_same_shape, float_mask, masked_mean};

/// The log-ratio `log π − log π_old` is clamped to ±`POLICY_LOG_RATIO_CLAMP` before `exp`.
pub const POLICY_LOG_RATIO_CLAMP: f64 = 20.0;

/// The `ε` that keeps an empty sequence's mean finite in [`LossAggregation::SequenceMean`].
pub const SEQUENCE_MEAN_EPS: f64 = 1e-8;

/// How a per-token loss `[B, T]` becomes a scalar (OpenRLHF's `aggregate_loss`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossAggregation {
    /// Σ loss·mask / Σ mask over this micro-batch; the default.
    #[default]
    TokenMean,
    /// Σ loss·mask / `batch_num_tokens` · `dp_size`: a token mean over the *global* batch that
    /// stays right when the gradients are then averaged over `dp_size` ranks.
    GlobalTokenMean {
        /// Action tokens in the global batch (all ranks, all micro-batches of the step).
        batch_num_tokens: f64,
        /// Data-parallel ranks whose gradients are averaged.
        dp_size: usize,
    },
    /// The mean over sequences of each sequence's token mean (fully masked rows excluded).
    SequenceMean,
    /// Σ over sequences of each token mean / `global_batch_size` · `dp_size`.
    GlobalSequenceMean {
        /// Sequences in the global batch.
        global_batch_size: f64,
        /// Data-parallel ranks whose gradients are averaged.
        dp_size: usize,
    },
    /// Σ over sequences of each token *sum* / `global_batch_size` · `dp_size` (verl's
    /// `seq-mean-token-sum`: a long response weighs as much as its tokens).
    GlobalSequenceSum {
        /// Sequences in the global batch.
        global_batch_size: f64,
        /// Data-parallel ranks whose gradients are averaged.
        dp_size: usize,
    },
    /// Σ over every token / (`global_batch_size` · `norm_len`) · `dp_size`: Dr. GRPO's
    /// constant normaliser (verl's `seq-mean-token-sum-norm`), which no response length
    /// biases.
    GlobalConstant {
        /// Sequences in the global batch.
        global_batch_size: f64,
        /// The constant length each sequence's sum is divided by (the generation budget).
        norm_len: f64,
        /// Data-parallel ranks whose gradients are averaged.
        dp_size: usize,
    },
}

/// Reduces a per-token loss `[B, T]` under `action_mask` as `aggregation` says.
pub fn aggregate_loss(
    loss: &Tensor,
    action_mask: &Tensor,
    aggregation: LossAggregation,
) -> Result<Tensor> {
    let mask = float_mask(action_mask, loss)?;
    match aggregation {
        LossAggregation::TokenMean => masked_mean(loss, &mask, None),
        LossAggregation::GlobalTokenMean { batch_num_tokens, dp_size } => {
            positive("batch_num_tokens", batch_num_tokens)?;
            Ok(loss
                .f_mul(&mask)?
                .f_sum(Kind::Float)?
                .f_div_scalar(batch_num_tokens)?
                .f_mul_scalar(dp_size as f64)?)
        }
        LossAggregation::GlobalSequenceSum { global_batch_size, dp_size } => {
            positive("global_batch_size", global_batch_size)?;
            Ok(loss
                .f_mul(&mask)?
                .f_sum(Kind::Float)?
                .f_div_scalar(global_batch_size)?
                .f_mul_scalar(dp_size as f64)?)
        }
        LossAggregation::GlobalConstant { global_batch_size, norm_len, dp_size } => {
            positive("global_batch_size", global_batch_size)?;
            positive("norm_len", norm_len)?;
            Ok(loss
                .f_mul(&mask)?
                .f_sum(Kind::Float)?
                .f_div_scalar(global_batch_size * norm_len)?
                .f_mul_scalar(dp_size as f64)?)
        }
        LossAggregation::SequenceMean | LossAggregation::GlobalSequenceMean { .. } => {
            let tokens = mask.f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)?;
            let per_sequence = loss
                .f_mul(&mask)?
                .f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)?
                .f_div(&tokens.f_add_scalar(SEQUENCE_MEAN_EPS)?)?;
            let present = tokens.f_gt(0.0)?.f_to_kind(Kind::Float)?;
            match aggregation {
                LossAggregation::GlobalSequenceMean { global_batch_size, dp_size } => {
                    positive("global_batch_size", global_batch_size)?;
                    Ok(per_sequence
                        .f_mul(&present)?
                        .f_sum(Kind::Float)?
                        .f_div_scalar(global_batch_size)?
                        .f_mul_scalar(dp_size as f64)?)
                }
                _ => masked_mean(&per_sequence, &present, None),
            }
        }
    }
}

fn positive(name: &str, value: f64) -> Result<()> {
    if value > 0.0 && value.is_finite() {
        Ok(())
    } else {
        Err(AlgoError::Config(format!("{name} must be a positive number, found {value}")))
    }
}

/// Where the importance ratio of the clipped policy loss is taken.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum RatioLevel {
    /// Per token, `π(y_t)/π_old(y_t)`: PPO, as OpenRLHF and verl's `vanilla`.
    #[default]
    Ppo,
    /// Per sequence, GSPO's (Zheng et al. 2025) `s_i = exp(mean_t(log π − log π_old))` over the
    /// sequence's action tokens, clipped and weighted by the advantage as one number per
    /// sequence; every token of the sequence carries `s_i` and the gradient of its own
    /// log-prob (the token form whose gradient is GSPO's). The paper clips at `ε` of
    /// 3e-4 / 4e-4 and averages over sequences (`seq-mean-token-mean`).
    Gspo,
}

/// Settings of the clipped policy loss, defaulted as OpenRLHF's `--actor.eps_clip*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyLossConfig {
    /// The ratio is clipped below at `1 − clip_eps_low`.
    pub clip_eps_low: f64,
    /// The ratio is clipped above at `1 + clip_eps_high` (DAPO's clip-higher raises it).
    pub clip_eps_high: f64,
    /// Dual-clip constant `c > 1` (Ye et al. 2019): for negative advantages the objective is
    /// bounded below by `c·A`. `None` is plain PPO.
    pub dual_clip: Option<f64>,
    /// Per-token (PPO) or per-sequence (GSPO) ratio.
    pub ratio: RatioLevel,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        PolicyLossConfig {
            clip_eps_low: 0.2,
            clip_eps_high: 0.2,
            dual_clip: None,
            ratio: RatioLevel::Ppo,
        }
    }
}

/// The policy loss and its diagnostics.
#[derive(Debug)]
pub struct PolicyLoss {
    /// The scalar loss (with autograd to the policy's log-probs).
    pub loss: Tensor,
    /// Fraction of action tokens where the clipped objective was the smaller one (detached).
    pub clip_fraction: Tensor,
    /// `mean(log π_old − log π)` over action tokens, OpenRLHF's `ppo_kl` (detached).
    pub approx_kl: Tensor,
}

/// PPO's clipped surrogate loss: with `ratio = exp(clamp(log π − log π_old, ±20))`,
/// `L = −min(ratio·A, clip(ratio, 1 − ε_low, 1 + ε_high)·A)` per token, aggregated over the
/// action tokens. All of `log_probs`, `old_log_probs`, `advantages`, `action_mask` are `[B, T]`.
/// With [`RatioLevel::Gspo`] every token's ratio is its sequence's `s_i` in value, with the
/// gradient `s_i · ∇ log π(y_t)` (`log s_i` is `log π − sg(log π) + sg(mean_t log-ratio)`).
pub fn policy_loss(
    log_probs: &Tensor,
    old_log_probs: &Tensor,
    advantages: &Tensor,
    action_mask: &Tensor,
    config: &PolicyLossConfig,
    aggregation: LossAggregation,
) -> Result<PolicyLoss> {
    policy_loss_weighted(
        log_probs,
        old_log_probs,
        advantages,
        action_mask,
        None,
        config,
        aggregation,
    )
}

/// A token's truncated importance weight (Yao et al. 2025, verl's `tis_imp_ratio_cap`):
/// `min(π_old / π_behaviour, cap) = min(exp(log π_old − log π_behaviour), cap)`, where π_old is
/// the policy the trainer holds before the update (its recomputed old log-probs) and
/// π_behaviour the weights that sampled the token (the engine's log-probs, possibly older
/// weights in an asynchronous or partial rollout). An undefined gap (NaN) weighs 0.
pub fn truncated_is_weight(old_log_prob: f32, behaviour_log_prob: f32, cap: f32) -> f32 {
    let gap = old_log_prob - behaviour_log_prob;
    if gap.is_nan() { 0.0 } else { gap.exp().min(cap) }
}

/// [`policy_loss`] with each token's objective multiplied by a detached importance weight
/// (`is_weights`, `[B, T]`, e.g. [`truncated_is_weight`]s): the clipped PPO surrogate corrects
/// for the trainer's policy against the old one, the weight for the old one against the
/// weights that sampled the token. The diagnostics are unweighted.
pub fn policy_loss_weighted(
    log_probs: &Tensor,
    old_log_probs: &Tensor,
    advantages: &Tensor,
    action_mask: &Tensor,
    is_weights: Option<&Tensor>,
    config: &PolicyLossConfig,
    aggregation: LossAggregation,
) -> Result<PolicyLoss> {
    let shape = log_probs.size();
    expect_same_shape("old_log_probs", old_log_probs, &shape)?;
    expect_same_shape("advantages", advantages, &shape)?;
    if !(config.clip_eps_low >= 0.0 && config.clip_eps_high >= 0.0) {
        return Err(AlgoError::Config(format!(
            "policy clip epsilons must be non-negative, found low {} and high {}",
            config.clip_eps_low, config.clip_eps_high
        )));
    }
    let advantages = advantages.f_to_kind(Kind::Float)?;
    let log_probs = log_probs.f_to_kind(Kind::Float)?;
    let log_ratio = log_probs.f_sub(&old_log_probs.f_to_kind(Kind::Float)?)?;
    let ratio_log = match config.ratio {
        RatioLevel::Ppo => log_ratio.shallow_clone(),
        RatioLevel::Gspo => {
            let mask = float_mask(action_mask, &log_ratio)?;
            let tokens =
                mask.f_sum_dim_intlist([-1i64].as_slice(), true, Kind::Float)?.f_clamp_min(1.0)?;
            let sequence = log_ratio
                .f_mul(&mask)?
                .f_sum_dim_intlist([-1i64].as_slice(), true, Kind::Float)?
                .f_div(&tokens)?
                .f_detach()?;
            log_probs.f_sub(&log_probs.f_detach()?)?.f_add(&sequence)?
        }
    };
    let ratio = ratio_log.f_clamp(-POLICY_LOG_RATIO_CLAMP, POLICY_LOG_RATIO_CLAMP)?.f_exp()?;
    let surrogate = ratio.f_mul(&advantages)?;
    let clipped =
        ratio.f_clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)?.f_mul(&advantages)?;
    let objective = surrogate.f_minimum(&clipped)?;
    let objective = match config.dual_clip {
        None => objective,
        Some(c) if c > 1.0 => {
            let bounded = objective.f_maximum(&advantages.f_mul_scalar(c)?)?;
            bounded.f_where_self(&advantages.f_lt(0.0)?, &objective)?
        }
        Some(c) => {
            return Err(AlgoError::Config(format!("dual_clip must be > 1, found {c}")));
        }
    };
    let weighted = match is_weights {
        None => objective.shallow_clone(),
        Some(weights) => {
            expect_same_shape("is_weights", weights, &shape)?;
            objective.f_mul(&weights.f_to_kind(Kind::Float)?.f_detach()?)?
        }
    };
    let loss = aggregate_loss(&weighted.f_neg()?, action_mask, aggregation)?;
    let clip_fraction =
        masked_mean(&clipped.f_lt_tensor(&surrogate)?.f_to_kind(Kind::Float)?, action_mask, None)?
            .f_detach()?;
    let approx_kl = masked_mean(&log_ratio.f_neg()?.f_detach()?, action_mask, None)?;
    Ok(PolicyLoss { loss, clip_fraction, approx_kl })
}

/// The critic's loss: `0.5 · aggregate(max((V_clip − G)², (V − G)²))` with
/// `V_clip = V_old + clip(V − V_old, ±clip_eps)`, or `0.5 · aggregate((V − G)²)` without a clip
/// (OpenRLHF's default `--critic.value_clip` is 0.5). All inputs are `[B, T]`.
pub fn value_loss(
    values: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    action_mask: &Tensor,
    clip_eps: Option<f64>,
    aggregation: LossAggregation,
) -> Result<Tensor> {
    let shape = values.size();
    expect_same_shape("old_values", old_values, &shape)?;
    expect_same_shape("returns", returns, &shape)?;
    let values = values.f_to_kind(Kind::Float)?;
    let returns = returns.f_to_kind(Kind::Float)?;
    let unclipped = values.f_sub(&returns)?.f_square()?;
    let per_token = match clip_eps {
        None => unclipped,
        Some(eps) if eps >= 0.0 => {
            let old_values = old_values.f_to_kind(Kind::Float)?;
            let clipped_values =
                old_values.f_add(&values.f_sub(&old_values)?.f_clamp(-eps, eps)?)?;
            clipped_values.f_sub(&returns)?.f_square()?.f_maximum(&unclipped)?
        }
        Some(eps) => {
            return Err(AlgoError::Config(format!("value clip must be non-negative, found {eps}")));
        }
    };
    Ok(aggregate_loss(&per_token, action_mask, aggregation)?.f_mul_scalar(0.5)?)
}

/// The entropy of the softmax of `logits` (`[.., V]`) at every position (`[..]`), in nats:
/// `logsumexp(z) − Σ softmax(z)·z`. Keeps autograd.
pub fn entropy_from_logits(logits: &Tensor) -> Result<Tensor> {
    let logits = logits.f_to_kind(Kind::Float)?;
    let probs = logits.f_softmax(-1, Kind::Float)?;
    let expected_logit =
        probs.f_mul(&logits)?.f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)?;
    Ok(logits.f_logsumexp([-1i64].as_slice(), false)?.f_sub(&expected_logit)?)
}

/// The aggregated entropy over action tokens of `logits` `[B, T, V]` (the entropy bonus: the
/// actor loss subtracts `entropy_coef ·` this).
pub fn masked_entropy(
    logits: &Tensor,
    action_mask: &Tensor,
    aggregation: LossAggregation,
) -> Result<Tensor> {
    aggregate_loss(&entropy_from_logits(logits)?, action_mask, aggregation)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::masked::tests::{assert_close, t2, values};

    #[test]
    fn policy_loss_matches_hand_computation() {
        // ε_low = 0.2, ε_high = 0.28, so the ratio is clipped to [0.8, 1.28].
        // tok  log-ratio  ratio      A    surr1 = ratio·A  surr2 = clip·A  −min      clipped?
        // 1    0          1          1    1                1               −1        no
        // 2    0.5        1.6487213  2    3.2974425        1.28·2 = 2.56   −2.56     yes
        // 3    −0.5       0.6065307  −1   −0.6065307       −0.8            0.8       yes
        // 4    0.2        1.2214028  −2   −2.4428055       −2.4428055      2.4428055 no
        // 5    −2         0.1353353  1    0.1353353        0.8             −0.1353353 no
        // 6    (masked)
        // Loss = (−1 − 2.56 + 0.8 + 2.4428055 − 0.1353353)/5 = −0.4525298/5 = −0.0905060.
        // Clip fraction = 2/5 = 0.4. approx_kl = −(0 + 0.5 − 0.5 + 0.2 − 2)/5 = 0.36.
        let lp = t2(&[&[-1.0, -0.5, -2.0], &[-1.0, -3.0, 0.0]]);
        let old = t2(&[&[-1.0, -1.0, -1.5], &[-1.2, -1.0, 0.0]]);
        let adv = t2(&[&[1.0, 2.0, -1.0], &[-2.0, 1.0, 5.0]]);
        let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let config = PolicyLossConfig {
            clip_eps_low: 0.2,
            clip_eps_high: 0.28,
            ..PolicyLossConfig::default()
        };
        let out = policy_loss(&lp, &old, &adv, &mask, &config, LossAggregation::TokenMean).unwrap();
        assert_close(&out.loss, &[-0.090_505_96]);
        assert_close(&out.clip_fraction, &[0.4]);
        assert_close(&out.approx_kl, &[0.36]);
    }

    #[test]
    fn truncated_importance_weights_scale_each_tokens_objective_by_hand() {
        // The weights of the hand computation above's tokens:
        // tok  old    behaviour  exp(old − behaviour)  cap 2   −min·w
        // 1    −1.0   −1.0       1                     1       −1
        // 2    −1.0   −2.0       e = 2.7182818         2       −5.12
        // 3    −1.5   −1.0       e^−0.5 = 0.6065307    0.6065  0.4852245
        // 4    −1.2   −1.2       1                     1       2.4428055
        // 5    −1.0   −0.3       e^−0.7 = 0.4965853    0.4966  −0.0672051
        // Loss = (−1 − 5.12 + 0.4852245 + 2.4428055 − 0.0672051)/5 = −3.2591751/5 = −0.6518350.
        let w = |old: f32, behaviour: f32| truncated_is_weight(old, behaviour, 2.0);
        assert_eq!(w(-1.0, -2.0), 2.0);
        assert!((w(-1.5, -1.0) - 0.606_530_7).abs() < 1e-6);
        assert_eq!(truncated_is_weight(0.0, f32::NEG_INFINITY, 2.0), 2.0);
        assert_eq!(truncated_is_weight(f32::NAN, 0.0, 2.0), 0.0);
        let weights = Tensor::from_slice(&[
            w(-1.0, -1.0),
            w(-1.0, -2.0),
            w(-1.5, -1.0),
            w(-1.2, -1.2),
            w(-1.0, -0.3),
            0.0,
        ])
        .reshape([2, 3]);
        let lp = t2(&[&[-1.0, -0.5, -2.0], &[-1.0, -3.0, 0.0]]).set_requires_grad(true);
        let old = t2(&[&[-1.0, -1.0, -1.5], &[-1.2, -1.0, 0.0]]);
        let adv = t2(&[&[1.0, 2.0, -1.0], &[-2.0, 1.0, 5.0]]);
        let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let config = PolicyLossConfig {
            clip_eps_low: 0.2,
            clip_eps_high: 0.28,
            ..PolicyLossConfig::default()
        };
        let aggregation = LossAggregation::TokenMean;
        let out =
            policy_loss_weighted(&lp, &old, &adv, &mask, Some(&weights), &config, aggregation)
                .unwrap();
        assert_close(&out.loss, &[-0.651_835_0]);
        // The diagnostics stay those of the unweighted loss.
        assert_close(&out.clip_fraction, &[0.4]);
        // The weight scales the gradient of the unclipped tokens: token 1's is −A·ratio·w/5.
        out.loss.backward();
        let grad = values(&lp.grad());
        assert!((grad[0] + 0.2).abs() < 1e-6, "{grad:?}");
        assert!((grad[4] - (-0.135_335_3 * 0.496_585_3 / 5.0)).abs() < 1e-6, "{grad:?}");
        // Unit weights give the unweighted loss.
        let ones = Tensor::ones([2, 3], (Kind::Float, tch::Device::Cpu));
        let unit = policy_loss_weighted(&lp, &old, &adv, &mask, Some(&ones), &config, aggregation)
            .unwrap();
        assert_close(&unit.loss, &[-0.090_505_96]);
        let bad = Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu));
        assert!(
            policy_loss_weighted(&lp, &old, &adv, &mask, Some(&bad), &config, aggregation).is_err()
        );
    }

    #[test]
    fn policy_loss_clamps_the_log_ratio_and_applies_dual_clip() {
        // Log-ratio 30 is clamped to 20: ratio = e^20 = 485165195.4.
        // A = 1: −min(e^20, 1.2) = −1.2. A = −1: −min(−e^20, −1.2) = e^20.
        let lp = t2(&[&[30.0, 30.0]]);
        let old = t2(&[&[0.0, 0.0]]);
        let adv = t2(&[&[1.0, -1.0]]);
        let mask = t2(&[&[1.0, 0.0]]);
        let config = PolicyLossConfig::default();
        let out = policy_loss(&lp, &old, &adv, &mask, &config, LossAggregation::TokenMean).unwrap();
        assert_close(&out.loss, &[-1.2]);
        let mask = t2(&[&[0.0, 1.0]]);
        let out = policy_loss(&lp, &old, &adv, &mask, &config, LossAggregation::TokenMean).unwrap();
        assert_close(&out.loss, &[485_165_195.409_790_3]);
        // Dual clip c = 3 on A = −1, ratio e^2 = 7.3890561: min = −7.3890561, max(−7.389, −3)
        // = −3 → loss 3. On A = +1 dual clip does nothing: −min(7.389, 1.2) = −1.2.
        let lp = t2(&[&[2.0, 2.0]]);
        let config = PolicyLossConfig { dual_clip: Some(3.0), ..PolicyLossConfig::default() };
        let all = t2(&[&[1.0, 1.0]]);
        let out = policy_loss(&lp, &old, &adv, &all, &config, LossAggregation::TokenMean).unwrap();
        // (−1.2 + 3)/2 = 0.9.
        assert_close(&out.loss, &[0.9]);
        let bad = PolicyLossConfig { dual_clip: Some(0.5), ..PolicyLossConfig::default() };
        assert!(policy_loss(&lp, &old, &adv, &all, &bad, LossAggregation::TokenMean).is_err());
    }

    #[test]
    fn policy_loss_gradient_flows_only_through_unclipped_tokens() {
        // Token 0: ratio 1, A = 1, unclipped: d(−ratio·A)/d logπ = −ratio·A = −1, over 2 tokens
        // → −0.5. Token 1: ratio e^0.5 > 1.2 with A = 1 is clipped: gradient 0.
        let lp = t2(&[&[0.0, 0.5]]).set_requires_grad(true);
        let old = t2(&[&[0.0, 0.0]]);
        let adv = t2(&[&[1.0, 1.0]]);
        let mask = t2(&[&[1.0, 1.0]]);
        let out = policy_loss(
            &lp,
            &old,
            &adv,
            &mask,
            &PolicyLossConfig::default(),
            LossAggregation::TokenMean,
        )
        .unwrap();
        out.loss.backward();
        assert_close(&lp.grad(), &[-0.5, 0.0]);
    }

    #[test]
    fn gspo_takes_one_ratio_per_sequence_and_its_gradient_by_hand() {
        // ε = 0.2 both sides. Sequence 0 (2 tokens): log-ratios 0.1 and −0.3, mean −0.1,
        // s = e^−0.1 = 0.9048374, A = 1: unclipped (0.8 ≤ s ≤ 1.2): per token −s·A = −0.9048374.
        // Sequence 1 (3 tokens; the fourth masked): log-ratios 0.5, 0.4, 0.3, mean 0.4,
        // s = e^0.4 = 1.4918247 > 1.2, A = 2: min(2.9836494, 2.4) = 2.4, clipped: −2.4 per token.
        // seq-mean-token-mean: (−0.9048374 − 2.4)/2 = −1.6524187.
        // token-mean: (2·−0.9048374 + 3·−2.4)/5 = −1.8019350.
        // Gradient (seq mean): d/d logπ_{0,t} = −s·A/(2 tokens)/(2 sequences) = −0.2262094 for
        // sequence 0's tokens; 0 for the clipped sequence 1 and the masked token.
        // A token-level ratio would differ: PPO clips token 0.5 and 0.4 of sequence 1 only.
        let lp = t2(&[&[0.1, -0.3, 0.0, 0.0], &[0.5, 0.4, 0.3, 9.0]]).set_requires_grad(true);
        let old = Tensor::zeros([2, 4], (Kind::Float, tch::Device::Cpu));
        let adv = t2(&[&[1.0, 1.0, 1.0, 1.0], &[2.0, 2.0, 2.0, 2.0]]);
        let mask = t2(&[&[1.0, 1.0, 0.0, 0.0], &[1.0, 1.0, 1.0, 0.0]]);
        let config = PolicyLossConfig { ratio: RatioLevel::Gspo, ..PolicyLossConfig::default() };
        let out =
            policy_loss(&lp, &old, &adv, &mask, &config, LossAggregation::SequenceMean).unwrap();
        assert_close(&out.loss, &[-1.652_418_7]);
        // Tokens of the clipped sequence count as clipped: 3 of 5.
        assert_close(&out.clip_fraction, &[0.6]);
        out.loss.backward();
        let g = -0.904_837_4 / 4.0;
        assert_close(&lp.grad(), &[g, g, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        let out = policy_loss(&lp, &old, &adv, &mask, &config, LossAggregation::TokenMean).unwrap();
        assert_close(&out.loss, &[-1.801_935_0]);
    }

    #[test]
    fn value_loss_matches_hand_computation() {
        // clip 0.2. Token 1: V_clip = 0.5 + clip(0.5) = 0.7; (0.7 − 2)² = 1.69, (1 − 2)² = 1
        // → 1.69. Token 2: V_clip = 2.2 + clip(−0.2) = 2.0; (2 − 1)² = 1 and (2 − 1)² = 1 → 1.
        // Token 3 masked. 0.5·(1.69 + 1)/2 = 0.6725. Without clip: 0.5·(1 + 1)/2 = 0.5.
        let v = t2(&[&[1.0, 2.0, 0.0]]);
        let old = t2(&[&[0.5, 2.2, 0.0]]);
        let ret = t2(&[&[2.0, 1.0, 1.0]]);
        let mask = t2(&[&[1.0, 1.0, 0.0]]);
        assert_close(
            &value_loss(&v, &old, &ret, &mask, Some(0.2), LossAggregation::TokenMean).unwrap(),
            &[0.6725],
        );
        assert_close(
            &value_loss(&v, &old, &ret, &mask, None, LossAggregation::TokenMean).unwrap(),
            &[0.5],
        );
        assert!(value_loss(&v, &old, &ret, &mask, Some(-1.0), LossAggregation::TokenMean).is_err());
    }

    #[test]
    fn aggregations_match_hand_computation() {
        // Loss [[1, 2, 3], [4, 5, 6], [7, 8, 9]], mask [[1, 1, 0], [1, 0, 0], [0, 0, 0]].
        // Token mean: (1 + 2 + 4)/3 = 7/3. Global token mean over 14 tokens, dp 2: 7/14·2 = 1.
        // Sequence means: 1.5, 4, (empty row excluded) → (1.5 + 4)/2 = 2.75; global over 11
        // sequences, dp 2: 5.5/11·2 = 1.
        let loss = t2(&[&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0], &[7.0, 8.0, 9.0]]);
        let mask = t2(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
        let agg = |a| values(&aggregate_loss(&loss, &mask, a).unwrap())[0];
        assert!((agg(LossAggregation::TokenMean) - 7.0 / 3.0).abs() < 1e-6);
        let global = LossAggregation::GlobalTokenMean { batch_num_tokens: 14.0, dp_size: 2 };
        assert!((agg(global) - 1.0).abs() < 1e-6);
        assert!((agg(LossAggregation::SequenceMean) - 2.75).abs() < 1e-6);
        let global = LossAggregation::GlobalSequenceMean { global_batch_size: 11.0, dp_size: 2 };
        assert!((agg(global) - 1.0).abs() < 1e-6);
        // Sequence sums: 3, 4, 0 → 7/14 sequences · dp 2 = 1; Dr. GRPO's constant over 14
        // sequences of length 4, dp 2: 7/56·2 = 0.25.
        let sums = LossAggregation::GlobalSequenceSum { global_batch_size: 14.0, dp_size: 2 };
        assert!((agg(sums) - 1.0).abs() < 1e-6);
        let constant =
            LossAggregation::GlobalConstant { global_batch_size: 14.0, norm_len: 4.0, dp_size: 2 };
        assert!((agg(constant) - 0.25).abs() < 1e-6);
        let bad = LossAggregation::GlobalTokenMean { batch_num_tokens: 0.0, dp_size: 1 };
        assert!(aggregate_loss(&loss, &mask, bad).is_err());
        let bad =
            LossAggregation::GlobalConstant { global_batch_size: 1.0, norm_len: 0.0, dp_size: 1 };
        assert!(aggregate_loss(&loss, &mask, bad).is_err());
    }

    #[test]
    fn entropy_matches_hand_computation() {
        // Uniform over 2: ln 2 = 0.6931472. Logits [0, ln 3]: p = [0.25, 0.75],
        // H = ln 4 − 0.75·ln 3 = 1.3862944 − 0.8239592 = 0.5623351.
        let logits = Tensor::from_slice(&[0.0f32, 0.0, 0.0, 3f32.ln()]).view([1, 2, 2]);
        assert_close(
            &entropy_from_logits(&logits).unwrap(),
            &[std::f64::consts::LN_2, 0.562_335_1],
        );
        // Masked mean over the second token only.
        let mask = t2(&[&[0.0, 1.0]]);
        assert_close(
            &masked_entropy(&logits, &mask, LossAggregation::TokenMean).unwrap(),
            &[0.562_335_1],
        );
    }
}
