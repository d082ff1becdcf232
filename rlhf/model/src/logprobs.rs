//! Per-token functions of logits and the batch layout of RLHF experience.
//!
//! An experience batch ([`ResponseBatch`]) is laid out the way OpenRLHF lays it out: each row is
//! a prompt followed by its response, padded on either side, and the last `R` columns hold the
//! response tokens, where `R` is the width of the action mask. The log-prob (or value) of the
//! response token at column `t` is read from the model output at column `t - 1`.

use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};

/// A batch of prompt + response sequences.
#[derive(Debug)]
pub struct ResponseBatch {
    /// `[batch, seq]` token ids.
    pub input_ids: Tensor,
    /// `[batch, seq]`, 1 for real tokens and 0 for padding.
    pub attention_mask: Tensor,
    /// `[batch, R]`, 1 for response tokens that count (the last `R` columns of the sequence).
    pub action_mask: Tensor,
}

impl ResponseBatch {
    /// Number of response columns `R`.
    pub fn num_actions(&self) -> Result<i64> {
        let seq = self.input_ids.size().get(1).copied().unwrap_or(0);
        let size = self.action_mask.size();
        let batch = self.input_ids.size().first().copied().unwrap_or(0);
        match size.as_slice() {
            [b, r] if *b == batch && *r >= 1 && *r < seq => Ok(*r),
            _ => Err(ModelError::Input(format!(
                "action_mask should be [batch={batch}, R] with 1 <= R < seq={seq}, found {size:?}"
            ))),
        }
    }

    /// The columns of model output that predict the response tokens: `seq - 1 - R .. seq - 1`.
    pub fn output_columns(&self) -> Result<(i64, i64)> {
        let r = self.num_actions()?;
        let seq = self.input_ids.size()[1];
        Ok((seq - 1 - r, r))
    }

    /// The response token ids, `[batch, R]`.
    pub fn response_ids(&self) -> Result<Tensor> {
        let r = self.num_actions()?;
        let seq = self.input_ids.size()[1];
        Ok(self.input_ids.f_narrow(1, seq - r, r)?.f_to_kind(Kind::Int64)?)
    }
}

/// `log softmax(logits)[target]` for every position: `[.., vocab]` logits and `[..]` integer
/// targets give `[..]` float32 log-probs. Uses `gather - logsumexp` so no `[.., vocab]`
/// log-softmax is materialised.
pub fn token_log_probs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = logits.f_to_kind(Kind::Float)?;
    let targets = targets.f_to_kind(Kind::Int64)?.f_to_device(logits.device())?;
    let picked = logits.f_gather(-1, &targets.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?;
    Ok(picked.f_sub(&logits.f_logsumexp([-1], false)?)?)
}

/// Entropy of the softmax distribution at every position, `[.., vocab] -> [..]`, float32.
pub fn token_entropy(logits: &Tensor) -> Result<Tensor> {
    let logits = logits.f_to_kind(Kind::Float)?;
    let log_p = logits.f_log_softmax(-1, Kind::Float)?;
    let p = log_p.f_exp()?;
    Ok(p.f_mul(&log_p)?.f_sum_dim_intlist(-1, false, Kind::Float)?.f_neg()?)
}

/// Index of the last real token of each row of a `[batch, seq]` mask (0 for an empty row).
pub fn last_token_index(attention_mask: &Tensor) -> Result<Tensor> {
    let seq = attention_mask.size().get(1).copied().unwrap_or(0);
    let columns = Tensor::f_arange(seq, (Kind::Int64, attention_mask.device()))?;
    let real = attention_mask.f_ne(0)?.f_to_kind(Kind::Int64)?;
    Ok(real.f_mul(&columns)?.f_argmax(-1, false)?)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn log_probs_match_log_softmax(values in prop::collection::vec(-20.0f32..20.0, 12), t in 0i64..4) {
            let logits = Tensor::from_slice(&values).view([3, 4]);
            let targets = Tensor::from_slice(&[t, (t + 1) % 4, (t + 3) % 4]);
            let ours = token_log_probs(&logits, &targets).unwrap();
            let reference = logits.log_softmax(-1, Kind::Float).gather(-1, &targets.unsqueeze(-1), false).squeeze_dim(-1);
            prop_assert!(ours.allclose(&reference, 1e-5, 1e-5, false));
            // Probabilities of all targets sum to one.
            let all = (0..4).map(|k| token_log_probs(&logits, &Tensor::full([3], k, (Kind::Int64, tch::Device::Cpu))).unwrap().exp()).fold(Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)), |a, b| a + b);
            prop_assert!(all.allclose(&Tensor::ones([3], (Kind::Float, tch::Device::Cpu)), 1e-4, 1e-4, false));
        }

        #[test]
        fn entropy_is_between_zero_and_log_vocab(values in prop::collection::vec(-10.0f32..10.0, 8)) {
            let h = token_entropy(&Tensor::from_slice(&values).view([2, 4])).unwrap();
            prop_assert!(h.min().double_value(&[]) >= -1e-5);
            prop_assert!(h.max().double_value(&[]) <= 4f64.ln() + 1e-5);
        }
    }

    #[test]
    fn last_token_handles_left_and_right_padding() {
        let mask = Tensor::from_slice(&[0i64, 1, 1, 1, 1, 1, 0, 0]).view([2, 4]);
        let idx = last_token_index(&mask).unwrap();
        assert_eq!(Vec::<i64>::try_from(idx).unwrap(), vec![3, 1]);
    }

    #[test]
    fn bad_action_masks_are_rejected() {
        let batch = ResponseBatch {
            input_ids: Tensor::zeros([2, 4], (Kind::Int64, tch::Device::Cpu)),
            attention_mask: Tensor::ones([2, 4], (Kind::Int64, tch::Device::Cpu)),
            action_mask: Tensor::ones([2, 4], (Kind::Int64, tch::Device::Cpu)),
        };
        assert!(batch.num_actions().is_err());
    }
}
