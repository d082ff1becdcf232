//! Masked reductions and token losses: every RLHF loss is a mean over the tokens an action or
//! loss mask selects, never over padding.

use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::logprobs::token_log_probs;

/// Sum of `values * mask` divided by the mask's sum (at least 1), over all elements.
pub fn masked_mean(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    check_same_shape(values, mask)?;
    let mask = mask.f_to_device(values.device())?.f_to_kind(Kind::Float)?;
    let total = values.f_to_kind(Kind::Float)?.f_mul(&mask)?.f_sum(Kind::Float)?;
    Ok(total.f_div(&mask.f_sum(Kind::Float)?.f_clamp_min(1.0)?)?)
}

/// Per-row masked mean over the last dimension, `[batch, T] -> [batch]` (OpenRLHF's
/// `masked_mean(x, mask, dim=-1)`).
pub fn masked_mean_per_row(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    check_same_shape(values, mask)?;
    let mask = mask.f_to_device(values.device())?.f_to_kind(Kind::Float)?;
    let sums =
        values.f_to_kind(Kind::Float)?.f_mul(&mask)?.f_sum_dim_intlist(-1, false, Kind::Float)?;
    Ok(sums.f_div(&mask.f_sum_dim_intlist(-1, false, Kind::Float)?.f_clamp_min(1.0)?)?)
}

/// Mean negative log-likelihood of `targets` under `logits` over the positions `mask` selects:
/// the supervised fine-tuning loss and the memorisation loss of the tests.
pub fn masked_cross_entropy(logits: &Tensor, targets: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let nll = token_log_probs(logits, targets)?.f_neg()?;
    masked_mean(&nll, mask)
}

fn check_same_shape(values: &Tensor, mask: &Tensor) -> Result<()> {
    if values.size() != mask.size() {
        return Err(ModelError::Shape {
            name: "mask".into(),
            expected: values.size(),
            found: mask.size(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_mean_ignores_masked_entries() {
        let v = Tensor::from_slice(&[1.0f32, 2.0, 100.0, 4.0]).view([2, 2]);
        let m = Tensor::from_slice(&[1i64, 1, 0, 1]).view([2, 2]);
        assert!((masked_mean(&v, &m).unwrap().double_value(&[]) - 7.0 / 3.0).abs() < 1e-6);
        let rows = masked_mean_per_row(&v, &m).unwrap();
        assert_eq!(Vec::<f32>::try_from(rows).unwrap(), vec![1.5, 4.0]);
        assert!(masked_mean(&v, &Tensor::ones([4], (Kind::Int64, tch::Device::Cpu))).is_err());
    }
}
