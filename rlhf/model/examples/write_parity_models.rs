//! Writes the tiny parity checkpoints, their fixed inputs and our own outputs into
//! `rlhf/model/parity/<name>/`, for `parity/make_golden.py` to check against `transformers`.
//!
//! Run: `cargo run -p rtrun-rlhf-model --example write_parity_models`.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Result;
use rtrun_rlhf_model::safetensors_io::write_file;
use rtrun_rlhf_model::tch::{self, Kind, Tensor};
use rtrun_rlhf_model::tiny::{tiny_config, write_tiny_model};
use rtrun_rlhf_model::{ModelFamily, ResponseBatch, SaveOptions, ScalarHeadModel};

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

fn main() -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("parity");
    let cases = [
        ("llama", ModelFamily::Llama, 11u64, SaveOptions::default()),
        // Sharded on purpose, so transformers reads our index file too.
        ("qwen2", ModelFamily::Qwen2, 22, SaveOptions { max_shard_bytes: 200_000 }),
        ("qwen3", ModelFamily::Qwen3, 44, SaveOptions::default()),
    ];
    for (name, family, seed, options) in cases {
        let dir = root.join(name);
        let model = write_tiny_model(&dir, &tiny_config(family), seed, &options)?;
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
