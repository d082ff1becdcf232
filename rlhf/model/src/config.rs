//! The model configuration, read from and written to a Hugging Face `config.json`.
//!
//! One struct covers the Llama, Qwen2 and Qwen3 (dense) families: they differ in which
//! projections carry a bias (Qwen2: q, k and v; Llama and Qwen3: all four attention projections
//! when `attention_bias` is set), in Qwen3's RMSNorm of every query and key head (`q_norm`,
//! `k_norm`, over `head_dim`, before RoPE) and in their defaults. Fields this crate does not use are kept in [`ModelConfig::extra`] so a
//! loaded config is written back unchanged. Both the transformers 4 spelling of RoPE settings
//! (`rope_theta` + `rope_scaling`) and the transformers 5 one (`rope_parameters`) are accepted;
//! the 4 spelling is written, which transformers 5 still reads.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Which Hugging Face architecture a config describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelFamily {
    /// `model_type: "llama"`.
    Llama,
    /// `model_type: "mistral"`: Llama's layers, with `sliding_window` (when set) on every
    /// layer.
    Mistral,
    /// `model_type: "qwen2"`: bias on the q, k and v projections.
    Qwen2,
    /// `model_type: "qwen3"` (dense): an RMSNorm over each query and key head before RoPE, an
    /// explicit `head_dim`, biases only with `attention_bias`.
    Qwen3,
}

impl ModelFamily {
    /// The `architectures` entry transformers uses for the causal LM of this family.
    pub fn causal_lm_architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The `model_type` of its `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }
}

/// RoPE frequency scaling, as in the `rope_scaling` entry of a Hugging Face config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Position interpolation: every inverse frequency is divided by `factor`.
    Linear {
        /// The context extension factor.
        factor: f64,
    },
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        /// The context extension factor.
        factor: f64,
        /// Wavelengths longer than `original / low_freq_factor` are scaled fully.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: i64,
    },
}

/// Sliding-window attention (Mistral's `sliding_window`; Qwen2/Qwen3's `use_sliding_window`
/// with `sliding_window` and `max_window_layers` or `layer_types`): a query at position `i` of a
/// sliding layer attends the keys at positions `i - size + 1 ..= i` (transformers' `kv_idx >
/// q_idx - sliding_window`).
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Keys a query sees, itself included.
    pub size: i64,
    /// Per decoder layer: whether it slides (the others attend the whole context).
    pub layers: Vec<bool>,
}

/// A validated decoder-only LM configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Llama or Qwen2.
    pub family: ModelFamily,
    /// Rows of the embedding matrix (and of the LM head).
    pub vocab_size: i64,
    /// Width of the residual stream.
    pub hidden_size: i64,
    /// Width of the SwiGLU hidden layer.
    pub intermediate_size: i64,
    /// Number of decoder layers.
    pub num_hidden_layers: i64,
    /// Number of query heads.
    pub num_attention_heads: i64,
    /// Number of key/value heads (grouped-query attention when below `num_attention_heads`).
    pub num_key_value_heads: i64,
    /// Width of one head; `hidden_size / num_attention_heads` unless the config says otherwise.
    pub head_dim: i64,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Optional RoPE scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// Longest context the config declares (kept for the file; RoPE needs no table).
    pub max_position_embeddings: i64,
    /// Sliding-window attention, when some layers use it.
    pub sliding_window: Option<SlidingWindow>,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    /// Bias on the three MLP projections.
    pub mlp_bias: bool,
    /// Standard deviation of the normal init of weight matrices.
    pub initializer_range: f64,
    /// Token ids from the config, written back as they were.
    pub bos_token_id: Option<i64>,
    /// End-of-sequence token id.
    pub eos_token_id: Option<i64>,
    /// Padding token id.
    pub pad_token_id: Option<i64>,
    /// Every other field of the source `config.json`, written back unchanged.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// The raw `config.json` shape; validated into [`ModelConfig`].
#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: String,
    vocab_size: i64,
    hidden_size: i64,
    intermediate_size: i64,
    num_hidden_layers: i64,
    num_attention_heads: i64,
    num_key_value_heads: Option<i64>,
    head_dim: Option<i64>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    rope_parameters: Option<serde_json::Value>,
    max_position_embeddings: Option<i64>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    /// `None` when absent, `Some(Null)` when null: Mistral defaults an absent one to 4096.
    #[serde(default, deserialize_with = "present")]
    sliding_window: Option<serde_json::Value>,
    max_window_layers: Option<i64>,
    layer_types: Option<Vec<String>>,
    initializer_range: Option<f64>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
    pad_token_id: Option<serde_json::Value>,
    #[serde(flatten)]
    extra: serde_json::Map<String, serde_json::Value>,
}

/// Field names that [`ModelConfig::to_json`] writes itself and therefore drops from `extra`.
const OWNED_KEYS: &[&str] =
    &["architectures", "model_type", "torch_dtype", "dtype", "rope_parameters"];

impl ModelConfig {
    /// Reads and validates `<dir>/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let raw: RawConfig = serde_json::from_str(&text).map_err(|e| ModelError::json(&path, e))?;
        Self::from_raw(raw)
    }

    /// Parses and validates the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| ModelError::json("config.json", e))?;
        Self::from_raw(raw)
    }

    fn from_raw(raw: RawConfig) -> Result<Self> {
        let family = match raw.model_type.as_str() {
            "llama" => ModelFamily::Llama,
            "mistral" => ModelFamily::Mistral,
            "qwen2" => ModelFamily::Qwen2,
            "qwen3" => ModelFamily::Qwen3,
            other => {
                return Err(ModelError::Config(format!(
                    "model_type should be `llama`, `mistral`, `qwen2` or `qwen3`, found `{other}`"
                )));
            }
        };
        if let Some(act) = raw.hidden_act.as_deref()
            && act != "silu"
        {
            return Err(ModelError::Config(format!("hidden_act should be `silu`, found `{act}`")));
        }
        let sliding_window = sliding_window_of(&raw, family)?;
        // transformers 5 moves theta and scaling into `rope_parameters`.
        let rope_source = raw.rope_parameters.clone().or(raw.rope_scaling.clone());
        let mut rope_theta = raw.rope_theta;
        if rope_theta.is_none()
            && let Some(theta) = raw.rope_parameters.as_ref().and_then(|p| p.get("rope_theta"))
        {
            rope_theta = theta.as_f64();
        }
        let rope_scaling = parse_rope_scaling(rope_source.as_ref())?;
        let attention_bias = raw.attention_bias.unwrap_or(false);
        let (qkv_bias, o_bias) = match family {
            ModelFamily::Llama | ModelFamily::Mistral | ModelFamily::Qwen3 => {
                (attention_bias, attention_bias)
            }
            ModelFamily::Qwen2 => (true, false),
        };
        let num_key_value_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if raw.num_attention_heads > 0 => raw.hidden_size / raw.num_attention_heads,
            None => 0,
        };
        let mut extra = raw.extra;
        for key in OWNED_KEYS {
            extra.remove(*key);
        }
        let config = Self {
            family,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(2048),
            sliding_window,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            initializer_range: raw.initializer_range.unwrap_or(0.02),
            bos_token_id: token_id(raw.bos_token_id.as_ref()),
            eos_token_id: token_id(raw.eos_token_id.as_ref()),
            pad_token_id: token_id(raw.pad_token_id.as_ref()),
            extra,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks that every size is positive and that the heads divide evenly.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ];
        for (name, value) in positive {
            if value <= 0 {
                return Err(ModelError::Config(format!(
                    "{name} should be positive, found {value}"
                )));
            }
        }
        if let Some(window) = &self.sliding_window {
            if window.size <= 0 {
                return Err(ModelError::Config(format!(
                    "sliding_window should be positive, found {}",
                    window.size
                )));
            }
            if window.layers.len() as i64 != self.num_hidden_layers {
                return Err(ModelError::Config(format!(
                    "layer_types should name {} layers (num_hidden_layers), found {}",
                    self.num_hidden_layers,
                    window.layers.len()
                )));
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(ModelError::Config(format!(
                "num_attention_heads ({}) should be a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if self.head_dim % 2 != 0 {
            return Err(ModelError::Config(format!(
                "head_dim should be even for rotary embeddings, found {}",
                self.head_dim
            )));
        }
        let eps_ok = self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite();
        let theta_ok = self.rope_theta > 1.0 && self.rope_theta.is_finite();
        if !eps_ok || !theta_ok {
            return Err(ModelError::Config(format!(
                "rms_norm_eps should be > 0 and rope_theta > 1, found {} and {}",
                self.rms_norm_eps, self.rope_theta
            )));
        }
        Ok(())
    }

    /// Renders the config as a Hugging Face `config.json` object for the causal LM.
    pub fn to_json(&self) -> serde_json::Value {
        self.to_json_with_architecture(self.family.causal_lm_architecture())
    }

    /// Renders the config with a given `architectures` entry (for example a sequence
    /// classification head for reward models).
    pub fn to_json_with_architecture(&self, architecture: &str) -> serde_json::Value {
        let mut map = self.extra.clone();
        let mut set = |key: &str, value: serde_json::Value| {
            map.insert(key.to_string(), value);
        };
        set("architectures", serde_json::json!([architecture]));
        set("model_type", self.family.model_type().into());
        set("vocab_size", self.vocab_size.into());
        set("hidden_size", self.hidden_size.into());
        set("intermediate_size", self.intermediate_size.into());
        set("num_hidden_layers", self.num_hidden_layers.into());
        set("num_attention_heads", self.num_attention_heads.into());
        set("num_key_value_heads", self.num_key_value_heads.into());
        set("head_dim", self.head_dim.into());
        set("hidden_act", "silu".into());
        set("rms_norm_eps", self.rms_norm_eps.into());
        set("rope_theta", self.rope_theta.into());
        set(
            "rope_scaling",
            self.rope_scaling
                .as_ref()
                .map_or(serde_json::Value::Null, |s| serde_json::to_value(s).unwrap_or_default()),
        );
        set("max_position_embeddings", self.max_position_embeddings.into());
        set("tie_word_embeddings", self.tie_word_embeddings.into());
        set("initializer_range", self.initializer_range.into());
        set("torch_dtype", "float32".into());
        set("bos_token_id", self.bos_token_id.into());
        set("eos_token_id", self.eos_token_id.into());
        set("pad_token_id", self.pad_token_id.into());
        let window_size = self.sliding_window.as_ref().map(|w| w.size);
        let qwen_windows = |set: &mut dyn FnMut(&str, serde_json::Value)| {
            set("use_sliding_window", window_size.is_some().into());
            set("sliding_window", window_size.into());
            if let Some(window) = &self.sliding_window {
                let first = window.layers.iter().position(|&s| s).unwrap_or(window.layers.len());
                set("max_window_layers", (first as i64).into());
                let types: Vec<&str> = window
                    .layers
                    .iter()
                    .map(|&s| if s { "sliding_attention" } else { "full_attention" })
                    .collect();
                set("layer_types", types.into());
            }
        };
        match self.family {
            ModelFamily::Llama => {
                set("attention_bias", self.qkv_bias.into());
                set("mlp_bias", self.mlp_bias.into());
            }
            ModelFamily::Mistral => {
                set("sliding_window", window_size.into());
            }
            ModelFamily::Qwen2 => qwen_windows(&mut set),
            ModelFamily::Qwen3 => {
                set("attention_bias", self.qkv_bias.into());
                qwen_windows(&mut set);
            }
        }
        serde_json::Value::Object(map)
    }

    /// Writes `<dir>/config.json` for the causal LM.
    pub fn write_to_dir(&self, dir: &Path) -> Result<()> {
        write_json(&dir.join("config.json"), &self.to_json())
    }

    /// The window of decoder layer `layer`, when it slides.
    pub fn window_of(&self, layer: usize) -> Option<i64> {
        let window = self.sliding_window.as_ref()?;
        window.layers.get(layer).copied().unwrap_or(false).then_some(window.size)
    }

    /// Whether every query and key head is RMS-normalised before RoPE (Qwen3).
    pub fn qk_norm(&self) -> bool {
        self.family == ModelFamily::Qwen3
    }

    /// Parameter count of the causal LM (the LM head counted once when tied).
    pub fn num_parameters(&self) -> i64 {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let attn = h * q
            + 2 * h * kv
            + q * h
            + if self.qkv_bias { q + 2 * kv } else { 0 }
            + if self.o_bias { h } else { 0 };
        let mlp = 3 * h * self.intermediate_size
            + if self.mlp_bias { 2 * self.intermediate_size + h } else { 0 };
        let qk_norm = if self.qk_norm() { 2 * self.head_dim } else { 0 };
        let layer = attn + qk_norm + mlp + 2 * h;
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + head + self.num_hidden_layers * layer + h
    }
}

/// The sliding window a raw config declares, as transformers reads it: Mistral's
/// `sliding_window` on every layer; Qwen2/Qwen3's only with `use_sliding_window`, on the layers
/// `layer_types` marks `sliding_attention` or else from `max_window_layers` on; none for Llama.
fn sliding_window_of(raw: &RawConfig, family: ModelFamily) -> Result<Option<SlidingWindow>> {
    let size = match &raw.sliding_window {
        // transformers' MistralConfig default.
        None if family == ModelFamily::Mistral => Some(4096),
        None | Some(serde_json::Value::Null) => None,
        Some(value) => Some(value.as_i64().ok_or_else(|| {
            ModelError::Config(format!(
                "sliding_window should be an integer or null, found {value}"
            ))
        })?),
    };
    if let Some(size) = size.filter(|&size| size <= 0) {
        return Err(ModelError::Config(format!("sliding_window should be positive, found {size}")));
    }
    let layers = raw.num_hidden_layers.max(0) as usize;
    match family {
        ModelFamily::Llama => Ok(None),
        ModelFamily::Mistral => {
            Ok(size.map(|size| SlidingWindow { size, layers: vec![true; layers] }))
        }
        ModelFamily::Qwen2 | ModelFamily::Qwen3 => {
            let Some(size) = size.filter(|_| raw.use_sliding_window == Some(true)) else {
                return Ok(None);
            };
            let sliding = match &raw.layer_types {
                Some(types) => types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(true),
                        "full_attention" => Ok(false),
                        other => Err(ModelError::Config(format!(
                            "layer_types entries should be `full_attention` or \
                             `sliding_attention`, found `{other}`"
                        ))),
                    })
                    .collect::<Result<Vec<bool>>>()?,
                None => {
                    let first = raw.max_window_layers.unwrap_or(28).max(0) as usize;
                    (0..layers).map(|i| i >= first).collect()
                }
            };
            Ok(sliding.contains(&true).then_some(SlidingWindow { size, layers: sliding }))
        }
    }
}

/// Deserialises a field that is present (null included) as `Some`.
fn present<'de, D: serde::Deserializer<'de>>(
    de: D,
) -> std::result::Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(de).map(Some)
}

/// Writes pretty JSON to a file.
pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| ModelError::json(path, e))?;
    std::fs::write(path, text + "\n").map_err(|e| ModelError::io(path, e))
}

/// Reads a token id that configs spell as a number, a list (first entry wins) or null.
fn token_id(value: Option<&serde_json::Value>) -> Option<i64> {
    match value? {
        serde_json::Value::Number(n) => n.as_i64(),
        serde_json::Value::Array(items) => items.first().and_then(serde_json::Value::as_i64),
        _ => None,
    }
}

/// Parses `rope_scaling` / `rope_parameters`; `default` (or absent) means no scaling.
fn parse_rope_scaling(value: Option<&serde_json::Value>) -> Result<Option<RopeScaling>> {
    let Some(value) = value else { return Ok(None) };
    if value.is_null() {
        return Ok(None);
    }
    let kind = value
        .get("rope_type")
        .or_else(|| value.get("type"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| -> Result<f64> {
        value.get(key).and_then(serde_json::Value::as_f64).ok_or_else(|| {
            ModelError::Config(format!("rope scaling `{kind}` should have a number `{key}`"))
        })
    };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear { factor: number("factor")? })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: number("original_max_position_embeddings")? as i64,
        })),
        other => Err(ModelError::Config(format!(
            "rope scaling type should be `default`, `linear` or `llama3`, found `{other}`"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN2: &str = r#"{
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": true, "hidden_act": "silu",
        "use_sliding_window": false, "sliding_window": 32768, "bos_token_id": 151643,
        "eos_token_id": 151645, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"
    }"#;

    #[test]
    fn qwen2_config_parses_with_qkv_bias_and_gqa() {
        let config = ModelConfig::from_json_str(QWEN2).unwrap();
        assert_eq!(config.family, ModelFamily::Qwen2);
        assert!(config.qkv_bias && !config.o_bias);
        assert_eq!(config.head_dim, 64);
        assert_eq!(config.num_key_value_heads, 2);
        assert!(config.tie_word_embeddings);
        // `sliding_window` without `use_sliding_window`: transformers attends everything.
        assert_eq!(config.sliding_window, None);
        // Qwen2-0.5B has 494M parameters.
        assert_eq!(config.num_parameters(), 494_032_768);
    }

    /// Qwen3-0.6B's config as its hub repository has it.
    const QWEN3: &str = r#"{
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
        "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
    }"#;

    #[test]
    fn qwen3_config_parses_with_head_norms_and_an_explicit_head_dim() {
        let config = ModelConfig::from_json_str(QWEN3).unwrap();
        assert_eq!(config.family, ModelFamily::Qwen3);
        assert!(config.qk_norm() && !config.qkv_bias && !config.o_bias);
        // 16 heads of 128 are wider than the 1024 residual stream.
        assert_eq!((config.head_dim, config.num_attention_heads), (128, 16));
        // Qwen3-0.6B has 596M parameters (the q/k norms included).
        assert_eq!(config.num_parameters(), 596_049_920);
        let json = config.to_json();
        assert_eq!(json["model_type"], "qwen3");
        assert_eq!(json["architectures"][0], "Qwen3ForCausalLM");
        assert_eq!(ModelConfig::from_json_str(&json.to_string()).unwrap(), config);
        let unknown = QWEN3.replace("\"qwen3\"", "\"qwen3_moe\"");
        let err = ModelConfig::from_json_str(&unknown).unwrap_err().to_string();
        assert!(err.contains("model_type") && err.contains("qwen3_moe"), "{err}");
    }

    #[test]
    fn sliding_windows_are_read_as_transformers_reads_them() {
        let with = |family: &str, extra: &str| {
            let text = format!(
                r#"{{"model_type": "{family}", "vocab_size": 10, "hidden_size": 8,
                "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2
                {extra}}}"#
            );
            ModelConfig::from_json_str(&text)
        };
        let layers = |c: &ModelConfig| (0..3).map(|i| c.window_of(i)).collect::<Vec<_>>();
        // Mistral: every layer.
        let mistral = with("mistral", r#", "sliding_window": 4096"#).unwrap();
        assert_eq!(mistral.family, ModelFamily::Mistral);
        assert_eq!(layers(&mistral), [Some(4096); 3]);
        // Absent, it is transformers' default 4096.
        assert_eq!(with("mistral", "").unwrap(), mistral);
        assert_eq!(with("mistral", r#", "sliding_window": null"#).unwrap().sliding_window, None);
        // Qwen2: only with use_sliding_window, from max_window_layers on.
        let off = with("qwen2", r#", "sliding_window": 64, "max_window_layers": 1"#).unwrap();
        assert_eq!(off.sliding_window, None);
        let on = r#", "use_sliding_window": true, "sliding_window": 64, "max_window_layers": 1"#;
        let qwen2 = with("qwen2", on).unwrap();
        assert_eq!(layers(&qwen2), [None, Some(64), Some(64)]);
        // transformers 5's layer_types win.
        let types = r#", "use_sliding_window": true, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]"#;
        let qwen3 = with("qwen3", types).unwrap();
        assert_eq!(layers(&qwen3), [Some(8), None, Some(8)]);
        // Written back so transformers reads the same windows, and read back equal.
        for config in [&mistral, &qwen2, &qwen3] {
            let again = ModelConfig::from_json_str(&config.to_json().to_string()).unwrap();
            assert_eq!(&again, config);
        }
        // Bad values name the key.
        let bad =
            with("qwen3", r#", "use_sliding_window": true, "sliding_window": 0"#).unwrap_err();
        assert!(bad.to_string().contains("sliding_window"), "{bad}");
        let bad = with("mistral", r#", "sliding_window": "wide""#).unwrap_err();
        assert!(bad.to_string().contains("sliding_window"), "{bad}");
        let types = r#", "use_sliding_window": true, "sliding_window": 8,
            "layer_types": ["sliding_attention"]"#;
        let bad = with("qwen2", types).unwrap_err();
        assert!(bad.to_string().contains("layer_types"), "{bad}");
        let types = r#", "use_sliding_window": true, "sliding_window": 8,
            "layer_types": ["chunked_attention", "full_attention", "full_attention"]"#;
        let bad = with("qwen2", types).unwrap_err();
        assert!(bad.to_string().contains("chunked_attention"), "{bad}");
    }

    #[test]
    fn config_round_trips_through_json() {
        let config = ModelConfig::from_json_str(QWEN2).unwrap();
        let again = ModelConfig::from_json_str(&config.to_json().to_string()).unwrap();
        assert_eq!(config, again);
    }

    #[test]
    fn rope_parameters_of_transformers_5_are_read() {
        let text = r#"{"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}}"#;
        let config = ModelConfig::from_json_str(text).unwrap();
        assert_eq!(config.rope_theta, 500_000.0);
        assert!(matches!(config.rope_scaling, Some(RopeScaling::Llama3 { factor: 8.0, .. })));
    }

    #[test]
    fn bad_configs_are_errors_not_panics() {
        let bad_heads = r#"{"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 3,
            "num_key_value_heads": 2}"#;
        let err = ModelConfig::from_json_str(bad_heads).unwrap_err().to_string();
        assert!(err.contains("multiple of num_key_value_heads"), "{err}");
        let zero_heads = r#"{"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 0}"#;
        assert!(ModelConfig::from_json_str(zero_heads).is_err());
        let gpt2 = r#"{"model_type": "gpt2", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}"#;
        assert!(ModelConfig::from_json_str(gpt2).unwrap_err().to_string().contains("gpt2"));
        assert!(ModelConfig::from_json_str("{").is_err());
    }
}
