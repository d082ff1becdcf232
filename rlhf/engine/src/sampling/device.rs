//! Sampling where the logits are (issue 42): the host sampler's maths ([`super::Sampler`]) as
//! batched tensor operations, so that on a GPU only each row's chosen token and log-prob cross
//! to the host instead of `[rows, vocab]` float32 logits (155 MB per step at batch 256 and a
//! 152k vocabulary).
//!
//! Every row keeps the host's contract: its draw is the request's one uniform number
//! ([`crate::rng::token_uniform`], computed on the host, so a seed reproduces its tokens
//! whatever the batch), by inverse CDF over the same order: token order when nothing is
//! truncated, most likely first (ties to the lower id) under top-k / top-p, whose kept set is
//! the host's. Weights are `exp((logit - max) / T)` in float32 and every sum is in float64, as
//! on the host, so the two agree token for token except where a uniform falls within rounding
//! of a CDF boundary; log-probs agree to float rounding. Greedy rows take the argmax (ties to
//! the lowest id). A row with a NaN or `+inf` logit, or none above `-inf`, is refused with the
//! host sampler's error naming the entry.
//!
//! On the CPU the engine keeps the host sampler (exact, and the tests' oracle); this runs
//! there in tests, against it.

use tch::{Device, Kind, Tensor};

use super::{SampledToken, SamplingError, checked_max, truncates};
use crate::error::EngineError;
use crate::params::{LogprobMode, SamplingParams};

/// One row's sampling: its parameters and its uniform number in `[0, 1)`.
#[derive(Debug, Clone, Copy)]
pub struct RowSampling<'a> {
    /// The request's parameters.
    pub params: &'a SamplingParams,
    /// The row's draw ([`crate::rng::token_uniform`]).
    pub uniform: f64,
}

/// Samples row `i` of `logits` (`[rows, vocab]`, any float kind, on any device) under
/// `rows[i]`; only the chosen tokens and their log-probs come back to the host.
pub fn sample(logits: &Tensor, rows: &[RowSampling<'_>]) -> Result<Vec<SampledToken>, EngineError> {
    let (count, vocab) = logits.size2()?;
    if count != rows.len() as i64 {
        return Err(EngineError::InvalidArgument(format!(
            "{} sampling rows for {count} rows of logits",
            rows.len()
        )));
    }
    if vocab == 0 {
        return Err(SamplingError::EmptyLogits.into());
    }
    if vocab > i64::from(u32::MAX) {
        return Err(SamplingError::VocabTooLarge(vocab as usize).into());
    }
    if let Some(bad) = rows.iter().find(|r| !(0.0..1.0).contains(&r.uniform)) {
        return Err(SamplingError::InvalidUniform(bad.uniform).into());
    }
    let logits = logits.f_to_kind(Kind::Float)?;
    let device = logits.device();
    let mut out = vec![SampledToken { token: 0, logprob: 0.0 }; rows.len()];
    // Three kinds of rows, each sampled in one batch: greedy, all tokens kept, truncated.
    let mut kinds: [Vec<usize>; 3] = Default::default();
    for (i, row) in rows.iter().enumerate() {
        let kind = match (row.params.is_greedy(), truncates(row.params, vocab as usize)) {
            (true, _) => 0,
            (false, false) => 1,
            (false, true) => 2,
        };
        kinds[kind].push(i);
    }
    for (kind, members) in kinds.iter().enumerate() {
        if members.is_empty() {
            continue;
        }
        let index: Vec<i64> = members.iter().map(|&i| i as i64).collect();
        let index = Tensor::f_from_slice(&index)?.f_to_device(device)?;
        let part = logits.f_index_select(0, &index)?;
        let params: Vec<RowSampling<'_>> = members.iter().map(|&i| rows[i]).collect();
        let picked = match kind {
            0 => greedy(&part)?,
            _ => draw(&part, &params, kind == 2)?,
        };
        for (&i, (token, logprob)) in members.iter().zip(picked) {
            if !logprob.is_finite() {
                // Only a bad row gives a non-finite log-prob: name its entry as the host does.
                let row = Vec::<f32>::try_from(logits.f_get(i as i64)?.f_to_device(Device::Cpu)?)?;
                checked_max(&row)?;
            }
            out[i] = SampledToken { token, logprob: logprob as f32 };
        }
    }
    Ok(out)
}

/// Argmax (ties to the lowest id: libtorch's `argmax` returns the first maximum) and the raw
/// log-prob of each row.
fn greedy(logits: &Tensor) -> Result<Vec<(u32, f64)>, EngineError> {
    let tokens = logits.f_argmax(-1, true)?;
    let logprobs = logits.f_log_softmax(-1, Kind::Double)?.f_gather(-1, &tokens, false)?;
    collect(&tokens, &logprobs)
}

/// Inverse-CDF draws of rows `logits` under `rows`: over token order, or (`truncated`) over
/// the kept tokens most likely first.
fn draw(
    logits: &Tensor,
    rows: &[RowSampling<'_>],
    truncated: bool,
) -> Result<Vec<(u32, f64)>, EngineError> {
    let (count, vocab) = logits.size2()?;
    let device = logits.device();
    let column = |values: Vec<f64>, kind: Kind| -> Result<Tensor, EngineError> {
        Ok(Tensor::f_from_slice(&values)?
            .f_to_device(device)?
            .f_to_kind(kind)?
            .f_view([count, 1])?)
    };
    let temperature =
        column(rows.iter().map(|r| f64::from(r.params.temperature)).collect(), Kind::Float)?;
    let uniform = column(rows.iter().map(|r| r.uniform).collect(), Kind::Double)?;
    let max = logits.f_amax([-1].as_slice(), true)?;
    // `exp((logit - max) / T)`, as the host's `fill_weights` (a multiply by `1 / T`).
    let scaled = logits.f_sub(&max)?.f_mul(&temperature.f_reciprocal()?)?;
    let weights = scaled.f_exp()?.f_to_kind(Kind::Double)?;
    let full_mass = weights.f_sum_dim_intlist([-1].as_slice(), true, Kind::Double)?;
    let (order, kept) = match truncated {
        false => (None, weights.shallow_clone()),
        true => {
            let (sorted, order) = weights.f_sort_stable(true, -1, true)?;
            let rank = Tensor::f_arange(vocab, (Kind::Int64, device))?.f_unsqueeze(0)?;
            let top_k =
                rows.iter().map(|r| r.params.top_k.map_or(vocab, i64::from).min(vocab) as f64);
            let top_k = column(top_k.collect(), Kind::Int64)?;
            let kept_k = sorted.f_mul(&rank.f_lt_tensor(&top_k)?.f_to_kind(Kind::Double)?)?;
            // Top-p keeps the most likely tokens up to the first whose running mass reaches
            // `top_p` of the top-k mass: those whose mass before them is below it.
            let top_p =
                column(rows.iter().map(|r| f64::from(r.params.top_p)).collect(), Kind::Double)?;
            let running = kept_k.f_cumsum(-1, Kind::Double)?;
            let total_k = running.f_narrow(-1, vocab - 1, 1)?;
            let before = running.f_sub(&kept_k)?;
            let threshold = top_p.f_mul(&total_k)?;
            let in_p = before.f_lt_tensor(&threshold)?.f_logical_or(&top_p.f_ge(1.0)?)?;
            let kept = kept_k.f_mul(&in_p.f_to_kind(Kind::Double)?)?;
            (Some(order), kept)
        }
    };
    let cdf = kept.f_cumsum(-1, Kind::Double)?;
    let kept_mass = cdf.f_narrow(-1, vocab - 1, 1)?;
    let target = uniform.f_mul(&kept_mass)?;
    // The first position whose running mass passes the target; rounding can leave the target
    // at the total, where the last kept token is the answer (the host's rule).
    let found = target.f_searchsorted(&cdf, false, true, "right", None::<Tensor>)?;
    let last_kept = kept
        .f_gt(0.0)?
        .f_to_kind(Kind::Int64)?
        .f_mul(&Tensor::f_arange(vocab, (Kind::Int64, device))?.f_unsqueeze(0)?)?
        .f_amax([-1].as_slice(), true)?;
    let position = found.f_minimum(&last_kept)?;
    let weight = kept.f_gather(-1, &position, false)?;
    let token = match &order {
        Some(order) => order.f_gather(-1, &position, false)?,
        None => position,
    };
    let logit = logits.f_gather(-1, &token, false)?.f_to_kind(Kind::Double)?;
    let max = max.f_to_kind(Kind::Double)?;
    let modes: Vec<LogprobMode> = rows.iter().map(|r| r.params.logprob_mode).collect();
    // Every mode's log-prob where a row needs it; each row picks its own.
    let raw = || -> Result<Tensor, EngineError> {
        Ok(logits.f_log_softmax(-1, Kind::Double)?.f_gather(-1, &token, false)?)
    };
    let scaled = || -> Result<Tensor, EngineError> {
        let temperature = temperature.f_to_kind(Kind::Double)?;
        Ok(logit.f_sub(&max)?.f_div(&temperature)?.f_sub(&full_mass.f_log()?)?)
    };
    let processed =
        || -> Result<Tensor, EngineError> { Ok(weight.f_log()?.f_sub(&kept_mass.f_log()?)?) };
    let needs = |mode: LogprobMode| modes.contains(&mode);
    let by_mode = [
        (LogprobMode::Raw, needs(LogprobMode::Raw).then(raw).transpose()?),
        (
            LogprobMode::TemperatureScaled,
            needs(LogprobMode::TemperatureScaled).then(scaled).transpose()?,
        ),
        (LogprobMode::Processed, needs(LogprobMode::Processed).then(processed).transpose()?),
    ];
    let mut logprobs: Vec<f64> = vec![0.0; count as usize];
    for (mode, values) in by_mode {
        let Some(values) = values else { continue };
        let values = Vec::<f64>::try_from(values.f_view([-1])?.f_to_device(Device::Cpu)?)?;
        for (row, value) in values.into_iter().enumerate() {
            if modes[row] == mode {
                logprobs[row] = value;
            }
        }
    }
    // A bad row (NaN, +inf, all -inf) has a NaN maximum or total: flag it non-finite.
    let bad = max
        .f_isfinite()?
        .f_logical_not()?
        .f_logical_or(&full_mass.f_isfinite()?.f_logical_not()?)?;
    let bad = Vec::<bool>::try_from(bad.f_view([-1])?.f_to_device(Device::Cpu)?)?;
    for (logprob, bad) in logprobs.iter_mut().zip(bad) {
        if bad {
            *logprob = f64::NAN;
        }
    }
    let tokens = Vec::<i64>::try_from(token.f_view([-1])?.f_to_device(Device::Cpu)?)?;
    Ok(tokens.into_iter().map(|t| t as u32).zip(logprobs).collect())
}

/// `[rows, 1]` tokens and log-probs to the host.
fn collect(tokens: &Tensor, logprobs: &Tensor) -> Result<Vec<(u32, f64)>, EngineError> {
    let tokens = Vec::<i64>::try_from(tokens.f_view([-1])?.f_to_device(Device::Cpu)?)?;
    let logprobs = Vec::<f64>::try_from(logprobs.f_view([-1])?.f_to_device(Device::Cpu)?)?;
    Ok(tokens.into_iter().map(|t| t as u32).zip(logprobs).collect())
}
