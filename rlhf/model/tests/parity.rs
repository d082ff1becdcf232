//! Parity with Hugging Face `transformers`: our forward on the committed tiny checkpoints must
//! match the golden logits and log-probs that `parity/make_golden.py` computed with
//! transformers, within 1e-4 (fp32). Covers a Llama-style config (GQA 4/2, untied head, linear
//! RoPE scaling) and a Qwen2-style one (GQA 4/1, qkv bias, tied embeddings, sharded files).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rtrun_rlhf_model::safetensors_io::read_file;
use rtrun_rlhf_model::tch::{Device, Kind, Tensor};
use rtrun_rlhf_model::{CausalLm, ResponseBatch, ScalarHeadModel, TextTokenizer};

const TOLERANCE: f64 = 1e-4;

fn case_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("parity").join(name)
}

fn tensor(dir: &Path, file: &str, name: &str) -> Result<Tensor> {
    let (tensors, _) = read_file(&dir.join(file))?;
    tensors
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t)
        .with_context(|| format!("{file} lacks {name}"))
}

fn check_case(name: &str) -> Result<()> {
    let dir = case_dir(name);
    let model = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float)?;
    let input_ids = tensor(&dir, "inputs.safetensors", "input_ids")?;
    let attention_mask = tensor(&dir, "inputs.safetensors", "attention_mask")?;
    let action_mask = tensor(&dir, "inputs.safetensors", "action_mask")?;
    let golden_logits = tensor(&dir, "golden.safetensors", "logits")?;
    let golden_log_probs = tensor(&dir, "golden.safetensors", "response_log_probs")?;

    let logits =
        rtrun_rlhf_model::tch::no_grad(|| model.forward(&input_ids, &attention_mask, None))?;
    // Only real tokens count: outputs at padding positions are unspecified in both libraries.
    let real = attention_mask.ne(0).unsqueeze(-1).to_kind(Kind::Float);
    let logit_diff = ((&logits - &golden_logits).abs() * &real).max().double_value(&[]);
    assert!(logit_diff < TOLERANCE, "{name}: logits differ from transformers by {logit_diff:e}");

    let batch = ResponseBatch { input_ids, attention_mask, action_mask };
    let log_probs = rtrun_rlhf_model::tch::no_grad(|| model.response_log_probs(&batch))?;
    let lp_diff = (&log_probs - &golden_log_probs).abs().max().double_value(&[]);
    assert!(lp_diff < TOLERANCE, "{name}: log-probs differ from transformers by {lp_diff:e}");

    // The tokenizer we trained and saved encodes like transformers' fast tokenizer.
    let (_, metadata) = read_file(&dir.join("golden.safetensors"))?;
    let text = metadata.get("tokenizer_text").context("golden file lacks tokenizer_text")?;
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    let ids: Vec<i64> = tokenizer.encode(text, false)?.into_iter().map(i64::from).collect();
    let golden_ids = Vec::<i64>::try_from(tensor(&dir, "golden.safetensors", "tokenizer_ids")?)?;
    assert_eq!(ids, golden_ids, "{name}: tokenizer ids differ from transformers");
    Ok(())
}

#[test]
fn llama_style_forward_matches_transformers() -> Result<()> {
    check_case("llama")
}

#[test]
fn qwen2_style_forward_matches_transformers() -> Result<()> {
    check_case("qwen2")
}

#[test]
fn qwen3_style_forward_matches_transformers() -> Result<()> {
    check_case("qwen3")
}

/// Sequences longer than the sliding window: Qwen2's on its second layer only, Mistral's on
/// every layer.
#[test]
fn sliding_window_forwards_match_transformers() -> Result<()> {
    check_case("qwen2-sw")?;
    check_case("mistral-sw")
}

#[test]
fn reward_model_matches_transformers_sequence_classification() -> Result<()> {
    let dir = case_dir("qwen2-rm");
    let model = ScalarHeadModel::from_pretrained(&dir, Device::Cpu, Kind::Float, 0)?;
    let input_ids = tensor(&dir, "inputs.safetensors", "input_ids")?;
    let attention_mask = tensor(&dir, "inputs.safetensors", "attention_mask")?;
    let golden = tensor(&dir, "golden.safetensors", "rewards")?;
    let rewards = rtrun_rlhf_model::tch::no_grad(|| model.rewards(&input_ids, &attention_mask))?;
    let diff = (&rewards - &golden).abs().max().double_value(&[]);
    assert!(diff < TOLERANCE, "rewards differ from transformers by {diff:e}");
    Ok(())
}
