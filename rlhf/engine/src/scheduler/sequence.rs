//! The per-sequence state the scheduler tracks, and the outputs it hands back.

use crate::SequenceId;
use serde::{Deserialize, Serialize};

/// Why a sample stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token id was generated (it is the last output token).
    StopToken(u32),
    /// The detokenised output contained stop string number `index` of the request.
    StopString(usize),
    /// `max_tokens` tokens were generated.
    Length,
    /// The request was aborted.
    Aborted,
}

/// The result of one sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleOutput {
    /// Index of the sample within its request.
    pub sample_index: u32,
    /// Generated token ids (the prompt excluded).
    pub token_ids: Vec<u32>,
    /// Log-prob of each generated token, when the request asked for them.
    pub logprobs: Option<Vec<f32>>,
    /// The weight version ([`crate::LlmEngine::set_weight_version`]) that sampled each
    /// generated token.
    pub weight_versions: Vec<u64>,
    /// Why generation stopped.
    pub finish_reason: FinishReason,
    /// How often the sample was preempted and recomputed.
    pub num_preemptions: u32,
}

/// The result of a request: its samples in sample-index order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestOutput {
    /// The request.
    pub request_id: crate::RequestId,
    /// Number of prompt tokens.
    pub prompt_len: usize,
    /// One entry per sample.
    pub samples: Vec<SampleOutput>,
}

/// Where a sequence is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SequenceStatus {
    Waiting,
    Running,
    Finished(FinishReason),
}

/// One sample being generated.
#[derive(Debug, Clone)]
pub(crate) struct Sequence {
    pub(crate) id: SequenceId,
    /// Prompt followed by the generated tokens.
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    /// Leading tokens whose K/V exists (or is being computed in the current step).
    pub(crate) num_computed: usize,
    pub(crate) logprobs: Vec<f32>,
    /// The weight version that sampled each generated token.
    pub(crate) versions: Vec<u64>,
    pub(crate) status: SequenceStatus,
    /// Scheduled with a sampled position whose token has not been reported yet.
    pub(crate) awaiting_token: bool,
    /// Admission counter value when last admitted (the preemption victim is the largest).
    pub(crate) admitted_at: u64,
    pub(crate) num_preemptions: u32,
}

impl Sequence {
    pub(crate) fn new(id: SequenceId, prompt: Vec<u32>) -> Self {
        Self {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            logprobs: Vec::new(),
            versions: Vec::new(),
            status: SequenceStatus::Waiting,
            awaiting_token: false,
            admitted_at: 0,
            num_preemptions: 0,
        }
    }

    pub(crate) fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub(crate) fn output(&self, with_logprobs: bool) -> SampleOutput {
        SampleOutput {
            sample_index: self.id.sample_index,
            token_ids: self.tokens[self.prompt_len..].to_vec(),
            logprobs: with_logprobs.then(|| self.logprobs.clone()),
            weight_versions: self.versions.clone(),
            finish_reason: match &self.status {
                SequenceStatus::Finished(reason) => reason.clone(),
                // Outputs are only built for finished sequences; an unfinished one reads as aborted.
                _ => FinishReason::Aborted,
            },
            num_preemptions: self.num_preemptions,
        }
    }
}
