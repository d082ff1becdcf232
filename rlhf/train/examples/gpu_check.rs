//! The GPU checks `scripts/gpu-check.sh` runs on a lent GPU machine (built by
//! `scripts/build-gpu.sh` with the `cuda` feature). Each subcommand prints one JSON line with
//! its figures and `"ok"`; the script collects them into its report.
//!
//! ```text
//! gpu_check forward CKPT                      CUDA fp32 vs CPU fp32 logits; bf16 vs fp32
//! gpu_check engine CKPT PROMPTS OUT DTYPE BATCHES NEW   engine on CUDA, greedy; tokens/s per batch
//! gpu_check sleep CKPT                        engine sleep/wake: memory freed vs claimed
//! gpu_check ipc CKPT BUCKET_BYTES             weight sync by CUDA IPC to a second process
//! gpu_check nccl-same-gpu                     2 NCCL ranks on one GPU: refused, not a hang
//! gpu_check zero CKPT                         ZeRO on CUDA: NCCL device reduce-scatter and
//!                                             all-gather (one rank), stage 3 + checkpointing
//!                                             training steps against stage 0
//! ```
//! Built without `cuda` (as the workspace tests build it) every subcommand that needs a GPU
//! says so and exits 2.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use rtrun_rlhf_engine::weight_ipc::{self, IpcWeightBucket};
use rtrun_rlhf_engine::{EngineConfig, GenerationRequest, LlmEngine, SamplingParams, WeightMeta};
use rtrun_rlhf_model::CausalLm;
use rtrun_rlhf_model::tch::{self, Device, Kind, Tensor};
use serde_json::json;

/// The GPU checks `scripts/gpu-check.sh` runs on a lent GPU machine. Each check prints one JSON
/// line with its figures and `"ok"`; without a usable CUDA device it says so and exits 2.
#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    check: Check,
}

#[derive(Subcommand)]
enum Check {
    /// Model forward: CUDA fp32 logits against CPU fp32 (limit 1e-4); bf16 against fp32.
    Forward {
        /// The Hugging Face checkpoint directory.
        ckpt: PathBuf,
    },
    /// The engine on CUDA, greedy: tokens/s for each batch size; writes the largest batch's
    /// outputs.
    Engine {
        /// The Hugging Face checkpoint directory.
        ckpt: PathBuf,
        /// The prompts: a JSON list of token-id lists.
        prompts: PathBuf,
        /// Where to write the largest batch's generated token ids (JSON).
        out: PathBuf,
        /// The engine's dtype.
        #[arg(value_parser = ["f32", "bf16"])]
        dtype: String,
        /// Batch sizes, comma-separated (`1,64,256`): each generates for the first that many
        /// prompts.
        #[arg(num_args = 1, value_delimiter = ',', required = true)]
        batches: Vec<usize>,
        /// Tokens generated per prompt.
        new: u32,
    },
    /// Sampling on the device: the host sampler's tokens for the same uniforms on a
    /// 152k-vocabulary batch, a distribution check, and seeded engine requests that give the
    /// same tokens alone and inside a larger batch.
    Sampling {
        /// The Hugging Face checkpoint directory.
        ckpt: PathBuf,
        /// The prompts: a JSON list of token-id lists.
        prompts: PathBuf,
    },
    /// Engine sleep and wake: the device memory freed against what the engine claims.
    Sleep {
        /// The Hugging Face checkpoint directory.
        ckpt: PathBuf,
    },
    /// Weight sync by CUDA IPC to a second process started from this binary.
    Ipc {
        /// The Hugging Face checkpoint directory.
        ckpt: PathBuf,
        /// Size of each weight bucket, in bytes.
        bucket_bytes: usize,
    },
    /// The receiving process of `ipc` (started by it).
    #[command(hide = true)]
    IpcReceive {
        /// The Hugging Face checkpoint directory.
        ckpt: PathBuf,
    },
    /// Two NCCL ranks on one GPU: the collective must refuse, not hang.
    NcclSameGpu,
    /// Sharded training on CUDA: NCCL's in-place reduce-scatter and all-gather on device memory
    /// (one rank: one GPU cannot host two), and two training steps at stage 3 with activation
    /// checkpointing against stage 0 (storages freed and re-allocated on the device).
    Zero {
        /// The Hugging Face checkpoint directory.
        ckpt: PathBuf,
    },
    /// A tensor-parallel engine on CUDA: two ranks on the one GPU (threads, their all-reduces
    /// staged through the CPU ring, since one GPU cannot host two NCCL ranks) against the whole
    /// model, greedy, fp32: tokens equal, log-probs within 1e-4.
    Tp {
        /// The Hugging Face checkpoint directory.
        ckpt: PathBuf,
    },
    /// One rank of `nccl-same-gpu` (started by it).
    #[command(hide = true)]
    NcclRank {
        /// This process's rank.
        rank: usize,
        /// The rendezvous port on 127.0.0.1.
        port: u16,
    },
}

fn main() {
    let Args { check } = Args::parse();
    if let Err(e) = run(check) {
        eprintln!("gpu_check: {e:#}");
        std::process::exit(1);
    }
}

fn run(check: Check) -> Result<()> {
    if !tch::Cuda::is_available() {
        eprintln!(
            "gpu_check: no usable CUDA device (this build: cuda feature {})",
            cfg!(feature = "cuda")
        );
        std::process::exit(2);
    }
    match check {
        Check::Forward { ckpt } => forward(&ckpt),
        Check::Engine { ckpt, prompts, out, dtype, batches, new } => {
            engine(&ckpt, &prompts, &out, &dtype, &batches, new)
        }
        Check::Sampling { ckpt, prompts } => sampling(&ckpt, &prompts),
        Check::Sleep { ckpt } => sleep(&ckpt),
        Check::Ipc { ckpt, bucket_bytes } => ipc_send(&ckpt, bucket_bytes),
        Check::IpcReceive { ckpt } => ipc_receive(&ckpt),
        Check::NcclSameGpu => nccl_same_gpu(),
        Check::Zero { ckpt } => zero(&ckpt),
        Check::Tp { ckpt } => tp(&ckpt),
        Check::NcclRank { rank, port } => nccl_rank(rank, port).map_err(anyhow::Error::msg),
    }
}

fn emit(value: serde_json::Value) {
    println!("{value}");
    let _ = std::io::stdout().flush();
}

fn ids(vocab: i64, batch: i64, seq: i64) -> Tensor {
    tch::manual_seed(7);
    Tensor::randint(vocab, [batch, seq], (Kind::Int64, Device::Cpu))
}

fn logits(model: &CausalLm, ids: &Tensor, device: Device) -> Result<Tensor> {
    let ids = ids.to_device(device);
    let mask = ids.ones_like();
    Ok(tch::no_grad(|| model.forward(&ids, &mask, None))?
        .to_device(Device::Cpu)
        .to_kind(Kind::Float))
}

/// Model forward: CUDA fp32 against CPU fp32 (limit 1e-4), bf16 against fp32 reported.
fn forward(dir: &Path) -> Result<()> {
    let cpu = CausalLm::from_pretrained(dir, Device::Cpu, Kind::Float)?;
    let vocab = cpu.config().vocab_size;
    let input = ids(vocab, 4, 64);
    let reference = logits(&cpu, &input, Device::Cpu)?;
    drop(cpu);
    let gpu = CausalLm::from_pretrained(dir, Device::Cuda(0), Kind::Float)?;
    let fp32 = logits(&gpu, &input, Device::Cuda(0))?;
    drop(gpu);
    let bf16_model = CausalLm::from_pretrained(dir, Device::Cuda(0), Kind::BFloat16)?;
    let bf16 = logits(&bf16_model, &input, Device::Cuda(0))?;
    let max_abs = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    let cuda_vs_cpu = max_abs(&fp32, &reference);
    let bf16_vs_fp32 = max_abs(&bf16, &fp32);
    let bf16_mean = (&bf16 - &fp32).abs().mean(Kind::Float).double_value(&[]);
    let argmax_agree = bf16
        .argmax(-1, false)
        .eq_tensor(&fp32.argmax(-1, false))
        .to_kind(Kind::Float)
        .mean(Kind::Float)
        .double_value(&[]);
    emit(json!({
        "check": "forward",
        "tokens": 4 * 64,
        "logit_scale": reference.abs().max().double_value(&[]),
        "cuda_fp32_vs_cpu_fp32_max_abs": cuda_vs_cpu,
        "bf16_vs_fp32_max_abs": bf16_vs_fp32,
        "bf16_vs_fp32_mean_abs": bf16_mean,
        "bf16_argmax_agreement": argmax_agree,
        "ok": cuda_vs_cpu <= 1e-4,
    }));
    Ok(())
}

fn kind_of(dtype: &str) -> Result<Kind> {
    Ok(match dtype {
        "f32" => Kind::Float,
        "bf16" => Kind::BFloat16,
        other => bail!("dtype `{other}`: expected f32 or bf16"),
    })
}

/// The engine on CUDA: greedy generation of `new` tokens for the first `b` prompts, for each
/// `b` in `batches`; tokens/s per batch after a warm-up; the largest batch's outputs written.
fn engine(
    dir: &Path,
    prompts: &Path,
    out: &Path,
    dtype: &str,
    batches: &[usize],
    new: u32,
) -> Result<()> {
    let prompts: Vec<Vec<u32>> = serde_json::from_str(&std::fs::read_to_string(prompts)?)?;
    let max_batch = *batches.iter().max().context("no batch sizes")?;
    let prompt_len = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let model = CausalLm::from_pretrained(dir, Device::Cuda(0), kind_of(dtype)?)?;
    let block_size = 16;
    let blocks_per_seq = (prompt_len + new as usize).div_ceil(block_size) + 1;
    let config = EngineConfig {
        num_gpu_blocks: Some(blocks_per_seq * max_batch + 8),
        max_num_seqs: max_batch,
        max_num_batched_tokens: (max_batch * prompt_len).max(2048),
        device: "cuda".into(),
        dtype: dtype.into(),
        block_size,
        ..EngineConfig::default()
    };
    // The decode step reads every weight once: its floor at the H100's ~3.35 TB/s.
    let weight_bytes = model.params.numel() as f64 * kind_of(dtype)?.elt_size_in_bytes() as f64;
    let eager_model = CausalLm::from_pretrained(dir, Device::Cuda(0), kind_of(dtype)?)?;
    let mut engine = LlmEngine::new(model, None, config.clone())?;
    let greedy = SamplingParams {
        temperature: 0.0,
        max_tokens: new,
        min_tokens: new,
        logprobs: false,
        ..SamplingParams::default()
    };
    // RL's sampling: temperature 1, seeded per request.
    let warm = SamplingParams { temperature: 1.0, seed: Some(7), ..greedy.clone() };
    let requests = |b: usize, params: &SamplingParams| -> Vec<GenerationRequest> {
        prompts[..b].iter().map(|p| GenerationRequest::new(p.clone(), params.clone())).collect()
    };
    // One timed run (after a warm-up run at the same shapes, as the anchor does): seconds,
    // tokens/s, and the mean engine step (busy time over steps, the prefill step included).
    let timed = |engine: &mut LlmEngine, b: usize, params: &SamplingParams| -> Result<_> {
        engine.generate(requests(b, params))?;
        tch::Cuda::synchronize(0);
        let before = engine.stats();
        let start = Instant::now();
        let outputs = engine.generate(requests(b, params))?;
        tch::Cuda::synchronize(0);
        let seconds = start.elapsed().as_secs_f64();
        let after = engine.stats();
        let steps = (after.steps - before.steps).max(1) as f64;
        let step_ms = 1e3 * (after.busy_seconds - before.busy_seconds) / steps;
        let tokens: usize = outputs.iter().map(|o| o.samples[0].token_ids.len()).sum();
        Ok((outputs, seconds, tokens as f64 / seconds, step_ms))
    };
    let mut rows = Vec::new();
    let mut last = Vec::new();
    for &b in batches {
        let (outputs, seconds, tokens_per_s, step_ms) = timed(&mut engine, b, &greedy)?;
        let (_, _, sampled_tokens_per_s, sampled_step_ms) = timed(&mut engine, b, &warm)?;
        rows.push(json!({
            "batch": b, "seconds": seconds, "tokens_per_s": tokens_per_s, "step_ms": step_ms,
            "sampled_tokens_per_s": sampled_tokens_per_s, "sampled_step_ms": sampled_step_ms,
            "sampled_vs_greedy": sampled_tokens_per_s / tokens_per_s,
        }));
        if b == max_batch {
            last = outputs.into_iter().map(|o| o.samples[0].token_ids.clone()).collect();
        }
    }
    let graphs = engine.stats().static_decode;
    drop(engine);
    // The same engine with `enforce_eager` at the middle batch size: what the graphs gain.
    let b = batches[batches.len() / 2];
    let eager_config = EngineConfig { enforce_eager: true, ..config };
    let mut eager = LlmEngine::new(eager_model, None, eager_config)?;
    let (_, _, eager_tokens_per_s, eager_step_ms) = timed(&mut eager, b, &greedy)?;
    std::fs::write(out, serde_json::to_string(&last)?)?;
    emit(json!({
        "check": "engine", "dtype": dtype, "new_tokens": new, "rows": rows,
        "weight_read_floor_ms": 1e3 * weight_bytes / 3.35e12,
        "graphs": graphs,
        "eager": {"batch": b, "tokens_per_s": eager_tokens_per_s, "step_ms": eager_step_ms},
        "ok": graphs.capture_failures == 0 && graphs.graph_replays > 0,
    }));
    Ok(())
}

/// Sampling on the device against the host sampler and its distribution, and seeded engine
/// requests that do not depend on the batch they run in.
fn sampling(dir: &Path, prompts: &Path) -> Result<()> {
    use rtrun_rlhf_engine::sampling::device::{self, RowSampling};
    use rtrun_rlhf_engine::{LogprobMode, Sampler};
    let vocab = 151_936i64;
    let rows = 256usize;
    tch::manual_seed(3);
    let logits = (Tensor::randn([rows as i64, vocab], (Kind::Float, Device::Cuda(0))) * 3.0)
        .to_kind(Kind::BFloat16)
        .to_kind(Kind::Float);
    let modes = [LogprobMode::Raw, LogprobMode::TemperatureScaled, LogprobMode::Processed];
    let params: Vec<SamplingParams> = (0..rows)
        .map(|i| SamplingParams {
            temperature: [0.0, 0.7, 1.0, 1.0][i % 4],
            top_k: [None, None, Some(50), None][(i / 4) % 4],
            top_p: [1.0, 0.9][(i / 16) % 2],
            logprob_mode: modes[i % 3],
            ..SamplingParams::default()
        })
        .collect();
    let uniforms: Vec<f64> =
        (0..rows).map(|i| rtrun_rlhf_engine::rng::token_uniform(9, 0, i)).collect();
    let sampling: Vec<RowSampling<'_>> = params
        .iter()
        .zip(&uniforms)
        .map(|(params, &uniform)| RowSampling { params, uniform })
        .collect();
    let start = Instant::now();
    let found = device::sample(&logits, &sampling)?;
    tch::Cuda::synchronize(0);
    let device_ms = start.elapsed().as_secs_f64() * 1e3;
    let host_logits = Vec::<f32>::try_from(logits.to_device(Device::Cpu).view([-1]))?;
    let mut sampler = Sampler::new();
    let (mut same, mut gap) = (0, 0.0f32);
    for (row, found) in found.iter().enumerate() {
        let row_logits = &host_logits[row * vocab as usize..(row + 1) * vocab as usize];
        let host = sampler.sample(row_logits, &params[row], uniforms[row])?;
        same += usize::from(host.token == found.token);
        gap = gap.max((host.logprob - found.logprob).abs());
    }
    // 20,000 draws of one 8-token row at temperature 1 against its softmax.
    let row = Tensor::from_slice(&[2.0f32, 1.5, 1.2, 0.5, 0.0, -0.5, -1.0, -3.0]);
    let draws = 20_000usize;
    let many = row.to_device(Device::Cuda(0)).unsqueeze(0).expand([draws as i64, 8], false);
    let one = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    let draws_uniforms: Vec<f64> =
        (0..draws).map(|i| rtrun_rlhf_engine::rng::token_uniform(4, 1, i)).collect();
    let many_rows: Vec<RowSampling<'_>> =
        draws_uniforms.iter().map(|&uniform| RowSampling { params: &one, uniform }).collect();
    let mut counts = [0f64; 8];
    for sampled in device::sample(&many.contiguous(), &many_rows)? {
        counts[sampled.token as usize] += 1.0 / draws as f64;
    }
    let expected = Vec::<f32>::try_from(row.softmax(-1, Kind::Float))?;
    let worst_sigma = counts
        .iter()
        .zip(&expected)
        .map(|(&f, &p)| {
            let p = f64::from(p);
            (f - p).abs() / (p * (1.0 - p) / draws as f64).sqrt()
        })
        .fold(0.0, f64::max);
    // Seeded requests: the same tokens alone and at positions 3 and 40 of a 64-request batch.
    let prompts: Vec<Vec<u32>> = serde_json::from_str(&std::fs::read_to_string(prompts)?)?;
    let model = CausalLm::from_pretrained(dir, Device::Cuda(0), Kind::BFloat16)?;
    let config = EngineConfig {
        num_gpu_blocks: Some(1024),
        device: "cuda".into(),
        dtype: "bf16".into(),
        ..EngineConfig::default()
    };
    let mut engine = LlmEngine::new(model, None, config)?;
    let seeded = |seed: u64| SamplingParams {
        temperature: 1.0,
        max_tokens: 32,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let mine = [
        GenerationRequest::new(prompts[0].clone(), seeded(11)),
        GenerationRequest::new(prompts[1].clone(), seeded(12)),
    ];
    let alone = engine.generate(mine.to_vec())?;
    let mut batch: Vec<GenerationRequest> = prompts[2..64]
        .iter()
        .enumerate()
        .map(|(i, p)| GenerationRequest::new(p.clone(), seeded(100 + i as u64)))
        .collect();
    batch.insert(3, mine[0].clone());
    batch.insert(40, mine[1].clone());
    let together = engine.generate(batch)?;
    let reproduced = alone[0].samples[0].token_ids == together[3].samples[0].token_ids
        && alone[1].samples[0].token_ids == together[40].samples[0].token_ids;
    emit(json!({
        "check": "sampling", "rows": rows, "vocab": vocab, "same_tokens_as_host": same,
        "max_logprob_gap": gap, "device_ms": device_ms, "draws": draws,
        "distribution_worst_sigma": worst_sigma, "seeded_reproduced": reproduced,
        "ok": same == rows && gap < 1e-3 && worst_sigma < 4.5 && reproduced,
    }));
    Ok(())
}

fn device_used() -> Result<u64> {
    let (free, total) = rtrun::cuda_ipc::device_memory(0).map_err(anyhow::Error::msg)?;
    Ok(total - free)
}

/// Sleep level 1 frees the KV cache and moves the weights to host memory: the device's used
/// memory must drop by about what the engine holds (KV cache + weights).
fn sleep(dir: &Path) -> Result<()> {
    let model = CausalLm::from_pretrained(dir, Device::Cuda(0), Kind::BFloat16)?;
    let weight_bytes = model.params.numel() as u64 * 2;
    let config = EngineConfig {
        kv_cache_bytes: 4 << 30,
        device: "cuda".into(),
        dtype: "bf16".into(),
        ..EngineConfig::default()
    };
    let mut engine = LlmEngine::new(model, None, config)?;
    let params = SamplingParams { temperature: 0.0, max_tokens: 16, ..SamplingParams::default() };
    engine.generate(vec![GenerationRequest::new(vec![1, 2, 3, 4], params.clone())])?;
    let claimed = (4u64 << 30) + weight_bytes;
    let awake = device_used()?;
    engine.sleep(1)?;
    let asleep = device_used()?;
    engine.wake_up(&[])?;
    let woken = device_used()?;
    let out = engine.generate(vec![GenerationRequest::new(vec![1, 2, 3, 4], params)])?;
    let freed = awake.saturating_sub(asleep);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    emit(json!({
        "check": "sleep",
        "device_used_mib": {"awake": mib(awake), "asleep": mib(asleep), "woken": mib(woken)},
        "freed_mib": mib(freed),
        "claimed_mib": mib(claimed),
        "freed_over_claimed": freed as f64 / claimed as f64,
        "generates_after_wake": out[0].samples[0].token_ids.len() == 16,
        "ok": freed as f64 >= 0.9 * claimed as f64,
    }));
    Ok(())
}

/// A per-parameter fingerprint: (sum, sum of |x|) in f64.
fn fingerprint(model: &CausalLm) -> Vec<(String, f64, f64)> {
    model
        .named_parameters()
        .map(|(name, t)| {
            let t = t.to_kind(Kind::Double);
            (
                name.to_owned(),
                t.sum(Kind::Double).double_value(&[]),
                t.abs().sum(Kind::Double).double_value(&[]),
            )
        })
        .collect()
}

/// Exports the checkpoint's weights bucket by bucket to a child process (this binary's
/// `ipc-receive`), which loads the same architecture with zeroed weights, copies every bucket
/// through CUDA IPC, and answers with its fingerprint; the two must be equal.
fn ipc_send(dir: &Path, bucket_bytes: usize) -> Result<()> {
    let model = CausalLm::from_pretrained(dir, Device::Cuda(0), Kind::BFloat16)?;
    let metas = WeightMeta::of_model(&model)?;
    let plans = weight_ipc::plan_buckets(&metas, bucket_bytes)?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["ipc-receive", &dir.display().to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut to_child = child.stdin.take().context("child stdin")?;
    let mut from_child = std::io::BufReader::new(child.stdout.take().context("child stdout")?);
    let mut line = String::new();
    from_child.read_line(&mut line)?; // "ready": the child loaded its model
    let start = Instant::now();
    let mut bytes = 0u64;
    for plan in &plans {
        let (buffer, bucket) = weight_ipc::export_bucket(&model, plan)?;
        writeln!(to_child, "{}", serde_json::to_string(&bucket)?)?;
        line.clear();
        from_child.read_line(&mut line)?;
        if line.trim() != "copied" {
            bail!("the receiver answered `{}`", line.trim());
        }
        bytes += plan.len;
        drop(buffer);
    }
    let seconds = start.elapsed().as_secs_f64();
    writeln!(to_child, "done")?;
    line.clear();
    from_child.read_line(&mut line)?;
    let received: Vec<(String, f64, f64)> = serde_json::from_str(line.trim())?;
    let _ = child.wait();
    let sent = fingerprint(&model);
    let equal = received == sent;
    emit(json!({
        "check": "ipc",
        "buckets": plans.len(),
        "bytes": bytes,
        "seconds": seconds,
        "gb_per_s": bytes as f64 / seconds / 1e9,
        "receiver_weights_equal_sender": equal,
        "ok": equal,
    }));
    Ok(())
}

fn ipc_receive(dir: &Path) -> Result<()> {
    let model = CausalLm::from_pretrained(dir, Device::Cuda(0), Kind::BFloat16)?;
    tch::no_grad(|| {
        for (_, t) in model.named_parameters() {
            let _ = t.shallow_clone().zero_();
        }
    });
    println!("ready");
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line?;
        if line == "done" {
            break;
        }
        let bucket: IpcWeightBucket = serde_json::from_str(&line)?;
        weight_ipc::receive_bucket(&model, &bucket)?;
        println!("copied");
    }
    println!("{}", serde_json::to_string(&fingerprint(&model))?);
    Ok(())
}

/// Two processes on GPU 0 form one NCCL group: the collective must refuse with an error that
/// says so, within seconds, on both ranks.
fn nccl_same_gpu() -> Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["nccl-rank", "1", &port.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let start = Instant::now();
    let mine = nccl_rank(0, port);
    let mut child_out = String::new();
    std::io::Read::read_to_string(
        &mut child.stdout.take().context("child stdout")?,
        &mut child_out,
    )?;
    let _ = child.wait();
    let seconds = start.elapsed().as_secs_f64();
    let refused = matches!(&mine, Err(e) if e.contains("NCCL needs one GPU per rank"));
    emit(json!({
        "check": "nccl_same_gpu",
        "seconds": seconds,
        "rank0": match &mine { Ok(()) => "joined".to_owned(), Err(e) => e.clone() },
        "rank1": child_out.trim(),
        "ok": refused && child_out.contains("NCCL needs one GPU per rank"),
    }));
    Ok(())
}

fn nccl_rank(rank: usize, port: u16) -> Result<(), String> {
    use rtrun::collective::{Backend, CollectiveConfig, Communicator};
    let mut config =
        CollectiveConfig::new("same-gpu", rank, 2, "127.0.0.1", port).with_backend(Backend::Nccl);
    config.cuda_device = 0;
    config.timeout = Duration::from_secs(30);
    let result = Communicator::init(config).map(|_| ()).map_err(|e| e.to_string());
    if rank == 1 {
        println!(
            "{}",
            match &result {
                Ok(()) => "joined".to_owned(),
                Err(e) => e.clone(),
            }
        );
    }
    result
}

/// NCCL's device reduce-scatter and all-gather on one rank, then stage 3 (+ checkpointing)
/// against stage 0 for two training steps on CUDA.
fn zero(ckpt: &Path) -> Result<()> {
    use rtrun::collective::{Backend, CollectiveConfig, Communicator};
    use rtrun_rlhf_model::train::OptimizerConfig;
    use rtrun_rlhf_shard::{GroupComm, ShardConfig, ShardedModel, ZeroStage};
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let config = CollectiveConfig::new("zero", 0, 1, "127.0.0.1", port).with_backend(Backend::Nccl);
    let comm = Communicator::init(config)?;
    let values = Tensor::arange(1024, (Kind::Float, Device::Cuda(0)));
    let expected = values.copy();
    device_collectives(comm, &values)?;
    let collectives_equal = values.equal(&expected);

    let steps = |stage: ZeroStage, checkpoint: bool| -> Result<(Vec<f64>, Vec<Tensor>)> {
        let model = CausalLm::from_pretrained(ckpt, Device::Cuda(0), Kind::Float)?;
        let shard = ShardConfig { stage, gradient_checkpointing: checkpoint };
        let mut sharded = ShardedModel::for_causal_lm(
            &model,
            shard,
            GroupComm::solo(),
            Some(OptimizerConfig::default()),
        )?;
        let ids = ids(model.config().vocab_size, 4, 64).to_device(Device::Cuda(0));
        let mut losses = Vec::new();
        for _ in 0..2 {
            sharded.zero_grad()?;
            let logits = model.forward(&ids, &ids.ones_like(), None)?;
            let loss = logits.log_softmax(-1, Kind::Float).mean(Kind::Float).neg();
            losses.push(loss.double_value(&[]));
            model.backward(&loss)?;
            sharded.step()?;
        }
        sharded.gather_all()?;
        let weights = model.named_parameters().map(|(_, t)| t.to_device(Device::Cpu)).collect();
        Ok((losses, weights))
    };
    let (base_losses, base) = steps(ZeroStage::Zero, false)?;
    let (losses, sharded) = steps(ZeroStage::Three, true)?;
    let (mut gap, mut norm) = (0.0, 0.0);
    for (a, b) in sharded.iter().zip(&base) {
        gap += (a - b).square().sum(Kind::Double).double_value(&[]);
        norm += b.square().sum(Kind::Double).double_value(&[]);
    }
    let gap = (gap / norm).sqrt();
    emit(json!({
        "check": "zero",
        "nccl_device_collectives_equal": collectives_equal,
        "stage0_losses": base_losses,
        "stage3_checkpointed_losses": losses,
        "weight_gap": gap,
        "ok": collectives_equal && gap < 1e-5,
    }));
    Ok(())
}

/// NCCL's in-place reduce-scatter (sum) then all-gather of `values` on one rank: the identity.
#[cfg(feature = "cuda")]
fn device_collectives(mut comm: rtrun::collective::Communicator, values: &Tensor) -> Result<()> {
    use rtrun::collective::ReduceOp;
    rtrun_rlhf_shard::device::reduce_scatter_on_device(&mut comm, values, ReduceOp::Sum)?;
    rtrun_rlhf_shard::device::all_gather_on_device(&mut comm, values)?;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn device_collectives(_comm: rtrun::collective::Communicator, _values: &Tensor) -> Result<()> {
    bail!("device collectives need a build with the cuda feature")
}

/// The `tp` check.
fn tp(dir: &Path) -> Result<()> {
    let whole = CausalLm::from_pretrained(dir, Device::Cuda(0), Kind::Float)?;
    let config = EngineConfig {
        num_gpu_blocks: Some(256),
        device: "cuda".into(),
        dtype: "f32".into(),
        ..EngineConfig::default()
    };
    let vocab = whole.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..8u32)
        .map(|i| (0..24).map(|j| 3 + (i * 7919 + j * 104_729) % (vocab - 3)).collect())
        .collect();
    let params = SamplingParams::greedy(32);
    let requests: Vec<GenerationRequest> =
        prompts.iter().map(|p| GenerationRequest::new(p.clone(), params.clone())).collect();
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut split =
        rtrun_rlhf_engine::tp::ThreadFollowers::engine(&whole, None, config.clone(), 2, port)?;
    let started = Instant::now();
    let got = split.generate(requests.clone())?;
    let tp_seconds = started.elapsed().as_secs_f64();
    drop(split);
    let mut engine = LlmEngine::new(whole, None, config)?;
    let started = Instant::now();
    let want = engine.generate(requests)?;
    let whole_seconds = started.elapsed().as_secs_f64();
    let mut worst = 0f32;
    for (a, b) in want.iter().zip(&got) {
        anyhow::ensure!(a.samples[0].token_ids == b.samples[0].token_ids, "tp=2 tokens differ");
        for (x, y) in a.samples[0].log_probs.iter().zip(&b.samples[0].log_probs) {
            worst = worst.max((x - y).abs());
        }
    }
    anyhow::ensure!(worst <= 1e-4, "tp=2 log-probs differ by {worst}");
    emit(json!({
        "check": "tp", "ok": true, "max_logprob_diff": worst,
        "tp2_seconds": tp_seconds, "tp1_seconds": whole_seconds,
    }));
    Ok(())
}
