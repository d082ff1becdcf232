//! Rotary position embeddings (RoPE) in the Hugging Face "rotate half" layout.
//!
//! The inverse frequencies are computed once (with the config's theta and scaling); cos and sin
//! are computed from explicit per-token positions at every call, so callers with left padding,
//! packed sequences or a paged KV cache pass whatever positions they need and no position table
//! can be overrun.

use tch::{Device, Kind, Tensor};

use crate::config::{ModelConfig, RopeScaling};
use crate::error::Result;

/// The inverse frequencies of one model's rotary embedding.
#[derive(Debug)]
pub struct RotaryEmbedding {
    /// `[head_dim / 2]` inverse frequencies, float32.
    inv_freq: Tensor,
}

impl RotaryEmbedding {
    /// Builds the inverse frequencies for `config` on `device`.
    pub fn new(config: &ModelConfig, device: Device) -> Result<Self> {
        let values =
            inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling.as_ref());
        let inv_freq = Tensor::f_from_slice(&values)?.f_to_device(device)?;
        Ok(Self { inv_freq })
    }

    /// The inverse frequencies, `[head_dim / 2]` float32.
    pub fn inv_freq(&self) -> &Tensor {
        &self.inv_freq
    }

    /// Returns `(cos, sin)` of shape `[batch, 1, seq, head_dim]` in `kind` for integer
    /// `positions` of shape `[batch, seq]`, ready to broadcast over heads.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
        let positions = positions.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?;
        let freqs = positions.f_mul(&self.inv_freq.f_view([1, 1, -1])?)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?;
        Ok((emb.f_cos()?.f_to_kind(kind)?, emb.f_sin()?.f_to_kind(kind)?))
    }
}

/// Applies the rotation to `x` of shape `[batch, heads, seq, head_dim]` given `cos`/`sin` from
/// [`RotaryEmbedding::cos_sin`].
pub fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.size().last().copied().unwrap_or(0) / 2;
    let first = x.f_narrow(-1, 0, half)?;
    let second = x.f_narrow(-1, half, half)?;
    let rotated = Tensor::f_cat(&[&second.f_neg()?, &first], -1)?;
    Ok(x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?)
}

/// The inverse frequencies `1 / theta^(2i / head_dim)`, with optional scaling applied.
pub fn inverse_frequencies(head_dim: i64, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f32> {
    let base: Vec<f64> =
        (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
    let scaled: Vec<f64> = match scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let original = *original_max_position_embeddings as f64;
            let low_freq_wavelen = original / low_freq_factor;
            let high_freq_wavelen = original / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen > low_freq_wavelen {
                        f / factor
                    } else if wavelen < high_freq_wavelen {
                        f
                    } else {
                        let smooth = (original / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    };
    scaled.into_iter().map(|f| f as f32).collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn rotate(x: &[f32], position: i64, head_dim: i64) -> Tensor {
        let inv = Tensor::from_slice(&inverse_frequencies(head_dim, 10_000.0, None));
        let rope = RotaryEmbedding { inv_freq: inv };
        let (cos, sin) =
            rope.cos_sin(&Tensor::from_slice(&[position]).view([1, 1]), Kind::Float).unwrap();
        apply_rotary(&Tensor::from_slice(x).view([1, 1, 1, head_dim]), &cos, &sin).unwrap()
    }

    proptest! {
        #[test]
        fn rotation_preserves_the_norm(x in prop::collection::vec(-3.0f32..3.0, 8), pos in 0i64..4096) {
            let y = rotate(&x, pos, 8);
            let before = Tensor::from_slice(&x).norm().double_value(&[]);
            let after = y.norm().double_value(&[]);
            prop_assert!((before - after).abs() < 1e-3 * (1.0 + before));
        }

        #[test]
        fn dot_products_depend_only_on_relative_position(
            q in prop::collection::vec(-2.0f32..2.0, 8),
            k in prop::collection::vec(-2.0f32..2.0, 8),
            m in 0i64..512, n in 0i64..512, shift in 0i64..512,
        ) {
            let a = rotate(&q, m, 8).view(-1).dot(&rotate(&k, n, 8).view(-1)).double_value(&[]);
            let b = rotate(&q, m + shift, 8).view(-1).dot(&rotate(&k, n + shift, 8).view(-1)).double_value(&[]);
            prop_assert!((a - b).abs() < 2e-2, "{a} vs {b}");
        }
    }

    #[test]
    fn linear_scaling_divides_frequencies() {
        let plain = inverse_frequencies(8, 10_000.0, None);
        let scaled = inverse_frequencies(8, 10_000.0, Some(&RopeScaling::Linear { factor: 4.0 }));
        for (p, s) in plain.iter().zip(&scaled) {
            assert!((p / 4.0 - s).abs() < 1e-9);
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_scales_low_frequencies() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = inverse_frequencies(128, 500_000.0, None);
        let scaled = inverse_frequencies(128, 500_000.0, Some(&scaling));
        assert_eq!(plain[0], scaled[0]);
        assert!((plain[63] / 8.0 - scaled[63]).abs() < 1e-12);
    }
}
