//! The sharded-training benchmark behind `scripts/bench-memory.sh`:
//!
//! - **memory**: for each model, number of ranks and ZeRO stage, a group of real policy ranks
//!   (`LmWorker` worker processes, as `train --mode sft` makes them) trains a few supervised
//!   steps; each rank's peak bytes of parameters, gradients and AdamW state (tensor bytes it
//!   holds, measured at every gather, reduction and step) are printed beside the ZeRO paper's
//!   formula for the same model (fp32: 4 + 4 + 8 bytes per parameter, the last two divided by
//!   N from stage 1 and 2 on, all three from stage 3);
//! - **time**: stage 3 against stage 0 on the same 2 ranks, step time and the collectives'
//!   share of it;
//! - **checkpointing**: one policy training step (prompt + response, loss on the response) with
//!   and without activation checkpointing in this process: peak host tensor bytes above what
//!   the model and optimizer hold (counted by a wrapper around libtorch's CPU allocator) and
//!   step time.
//!
//! Models are Qwen2-style with tied embeddings and random weights, written as Hugging Face
//! checkpoints under `--dir`: `27m` (hidden 512, 8 layers, vocabulary 8192, the engine
//! benchmark's) and `110m` (hidden 768, 12 layers, vocabulary 32000).

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use rtrun::ActorGroup;
use rtrun_rlhf::roles::lm::{LmWorker, LmWorkerConfig, PolicyLossConfig};
use rtrun_rlhf::roles::{ThreadPlan, WorkerSetup};
use rtrun_rlhf::stage::pack::{Sample, rank_batches};
use rtrun_rlhf_model::logprobs::token_log_probs;
use rtrun_rlhf_model::storage::{host_allocations, reset_host_peak, track_host_allocations};
use rtrun_rlhf_model::train::OptimizerConfig;
use rtrun_rlhf_model::{CausalLm, ModelConfig, ModelFamily};
use rtrun_rlhf_shard::{GroupComm, ShardConfig, ShardStats, ShardedModel, ZeroStage};
use tch::{Kind, Tensor};

#[derive(Parser, Debug)]
#[command(about = "ZeRO memory, step time and activation checkpointing benchmark")]
struct Args {
    /// Where the model checkpoints are written (kept between runs).
    #[arg(long)]
    dir: PathBuf,
    /// What to run: memory, time, checkpointing.
    #[arg(long, value_delimiter = ',', default_value = "memory,time,checkpointing")]
    parts: Vec<String>,
    /// Models of the memory table.
    #[arg(long, value_delimiter = ',', default_value = "27m,110m")]
    models: Vec<String>,
    /// Numbers of ranks of the memory table.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    ranks: Vec<usize>,
    /// ZeRO stages of the memory table.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3")]
    stages: Vec<u64>,
    /// Optimizer steps per configuration (the time part drops the first).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Model of the time part.
    #[arg(long, default_value = "27m")]
    time_model: String,
    /// Rows × tokens of a global batch in the time part (the memory part uses 4 × 128).
    #[arg(long, default_value_t = 8)]
    rows: usize,
    /// Tokens per row in the time part and the checkpointing part.
    #[arg(long, default_value_t = 512)]
    len: usize,
    /// Model of the checkpointing part.
    #[arg(long, default_value = "110m")]
    checkpoint_model: String,
}

/// The benchmark's model shapes.
fn model_config(name: &str) -> anyhow::Result<ModelConfig> {
    let mut config = rtrun_rlhf_model::tiny::tiny_config(ModelFamily::Qwen2);
    let (hidden, layers, heads, kv_heads, intermediate, vocab) = match name {
        "27m" => (512, 8, 8, 2, 1408, 8192),
        "110m" => (768, 12, 12, 12, 2048, 32000),
        other => anyhow::bail!("--models: expected 27m or 110m, found `{other}`"),
    };
    config.hidden_size = hidden;
    config.num_hidden_layers = layers;
    config.num_attention_heads = heads;
    config.num_key_value_heads = kv_heads;
    config.head_dim = hidden / heads;
    config.intermediate_size = intermediate;
    config.vocab_size = vocab;
    config.max_position_embeddings = 4096;
    config.initializer_range = 0.02;
    Ok(config)
}

/// Writes (once) and returns the directory of model `name`.
fn model_dir(root: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let dir = root.join(name);
    if !dir.join("config.json").is_file() {
        let model = CausalLm::new_random(&model_config(name)?, tch::Device::Cpu, Kind::Float, 1)?;
        model.save_pretrained(&dir, &Default::default())?;
    }
    Ok(dir)
}

/// A global batch of `rows` samples of `len` tokens (the second half is the response).
fn units(rows: usize, len: usize, vocab: usize, step: usize) -> Vec<Vec<Sample>> {
    (0..rows)
        .map(|r| {
            let ids =
                (0..len).map(|t| ((step * 7919 + r * 104_729 + t * 31) % (vocab - 3) + 3) as u32);
            vec![Sample { ids: ids.collect(), prompt_len: len / 2 }]
        })
        .collect()
}

/// What one configuration measured.
struct Run {
    /// Per rank, after the last step.
    stats: Vec<ShardStats>,
    /// Seconds per step (steps after the first).
    step_seconds: f64,
}

/// `steps` supervised steps on `ranks` real ranks of model `name` at `shard`.
fn run_ranks(
    dir: &Path,
    name: &str,
    ranks: usize,
    shard: ShardConfig,
    (rows, len): (usize, usize),
    steps: usize,
) -> anyhow::Result<Run> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = i32::try_from((cores / ranks).max(1))?;
    let config = LmWorkerConfig {
        setup: WorkerSetup::cpu("actor", ThreadPlan::Fixed(threads)),
        model_dir: model_dir(dir, name)?,
        optimizer: Some(OptimizerConfig::default()),
        loss: PolicyLossConfig {
            clip: Default::default(),
            entropy_coef: 0.0,
            use_kl_loss: false,
            kl_estimator: Default::default(),
            micro_batch_size: 2,
            share_prompt: false,
            ..Default::default()
        },
        with_reference: false,
        shard,
        lora: None,
    };
    let group =
        ActorGroup::<LmWorker>::create("bench", ranks, Default::default(), |_, options| {
            LmWorker::remote_with(options, config.clone())
        })?;
    let vocab = usize::try_from(model_config(name)?.vocab_size)?;
    let mut timed = Vec::new();
    for step in 0..steps {
        let global = units(rows, len, vocab, step);
        let tokens = rows * (len - len / 2);
        let shares = rank_batches(global, ranks, len, false, false, 2);
        let started = Instant::now();
        let members = group.members();
        let calls: Vec<_> =
            members.iter().zip(shares).map(|(m, share)| m.supervised_step(share, tokens)).collect();
        for call in calls {
            call.get()?.map_err(anyhow::Error::msg)?;
        }
        if step > 0 || steps == 1 {
            timed.push(started.elapsed().as_secs_f64());
        }
    }
    let mut stats = Vec::new();
    for member in group.members() {
        stats.push(member.shard_stats(false).get()?.map_err(anyhow::Error::msg)?);
    }
    group.kill()?;
    Ok(Run { stats, step_seconds: timed.iter().sum::<f64>() / timed.len().max(1) as f64 })
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// The ZeRO paper's per-rank bytes (fp32 parameters, gradients, two AdamW moments).
fn zero_formula(numel: u64, stage: ZeroStage, ranks: u64) -> u64 {
    let (p, g, o) = (4 * numel, 4 * numel, 8 * numel);
    match stage {
        ZeroStage::Zero => p + g + o,
        ZeroStage::One => p + g + o / ranks,
        ZeroStage::Two => p + (g + o) / ranks,
        ZeroStage::Three => (p + g + o) / ranks,
    }
}

fn memory(args: &Args) -> anyhow::Result<()> {
    println!("## Per-rank bytes of parameters + gradients + AdamW state (peak of a step)\n");
    println!(
        "| model | params | ranks | stage | measured peak MiB (params / grads / optim) | ZeRO formula MiB | stage-3 bound MiB |"
    );
    println!("|---|---|---|---|---|---|---|");
    for name in &args.models {
        let config = model_config(name)?;
        let model = CausalLm::new_random(&config, tch::Device::Cpu, Kind::Float, 1)?;
        let numel = model.params.numel() as u64;
        let names: Vec<(String, Vec<i64>)> =
            model.named_parameters().map(|(n, t)| (n.to_string(), t.size())).collect();
        drop(model);
        for &ranks in &args.ranks {
            let plan = rtrun_rlhf_shard::plan::ShardPlan::new(&names, ranks, true)?;
            for &stage in &args.stages {
                let stage = ZeroStage::from_number(stage)
                    .ok_or_else(|| anyhow::anyhow!("--stages: expected 0-3, found {stage}"))?;
                let shard = ShardConfig { stage, gradient_checkpointing: false };
                let run = run_ranks(&args.dir, name, ranks, shard, (4, 128), args.steps)?;
                let worst =
                    run.stats.iter().map(|s| s.peak).max_by_key(|p| p.total()).unwrap_or_default();
                let formula = zero_formula(numel, stage, ranks as u64);
                // Stage 3 may hold, beside its shards, the head's units and one layer whole, each
                // with its full gradient until reduced (8 bytes per element).
                let bound = zero_formula(numel, ZeroStage::Zero, 1) / ranks as u64
                    + 8 * (plan.units[0].padded + plan.largest_unit()) as u64;
                let bound_cell = if stage == ZeroStage::Three {
                    let ok = if worst.total() <= bound { "within" } else { "OVER" };
                    format!("{:.1} ({ok})", mib(bound))
                } else {
                    "".into()
                };
                println!(
                    "| {name} | {:.1}M | {ranks} | {stage} | {:.1} ({:.1} / {:.1} / {:.1}) | {:.1} | {bound_cell} |",
                    numel as f64 / 1e6,
                    mib(worst.total()),
                    mib(worst.parameters),
                    mib(worst.gradients),
                    mib(worst.optimizer),
                    mib(formula),
                );
                eprintln!(
                    "{{\"part\":\"memory\",\"model\":\"{name}\",\"ranks\":{ranks},\"stage\":{stage},\"peak\":{},\"formula\":{formula}}}",
                    worst.total()
                );
            }
        }
    }
    println!();
    Ok(())
}

fn time(args: &Args) -> anyhow::Result<()> {
    println!(
        "## Step time on 2 ranks, {} × {} tokens per step, model {}\n",
        args.rows, args.len, args.time_model
    );
    println!(
        "| stage | s/step | ratio to stage 0 | collectives waited for, s/step (share) | gathers prefetched |"
    );
    println!("|---|---|---|---|---|");
    let mut base = None;
    for stage in [ZeroStage::Zero, ZeroStage::Three] {
        let shard = ShardConfig { stage, gradient_checkpointing: false };
        let run =
            run_ranks(&args.dir, &args.time_model, 2, shard, (args.rows, args.len), args.steps)?;
        let collective =
            run.stats.iter().map(|s| s.collective_seconds).fold(0.0, f64::max) / args.steps as f64;
        let base = *base.get_or_insert(run.step_seconds);
        let prefetched: u64 = run.stats.iter().map(|s| s.prefetched_gathers).sum();
        println!(
            "| {stage} | {:.2} | {:.2}× | {:.2} ({:.0}%) | {prefetched} |",
            run.step_seconds,
            run.step_seconds / base,
            collective,
            100.0 * collective / run.step_seconds
        );
    }
    println!();
    Ok(())
}

/// One policy step (forward, NLL of the response, backward, AdamW) on `rows × len` tokens;
/// returns (peak host bytes above the start, seconds).
fn policy_step(
    model: &CausalLm,
    sharded: &mut ShardedModel,
    rows: usize,
    len: usize,
) -> anyhow::Result<(i64, f64)> {
    let vocab = usize::try_from(model.config().vocab_size)?;
    let ids: Vec<i64> = units(rows, len, vocab, 0)
        .into_iter()
        .flat_map(|u| u[0].ids.iter().map(|&i| i64::from(i)).collect::<Vec<_>>())
        .collect();
    let ids = Tensor::from_slice(&ids).view([rows as i64, len as i64]);
    let response = (len / 2) as i64;
    sharded.zero_grad()?;
    let start = host_allocations().current;
    reset_host_peak();
    let started = Instant::now();
    let hidden = model.backbone.forward(&ids, &ids.ones_like(), None)?;
    let predicting = hidden.narrow(1, len as i64 - response - 1, response);
    let logits = model.lm_logits(&predicting)?;
    let targets = ids.narrow(1, len as i64 - response, response);
    let loss = token_log_probs(&logits, &targets)?.mean(Kind::Float).neg();
    drop((hidden, predicting, logits));
    model.backward(&loss)?;
    sharded.step()?;
    let seconds = started.elapsed().as_secs_f64();
    Ok((host_allocations().peak - start, seconds))
}

fn checkpointing(args: &Args) -> anyhow::Result<()> {
    let config = model_config(&args.checkpoint_model)?;
    let (rows, len) = (args.rows, args.len);
    println!(
        "## Activation checkpointing: one policy step, model {}, {rows} × {len} tokens (loss on the last {})\n",
        args.checkpoint_model,
        len / 2
    );
    println!("| gradient_checkpointing | peak activation MiB | s/step |");
    println!("|---|---|---|");
    track_host_allocations()?;
    let mut results = Vec::new();
    for checkpoint in [false, true] {
        let model = CausalLm::new_random(&config, tch::Device::Cpu, Kind::Float, 1)?;
        let shard = ShardConfig { stage: ZeroStage::Zero, gradient_checkpointing: checkpoint };
        let mut sharded = ShardedModel::for_causal_lm(
            &model,
            shard,
            GroupComm::solo(),
            Some(OptimizerConfig::default()),
        )?;
        // The first step allocates gradients and moments; the second is measured. Gradients
        // are zeroed (kept), so what the step adds is activations and temporaries.
        policy_step(&model, &mut sharded, rows, len)?;
        let mut best = (i64::MAX, f64::MAX);
        for _ in 0..args.steps.max(1) {
            let (peak, seconds) = policy_step(&model, &mut sharded, rows, len)?;
            best = (best.0.min(peak), best.1.min(seconds));
        }
        println!("| {checkpoint} | {:.0} | {:.2} |", best.0 as f64 / (1 << 20) as f64, best.1);
        results.push(best);
    }
    if let [(without, t0), (with, t1)] = results[..] {
        println!(
            "\nactivation memory {:.2}× lower, step time {:.2}× with checkpointing\n",
            without as f64 / with.max(1) as f64,
            t1 / t0
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    rtrun::init()?;
    let args = Args::parse();
    std::fs::create_dir_all(&args.dir)?;
    for part in &args.parts {
        match part.as_str() {
            "memory" => memory(&args)?,
            "time" => time(&args)?,
            "checkpointing" => checkpointing(&args)?,
            other => {
                anyhow::bail!("--parts: expected memory, time or checkpointing, found `{other}`")
            }
        }
    }
    Ok(())
}
