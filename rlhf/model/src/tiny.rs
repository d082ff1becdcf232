//! Tiny models for tests, examples and parity checks, made entirely on this machine: a config,
//! seeded random weights and a byte-level BPE trained on a corpus shipped in the crate, written
//! as a real Hugging Face directory. Nothing is downloaded.

use std::path::Path;

use tch::{Device, Kind};

use crate::causal_lm::CausalLm;
use crate::config::{ModelConfig, ModelFamily, RopeScaling, write_json};
use crate::error::Result;
use crate::params::SeededNormal;
use crate::safetensors_io::SaveOptions;
use crate::tokenizer::TextTokenizer;

/// The training corpus of the tiny tokenizers.
pub const TINY_CORPUS: &str = include_str!("../assets/corpus.txt");

/// Special tokens of the tiny tokenizers, ids 0, 1 and 2.
pub const TINY_SPECIAL_TOKENS: [&str; 3] = ["<|pad|>", "<|bos|>", "<|eos|>"];

/// Vocabulary size of the tiny models (the trained tokenizer uses at most this many ids).
pub const TINY_VOCAB_SIZE: i64 = 384;

/// A tiny config of `family`:
/// - Llama: 2 layers, hidden 64, 4 query heads over 2 key/value heads, untied LM head, linear
///   RoPE scaling (factor 2).
/// - Qwen2: 2 layers, hidden 64, 4 query heads over 1 key/value head, qkv bias, tied
///   embeddings, theta 1e6.
pub fn tiny_config(family: ModelFamily) -> ModelConfig {
    let (kv_heads, tied, qkv_bias, theta, scaling, intermediate) = match family {
        ModelFamily::Llama | ModelFamily::Mistral => {
            (2, false, false, 10_000.0, Some(RopeScaling::Linear { factor: 2.0 }), 128)
        }
        ModelFamily::Qwen2 => (1, true, true, 1_000_000.0, None, 160),
        // Heads wider than hidden / heads (as Qwen3's 128 are), untied head.
        ModelFamily::Qwen3 => (2, false, false, 1_000_000.0, None, 96),
    };
    let head_dim = if family == ModelFamily::Qwen3 { 24 } else { 16 };
    ModelConfig {
        family,
        vocab_size: TINY_VOCAB_SIZE,
        hidden_size: 64,
        intermediate_size: intermediate,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: kv_heads,
        head_dim,
        rms_norm_eps: 1e-6,
        rope_theta: theta,
        rope_scaling: scaling,
        max_position_embeddings: 512,
        sliding_window: None,
        tie_word_embeddings: tied,
        qkv_bias,
        o_bias: false,
        mlp_bias: false,
        initializer_range: 0.1,
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        pad_token_id: Some(0),
        extra: serde_json::Map::new(),
    }
}

/// A ~25M-parameter Qwen2-style config for benchmarks: 6 layers, hidden 512, 8 query heads
/// over 4 key/value heads, vocabulary 16384, tied embeddings.
pub fn bench_config_25m() -> ModelConfig {
    ModelConfig {
        vocab_size: 16_384,
        hidden_size: 512,
        intermediate_size: 1376,
        num_hidden_layers: 6,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        head_dim: 64,
        initializer_range: 0.02,
        max_position_embeddings: 4096,
        ..tiny_config(ModelFamily::Qwen2)
    }
}

/// A ~110M-parameter Qwen2-style config: 12 layers, hidden 768, 12 query heads over 4
/// key/value heads (no replication at TP 2 or 4), vocabulary 32000, tied embeddings. The MLP
/// width 2432 (19 × 128, a multiple of 8 ranks) puts it at 110.7M parameters.
pub fn bench_config_110m() -> ModelConfig {
    ModelConfig {
        vocab_size: 32_000,
        hidden_size: 768,
        intermediate_size: 2432,
        num_hidden_layers: 12,
        num_attention_heads: 12,
        num_key_value_heads: 4,
        head_dim: 64,
        ..bench_config_25m()
    }
}

/// Trains the tiny tokenizer on [`TINY_CORPUS`].
pub fn tiny_tokenizer() -> Result<TextTokenizer> {
    TextTokenizer::train_byte_level_bpe(
        TINY_CORPUS.lines(),
        TINY_VOCAB_SIZE as usize,
        &TINY_SPECIAL_TOKENS,
    )
}

/// A random tiny model whose norm scales and biases are also random (not ones and zeros), so a
/// parity check exercises every weight.
pub fn tiny_model(config: &ModelConfig, seed: u64) -> Result<CausalLm> {
    let model = CausalLm::new_random(config, Device::Cpu, Kind::Float, seed)?;
    let mut rng = SeededNormal::new(seed ^ 0x5EED);
    tch::no_grad(|| -> Result<()> {
        for (name, param) in model.named_parameters() {
            if param.dim() == 1 {
                let noise = rng.tensor(&param.size(), 0.1)?;
                let value =
                    if name.ends_with("norm.weight") { noise.f_add_scalar(1.0)? } else { noise };
                param.shallow_clone().f_copy_(&value)?;
            }
        }
        Ok(())
    })?;
    Ok(model)
}

/// Writes a tiny model as a Hugging Face directory: `config.json`, safetensors weights (sharded
/// when `options` says so), `tokenizer.json` and a `tokenizer_config.json` naming the special
/// tokens. Returns the model.
pub fn write_tiny_model(
    dir: &Path,
    config: &ModelConfig,
    seed: u64,
    options: &SaveOptions,
) -> Result<CausalLm> {
    let model = tiny_model(config, seed)?;
    model.save_pretrained(dir, options)?;
    let tokenizer = tiny_tokenizer()?;
    tokenizer.save_to_dir(dir)?;
    let tokenizer_config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": TINY_SPECIAL_TOKENS[0],
        "bos_token": TINY_SPECIAL_TOKENS[1],
        "eos_token": TINY_SPECIAL_TOKENS[2],
        "model_max_length": config.max_position_embeddings,
    });
    write_json(&dir.join("tokenizer_config.json"), &tokenizer_config)?;
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_tokenizer_fits_the_tiny_vocabulary() {
        let tok = tiny_tokenizer().unwrap();
        assert!(tok.vocab_size() as i64 <= TINY_VOCAB_SIZE);
        assert_eq!(tok.token_to_id("<|eos|>"), Some(2));
    }

    #[test]
    fn bench_config_has_about_25m_parameters() {
        let n = bench_config_25m().num_parameters();
        assert!((24_000_000..27_000_000).contains(&n), "{n}");
    }
}
