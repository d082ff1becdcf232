//! The engine's configuration: KV pool sizing, batching limits, prefix caching, seed, device and
//! dtype, with the defaults vLLM uses where it has one.

use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

use crate::error::EngineError;

/// Tunables of [`crate::LlmEngine`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Token slots per KV block. Default 16.
    pub block_size: usize,
    /// KV blocks in the pool. When absent the pool is sized from `kv_cache_bytes`.
    pub num_gpu_blocks: Option<usize>,
    /// Bytes the KV cache (keys and values of every layer) may take when `num_gpu_blocks` is
    /// absent. Default 128 MiB.
    pub kv_cache_bytes: u64,
    /// Running sequences at most. Default 256.
    pub max_num_seqs: usize,
    /// Token positions per step (prefill chunks plus decodes). Default 8192.
    pub max_num_batched_tokens: usize,
    /// Whether full KV blocks are shared between sequences with equal prefixes. Default true.
    pub enable_prefix_caching: bool,
    /// Base seed for requests without their own seed. Default 0.
    pub seed: u64,
    /// `"cpu"`, `"cuda"` or `"cuda:N"`. Default `"cpu"`.
    pub device: String,
    /// `"f32"`, `"bf16"` or `"f16"`: weights and KV cache. Default `"f32"`.
    pub dtype: String,
    /// Fraction of blocks admission leaves free for running sequences to grow. Default 0.01.
    pub watermark: f64,
    /// Prefill chunks share one padded attention problem while `chunks * longest chunk *
    /// longest context` stays within this many elements (attention scores of that size are
    /// materialised per head). Default 2^20.
    pub max_prefill_group_area: usize,
    /// Ranks of one engine (vLLM's `tensor_parallel_size`): 1 runs the whole model in one
    /// process; N runs an [`crate::EngineActor`] group of N processes, each with its share of
    /// the heads and of the MLP ([`crate::tp`]). Default 1.
    pub tensor_parallel_size: usize,
    /// Whether weight updates may arrive while requests run (partial and asynchronous
    /// rollouts): running sequences then continue with the new weights, keeping the K/V the old
    /// ones computed, and their tokens carry the version that sampled them. Default false: an
    /// update needs an idle engine.
    pub weight_updates_in_flight: bool,
    /// Whether steps of decodes only run the static-shape decode step (batch-size buckets,
    /// fixed-width block tables; [`crate::runner::static_decode`]). Absent: on a GPU yes, on
    /// the CPU no (its decode lanes are faster there).
    pub static_decode: Option<bool>,
    /// Whether the static decode step runs eagerly instead of replaying a CUDA graph captured
    /// per bucket (vLLM's name). Default false; graphs exist only on a GPU.
    pub enforce_eager: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_gpu_blocks: None,
            kv_cache_bytes: 128 << 20,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            enable_prefix_caching: true,
            seed: 0,
            device: "cpu".to_owned(),
            dtype: "f32".to_owned(),
            watermark: 0.01,
            max_prefill_group_area: 1 << 20,
            tensor_parallel_size: 1,
            weight_updates_in_flight: false,
            static_decode: None,
            enforce_eager: false,
        }
    }
}

impl EngineConfig {
    /// The libtorch device named by `device`.
    pub fn torch_device(&self) -> Result<Device, EngineError> {
        parse_device(&self.device)
    }

    /// The libtorch kind named by `dtype`.
    pub fn torch_kind(&self) -> Result<Kind, EngineError> {
        crate::api::dtype_kind(&self.dtype).ok_or_else(|| {
            EngineError::InvalidConfig(format!(
                "dtype should be one of f32, bf16, f16, found `{}`",
                self.dtype
            ))
        })
    }
}

/// Parses `"cpu"`, `"cuda"` (device 0) or `"cuda:N"`.
pub fn parse_device(name: &str) -> Result<Device, EngineError> {
    let invalid = || {
        EngineError::InvalidConfig(format!(
            "device should be `cpu`, `cuda` or `cuda:N`, found `{name}`"
        ))
    };
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => {
            let index = other.strip_prefix("cuda:").ok_or_else(invalid)?;
            index.parse::<usize>().map(Device::Cuda).map_err(|_| invalid())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_from_partial_json_and_rejects_unknown_fields() {
        let config: EngineConfig =
            serde_json::from_str(r#"{"num_gpu_blocks": 64, "device": "cuda:1"}"#).unwrap();
        assert_eq!(config.num_gpu_blocks, Some(64));
        assert_eq!(config.block_size, 16);
        assert_eq!(config.torch_device().unwrap(), Device::Cuda(1));
        assert!(serde_json::from_str::<EngineConfig>(r#"{"blocksize": 8}"#).is_err());
    }

    #[test]
    fn bad_device_and_dtype_names_say_what_was_found() {
        for bad in ["gpu", "cuda:", "cuda:x", "CPU"] {
            let err = parse_device(bad).unwrap_err().to_string();
            assert!(err.contains(&format!("`{bad}`")), "{err}");
        }
        let config = EngineConfig { dtype: "fp8".into(), ..EngineConfig::default() };
        assert!(config.torch_kind().unwrap_err().to_string().contains("`fp8`"));
    }
}
