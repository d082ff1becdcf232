//! Making the initial policy: a tiny Qwen2-style decoder sized for the task's character
//! vocabulary, a short supervised warm-up on `(prompt, label)` pairs, saved as a Hugging Face
//! directory that every role and engine loads (it is also the frozen reference model, as
//! OpenRLHF's `--pretrain` is).

use std::path::Path;

use tch::{Device, Kind};

use rtrun_rlhf_model::train::{AdamW, OptimizerConfig, ScheduleConfig, masked_mean};
use rtrun_rlhf_model::{CausalLm, ModelConfig, ModelFamily, SaveOptions};

use crate::config::{ModelShape, WarmupConfig};
use crate::demo::chars::{BOS_ID, CharTokenizer, EOS_ID, PAD_ID};
use crate::error::Result;
use crate::experience::{Sequence, response_batch};
use crate::prompts::PromptRecord;
use crate::rng::SplitMix64;

/// The policy's config: the tiny Qwen2 family at `shape`, with the character vocabulary.
pub fn policy_config(shape: &ModelShape, max_positions: i64) -> ModelConfig {
    let mut config = rtrun_rlhf_model::tiny::tiny_config(ModelFamily::Qwen2);
    config.vocab_size = CharTokenizer::VOCAB_SIZE as i64;
    config.hidden_size = shape.hidden_size;
    config.num_hidden_layers = shape.num_layers;
    config.num_attention_heads = shape.num_heads;
    config.num_key_value_heads = shape.num_kv_heads;
    config.head_dim = shape.hidden_size / shape.num_heads;
    config.intermediate_size = shape.intermediate_size;
    config.max_position_embeddings = max_positions.max(16);
    config.initializer_range = 0.05;
    config.bos_token_id = Some(i64::from(BOS_ID));
    config.eos_token_id = Some(i64::from(EOS_ID));
    config.pad_token_id = Some(i64::from(PAD_ID));
    config
}

/// The supervised sequence of a record: prompt, then label and `<eos>` as the response.
pub fn supervised_sequence(record: &PromptRecord) -> Result<Sequence> {
    let tok = CharTokenizer;
    let mut response_ids = tok.encode(&record.label)?;
    response_ids.push(EOS_ID);
    Ok(Sequence::new(tok.encode_prompt(&record.prompt)?, response_ids))
}

/// What the warm-up did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupReport {
    /// Mean token loss of the first step.
    pub first_loss: f64,
    /// Mean token loss of the last step.
    pub last_loss: f64,
    /// Steps run.
    pub steps: u64,
}

/// Creates a seeded random policy, trains it for `warmup.steps` on random batches of `records`
/// and saves it to `dir`.
pub fn make_initial_policy(
    dir: &Path,
    config: &ModelConfig,
    warmup: &WarmupConfig,
    records: &[PromptRecord],
    seed: u64,
) -> Result<WarmupReport> {
    let sequences = records.iter().map(supervised_sequence).collect::<Result<Vec<_>>>()?;
    train_supervised(dir, config, warmup, &sequences, seed)
}

/// Creates a seeded random model of `config`, trains it for `warmup.steps` on random batches of
/// `sequences` (loss on the response tokens) and saves it to `dir`.
pub fn train_supervised(
    dir: &Path,
    config: &ModelConfig,
    warmup: &WarmupConfig,
    sequences: &[Sequence],
    seed: u64,
) -> Result<WarmupReport> {
    if sequences.is_empty() {
        return Err(crate::TrainError::Data("supervised warm-up: no sequences".to_owned()));
    }
    let model = CausalLm::new_random(config, Device::Cpu, Kind::Float, seed)?;
    let optimizer_config = OptimizerConfig {
        schedule: ScheduleConfig {
            peak_lr: warmup.lr,
            warmup_steps: (warmup.steps / 10).max(1),
            total_steps: warmup.steps.max(1),
            min_lr_ratio: 0.1,
        },
        ..OptimizerConfig::default()
    };
    let mut optimizer = AdamW::new(model.named_parameters(), optimizer_config)?;
    let mut rng = SplitMix64::new(seed ^ 0xFEED);
    let mut report =
        WarmupReport { first_loss: f64::NAN, last_loss: f64::NAN, steps: warmup.steps };
    for step in 0..warmup.steps {
        let batch: Vec<&Sequence> = (0..warmup.batch_size)
            .map(|_| &sequences[rng.below(sequences.len() as u64) as usize])
            .collect();
        let batch = response_batch(&batch, Device::Cpu)?;
        let log_probs = model.response_log_probs(&batch)?;
        let loss = masked_mean(&log_probs, &batch.action_mask)?.f_neg()?;
        let value = loss.f_double_value(&[])?;
        loss.f_backward()?;
        optimizer.step()?;
        if step == 0 {
            report.first_loss = value;
        }
        report.last_loss = value;
    }
    model.save_pretrained(dir, &SaveOptions::default())?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::task::TaskConfig;

    #[test]
    fn warm_up_lowers_the_loss_and_saves_a_loadable_model() {
        let dir = std::env::temp_dir().join(format!("rtrun-warmup-{}", std::process::id()));
        let task = TaskConfig { train_size: 256, eval_size: 1, ..Default::default() };
        let (train, _) = task.generate(1).unwrap();
        let shape = ModelShape {
            hidden_size: 32,
            num_layers: 1,
            num_heads: 2,
            num_kv_heads: 1,
            intermediate_size: 64,
        };
        let config = policy_config(&shape, 32);
        let warmup = WarmupConfig { steps: 12, batch_size: 16, lr: 1e-2 };
        let report = make_initial_policy(&dir, &config, &warmup, &train, 1).unwrap();
        assert!(report.last_loss < report.first_loss, "{report:?}");
        let loaded = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float).unwrap();
        assert_eq!(loaded.config().vocab_size, CharTokenizer::VOCAB_SIZE as i64);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
