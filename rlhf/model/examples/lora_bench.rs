//! LoRA against full fine-tuning on a ~110M-parameter model: trainable parameters, optimizer
//! state bytes and the time of one training step (forward, next-token loss, backward, AdamW),
//! measured back to back in one process.
//!
//! Run: `cargo run --release -p rtrun-rlhf-model --example lora_bench [-- --rank 16 --iters 5]`.

use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use rtrun_rlhf_model::tch::{self, Device, Kind, Tensor};
use rtrun_rlhf_model::tiny::bench_config_110m;
use rtrun_rlhf_model::train::{AdamW, OptimizerConfig, masked_cross_entropy};
use rtrun_rlhf_model::{CausalLm, LoraConfig};

/// LoRA against full fine-tuning on a ~110M-parameter model.
#[derive(Parser)]
struct Args {
    /// LoRA rank (alpha is twice it, on every projection).
    #[arg(long, default_value_t = 16)]
    rank: i64,
    /// Timed steps per case (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    batch: i64,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    seq: i64,
}

struct Measured {
    trainable: i64,
    optimizer_bytes: i64,
    step_seconds: f64,
    final_loss: f64,
}

/// Steps `model` on `ids` with an optimizer over `trainable`: the median step time.
fn measure(model: &CausalLm, trainable: AdamW, ids: &Tensor, iters: usize) -> Result<Measured> {
    let mut optimizer = trainable;
    let mask = ids.ones_like();
    let seq = ids.size()[1];
    let count: i64 = optimizer.moments().map(|(_, m, _)| m.numel() as i64).sum();
    let mut times = Vec::new();
    let mut loss_value = 0.0;
    for i in 0..=iters {
        let started = Instant::now();
        let logits = model.forward(ids, &mask, None)?;
        let loss = masked_cross_entropy(
            &logits.narrow(1, 0, seq - 1),
            &ids.narrow(1, 1, seq - 1),
            &mask.narrow(1, 1, seq - 1),
        )?;
        model.backward(&loss)?;
        optimizer.step()?;
        loss_value = loss.double_value(&[]);
        if i > 0 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(Measured {
        trainable: count,
        // Two float32 moments per trainable element.
        optimizer_bytes: 2 * 4 * count,
        step_seconds: times[times.len() / 2],
        final_loss: loss_value,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let config = bench_config_110m();
    tch::manual_seed(0);
    let ids =
        Tensor::randint(config.vocab_size, [args.batch, args.seq], (Kind::Int64, Device::Cpu));
    let optimizer = OptimizerConfig::default();

    let full = CausalLm::new_random(&config, Device::Cpu, Kind::Float, 1)?;
    let total = full.params.numel();
    let full_adamw = AdamW::new(full.named_parameters(), optimizer.clone())?;
    let full = measure(&full, full_adamw, &ids, args.iters)?;

    let mut lora = CausalLm::new_random(&config, Device::Cpu, Kind::Float, 1)?;
    let settings = LoraConfig {
        rank: args.rank,
        alpha: 2.0 * args.rank as f64,
        dropout: 0.0,
        target_modules: vec!["all-linear".into()],
    };
    lora.add_lora(&settings, 2)?;
    let adapters = lora.lora_parameters().expect("adapters were added");
    let lora_adamw = AdamW::new(adapters.named(), optimizer)?;
    let lora = measure(&lora, lora_adamw, &ids, args.iters)?;

    println!(
        "model: {:.1}M parameters; {} x {} tokens per step; LoRA rank {} on every projection",
        total as f64 / 1e6,
        args.batch,
        args.seq,
        args.rank
    );
    println!(
        "| | trainable parameters | optimizer state | step time | loss after {} steps |",
        args.iters + 1
    );
    println!("|---|---|---|---|---|");
    for (name, m) in [("full fine-tuning", &full), ("LoRA", &lora)] {
        println!(
            "| {name} | {:.2}M ({:.2} %) | {:.1} MB | {:.3} s | {:.4} |",
            m.trainable as f64 / 1e6,
            100.0 * m.trainable as f64 / total as f64,
            m.optimizer_bytes as f64 / 1e6,
            m.step_seconds,
            m.final_loss
        );
    }
    println!(
        "LoRA / full: trainable {:.4}x, optimizer state {:.4}x, step time {:.2}x",
        lora.trainable as f64 / full.trainable as f64,
        lora.optimizer_bytes as f64 / full.optimizer_bytes as f64,
        lora.step_seconds / full.step_seconds
    );
    Ok(())
}
