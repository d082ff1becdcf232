//! Masked reductions over response tokens: sums, means and whitening that count only the
//! positions where the action mask is set (OpenRLHF's `masked_mean`, `masked_normalize` and the
//! global advantage whitening of its experience maker).
//!
//! Masks may be bool, integer or float tensors; they are converted to `f32` and multiplied in,
//! so a mask entry of 0 removes a position and 1 keeps it. Values are computed in `f32`.

use tch::{Kind, Tensor};

use crate::error::{AlgoError, Result};

/// Variance floor of the whitening functions (OpenRLHF clamps the variance at `1e-8` before
/// taking `rsqrt`).
pub const WHITEN_VARIANCE_FLOOR: f64 = 1e-8;

/// Checks that `tensor` has exactly the shape of `like`.
pub(crate) fn expect_same_shape(
    name: &'static str,
    tensor: &Tensor,
    like_shape: &[i64],
) -> Result<()> {
    let found = tensor.size();
    if found != like_shape {
        return Err(AlgoError::Shape { name, expected: like_shape.to_vec(), found });
    }
    Ok(())
}

/// Checks that `tensor` has `dims` dimensions and returns its shape.
pub(crate) fn expect_rank(name: &'static str, tensor: &Tensor, dims: usize) -> Result<Vec<i64>> {
    let found = tensor.size();
    if found.len() != dims {
        return Err(AlgoError::Rank { name, expected: dims, found });
    }
    Ok(found)
}

/// The mask as `f32` on the device of `like`, after checking it has `like`'s shape.
pub(crate) fn float_mask(mask: &Tensor, like: &Tensor) -> Result<Tensor> {
    expect_same_shape("mask", mask, &like.size())?;
    Ok(mask.f_to_kind(Kind::Float)?.f_to_device(like.device())?)
}

/// Σ tensor·mask over `dim` (all elements when `None`).
pub fn masked_sum(tensor: &Tensor, mask: &Tensor, dim: Option<i64>) -> Result<Tensor> {
    let mask = float_mask(mask, tensor)?;
    let product = tensor.f_to_kind(Kind::Float)?.f_mul(&mask)?;
    Ok(match dim {
        None => product.f_sum(Kind::Float)?,
        Some(d) => product.f_sum_dim_intlist([d].as_slice(), false, Kind::Float)?,
    })
}

/// Σ tensor·mask / Σ mask over `dim` (all elements when `None`). As in OpenRLHF, a row whose
/// mask is all zero gives NaN (0/0); callers that can meet empty rows mask them out afterwards.
pub fn masked_mean(tensor: &Tensor, mask: &Tensor, dim: Option<i64>) -> Result<Tensor> {
    let numerator = masked_sum(tensor, mask, dim)?;
    let mask = mask.f_to_kind(Kind::Float)?.f_to_device(tensor.device())?;
    let denominator = match dim {
        None => mask.f_sum(Kind::Float)?,
        Some(d) => mask.f_sum_dim_intlist([d].as_slice(), false, Kind::Float)?,
    };
    Ok(numerator.f_div(&denominator)?)
}

/// Whitens `tensor` over every masked position at once: `(x − μ)·rsqrt(max(σ², 1e-8))` with μ
/// and σ² (the biased variance) taken over the masked positions only. With `shift_mean_only`
/// the result is `x − μ` (OpenRLHF's `no_std_norm`). Unmasked positions are transformed too
/// (their values are meaningless and later ignored by the masked losses), exactly as OpenRLHF
/// does for its global advantage whitening.
pub fn masked_whiten(tensor: &Tensor, mask: &Tensor, shift_mean_only: bool) -> Result<Tensor> {
    let values = tensor.f_to_kind(Kind::Float)?;
    let mask = float_mask(mask, tensor)?;
    let count = mask.f_sum(Kind::Float)?;
    let mean = values.f_mul(&mask)?.f_sum(Kind::Float)?.f_div(&count)?;
    let centered = values.f_sub(&mean)?;
    if shift_mean_only {
        return Ok(centered);
    }
    let variance = centered.f_square()?.f_mul(&mask)?.f_sum(Kind::Float)?.f_div(&count)?;
    Ok(centered.f_mul(&variance.f_clamp_min(WHITEN_VARIANCE_FLOOR)?.f_rsqrt()?)?)
}

/// Normalises each slice along `dim` over its masked positions (OpenRLHF's `masked_normalize`):
/// `((x − μ)·mask)·rsqrt(max(σ², 1e-8))`, with an empty slice counted as one token so it stays
/// at zero instead of becoming NaN. Unmasked positions come out as 0.
pub fn masked_normalize(tensor: &Tensor, mask: &Tensor, dim: i64) -> Result<Tensor> {
    let values = tensor.f_to_kind(Kind::Float)?;
    let mask = float_mask(mask, tensor)?;
    let count = mask.f_sum_dim_intlist([dim].as_slice(), true, Kind::Float)?.f_clamp_min(1.0)?;
    let mean = values
        .f_mul(&mask)?
        .f_sum_dim_intlist([dim].as_slice(), true, Kind::Float)?
        .f_div(&count)?;
    let centered = values.f_sub(&mean)?.f_mul(&mask)?;
    let variance = centered
        .f_square()?
        .f_sum_dim_intlist([dim].as_slice(), true, Kind::Float)?
        .f_div(&count)?;
    Ok(centered.f_mul(&variance.f_clamp_min(WHITEN_VARIANCE_FLOOR)?.f_rsqrt()?)?)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A 2-D f32 tensor from rows.
    pub(crate) fn t2(rows: &[&[f32]]) -> Tensor {
        let cols = rows.first().map_or(0, |r| r.len()) as i64;
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_slice(&flat).view([rows.len() as i64, cols])
    }

    /// The tensor's values, flattened, as f64.
    pub(crate) fn values(t: &Tensor) -> Vec<f64> {
        let flat = t.to_kind(Kind::Double).flatten(0, -1);
        Vec::<f64>::try_from(&flat).expect("a flat double tensor converts to Vec<f64>")
    }

    /// Asserts element-wise closeness to `expected` within 1e-5 (absolute or relative).
    pub(crate) fn assert_close(t: &Tensor, expected: &[f64]) {
        let got = values(t);
        assert_eq!(got.len(), expected.len(), "length: got {got:?}, expected {expected:?}");
        for (i, (g, e)) in got.iter().zip(expected).enumerate() {
            let tolerance = 1e-5 * e.abs().max(1.0);
            assert!((g - e).abs() <= tolerance, "element {i}: got {g}, expected {e} ({got:?})");
        }
    }

    #[test]
    fn masked_sum_and_mean_count_only_masked_positions() {
        let x = t2(&[&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]]);
        let m = t2(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0]]);
        // Rows: 1+2 = 3 and 4; all: 7.
        assert_close(&masked_sum(&x, &m, Some(1)).unwrap(), &[3.0, 4.0]);
        assert_close(&masked_sum(&x, &m, None).unwrap(), &[7.0]);
        // Row means 3/2 = 1.5 and 4/1 = 4; global mean 7/3.
        assert_close(&masked_mean(&x, &m, Some(1)).unwrap(), &[1.5, 4.0]);
        assert_close(&masked_mean(&x, &m, None).unwrap(), &[7.0 / 3.0]);
        // A bool mask works the same.
        let bool_mask = m.ne(0.0);
        assert_close(&masked_mean(&x, &bool_mask, None).unwrap(), &[7.0 / 3.0]);
    }

    #[test]
    fn masked_whiten_uses_masked_mean_and_biased_variance() {
        // Masked values 1, 2, 3: μ = 2, σ² = (1 + 0 + 1)/3 = 2/3, rsqrt = sqrt(1.5) = 1.2247449.
        // The unmasked 10 is shifted and scaled too: (10 − 2)·1.2247449 = 9.797959.
        let x = t2(&[&[1.0, 2.0], &[3.0, 10.0]]);
        let m = t2(&[&[1.0, 1.0], &[1.0, 0.0]]);
        let s = 1.5f64.sqrt();
        assert_close(&masked_whiten(&x, &m, false).unwrap(), &[-s, 0.0, s, 8.0 * s]);
        assert_close(&masked_whiten(&x, &m, true).unwrap(), &[-1.0, 0.0, 1.0, 8.0]);
        // Constant values: σ² = 0 is floored at 1e-8, so (x − μ) = 0 stays 0 (no NaN).
        let c = t2(&[&[5.0, 5.0]]);
        assert_close(&masked_whiten(&c, &t2(&[&[1.0, 1.0]]), false).unwrap(), &[0.0, 0.0]);
    }

    #[test]
    fn masked_normalize_is_per_row_and_zeroes_padding() {
        // Row 0: values 1, 3 → μ = 2, σ² = 1 → −1, 1, pad 0. Row 1: only 7 → μ = 7, σ² = 0
        // floored at 1e-8 → 0. Row 2: empty → count clamped to 1, everything 0.
        let x = t2(&[&[1.0, 3.0, 9.0], &[7.0, 8.0, 9.0], &[4.0, 4.0, 4.0]]);
        let m = t2(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
        assert_close(
            &masked_normalize(&x, &m, 1).unwrap(),
            &[-1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        );
    }

    #[test]
    fn mask_of_the_wrong_shape_is_an_error() {
        let x = t2(&[&[1.0, 2.0]]);
        let m = t2(&[&[1.0, 1.0, 1.0]]);
        let err = masked_mean(&x, &m, None).unwrap_err();
        assert!(err.to_string().contains("`mask` should have shape [1, 2], found [1, 3]"), "{err}");
    }
}
