//! Decoder-only language models of the Llama / Qwen2 family on libtorch (through `tch`), for
//! the RLHF roles: policy and reference ([`CausalLm`]), critic and reward model
//! ([`ScalarHeadModel`]).
//!
//! - Hugging Face I/O: `config.json` ([`ModelConfig`]), single or sharded `*.safetensors` in HF
//!   tensor names ([`safetensors_io`]), `tokenizer.json` ([`TextTokenizer`]) with special tokens, EOS ids and chat
//!   templates ([`PretrainedTokenizer`], [`ChatTemplate`]); saved checkpoints
//!   load back in `transformers`.
//! - Forward with attention masks (any padding side) and explicit positions; log-probs of
//!   response tokens ([`CausalLm::response_log_probs`]), values per token
//!   ([`ScalarHeadModel::action_values`]) and rewards at the last real token
//!   ([`ScalarHeadModel::rewards`]).
//! - Training ([`train`]): AdamW with clipping, warm-up + cosine schedule, gradient accumulation,
//!   masked losses, save/load of model + optimizer state.
//! - Tiny models made locally for tests ([`tiny`]).
//!
//! The layers ([`layers`]) keep their projections public so the generation engine can run them
//! around its own paged attention. libtorch comes from `scripts/setup-libtorch.sh`; CPU by
//! default, CUDA (and bf16 kernels) with the `cuda` feature.
// Denied, not forbidden: `cuda` and `storage` (the C++ shims' FFI) are the modules allowed it.
#![deny(unsafe_code)]

pub mod backbone;
pub mod causal_lm;
pub mod chat_template;
pub mod config;
pub mod cuda;
pub mod error;
pub mod host_memory;
pub mod layers;
pub mod layerwise;
pub mod logprobs;
pub mod lora;
pub mod params;
mod pretrained;
pub mod rope;
pub mod safetensors_io;
pub mod scalar_head;
pub mod storage;
pub mod tiny;
pub mod tokenizer;
pub mod train;

pub use backbone::Backbone;
pub use causal_lm::CausalLm;
pub use chat_template::{ChatMessage, ChatTemplate};
pub use config::{ModelConfig, ModelFamily, RopeScaling, SlidingWindow};
pub use error::{ModelError, Result};
pub use logprobs::ResponseBatch;
pub use lora::{LORA_TARGETS, LoraConfig};
pub use params::Parameters;
pub use safetensors_io::SaveOptions;
pub use scalar_head::ScalarHeadModel;
pub use tch;
pub use tokenizer::{PretrainedTokenizer, TextTokenizer};
