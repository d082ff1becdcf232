//! The plain reference decode: no KV cache, no paging, no continuous batching. Every step runs
//! the full token lists of all unfinished samples (left-padded into one batch) through
//! [`CausalLm::forward`] and samples the last column with the same sampler and per-token seeds
//! as the engine.
//!
//! It is the oracle of the engine's correctness tests (run one request at a time it involves no
//! padding at all) and the anchor of its benchmark.

use rtrun_rlhf_model::CausalLm;
use tch::{Device, Kind, Tensor};

use crate::api::{GeneratedSample, GenerationOutput, GenerationRequest};
use crate::error::EngineError;
use crate::rng::token_uniform;
use crate::sampling::Sampler;
use crate::scheduler::FinishReason;

/// One sample being decoded.
struct Row {
    request: usize,
    sample_index: u32,
    seed: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    log_probs: Vec<f32>,
    finish: Option<FinishReason>,
}

/// Decodes `requests` by full recomputation. Sampling (temperature > 0) needs an explicit
/// `params.seed`, so that the result can be compared with the engine's; stop strings are not
/// supported here.
pub fn reference_generate(
    model: &CausalLm,
    requests: &[GenerationRequest],
) -> Result<Vec<GenerationOutput>, EngineError> {
    let mut rows = Vec::new();
    for (request, r) in requests.iter().enumerate() {
        r.params.validate().map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        if !r.params.stop.is_empty() {
            return Err(EngineError::InvalidRequest(
                "the reference decode has no stop strings".into(),
            ));
        }
        if r.prompt_token_ids.is_empty() {
            return Err(EngineError::InvalidRequest("prompts must not be empty".into()));
        }
        let seed = match (r.params.seed, r.params.is_greedy()) {
            (Some(seed), _) => seed,
            (None, true) => 0,
            (None, false) => {
                return Err(EngineError::InvalidRequest(
                    "the reference decode samples only with an explicit seed".into(),
                ));
            }
        };
        for sample_index in 0..r.params.n {
            rows.push(Row {
                request,
                sample_index,
                seed,
                tokens: r.prompt_token_ids.clone(),
                prompt_len: r.prompt_token_ids.len(),
                log_probs: Vec::new(),
                finish: None,
            });
        }
    }
    let mut sampler = Sampler::new();
    tch::no_grad(|| -> Result<(), EngineError> {
        loop {
            let active: Vec<usize> =
                (0..rows.len()).filter(|&i| rows[i].finish.is_none()).collect();
            if active.is_empty() {
                return Ok(());
            }
            let logits = last_logits(model, active.iter().map(|&i| rows[i].tokens.as_slice()))?;
            let vocab = logits.len() / active.len();
            for (k, &i) in active.iter().enumerate() {
                let row = &mut rows[i];
                let params = &requests[row.request].params;
                let position = row.tokens.len() - row.prompt_len;
                let uniform = token_uniform(row.seed, row.sample_index, position);
                let sampled =
                    sampler.sample(&logits[k * vocab..(k + 1) * vocab], params, uniform)?;
                row.tokens.push(sampled.token);
                row.log_probs.push(sampled.logprob);
                let produced = position + 1;
                if produced >= params.min_tokens as usize
                    && params.stop_token_ids.contains(&sampled.token)
                {
                    row.finish = Some(FinishReason::StopToken(sampled.token));
                } else if produced >= params.max_tokens as usize {
                    row.finish = Some(FinishReason::Length);
                }
            }
        }
    })?;
    let mut outputs: Vec<GenerationOutput> = requests
        .iter()
        .map(|r| GenerationOutput {
            prompt_token_ids: r.prompt_token_ids.clone(),
            samples: Vec::new(),
        })
        .collect();
    for row in rows {
        let logprobs = requests[row.request].params.logprobs;
        let token_ids = row.tokens[row.prompt_len..].to_vec();
        outputs[row.request].samples.push(GeneratedSample {
            // The reference has one version of the weights, the engine's first.
            weight_versions: vec![0; token_ids.len()],
            token_ids,
            log_probs: if logprobs { row.log_probs } else { Vec::new() },
            finish_reason: row.finish.unwrap_or(FinishReason::Aborted),
        });
    }
    Ok(outputs)
}

/// Float32 logits `[rows, vocab]` (row-major) of the last token of each token list, computed by
/// one left-padded forward pass.
fn last_logits<'a>(
    model: &CausalLm,
    sequences: impl Iterator<Item = &'a [u32]>,
) -> Result<Vec<f32>, EngineError> {
    let sequences: Vec<&[u32]> = sequences.collect();
    let width = sequences.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(sequences.len() * width);
    let mut mask = Vec::with_capacity(sequences.len() * width);
    for s in &sequences {
        let pad = width - s.len();
        ids.extend(std::iter::repeat_n(0i64, pad).chain(s.iter().map(|&t| i64::from(t))));
        mask.extend(std::iter::repeat_n(0i64, pad).chain(std::iter::repeat_n(1i64, s.len())));
    }
    let shape = [sequences.len() as i64, width as i64];
    let ids = Tensor::f_from_slice(&ids)?.f_view(shape)?;
    let mask = Tensor::f_from_slice(&mask)?.f_view(shape)?;
    let hidden = model.backbone.forward(&ids, &mask, None)?;
    let last = hidden.f_narrow(1, width as i64 - 1, 1)?.f_squeeze_dim(1)?;
    let logits = model.lm_logits(&last)?.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?;
    Ok(Vec::<f32>::try_from(logits.f_contiguous()?.f_view(-1)?)?)
}
