//! The preference losses of the reward-model and DPO trainers, on per-pair scores, as OpenRLHF
//! defines them: the Bradley–Terry pairwise loss `-log σ(r_c - r_r)` (`PairWiseLoss`), and DPO
//! `-(1-ε) log σ(β Δ) - ε log σ(-β Δ)` with `Δ = (π_c - ref_c) - (π_r - ref_r)` (cDPO label
//! smoothing ε) or IPO `(Δ - 1/(2β))²` (`DPOLoss`). Each returns one loss per pair; the caller
//! sums and scales.

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::Result;

/// Which preference loss a rank computes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum PreferenceLoss {
    /// Reward model: Bradley–Terry on the scores at the last token.
    BradleyTerry,
    /// DPO on summed response log-probs (`ipo`: IPO on mean log-probs per token).
    Dpo {
        /// β, the strength of the implicit KL to the reference.
        beta: f64,
        /// cDPO's ε: the probability that a label is flipped.
        label_smoothing: f64,
        /// IPO instead of DPO.
        ipo: bool,
    },
}

/// What a preference step or evaluation saw on one rank: sums over its pairs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PairStats {
    /// Summed loss.
    pub loss_sum: f64,
    /// Pairs.
    pub pairs: usize,
    /// Pairs whose chosen response scored higher.
    pub correct: usize,
    /// Summed chosen rewards (reward-model scores, or DPO's `β (π_c - ref_c)`).
    pub chosen_sum: f64,
    /// Summed rejected rewards.
    pub rejected_sum: f64,
    /// Tokens of the pairs (prompt and responses).
    pub tokens: usize,
    /// Gradient norm before clipping (steps only).
    pub grad_norm: f64,
    /// Learning rate (steps only).
    pub lr: f64,
}

impl PairStats {
    /// Adds `other`'s sums (the step fields are kept from the first).
    pub fn plus(mut self, other: &PairStats) -> PairStats {
        self.loss_sum += other.loss_sum;
        self.pairs += other.pairs;
        self.correct += other.correct;
        self.chosen_sum += other.chosen_sum;
        self.rejected_sum += other.rejected_sum;
        self.tokens += other.tokens;
        self
    }

    /// The means a run reports: loss, accuracy, chosen / rejected reward and their margin.
    pub fn means(&self) -> Vec<(&'static str, f64)> {
        let n = self.pairs.max(1) as f64;
        vec![
            ("loss", self.loss_sum / n),
            ("accuracy", self.correct as f64 / n),
            ("reward/chosen", self.chosen_sum / n),
            ("reward/rejected", self.rejected_sum / n),
            ("reward/margin", (self.chosen_sum - self.rejected_sum) / n),
        ]
    }
}

/// Per-pair losses and the rewards reported for them: `chosen` and `rejected` are `[pairs]`
/// scores (reward model) or log-probs minus the reference's (DPO; means per token for IPO).
pub fn preference_losses(
    chosen: &Tensor,
    rejected: &Tensor,
    loss: PreferenceLoss,
) -> Result<(Tensor, Tensor, Tensor)> {
    Ok(match loss {
        PreferenceLoss::BradleyTerry => {
            let losses = chosen.f_sub(rejected)?.f_log_sigmoid()?.f_neg()?;
            (losses, chosen.f_detach()?, rejected.f_detach()?)
        }
        PreferenceLoss::Dpo { beta, label_smoothing, ipo } => {
            let logits = chosen.f_sub(rejected)?;
            let losses = if ipo {
                logits.f_sub_scalar(1.0 / (2.0 * beta))?.f_square()?
            } else {
                let scaled = logits.f_mul_scalar(beta)?;
                let agree = scaled.f_log_sigmoid()?.f_mul_scalar(1.0 - label_smoothing)?;
                let flip = scaled.f_neg()?.f_log_sigmoid()?.f_mul_scalar(label_smoothing)?;
                agree.f_add(&flip)?.f_neg()?
            };
            (
                losses,
                chosen.f_detach()?.f_mul_scalar(beta)?,
                rejected.f_detach()?.f_mul_scalar(beta)?,
            )
        }
    })
}

/// The sums of a micro-batch's pairs.
pub fn pair_sums(losses: &Tensor, chosen: &Tensor, rejected: &Tensor) -> Result<PairStats> {
    let correct = chosen.f_gt_tensor(rejected)?.f_sum(tch::Kind::Int64)?.f_int64_value(&[])?;
    Ok(PairStats {
        loss_sum: losses.f_sum(tch::Kind::Double)?.f_double_value(&[])?,
        pairs: losses.size()[0] as usize,
        correct: correct as usize,
        chosen_sum: chosen.f_sum(tch::Kind::Double)?.f_double_value(&[])?,
        rejected_sum: rejected.f_sum(tch::Kind::Double)?.f_double_value(&[])?,
        ..PairStats::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v)
    }

    fn values(x: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(&x.to_kind(tch::Kind::Double)).unwrap()
    }

    #[test]
    fn losses_match_hand_computed_values() {
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        // Bradley-Terry: -log σ(2 - 1), -log σ(0 - 1).
        let (l, _, _) =
            preference_losses(&t(&[2.0, 0.0]), &t(&[1.0, 1.0]), PreferenceLoss::BradleyTerry)
                .unwrap();
        let expected = [-sigmoid(1.0).ln(), -sigmoid(-1.0).ln()];
        for (a, b) in values(&l).iter().zip(expected) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        // DPO, β = 0.5, ε = 0.1, Δ = 3 - 1 = 2: -(0.9 log σ(1) + 0.1 log σ(-1)).
        let dpo = PreferenceLoss::Dpo { beta: 0.5, label_smoothing: 0.1, ipo: false };
        let (l, c, r) = preference_losses(&t(&[3.0]), &t(&[1.0]), dpo).unwrap();
        let expected = -(0.9 * sigmoid(1.0).ln() + 0.1 * sigmoid(-1.0).ln());
        assert!((values(&l)[0] - expected).abs() < 1e-6);
        assert_eq!((values(&c)[0], values(&r)[0]), (1.5, 0.5));
        // IPO, β = 0.25: (2 - 2)² = 0.
        let ipo = PreferenceLoss::Dpo { beta: 0.25, label_smoothing: 0.0, ipo: true };
        let (l, _, _) = preference_losses(&t(&[3.0]), &t(&[1.0]), ipo).unwrap();
        assert!(values(&l)[0].abs() < 1e-9);
        let sums = pair_sums(&t(&[1.0, 2.0]), &t(&[1.0, 0.0]), &t(&[0.0, 1.0])).unwrap();
        assert_eq!((sums.pairs, sums.correct, sums.loss_sum), (2, 1, 3.0));
        let means = sums.means();
        assert_eq!(means[1], ("accuracy", 0.5));
    }
}
