//! Training behaviour on tiny models: memorisation, gradient wiring, accumulation, resume, and
//! the heads' padding invariance and input checks.

use std::path::PathBuf;

use anyhow::Result;
use rtrun_rlhf_model::tch::{self, Device, Kind, Tensor};
use rtrun_rlhf_model::tiny::{tiny_config, tiny_model};
use rtrun_rlhf_model::train::{
    AdamW, OptimizerConfig, ScheduleConfig, load_training_checkpoint, masked_cross_entropy,
    save_training_checkpoint,
};
use rtrun_rlhf_model::{CausalLm, ModelFamily, ResponseBatch, SaveOptions, ScalarHeadModel};

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rtrun-model-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn ids(values: &[i64], rows: i64) -> Tensor {
    Tensor::from_slice(values).view([rows, -1])
}

/// Next-token loss of a causal LM over a batch whose every token is real.
fn lm_loss(model: &CausalLm, input_ids: &Tensor) -> rtrun_rlhf_model::Result<Tensor> {
    let mask = input_ids.ones_like();
    let logits = model.forward(input_ids, &mask, None)?;
    let seq = input_ids.size()[1];
    let predictions = logits.narrow(1, 0, seq - 1);
    let targets = input_ids.narrow(1, 1, seq - 1);
    masked_cross_entropy(&predictions, &targets, &mask.narrow(1, 1, seq - 1))
}

fn optimizer_config(lr: f64, steps: u64) -> OptimizerConfig {
    OptimizerConfig {
        schedule: ScheduleConfig {
            peak_lr: lr,
            warmup_steps: 2,
            total_steps: steps,
            min_lr_ratio: 0.1,
        },
        weight_decay: 0.01,
        ..OptimizerConfig::default()
    }
}

#[test]
fn loss_goes_down_when_memorising_a_sequence() -> Result<()> {
    let model = tiny_model(&tiny_config(ModelFamily::Llama), 1)?;
    let batch = ids(
        &[
            1, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 2, 1, 7, 9, 11, 13, 15, 17,
            19, 21, 23, 25, 27, 29, 2,
        ],
        2,
    );
    let mut optimizer = AdamW::new(model.named_parameters(), optimizer_config(1e-2, 40))?;
    let first = lm_loss(&model, &batch)?.double_value(&[]);
    let mut last = first;
    for _ in 0..40 {
        let (_, loss) = optimizer.step_accumulated(&[&batch], |b| lm_loss(&model, b))?;
        last = loss;
    }
    assert!(last < 0.1 * first, "loss went from {first} to {last}");
    assert_eq!(optimizer.steps_taken(), 40);
    Ok(())
}

#[test]
fn gradients_reach_every_parameter() -> Result<()> {
    let batch = ResponseBatch {
        input_ids: ids(&[0, 1, 5, 6, 7, 8, 1, 9, 10, 11, 12, 0], 2),
        attention_mask: ids(&[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0], 2),
        action_mask: ids(&[1, 1, 1, 1, 1, 0], 2),
    };
    for family in [ModelFamily::Llama, ModelFamily::Qwen2, ModelFamily::Qwen3] {
        let config = tiny_config(family);
        let lm = tiny_model(&config, 3)?;
        let optimizer = AdamW::new(lm.named_parameters(), OptimizerConfig::default())?;
        lm.response_log_probs(&batch)?.sum(Kind::Float).backward();
        assert_eq!(optimizer.params_without_grad()?, Vec::<String>::new(), "{family:?} causal LM");

        let critic = ScalarHeadModel::new_random(&config, Device::Cpu, Kind::Float, 3)?;
        let optimizer = AdamW::new(critic.named_parameters(), OptimizerConfig::default())?;
        critic.action_values(&batch)?.sum(Kind::Float).backward();
        let missing = optimizer.params_without_grad()?;
        // Values are read before the last token, so its embedding row gets no gradient; every
        // parameter tensor still does.
        assert_eq!(missing, Vec::<String>::new(), "{family:?} critic");
    }
    Ok(())
}

#[test]
fn accumulated_micro_batches_equal_one_full_batch() -> Result<()> {
    let config = tiny_config(ModelFamily::Qwen2);
    let batch = ids(&[1, 20, 21, 22, 23, 2, 1, 30, 31, 32, 33, 2], 2);
    // A large epsilon makes the AdamW update a smooth function of the gradient (with the
    // default one, the first step is lr * sign(g), which amplifies rounding noise on
    // near-zero gradients), so equal parameters afterwards mean equal accumulated gradients.
    let config_with_eps = OptimizerConfig { eps: 1.0, ..optimizer_config(1e-1, 10) };
    let full = tiny_model(&config, 5)?;
    let mut full_opt = AdamW::new(full.named_parameters(), config_with_eps.clone())?;
    full_opt.step_accumulated(&[batch.shallow_clone()], |b| lm_loss(&full, b))?;

    let split = tiny_model(&config, 5)?;
    let mut split_opt = AdamW::new(split.named_parameters(), config_with_eps)?;
    let micro = [batch.narrow(0, 0, 1), batch.narrow(0, 1, 1)];
    split_opt.step_accumulated(&micro, |b| lm_loss(&split, b))?;

    let untouched = tiny_model(&config, 5)?;
    let mut moved = false;
    for (((name, a), (_, b)), (_, c)) in
        full.named_parameters().zip(split.named_parameters()).zip(untouched.named_parameters())
    {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(a.allclose(b, 1e-5, 1e-7, false), "{name} differs by {diff}");
        moved |= !a.allclose(c, 1e-6, 1e-6, false);
    }
    assert!(moved, "the step changed no parameter");
    Ok(())
}

#[test]
fn resumed_training_continues_identically() -> Result<()> {
    let config = tiny_config(ModelFamily::Llama);
    let batch = ids(&[1, 40, 41, 42, 43, 44, 45, 2], 1);
    let dir = temp_dir("resume");
    let model = tiny_model(&config, 7)?;
    let mut optimizer = AdamW::new(model.named_parameters(), optimizer_config(5e-3, 10))?;
    for _ in 0..3 {
        optimizer.step_accumulated(&[&batch], |b| lm_loss(&model, b))?;
    }
    save_training_checkpoint(&dir, &model, &optimizer, &SaveOptions::default())?;
    for _ in 0..2 {
        optimizer.step_accumulated(&[&batch], |b| lm_loss(&model, b))?;
    }

    let resumed = tiny_model(&config, 99)?;
    let mut resumed_opt = AdamW::new(resumed.named_parameters(), optimizer_config(5e-3, 10))?;
    load_training_checkpoint(&dir, &resumed.params, &mut resumed_opt)?;
    assert_eq!(resumed_opt.steps_taken(), 3);
    for _ in 0..2 {
        resumed_opt.step_accumulated(&[&batch], |b| lm_loss(&resumed, b))?;
    }
    for ((name, a), (_, b)) in model.named_parameters().zip(resumed.named_parameters()) {
        assert!(a.allclose(b, 1e-6, 1e-7, false), "{name} differs after resume");
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn outputs_do_not_depend_on_padding_side() -> Result<()> {
    let config = tiny_config(ModelFamily::Qwen2);
    let lm = tiny_model(&config, 9)?;
    let rm = ScalarHeadModel::new_random(&config, Device::Cpu, Kind::Float, 9)?;
    // The same prompt + response, left-padded in row 0 and right-padded in row 1 (with the
    // response columns kept last by padding the prompt side).
    let left = ResponseBatch {
        input_ids: ids(&[0, 0, 1, 30, 31, 32, 33, 34], 1),
        attention_mask: ids(&[0, 0, 1, 1, 1, 1, 1, 1], 1),
        action_mask: ids(&[1, 1, 1], 1),
    };
    let unpadded = ResponseBatch {
        input_ids: ids(&[1, 30, 31, 32, 33, 34], 1),
        attention_mask: ids(&[1, 1, 1, 1, 1, 1], 1),
        action_mask: ids(&[1, 1, 1], 1),
    };
    tch::no_grad(|| -> Result<()> {
        let a = lm.response_log_probs(&left)?;
        let b = lm.response_log_probs(&unpadded)?;
        assert!(a.allclose(&b, 1e-5, 1e-5, false), "log-probs change with padding");
        let a = rm.rewards(&left.input_ids, &left.attention_mask)?;
        let b = rm.rewards(&unpadded.input_ids, &unpadded.attention_mask)?;
        assert!(a.allclose(&b, 1e-5, 1e-5, false), "rewards change with padding");
        let right_ids = ids(&[1, 30, 31, 32, 33, 34, 0, 0], 1);
        let right_mask = ids(&[1, 1, 1, 1, 1, 1, 0, 0], 1);
        let c = rm.rewards(&right_ids, &right_mask)?;
        assert!(a.allclose(&c, 1e-5, 1e-5, false), "reward not read at the last real token");
        let values = rm.values(&right_ids, &right_mask, None)?;
        assert!((values.double_value(&[0, 5]) - c.double_value(&[0])).abs() < 1e-6);
        Ok(())
    })
}

#[test]
fn checkpoints_round_trip_and_seed_a_critic() -> Result<()> {
    let config = tiny_config(ModelFamily::Llama);
    let dir = temp_dir("roundtrip");
    let lm = tiny_model(&config, 13)?;
    lm.save_pretrained(&dir, &SaveOptions { max_shard_bytes: 100_000 })?;
    let back = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float)?;
    let input = ids(&[1, 5, 6, 7], 1);
    let mask = input.ones_like();
    let (a, b) = tch::no_grad(|| -> Result<_> {
        Ok((lm.forward(&input, &mask, None)?, back.forward(&input, &mask, None)?))
    })?;
    assert!(a.equal(&b));

    // A critic starts from the LM checkpoint: same trunk, fresh head; it saves and reloads.
    let critic = ScalarHeadModel::from_pretrained(&dir, Device::Cpu, Kind::Float, 1)?;
    let trunk = critic.params.get("model.layers.1.mlp.down_proj.weight").map(Tensor::shallow_clone);
    assert!(trunk.is_some_and(|t| {
        t.equal(lm.params.get("model.layers.1.mlp.down_proj.weight").unwrap_or(&t))
    }));
    // The fresh head is the seed's: the same seed draws it again, another seed does not.
    let head = |seed| -> Result<Tensor> {
        let model = ScalarHeadModel::from_pretrained(&dir, Device::Cpu, Kind::Float, seed)?;
        Ok(model.score.weight.detach())
    };
    let first = critic.score.weight.detach();
    assert!(first.equal(&head(1)?));
    assert!(!first.equal(&head(2)?));
    assert!(first.abs().sum(Kind::Float).double_value(&[]) > 0.0, "the head is drawn");
    let critic_dir = dir.join("critic");
    critic.save_pretrained(&critic_dir, &SaveOptions::default())?;
    let again = ScalarHeadModel::from_pretrained(&critic_dir, Device::Cpu, Kind::Float, 2)?;
    let score = |m: &ScalarHeadModel| m.params.get("score.weight").map(Tensor::shallow_clone);
    assert!(score(&critic).zip(score(&again)).is_some_and(|(x, y)| x.equal(&y)));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn hostile_inputs_are_errors() -> Result<()> {
    let lm = tiny_model(&tiny_config(ModelFamily::Qwen2), 1)?;
    let good = ids(&[1, 2, 3], 1);
    let mask = good.ones_like();
    assert!(lm.forward(&ids(&[1, 2, 999], 1), &mask, None).is_err(), "id beyond vocab");
    assert!(lm.forward(&ids(&[1, -2, 3], 1), &mask, None).is_err(), "negative id");
    assert!(lm.forward(&good, &ids(&[1, 1], 1), None).is_err(), "mask shape");
    assert!(lm.forward(&good.to_kind(Kind::Float), &mask, None).is_err(), "float ids");
    assert!(lm.forward(&good, &mask, Some(&ids(&[0, -1, 2], 1))).is_err(), "negative position");
    assert!(lm.forward(&Tensor::from_slice(&[1i64, 2]), &mask, None).is_err(), "1-d ids");
    let dir = temp_dir("hostile");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"llama\"}")?;
    assert!(CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float).is_err());
    std::fs::remove_dir_all(&dir)?;

    // A checkpoint short of a layer the config declares: the load names the missing tensor
    // (parameters are not drawn before a load, so none may stay unloaded).
    let dir = temp_dir("short");
    let config = tiny_config(ModelFamily::Qwen2);
    tiny_model(&config, 3)?.save_pretrained(&dir, &SaveOptions::default())?;
    let path = dir.join("config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    json["num_hidden_layers"] = serde_json::json!(config.num_hidden_layers + 1);
    std::fs::write(&path, json.to_string())?;
    let err = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float).unwrap_err().to_string();
    let layer = format!("model.layers.{}.", config.num_hidden_layers);
    assert!(err.contains(&layer), "{err}");
    // The same for a critic or reward model: only its head may be absent.
    let err = ScalarHeadModel::from_pretrained(&dir, Device::Cpu, Kind::Float, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&layer), "{err}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn bf16_models_run_and_track_fp32() -> Result<()> {
    let config = tiny_config(ModelFamily::Llama);
    let dir = temp_dir("bf16");
    tiny_model(&config, 21)?.save_pretrained(&dir, &SaveOptions::default())?;
    let fp32 = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float)?;
    let bf16 = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::BFloat16)?;
    let batch = ResponseBatch {
        input_ids: ids(&[0, 1, 5, 6, 7, 8, 1, 9, 10, 11, 12, 0], 2),
        attention_mask: ids(&[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0], 2),
        action_mask: ids(&[1, 1, 1, 1, 1, 0], 2),
    };
    let (a, b) = tch::no_grad(|| -> Result<_> {
        Ok((fp32.response_log_probs(&batch)?, bf16.response_log_probs(&batch)?))
    })?;
    assert_eq!(b.kind(), Kind::Float, "log-probs are float32 whatever the weights");
    let diff = (&a - &b).abs().max().double_value(&[]);
    assert!(diff < 0.1, "bf16 log-probs drift by {diff}");
    // A bf16 model trains (moments stay float32) and saves bf16 tensors.
    let mut optimizer = AdamW::new(bf16.named_parameters(), optimizer_config(1e-2, 5))?;
    optimizer
        .step_accumulated(&[&batch], |b| Ok(bf16.response_log_probs(b)?.sum(Kind::Float).neg()))?;
    bf16.save_pretrained(&dir, &SaveOptions::default())?;
    let back = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float)?;
    assert!(back.named_parameters().all(|(_, t)| t.kind() == Kind::Float));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
