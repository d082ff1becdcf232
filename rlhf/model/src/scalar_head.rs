//! The trunk with a scalar head per token: the critic (value per token) and the reward model
//! (value read at the last real token).
//!
//! The head is `score.weight` (`[1, hidden]`, no bias), the name both OpenRLHF's default
//! `value_head_prefix` and transformers' `*ForSequenceClassification` use, so a reward model
//! saved here loads as `LlamaForSequenceClassification` / `Qwen2ForSequenceClassification` with
//! `num_labels = 1`.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::backbone::Backbone;
use crate::config::{ModelConfig, ModelFamily, write_json};
use crate::error::{ModelError, Result};
use crate::layers::Linear;
use crate::logprobs::{ResponseBatch, last_token_index};
use crate::params::Parameters;
use crate::pretrained::{load_into, save_params};
use crate::safetensors_io::SaveOptions;

/// Hugging Face name of the scalar head weight.
pub const SCORE_WEIGHT: &str = "score.weight";

/// A trunk plus a `hidden -> 1` head.
#[derive(Debug)]
pub struct ScalarHeadModel {
    /// Every weight under its Hugging Face name.
    pub params: Parameters,
    /// Embedding, layers and final norm.
    pub backbone: Backbone,
    /// The `[1, hidden]` head.
    pub score: Linear,
    /// LoRA adapters ([`ScalarHeadModel::add_lora`]): the trunk frozen, the head trained.
    pub lora: Option<crate::lora::Lora>,
}

impl ScalarHeadModel {
    /// A randomly initialised model; see [`crate::CausalLm::new_random`].
    pub fn new_random(config: &ModelConfig, device: Device, kind: Kind, seed: u64) -> Result<Self> {
        Self::build(config, device, kind, seed)
    }

    fn build(config: &ModelConfig, device: Device, kind: Kind, seed: u64) -> Result<Self> {
        let mut params = Parameters::new(device, kind, seed);
        let backbone = Backbone::new(&mut params, config)?;
        let score = Self::head(&mut params, config)?;
        Ok(Self { params, backbone, score, lora: None })
    }

    /// Registers the `[1, hidden]` head; OpenRLHF initialises a fresh value head with std
    /// 1 / (hidden + 1).
    fn head(params: &mut Parameters, config: &ModelConfig) -> Result<Linear> {
        let std = 1.0 / (config.hidden_size as f64 + 1.0);
        Linear::new(params, "score", config.hidden_size, 1, false, std)
    }

    /// Loads a checkpoint directory. A checkpoint without `score.weight` (a causal LM, which is
    /// how a critic usually starts) keeps a fresh head drawn from `seed`.
    ///
    /// The trunk is allocated without a random init first: the load fails unless the
    /// checkpoint holds every trunk tensor (see [`Parameters::for_loading`]). The head alone is
    /// drawn, from a stream of its own, so it does not depend on the trunk's size.
    pub fn from_pretrained(dir: &Path, device: Device, kind: Kind, seed: u64) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let mut params = Parameters::for_loading(device, kind);
        let backbone = Backbone::new(&mut params, &config)?;
        params.draw_from(seed);
        let score = Self::head(&mut params, &config)?;
        let model = Self { params, backbone, score, lora: None };
        let absent = load_into(&model.params, dir, &[SCORE_WEIGHT])?;
        if !absent.is_empty() {
            tracing::info!(dir = %dir.display(), "checkpoint has no score head; initialised a fresh one");
        }
        Ok(model)
    }

    /// Writes a `*ForSequenceClassification` checkpoint with one label.
    pub fn save_pretrained(&self, dir: &Path, options: &SaveOptions) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let config = self.config();
        let architecture = match config.family {
            ModelFamily::Llama => "LlamaForSequenceClassification",
            ModelFamily::Mistral => "MistralForSequenceClassification",
            ModelFamily::Qwen2 => "Qwen2ForSequenceClassification",
            ModelFamily::Qwen3 => "Qwen3ForSequenceClassification",
        };
        let mut json = config.to_json_with_architecture(architecture);
        if let Some(map) = json.as_object_mut() {
            map.insert("num_labels".into(), 1.into());
            map.insert("id2label".into(), serde_json::json!({"0": "LABEL_0"}));
            map.insert("label2id".into(), serde_json::json!({"LABEL_0": 0}));
        }
        write_json(&dir.join("config.json"), &json)?;
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

    /// Backpropagates `loss` through the model ([`crate::Backbone::backward`]: layer by layer
    /// when checkpointing or sharding is installed). Use it instead of `loss.backward()`.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        self.backbone.backward(loss)
    }

    /// `(name, tensor)` for every parameter, in a stable order.
    pub fn named_parameters(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.params.named()
    }

    /// The scalar at every position, `[batch, seq]` float32.
    pub fn values(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: Option<&Tensor>,
    ) -> Result<Tensor> {
        let hidden = self.backbone.forward(input_ids, attention_mask, position_ids)?;
        Ok(self.score.forward(&hidden)?.f_squeeze_dim(-1)?.f_to_kind(Kind::Float)?)
    }

    /// Critic values of the states before each response token, `[batch, R]`, zero where the
    /// action mask is 0 (OpenRLHF's `values[:, :-1][:, -R:]`).
    pub fn action_values(&self, batch: &ResponseBatch) -> Result<Tensor> {
        let (start, len) = batch.output_columns()?;
        let values = self.values(&batch.input_ids, &batch.attention_mask, None)?;
        let mask = batch.action_mask.f_to_device(values.device())?.f_ne(0)?;
        Ok(values.f_narrow(1, start, len)?.f_mul(&mask.f_to_kind(Kind::Float)?)?)
    }

    /// Reward-model scores: the scalar at the last real token of each row, `[batch]`.
    pub fn rewards(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let values = self.values(input_ids, attention_mask, None)?;
        let last = last_token_index(&attention_mask.f_to_device(values.device())?)?;
        Ok(values.f_gather(1, &last.f_unsqueeze(1)?, false)?.f_squeeze_dim(1)?)
    }
}
