//! Per-request sampling parameters: what a trainer rank sends with each prompt to an engine actor.
//!
//! The field names and defaults follow vLLM's `SamplingParams` where they overlap, so configs
//! written for OpenRLHF / verl translate one to one. The struct is serde-serialisable because it
//! crosses the wire to engine actors; [`SamplingParams::validate`] must be called on anything that
//! arrived from outside (the scheduler does so on `add_request`).

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Which log-probability of the sampled token the engine returns.
///
/// The default is [`LogprobMode::TemperatureScaled`]: `log_softmax(logits / T)` over the whole
/// vocabulary, before top-k / top-p truncation. That is the quantity the PPO trainer recomputes
/// with the policy model (OpenRLHF's actor and verl's `compute_log_prob` both divide the logits
/// by the rollout temperature and take a full log-softmax), so rollout and trainer log-probs are
/// directly comparable (e.g. to monitor the trainer/engine mismatch of TRL#3867, verl#2953).
/// vLLM's own default is `raw_logprobs` (temperature 1), available here as [`LogprobMode::Raw`];
/// the log-prob under the truncated, renormalised distribution that was actually sampled from
/// (vLLM's `processed_logprobs`, what truncated importance-sampling corrections want) is
/// [`LogprobMode::Processed`]. At temperature 0 (greedy) the scaled distribution is undefined, so
/// `TemperatureScaled` and `Processed` fall back to the raw (temperature 1) distribution.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogprobMode {
    /// `log_softmax(logits)`: the model's distribution at temperature 1.
    Raw,
    /// `log_softmax(logits / temperature)` over the full vocabulary.
    #[default]
    TemperatureScaled,
    /// The log-prob under the temperature-scaled, top-k / top-p truncated, renormalised
    /// distribution the token was drawn from.
    Processed,
}

/// How one prompt is to be sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Number of samples (sequences) generated for the prompt. Default 1.
    pub n: u32,
    /// Softmax temperature; 0 means greedy (argmax). Default 1.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability mass
    /// reaches `top_p`. In `(0, 1]`; 1 disables it. Default 1.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; `None` disables it. Default `None`.
    pub top_k: Option<u32>,
    /// Maximum number of generated tokens per sample. Default 16 (vLLM's default).
    pub max_tokens: u32,
    /// Stop token ids are ignored until this many tokens have been generated. Default 0.
    pub min_tokens: u32,
    /// Generation stops after any of these tokens (which is kept in the output). The engine adds
    /// the model's end-of-sequence id here unless the caller opted out. Default empty.
    pub stop_token_ids: Vec<u32>,
    /// Generation stops when the detokenised output contains one of these strings. Checked by
    /// the engine with its tokenizer, which then calls `Scheduler::stop_by_string`. Default empty.
    pub stop: Vec<String>,
    /// Seed of the request's samples; the same seed gives the same tokens whatever the batch.
    /// `None` lets the engine derive one from its own seed and the request id. Default `None`.
    pub seed: Option<u64>,
    /// Whether to return the sampled tokens' log-probs. Default true (RLHF always wants them).
    pub logprobs: bool,
    /// Which log-prob is returned, see [`LogprobMode`].
    pub logprob_mode: LogprobMode,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            max_tokens: 16,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            seed: None,
            logprobs: true,
            logprob_mode: LogprobMode::default(),
        }
    }
}

/// Why a [`SamplingParams`] was rejected.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SamplingParamsError {
    /// `n` was zero.
    #[error("n must be at least 1, found 0")]
    ZeroSamples,
    /// The temperature was negative, NaN or infinite.
    #[error("temperature must be a finite number >= 0, found {0}")]
    InvalidTemperature(f32),
    /// `top_p` was outside `(0, 1]`.
    #[error("top_p must be in (0, 1], found {0}")]
    InvalidTopP(f32),
    /// `top_k` was zero.
    #[error("top_k must be at least 1 (or absent), found 0")]
    ZeroTopK,
    /// `max_tokens` was zero.
    #[error("max_tokens must be at least 1, found 0")]
    ZeroMaxTokens,
    /// `min_tokens` exceeded `max_tokens`.
    #[error("min_tokens must be <= max_tokens ({max_tokens}), found {min_tokens}")]
    MinTokensAboveMax {
        /// The requested minimum.
        min_tokens: u32,
        /// The requested maximum.
        max_tokens: u32,
    },
    /// A stop string was empty (it would stop before the first token).
    #[error("stop strings must be non-empty, found an empty one at index {0}")]
    EmptyStopString(usize),
}

impl SamplingParams {
    /// Greedy decoding (temperature 0) of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        Self { temperature: 0.0, max_tokens, ..Self::default() }
    }

    /// Whether these parameters select the argmax token.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every field; anything that arrived over the wire must pass this.
    pub fn validate(&self) -> Result<(), SamplingParamsError> {
        if self.n == 0 {
            return Err(SamplingParamsError::ZeroSamples);
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingParamsError::InvalidTemperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingParamsError::InvalidTopP(self.top_p));
        }
        if self.top_k == Some(0) {
            return Err(SamplingParamsError::ZeroTopK);
        }
        if self.max_tokens == 0 {
            return Err(SamplingParamsError::ZeroMaxTokens);
        }
        if self.min_tokens > self.max_tokens {
            return Err(SamplingParamsError::MinTokensAboveMax {
                min_tokens: self.min_tokens,
                max_tokens: self.max_tokens,
            });
        }
        if let Some(index) = self.stop.iter().position(String::is_empty) {
            return Err(SamplingParamsError::EmptyStopString(index));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_round_trip_through_json() {
        let params = SamplingParams { top_k: Some(5), seed: Some(3), ..SamplingParams::default() };
        params.validate().unwrap();
        let json = serde_json::to_string(&params).unwrap();
        let back: SamplingParams = serde_json::from_str(&json).unwrap();
        assert_eq!(back, params);
    }

    #[test]
    fn missing_fields_take_defaults_and_unknown_fields_are_rejected() {
        let params: SamplingParams = serde_json::from_str(r#"{"temperature":0.7}"#).unwrap();
        assert_eq!(params.temperature, 0.7);
        assert_eq!(params.max_tokens, 16);
        assert!(serde_json::from_str::<SamplingParams>(r#"{"temprature":0.7}"#).is_err());
    }

    #[test]
    fn invalid_fields_are_rejected_with_what_was_found() {
        let bad = |f: fn(&mut SamplingParams)| {
            let mut p = SamplingParams::default();
            f(&mut p);
            p.validate().unwrap_err()
        };
        assert_eq!(bad(|p| p.n = 0), SamplingParamsError::ZeroSamples);
        assert!(matches!(
            bad(|p| p.temperature = f32::NAN),
            SamplingParamsError::InvalidTemperature(_)
        ));
        assert_eq!(bad(|p| p.temperature = -1.0), SamplingParamsError::InvalidTemperature(-1.0));
        assert_eq!(bad(|p| p.top_p = 0.0), SamplingParamsError::InvalidTopP(0.0));
        assert_eq!(bad(|p| p.top_p = 1.5), SamplingParamsError::InvalidTopP(1.5));
        assert_eq!(bad(|p| p.top_k = Some(0)), SamplingParamsError::ZeroTopK);
        assert_eq!(bad(|p| p.max_tokens = 0), SamplingParamsError::ZeroMaxTokens);
        let err = bad(|p| p.min_tokens = 17);
        assert_eq!(err.to_string(), "min_tokens must be <= max_tokens (16), found 17");
        assert_eq!(
            bad(|p| p.stop = vec!["x".into(), String::new()]),
            SamplingParamsError::EmptyStopString(1)
        );
    }
}
