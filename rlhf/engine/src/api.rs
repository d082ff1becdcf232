//! The engine's request and response types, shared by the library API ([`crate::LlmEngine`]),
//! the runtime actor ([`crate::EngineActor`]) and the trainer that drives them.
//!
//! Everything here is plain serde data so that it travels through the runtime unchanged. Weight
//! buckets carry raw little-endian bytes ([`NamedTensor`]); [`serde_bytes`] keeps them one byte
//! string on the wire rather than a list of numbers.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::EngineError;
use crate::params::SamplingParams;
use crate::scheduler::FinishReason;

/// One prompt and how to sample its continuations.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerationRequest {
    /// The prompt's token ids (at least one, each below the model's vocabulary size).
    pub prompt_token_ids: Vec<u32>,
    /// Sampling parameters (`n` samples are generated).
    pub params: SamplingParams,
}

impl GenerationRequest {
    /// A request for `prompt_token_ids` with `params`.
    pub fn new(prompt_token_ids: Vec<u32>, params: SamplingParams) -> Self {
        Self { prompt_token_ids, params }
    }
}

/// One generated continuation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GeneratedSample {
    /// Generated token ids, the prompt excluded (a stop token id that ended the sample is the
    /// last one; the tokens that completed a stop string are kept).
    pub token_ids: Vec<u32>,
    /// The log-prob of each generated token under the request's `logprob_mode`; empty when the
    /// request set `logprobs: false`.
    pub log_probs: Vec<f32>,
    /// The weight version that sampled each token ([`crate::LlmEngine::set_weight_version`]):
    /// all equal unless new weights arrived while the sample ran (a partial rollout).
    #[serde(default)]
    pub weight_versions: Vec<u64>,
    /// Why generation stopped.
    pub finish_reason: FinishReason,
}

/// The result of one request: its `params.n` samples in sample order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationOutput {
    /// The prompt of the request.
    pub prompt_token_ids: Vec<u32>,
    /// `params.n` samples, sample 0 first.
    pub samples: Vec<GeneratedSample>,
}

/// What [`crate::EngineActor::stream_step`] returns: the streamed requests that finished, by
/// the caller's tag, and how many are still queued or running.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamPoll {
    /// Finished requests, by the tag they were streamed with.
    pub finished: Vec<(u64, GenerationOutput)>,
    /// Streamed requests still unfinished.
    pub unfinished: usize,
    /// Engine steps this call ran.
    pub steps: u32,
    /// The weight version new tokens are tagged with.
    pub weight_version: u64,
}

/// One weight as raw bytes: a Hugging Face name (as [`rtrun_rlhf_model::CausalLm::named_parameters`]
/// yields it), a dtype, a shape and the little-endian row-major data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamedTensor {
    /// Hugging Face parameter name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// `"f32"`, `"bf16"` or `"f16"`.
    pub dtype: String,
    /// Dimensions.
    pub shape: Vec<i64>,
    /// `shape.product() * element size` bytes.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

/// A batch of weights sent in one call (trainers send a model in several buckets).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WeightBucket {
    /// The weights, by Hugging Face name.
    pub tensors: Vec<NamedTensor>,
}

/// The dtype names of [`NamedTensor::dtype`] and their libtorch kinds.
const DTYPES: [(&str, Kind); 3] =
    [("f32", Kind::Float), ("bf16", Kind::BFloat16), ("f16", Kind::Half)];

/// The wire name of a libtorch kind, if it is one a [`NamedTensor`] can carry.
pub fn dtype_name(kind: Kind) -> Option<&'static str> {
    DTYPES.iter().find(|(_, k)| *k == kind).map(|(name, _)| *name)
}

/// The libtorch kind of a wire dtype name.
pub fn dtype_kind(name: &str) -> Option<Kind> {
    DTYPES.iter().find(|(n, _)| *n == name).map(|(_, kind)| *kind)
}

/// The libtorch kind whose `Debug` name is `name` (how [`crate::WeightMeta::dtype`] spells it:
/// `Float`, `BFloat16`, ...), for the kinds a weight can have.
pub fn kind_from_debug(name: &str) -> Option<Kind> {
    [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Double]
        .into_iter()
        .find(|k| format!("{k:?}") == name)
}

impl NamedTensor {
    /// Copies a tensor (any device; f32, bf16 or f16) into a named byte buffer.
    pub fn from_tensor(name: impl Into<String>, tensor: &Tensor) -> Result<Self, EngineError> {
        let name = name.into();
        let kind = tensor.f_kind()?;
        let dtype = dtype_name(kind).ok_or_else(|| EngineError::InvalidWeight {
            name: name.clone(),
            message: format!("dtype should be f32, bf16 or f16, found {kind:?}"),
        })?;
        let host = tensor.f_detach()?.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
        let numel = host.numel();
        let mut data = vec![0u8; numel * kind.elt_size_in_bytes()];
        host.f_copy_data_u8(&mut data, numel)?;
        Ok(Self { name, dtype: dtype.to_owned(), shape: host.size(), data })
    }

    /// Checks dtype, shape and byte length and builds a CPU tensor over a copy of the bytes.
    pub fn to_tensor(&self) -> Result<Tensor, EngineError> {
        let invalid =
            |message: String| EngineError::InvalidWeight { name: self.name.clone(), message };
        let kind = dtype_kind(&self.dtype).ok_or_else(|| {
            invalid(format!("dtype should be one of f32, bf16, f16, found `{}`", self.dtype))
        })?;
        if self.shape.iter().any(|&d| d < 0) {
            return Err(invalid(format!("shape should be non-negative, found {:?}", self.shape)));
        }
        let numel = self
            .shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
            .ok_or_else(|| invalid(format!("shape {:?} overflows", self.shape)))?;
        let expected = numel.checked_mul(kind.elt_size_in_bytes());
        if expected != Some(self.data.len()) {
            return Err(invalid(format!(
                "{} data for shape {:?} should have {} bytes, found {}",
                self.dtype,
                self.shape,
                expected.map_or_else(|| "too many".to_owned(), |e| e.to_string()),
                self.data.len()
            )));
        }
        Ok(Tensor::f_from_data_size(&self.data, &self.shape, kind)?)
    }
}

impl WeightBucket {
    /// A bucket holding every parameter of `model` (for tests, tools and small models; trainers
    /// split large models into several buckets).
    pub fn from_model(model: &rtrun_rlhf_model::CausalLm) -> Result<Self, EngineError> {
        let tensors = model
            .named_parameters()
            .map(|(name, tensor)| NamedTensor::from_tensor(name, tensor))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { tensors })
    }

    /// Every parameter of `model` split into buckets of at most `max_bucket_bytes` of data each
    /// (a tensor larger than that travels alone), in `named_parameters` order, optionally cast
    /// to `dtype` first (e.g. bf16 to halve the traffic; the engine converts on arrival).
    pub fn split_model(
        model: &rtrun_rlhf_model::CausalLm,
        max_bucket_bytes: usize,
        dtype: Option<Kind>,
    ) -> Result<Vec<Self>, EngineError> {
        let named =
            model.named_parameters().map(|(name, t)| Ok((name.to_owned(), t.shallow_clone())));
        Self::split(named, max_bucket_bytes, dtype)
    }

    /// `tensors` in order, split into buckets of at most `max_bucket_bytes` of data each (a
    /// tensor larger than that travels alone), optionally cast to `dtype` first.
    pub fn split(
        tensors: impl IntoIterator<Item = Result<(String, Tensor), EngineError>>,
        max_bucket_bytes: usize,
        dtype: Option<Kind>,
    ) -> Result<Vec<Self>, EngineError> {
        let mut buckets = Vec::new();
        let mut current = WeightBucket::default();
        for named in tensors {
            let (name, tensor) = named?;
            let named = match dtype {
                Some(kind) => NamedTensor::from_tensor(name, &tensor.f_to_kind(kind)?)?,
                None => NamedTensor::from_tensor(name, &tensor)?,
            };
            if !current.tensors.is_empty()
                && current.num_bytes() + named.data.len() > max_bucket_bytes
            {
                buckets.push(std::mem::take(&mut current));
            }
            current.tensors.push(named);
        }
        if !current.tensors.is_empty() {
            buckets.push(current);
        }
        Ok(buckets)
    }

    /// Total bytes of data carried.
    pub fn num_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_round_trip_through_named_bytes_in_every_dtype() {
        let values = Tensor::from_slice(&[1.5f32, -2.0, 0.25, 3.0, 0.0, -0.5]).view([2, 3]);
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let original = values.to_kind(kind);
            let named = NamedTensor::from_tensor("w", &original).unwrap();
            assert_eq!(named.shape, vec![2, 3]);
            let back = named.to_tensor().unwrap();
            assert_eq!(back.kind(), kind);
            assert!(back.equal(&original));
        }
    }

    #[test]
    fn a_model_splits_into_bounded_buckets_in_parameter_order() {
        let config = rtrun_rlhf_model::tiny::tiny_config(rtrun_rlhf_model::ModelFamily::Llama);
        let model = rtrun_rlhf_model::tiny::tiny_model(&config, 1).unwrap();
        let whole = WeightBucket::from_model(&model).unwrap();
        let buckets = WeightBucket::split_model(&model, 40_000, None).unwrap();
        assert!(buckets.len() > 2);
        let largest = whole.tensors.iter().map(|t| t.data.len()).max().unwrap();
        assert!(buckets.iter().all(|b| b.num_bytes() <= 40_000.max(largest)));
        let rejoined: Vec<NamedTensor> = buckets.into_iter().flat_map(|b| b.tensors).collect();
        assert_eq!(rejoined, whole.tensors);
        let half = WeightBucket::split_model(&model, usize::MAX, Some(Kind::BFloat16)).unwrap();
        assert_eq!(half.len(), 1);
        assert_eq!(half[0].num_bytes() * 2, whole.num_bytes());
        assert!(half[0].tensors.iter().all(|t| t.dtype == "bf16"));
    }

    #[test]
    fn malformed_named_tensors_are_rejected_with_what_was_found() {
        let good = NamedTensor::from_tensor("w", &Tensor::from_slice(&[1.0f32, 2.0])).unwrap();
        let short = NamedTensor { data: vec![0; 7], ..good.clone() };
        assert!(
            short.to_tensor().unwrap_err().to_string().contains("should have 8 bytes, found 7")
        );
        let dtype = NamedTensor { dtype: "f64".into(), ..good.clone() };
        assert!(dtype.to_tensor().unwrap_err().to_string().contains("found `f64`"));
        let negative = NamedTensor { shape: vec![-2], ..good.clone() };
        assert!(negative.to_tensor().is_err());
        let huge = NamedTensor { shape: vec![i64::MAX, i64::MAX], ..good };
        assert!(huge.to_tensor().is_err());
    }
}
