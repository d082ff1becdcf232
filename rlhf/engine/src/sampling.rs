//! Sampling maths on one row of logits: temperature, top-k, top-p (nucleus), greedy at
//! temperature 0, and the log-prob of the sampled token.
//!
//! The engine passes each row of the logits tensor as a plain `&[f32]` together with the
//! request's [`SamplingParams`] and one uniform number from [`crate::rng::token_uniform`], which
//! makes sampling a pure function: the same seed gives the same tokens regardless of batch
//! composition or preemption.
//!
//! Order of operations (vLLM's): scale by `1 / temperature`, keep the `top_k` most likely
//! tokens, then keep the smallest prefix of those (by descending probability, ties broken by the
//! lower token id) whose renormalised mass reaches `top_p`, and draw from the renormalised
//! remainder by inverse CDF. Which log-prob comes back is chosen by
//! [`crate::params::LogprobMode`]; its doc says why the default is the temperature-scaled, untruncated
//! distribution. Arithmetic is in `f64` so that the log-prob of a token with a tiny probability is
//! still accurate.

use crate::params::{LogprobMode, SamplingParams};
use thiserror::Error;

/// The outcome of sampling one position.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampledToken {
    /// The chosen token id.
    pub token: u32,
    /// Its log-probability, in the [`LogprobMode`] of the request.
    pub logprob: f32,
}

/// Why a row of logits could not be sampled.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SamplingError {
    /// The row was empty.
    #[error("logits row must have at least one entry, found 0")]
    EmptyLogits,
    /// The vocabulary does not fit token ids of 32 bits.
    #[error("logits row must have at most 4294967295 entries, found {0}")]
    VocabTooLarge(usize),
    /// A logit was NaN or +inf (-inf is allowed and means "masked").
    #[error("logits must be finite or -inf, found {value} at token {index}")]
    NonFiniteLogit {
        /// Token id of the offending entry.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// Every logit was -inf.
    #[error("at least one logit must be above -inf, found all {0} masked")]
    AllMasked(usize),
    /// The uniform number was outside `[0, 1)`.
    #[error("uniform must be in [0, 1), found {0}")]
    InvalidUniform(f64),
}

/// Samples rows of logits, reusing its scratch buffer between calls (one per engine worker).
#[derive(Debug, Default)]
pub struct Sampler {
    /// `(token, unnormalised weight)` for the tokens still in play.
    candidates: Vec<(u32, f64)>,
}

impl Sampler {
    /// A sampler with an empty scratch buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Samples one token from `logits` under `params`, using `uniform` (in `[0, 1)`) as the
    /// single source of randomness. Greedy parameters ignore `uniform`.
    pub fn sample(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        uniform: f64,
    ) -> Result<SampledToken, SamplingError> {
        let max = checked_max(logits)?;
        if !(0.0..1.0).contains(&uniform) {
            return Err(SamplingError::InvalidUniform(uniform));
        }
        if params.is_greedy() {
            let token = argmax(logits, max);
            let logprob = raw_logprob(logits, max, token);
            return Ok(SampledToken { token, logprob: logprob as f32 });
        }
        let kept_mass = self.truncate(logits, max, params);
        let target = uniform * kept_mass;
        let mut cumulative = 0.0;
        // Rounding can leave `target` a hair above the last cumulative sum: the last kept token
        // is the right answer then.
        let (mut token, mut weight) = self.candidates[self.candidates.len() - 1];
        for &(candidate, w) in &self.candidates {
            cumulative += w;
            if target < cumulative {
                (token, weight) = (candidate, w);
                break;
            }
        }
        // Without top-k or top-p every token was kept, in token order, so `kept_mass` is the
        // very sum a second pass over the row would compute (the same terms in the same order):
        // the log-prob needs no second round of `exp`.
        let untruncated = !truncates(params, logits.len());
        let logprob = match params.logprob_mode {
            LogprobMode::Raw if untruncated && params.temperature == 1.0 => {
                f64::from(logits[token as usize]) - f64::from(max) - kept_mass.ln()
            }
            LogprobMode::Raw => raw_logprob(logits, max, token),
            LogprobMode::TemperatureScaled if untruncated => weight.ln() - kept_mass.ln(),
            LogprobMode::TemperatureScaled => {
                let total: f64 = scaled_weights(logits, max, params.temperature).sum();
                weight.ln() - total.ln()
            }
            LogprobMode::Processed => weight.ln() - kept_mass.ln(),
        };
        Ok(SampledToken { token, logprob: logprob as f32 })
    }

    /// The exact distribution [`Sampler::sample`] draws from (zero outside the kept set), for
    /// tests and diagnostics.
    pub fn distribution(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
    ) -> Result<Vec<f64>, SamplingError> {
        let max = checked_max(logits)?;
        let mut probabilities = vec![0.0; logits.len()];
        if params.is_greedy() {
            probabilities[argmax(logits, max) as usize] = 1.0;
            return Ok(probabilities);
        }
        let kept_mass = self.truncate(logits, max, params);
        for &(token, weight) in &self.candidates {
            probabilities[token as usize] = weight / kept_mass;
        }
        Ok(probabilities)
    }

    /// Fills `candidates` with the kept tokens and their temperature-scaled weights, most likely
    /// first when any truncation applies, and returns their total weight (always > 0 because
    /// the maximum logit has weight 1 and is never truncated away).
    fn truncate(&mut self, logits: &[f32], max: f32, params: &SamplingParams) -> f64 {
        self.candidates.clear();
        self.candidates.extend(
            scaled_weights(logits, max, params.temperature)
                .enumerate()
                .filter(|&(_, w)| w > 0.0)
                .map(|(token, w)| (token as u32, w)),
        );
        let by_weight_desc =
            |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let top_k = params.top_k.map_or(usize::MAX, |k| k as usize);
        if top_k < self.candidates.len() {
            self.candidates.select_nth_unstable_by(top_k - 1, by_weight_desc);
            self.candidates.truncate(top_k);
        }
        if truncates(params, logits.len()) {
            self.candidates.sort_unstable_by(by_weight_desc);
        }
        let mut total: f64 = self.candidates.iter().map(|c| c.1).sum();
        if params.top_p < 1.0 {
            let threshold = f64::from(params.top_p) * total;
            let mut cumulative = 0.0;
            let mut keep = self.candidates.len();
            for (index, &(_, w)) in self.candidates.iter().enumerate() {
                cumulative += w;
                if cumulative >= threshold {
                    keep = index + 1;
                    break;
                }
            }
            self.candidates.truncate(keep);
            total = self.candidates.iter().map(|c| c.1).sum();
        }
        total
    }
}

/// Whether `params` may drop tokens of a row of `vocab` (top-k below the row, or top-p).
fn truncates(params: &SamplingParams, vocab: usize) -> bool {
    params.top_k.is_some_and(|k| (k as usize) < vocab) || params.top_p < 1.0
}

/// Validates a row and returns its maximum.
fn checked_max(logits: &[f32]) -> Result<f32, SamplingError> {
    if logits.is_empty() {
        return Err(SamplingError::EmptyLogits);
    }
    if u32::try_from(logits.len()).is_err() {
        return Err(SamplingError::VocabTooLarge(logits.len()));
    }
    let mut max = f32::NEG_INFINITY;
    for (index, &value) in logits.iter().enumerate() {
        if value.is_nan() || value == f32::INFINITY {
            return Err(SamplingError::NonFiniteLogit { index, value });
        }
        max = max.max(value);
    }
    if max == f32::NEG_INFINITY {
        return Err(SamplingError::AllMasked(logits.len()));
    }
    Ok(max)
}

/// The lowest token id holding the maximum.
fn argmax(logits: &[f32], max: f32) -> u32 {
    // `checked_max` found `max` in the row, so the search succeeds; the row length fits u32.
    logits.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// `exp((logit - max) / temperature)` for every token: the unnormalised scaled distribution.
fn scaled_weights(logits: &[f32], max: f32, temperature: f32) -> impl Iterator<Item = f64> + '_ {
    let inverse_temperature = 1.0 / f64::from(temperature);
    logits.iter().map(move |&v| ((f64::from(v) - f64::from(max)) * inverse_temperature).exp())
}

/// `log_softmax(logits)[token]` at temperature 1.
fn raw_logprob(logits: &[f32], max: f32, token: u32) -> f64 {
    let total: f64 = scaled_weights(logits, max, 1.0).sum();
    f64::from(logits[token as usize]) - f64::from(max) - total.ln()
}

#[cfg(test)]
mod tests;
