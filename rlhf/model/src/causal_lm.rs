//! The causal language model (`LlamaForCausalLM` / `Qwen2ForCausalLM`): the policy and the
//! reference model of RLHF.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::backbone::Backbone;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::Linear;
use crate::logprobs::{ResponseBatch, token_log_probs};
use crate::params::Parameters;
use crate::pretrained::{load_into, save_params};
use crate::safetensors_io::SaveOptions;

/// A decoder-only LM with an LM head (tied to the embedding or separate).
#[derive(Debug)]
pub struct CausalLm {
    /// Every weight under its Hugging Face name.
    pub params: Parameters,
    /// Embedding, layers and final norm.
    pub backbone: Backbone,
    /// `lm_head` when the embeddings are untied; `None` reuses `model.embed_tokens.weight`.
    pub lm_head: Option<Linear>,
    /// LoRA adapters ([`CausalLm::add_lora`]), with the base weights frozen.
    pub lora: Option<crate::lora::Lora>,
}

impl CausalLm {
    /// A randomly initialised model (normal with the config's `initializer_range`, norms one,
    /// biases zero); the same `seed` gives the same weights.
    pub fn new_random(config: &ModelConfig, device: Device, kind: Kind, seed: u64) -> Result<Self> {
        Self::build_into(config, Parameters::new(device, kind, seed))
    }

    /// A model of `config` whose every parameter is allocated but not initialised, to be
    /// overwritten next (a tensor-parallel shard filled from the whole model's tensors).
    pub fn uninitialised(config: &ModelConfig, device: Device, kind: Kind) -> Result<Self> {
        config.validate()?;
        Self::build_into(config, Parameters::for_loading(device, kind))
    }

    fn build_into(config: &ModelConfig, mut params: Parameters) -> Result<Self> {
        let backbone = Backbone::new(&mut params, config)?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(Linear::new(
                &mut params,
                "lm_head",
                config.hidden_size,
                config.vocab_size,
                false,
                config.initializer_range,
            )?)
        };
        Ok(Self { params, backbone, lm_head, lora: None })
    }

    /// Loads `config.json` and the safetensors weights of a Hugging Face checkpoint directory.
    pub fn from_pretrained(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        // Every parameter is loaded (none may be missing), so none is drawn first.
        let model = Self::build_into(&config, Parameters::for_loading(device, kind))?;
        load_into(&model.params, dir, &[])?;
        Ok(model)
    }

    /// Writes `config.json` and the weights so that `transformers` loads them back (with LoRA
    /// adapters folded into their projections).
    pub fn save_pretrained(&self, dir: &Path, options: &SaveOptions) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| crate::ModelError::io(dir, e))?;
        self.config().write_to_dir(dir)?;
        if self.lora.is_some() {
            let merged = self.merged_parameters()?;
            return crate::safetensors_io::write_checkpoint(
                dir,
                merged.iter().map(|(n, t)| (n.as_str(), t)),
                options,
            );
        }
        save_params(&self.params, dir, options)
    }

    /// The model config.
    pub fn config(&self) -> &ModelConfig {
        &self.backbone.config
    }

    /// `(name, tensor)` for every parameter, in a stable order (for optimizers and weight sync).
    pub fn named_parameters(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.params.named()
    }

    /// Backpropagates `loss` through the model ([`crate::Backbone::backward`]: layer by layer
    /// when checkpointing or sharding is installed). Use it instead of `loss.backward()`.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        self.backbone.backward(loss)
    }

    /// Projects hidden states `[.., hidden]` to logits `[.., vocab]`.
    pub fn lm_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => Ok(hidden.f_linear::<Tensor>(&self.backbone.embed_tokens, None)?),
        }
    }

    /// Logits `[batch, seq, vocab]` for a batch of ids with its attention mask and optional
    /// explicit positions.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: Option<&Tensor>,
    ) -> Result<Tensor> {
        let hidden = self.backbone.forward(input_ids, attention_mask, position_ids)?;
        self.lm_logits(&hidden)
    }

    /// Logits `[batch, seq, vocab]` of packed rows (see [`crate::Backbone::forward_packed`]:
    /// `segment_ids` numbers each row's samples from 1, 0 is padding).
    pub fn forward_packed(&self, input_ids: &Tensor, segment_ids: &Tensor) -> Result<Tensor> {
        let hidden = self.backbone.forward_packed(input_ids, segment_ids)?;
        self.lm_logits(&hidden)
    }

    /// Logits predicting the response tokens, `[batch, R, vocab]` (only those columns are
    /// projected to the vocabulary, which saves memory on long prompts).
    pub fn response_logits(&self, batch: &ResponseBatch) -> Result<Tensor> {
        let (start, len) = batch.output_columns()?;
        let hidden = self.backbone.forward(&batch.input_ids, &batch.attention_mask, None)?;
        self.lm_logits(&hidden.f_narrow(1, start, len)?)
    }

    /// Log-probs of the response tokens, `[batch, R]` float32, zero where the action mask is 0.
    pub fn response_log_probs(&self, batch: &ResponseBatch) -> Result<Tensor> {
        let logits = self.response_logits(batch)?;
        let log_probs = token_log_probs(&logits, &batch.response_ids()?)?;
        let mask = batch.action_mask.f_to_device(log_probs.device())?.f_ne(0)?;
        Ok(log_probs.f_mul(&mask.f_to_kind(Kind::Float)?)?)
    }
}
