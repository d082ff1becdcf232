//! Writes the tiny parity checkpoints, their fixed inputs and our own outputs into
//! `rlhf/model/parity/<name>/`, for `parity/make_golden.py` to check against `transformers`.
//!
//! Run: `cargo run -p rtrun-rlhf-model --example write_parity_models [CASE...]` (all cases
//! without arguments).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Result;
use rtrun_rlhf_model::safetensors_io::write_file;
use rtrun_rlhf_model::tch::{self, Kind, Tensor};
use rtrun_rlhf_model::tiny::{tiny_config, write_tiny_model};
use rtrun_rlhf_model::{
    CausalLm, LoraConfig, ModelConfig, ModelFamily, ResponseBatch, SaveOptions, ScalarHeadModel,
    SlidingWindow,
};

/// Two rows of 12 tokens: the first left-padded by 3, the second right-padded by 2; the last 5
/// columns are the response, whose mask excludes the second row's padding.
fn fixed_inputs() -> (Tensor, Tensor, Tensor) {
    let ids: [i64; 24] =
        [0, 0, 0, 1, 17, 250, 33, 99, 7, 301, 12, 2, 1, 40, 41, 42, 200, 383, 5, 64, 128, 2, 0, 0];
    let mask: [i64; 24] = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0];
    let action: [i64; 10] = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0];
    (
        Tensor::from_slice(&ids).view([2, 12]),
        Tensor::from_slice(&mask).view([2, 12]),
        Tensor::from_slice(&action).view([2, 5]),
    )
}

/// A peft adapter directory for the qwen3 case's checkpoint (rank 4 on every projection, `B`
/// drawn so that it changes the outputs) with the adapted model's logits on the fixed inputs.
fn write_lora_case(root: &std::path::Path) -> Result<()> {
    let base = root.join("qwen3");
    let mut model = CausalLm::from_pretrained(&base, tch::Device::Cpu, Kind::Float)?;
    let settings =
        LoraConfig { rank: 4, alpha: 8.0, dropout: 0.0, target_modules: vec!["all-linear".into()] };
    model.add_lora(&settings, 77)?;
    let mut rng = rtrun_rlhf_model::params::SeededNormal::new(78);
    tch::no_grad(|| -> Result<()> {
        for (name, t) in model.lora_parameters().expect("adapters").named() {
            if name.ends_with("lora_B.weight") {
                let value = rng.tensor(&t.size(), 0.2)?;
                t.shallow_clone().f_copy_(&value)?;
            }
        }
        Ok(())
    })?;
    let dir = root.join("qwen3-lora");
    model.save_adapter(&dir, "../qwen3")?;
    let (input_ids, attention_mask, _) = fixed_inputs();
    let logits = tch::no_grad(|| model.forward(&input_ids, &attention_mask, None))?;
    write_file(
        &dir.join("inputs.safetensors"),
        [("input_ids", &input_ids), ("attention_mask", &attention_mask)],
        HashMap::new(),
    )?;
    write_file(&dir.join("ours.safetensors"), [("logits", &logits)], HashMap::new())?;
    println!("wrote {}", dir.display());
    Ok(())
}

fn main() -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("parity");
    // Sliding windows shorter than the inputs (9 and 10 real tokens): Qwen2's on its second
    // layer only (`max_window_layers: 1`), Mistral's on both.
    let window = |size, layers: &[bool]| Some(SlidingWindow { size, layers: layers.to_vec() });
    let qwen2_sw = ModelConfig {
        sliding_window: window(4, &[false, true]),
        ..tiny_config(ModelFamily::Qwen2)
    };
    let mistral_sw = ModelConfig {
        sliding_window: window(5, &[true, true]),
        rope_scaling: None,
        ..tiny_config(ModelFamily::Mistral)
    };
    let cases = [
        ("llama", tiny_config(ModelFamily::Llama), 11u64, SaveOptions::default()),
        // Sharded on purpose, so transformers reads our index file too.
        ("qwen2", tiny_config(ModelFamily::Qwen2), 22, SaveOptions { max_shard_bytes: 200_000 }),
        ("qwen3", tiny_config(ModelFamily::Qwen3), 44, SaveOptions::default()),
        ("qwen2-sw", qwen2_sw, 55, SaveOptions::default()),
        ("mistral-sw", mistral_sw, 66, SaveOptions::default()),
    ];
    let only: Vec<String> = std::env::args().skip(1).collect();
    for (name, config, seed, options) in cases {
        if !only.is_empty() && !only.iter().any(|o| o == name) {
            continue;
        }
        let dir = root.join(name);
        let model = write_tiny_model(&dir, &config, seed, &options)?;
        let (input_ids, attention_mask, action_mask) = fixed_inputs();
        let logits = model.forward(&input_ids, &attention_mask, None)?;
        let batch = ResponseBatch { input_ids, attention_mask, action_mask };
        let log_probs = model.response_log_probs(&batch)?;
        write_file(
            &dir.join("inputs.safetensors"),
            [
                ("input_ids", &batch.input_ids),
                ("attention_mask", &batch.attention_mask),
                ("action_mask", &batch.action_mask),
            ],
            HashMap::new(),
        )?;
        let logits = logits.to_kind(Kind::Float);
        write_file(
            &dir.join("ours.safetensors"),
            [("logits", &logits), ("response_log_probs", &log_probs)],
            HashMap::new(),
        )?;
        println!("wrote {}", dir.display());
    }

    if only.is_empty() || only.iter().any(|o| o == "qwen3-lora") {
        write_lora_case(&root)?;
    }
    if !only.is_empty() && !only.iter().any(|o| o == "qwen2-rm") {
        return Ok(());
    }
    // A reward model (Qwen2ForSequenceClassification, one label) with its rewards.
    let dir = root.join("qwen2-rm");
    let config = tiny_config(ModelFamily::Qwen2);
    let model = ScalarHeadModel::new_random(&config, tch::Device::Cpu, Kind::Float, 33)?;
    model.save_pretrained(&dir, &SaveOptions::default())?;
    let (input_ids, attention_mask, action_mask) = fixed_inputs();
    let rewards = model.rewards(&input_ids, &attention_mask)?;
    write_file(
        &dir.join("inputs.safetensors"),
        [
            ("input_ids", &input_ids),
            ("attention_mask", &attention_mask),
            ("action_mask", &action_mask),
        ],
        HashMap::new(),
    )?;
    write_file(&dir.join("ours.safetensors"), [("rewards", &rewards)], HashMap::new())?;
    println!("wrote {}", dir.display());
    Ok(())
}
