//! Benchmark of the generation engine against the plain reference decode (full recomputation,
//! no KV cache) in the same run: generated tokens per second at batch 1, 16 and 64 on the tiny
//! and the ~25M-parameter models, greedy, both decodes checked token-identical; then the
//! speed-up of prefix caching on prompts that share a long prefix.
//!
//! Run: `cargo run --release -p rtrun-rlhf-engine --example engine_bench -- [--threads N]
//! [--prompt-len P] [--max-tokens T] [--models tiny,25m] [--batches 1,16,64] [--prefix-len L]
//! [--repeats R] [--reference on|off]`; `--reference off` times the engine alone (the
//! reference's cost grows with the square of the length).
//!
//! With `--hf DIR` it instead runs the engine on the Hugging Face checkpoints and prompts that
//! `scripts/bench/hf_generate.py make DIR` wrote (`--models` then names `DIR/<model>`), checks
//! its greedy tokens against the `DIR/hf-<model>-b<batch>.json` that `generate` left, and prints
//! one JSON line per batch size: the engine's side of `scripts/bench-rlhf.sh`.
//!
//! With `--tp 1,2,4` it instead times tensor-parallel engines (issue 40, item 7): for each model
//! of `--tp-models` (`25m`, `110m`, or `tiny` for a smoke run) and each size N, one engine of N
//! actor processes (`EngineActor::create_group`, each rank with `max(1, cores / N)` libtorch
//! threads), greedy tokens/s of `--tp-batch` prompts of `--prompt-len` tokens × `--tp-new-tokens`
//! new tokens (best of `--tp-repeats` after a warm-up), checked token-identical to TP 1; and the
//! resharding per weight sync (`reshard::engine_buckets`, mean of 3) with the bytes each rank
//! receives. `scripts/bench-tp.sh` runs it.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use rtrun_rlhf_engine::rng::SplitMix64;
use rtrun_rlhf_engine::tp::{TpLayout, reshard};
use rtrun_rlhf_engine::{
    EngineActor, EngineActorConfig, EngineConfig, GenerationOutput, GenerationRequest, LlmEngine,
    SamplingParams, reference_generate,
};
use rtrun_rlhf_model::tch::{Device, Kind};
use rtrun_rlhf_model::{CausalLm, ModelConfig, ModelFamily, SaveOptions, tiny};

/// The engine's throughput against the reference decode (or, with `--hf`, against Hugging Face
/// `generate`'s recorded tokens), and the speed-up of prefix caching.
#[derive(clap::Parser)]
struct Options {
    /// libtorch intra-op threads.
    #[arg(long, default_value_t = 1)]
    threads: i32,
    /// Prompt tokens per request (random prompts; `--hf` uses the recorded ones).
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// New tokens per request.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Models, comma-separated: `tiny`, `25m` (or, with `--hf`, directories under it).
    #[arg(long, value_delimiter = ',', default_values_t = ["tiny".to_string(), "25m".to_string()])]
    models: Vec<String>,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 16, 64])]
    batches: Vec<usize>,
    /// Length of the shared prefix in the prefix-caching run.
    #[arg(long, default_value_t = 512)]
    prefix_len: usize,
    /// Timed rounds per row (the best is reported).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    repeats: u64,
    /// The directory `scripts/bench/hf_generate.py make` wrote: compare with `generate` there.
    #[arg(long)]
    hf: Option<std::path::PathBuf>,
    /// Whether throughput rows also time the full-recompute reference decode (its cost grows
    /// with the square of the length: `off` for long contexts).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    reference: String,
    /// Steps of decodes only run the static-shape decode step (`EngineConfig::static_decode`;
    /// absent: the device's default, off on the CPU).
    #[arg(long, value_parser = ["on", "off"])]
    static_decode: Option<String>,
    /// Tensor-parallel sizes, comma-separated or repeated (`--tp 1,2,4`): time engines of that
    /// many actor processes instead of the runs above (TP 1 always runs, as the anchor).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..))]
    tp: Vec<u64>,
    /// Models of the `--tp` run, comma-separated: `25m`, `110m`, `tiny`.
    #[arg(long, value_delimiter = ',', default_values_t = ["25m".to_string(), "110m".to_string()])]
    tp_models: Vec<String>,
    /// Prompts per timed `generate` call of the `--tp` run.
    #[arg(long, default_value_t = 32)]
    tp_batch: usize,
    /// New tokens per prompt in the `--tp` run.
    #[arg(long, default_value_t = 32)]
    tp_new_tokens: u32,
    /// Timed `generate` calls per row of the `--tp` run (after one warm-up; the best counts).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    tp_repeats: u64,
    /// Bucket size of the timed resharding (the trainer's `rollout.weight_bucket_bytes`
    /// default).
    #[arg(long, default_value_t = 32 << 20)]
    tp_bucket_bytes: usize,
}

fn build_model(name: &str) -> Result<(ModelConfig, CausalLm)> {
    let config = match name {
        "tiny" => tiny::tiny_config(ModelFamily::Qwen2),
        "25m" => tiny::bench_config_25m(),
        other => bail!("models are `tiny` or `25m`, found `{other}`"),
    };
    let model = CausalLm::new_random(&config, Device::Cpu, Kind::Float, 5)?;
    Ok((config, model))
}

fn random_prompts(count: usize, len: usize, vocab: i64, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = SplitMix64::new(seed);
    (0..count)
        .map(|_| (0..len).map(|_| 3 + (rng.next_u64() % (vocab as u64 - 3)) as u32).collect())
        .collect()
}

fn generated(outputs: &[GenerationOutput]) -> usize {
    outputs.iter().flat_map(|o| &o.samples).map(|s| s.token_ids.len()).sum()
}

fn tokens(outputs: &[GenerationOutput]) -> Vec<&Vec<u32>> {
    outputs.iter().flat_map(|o| &o.samples).map(|s| &s.token_ids).collect()
}

fn engine_config(num_blocks: usize, prefix_caching: bool) -> EngineConfig {
    EngineConfig {
        num_gpu_blocks: Some(num_blocks),
        enable_prefix_caching: prefix_caching,
        static_decode: STATIC_DECODE.get().copied().flatten(),
        ..EngineConfig::default()
    }
}

/// `--static-decode`, for every engine the bench makes.
static STATIC_DECODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();

fn throughput(options: &Options, name: &str) -> Result<()> {
    let (config, model) = build_model(name)?;
    let params = SamplingParams::greedy(options.max_tokens);
    let blocks_per_seq = (options.prompt_len + options.max_tokens as usize).div_ceil(16);
    let max_batch = options.batches.iter().copied().max().unwrap_or(1);
    let mut engine =
        LlmEngine::new(model, None, engine_config(blocks_per_seq * max_batch + 8, false))?;
    println!(
        "\n{name}: {} M params, prompt {} tokens, {} generated tokens per sequence, greedy",
        engine.model().params.numel() as f64 / 1e6,
        options.prompt_len,
        options.max_tokens
    );
    // Warm-up: first-touch of the KV cache and libtorch's lazy initialisation.
    let warm_up = random_prompts(4, options.prompt_len, config.vocab_size, 999);
    engine.generate(
        warm_up.into_iter().map(|p| GenerationRequest::new(p, SamplingParams::greedy(4))).collect(),
    )?;
    println!("| batch | engine tok/s | reference tok/s | speed-up | identical |");
    println!("|------:|-------------:|----------------:|---------:|:---------:|");
    for &batch in &options.batches {
        let prompts = random_prompts(batch, options.prompt_len, config.vocab_size, batch as u64);
        let requests: Vec<GenerationRequest> =
            prompts.iter().map(|p| GenerationRequest::new(p.clone(), params.clone())).collect();
        // Engine and reference alternate; the best of `repeats` rounds counts for each, which
        // is the figure least disturbed by other load on the machine.
        let (mut engine_rate, mut reference_rate) = (0.0f64, 0.0f64);
        let (mut fast, mut slow) = (Vec::new(), Vec::new());
        for _ in 0..options.repeats {
            let start = Instant::now();
            fast = engine.generate(requests.clone())?;
            engine_rate = engine_rate.max(generated(&fast) as f64 / start.elapsed().as_secs_f64());
            if options.reference == "on" {
                let start = Instant::now();
                slow = reference_generate(engine.model(), &requests)?;
                reference_rate =
                    reference_rate.max(generated(&slow) as f64 / start.elapsed().as_secs_f64());
            }
        }
        if options.reference == "on" {
            let same = if tokens(&fast) == tokens(&slow) { "yes" } else { "NO" };
            println!(
                "| {batch} | {engine_rate:.0} | {reference_rate:.0} | {:.1}x | {same} |",
                engine_rate / reference_rate
            );
        } else {
            println!("| {batch} | {engine_rate:.0} | - | - | - |");
        }
    }
    Ok(())
}

fn prefix_caching(options: &Options, name: &str) -> Result<()> {
    let (config, _) = build_model(name)?;
    let count = 32;
    let prefix = random_prompts(1, options.prefix_len, config.vocab_size, 77).remove(0);
    let requests: Vec<GenerationRequest> = random_prompts(count, 8, config.vocab_size, 78)
        .into_iter()
        .map(|suffix| {
            let prompt = prefix.iter().chain(&suffix).copied().collect();
            GenerationRequest::new(prompt, SamplingParams::greedy(16))
        })
        .collect();
    let blocks = (options.prefix_len + 8 + 16).div_ceil(16) * count + 8;
    let mut results = Vec::new();
    for caching in [false, true] {
        let mut best = None;
        for _ in 0..options.repeats {
            // A fresh engine each round, so every round starts with an empty prefix cache.
            let (_, model) = build_model(name)?;
            let mut engine = LlmEngine::new(model, None, engine_config(blocks, caching))?;
            let start = Instant::now();
            let outputs = engine.generate(requests.clone())?;
            let seconds = start.elapsed().as_secs_f64();
            if best.as_ref().is_none_or(|(b, _, _)| seconds < *b) {
                best = Some((seconds, outputs, engine.stats()));
            }
        }
        results.push(best.context("at least one round")?);
    }
    let (off, on) = (&results[0], &results[1]);
    println!(
        "\n{name}: {count} prompts = shared {}-token prefix + 8 own tokens, 16 generated each",
        options.prefix_len
    );
    println!(
        "prefix caching off: {:.3} s ({} prefill tokens); on: {:.3} s ({} prefill tokens, hit rate {:.2}); speed-up {:.1}x; identical: {}",
        off.0,
        off.2.prefill_tokens,
        on.0,
        on.2.prefill_tokens,
        on.2.prefix_hit_rate,
        off.0 / on.0,
        if tokens(&off.1) == tokens(&on.1) { "yes" } else { "NO" }
    );
    Ok(())
}

/// The engine on `dir/<name>` (a Hugging Face checkpoint) and `dir/prompts-<name>.json`, greedy
/// with `min_tokens = max_tokens` as HF's `min_new_tokens`, best of `repeats` rounds per batch
/// size after a warm-up round, its tokens compared with HF `generate`'s where they were saved.
fn against_hf(options: &Options, dir: &std::path::Path, name: &str) -> Result<()> {
    let read_json = |path: std::path::PathBuf| -> Result<Vec<Vec<u32>>> {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    };
    let start = Instant::now();
    let model = CausalLm::from_pretrained(&dir.join(name), Device::Cpu, Kind::Float)?;
    let load_seconds = start.elapsed().as_secs_f64();
    let prompts = read_json(dir.join(format!("prompts-{name}.json")))?;
    let max_batch = options.batches.iter().copied().max().unwrap_or(1);
    let prompt_len = prompts.first().map_or(0, Vec::len);
    let blocks_per_seq = (prompt_len + options.max_tokens as usize).div_ceil(16);
    let mut engine =
        LlmEngine::new(model, None, engine_config(blocks_per_seq * max_batch + 8, false))?;
    let params = SamplingParams {
        min_tokens: options.max_tokens,
        ..SamplingParams::greedy(options.max_tokens)
    };
    for &batch in &options.batches {
        if batch > prompts.len() {
            bail!("batch {batch} needs more than the {} prompts of {name}", prompts.len());
        }
        let requests: Vec<GenerationRequest> = prompts[..batch]
            .iter()
            .map(|p| GenerationRequest::new(p.clone(), params.clone()))
            .collect();
        engine.generate(requests.clone())?;
        let mut best = f64::INFINITY;
        let mut outputs = Vec::new();
        for _ in 0..options.repeats {
            let start = Instant::now();
            outputs = engine.generate(requests.clone())?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        let hf_path = dir.join(format!("hf-{name}-b{batch}.json"));
        let identical = match hf_path.exists() {
            true => {
                let theirs = read_json(hf_path)?;
                Some(tokens(&outputs).into_iter().eq(theirs.iter()))
            }
            false => None,
        };
        println!(
            "{}",
            serde_json::json!({
                "engine": name, "batch": batch, "seconds": best,
                "tokens_per_s": generated(&outputs) as f64 / best,
                "threads": options.threads, "identical_to_hf": identical,
                "load_seconds": load_seconds,
            })
        );
    }
    Ok(())
}

/// One row of the `--tp` table.
struct TpRow {
    world: usize,
    threads_per_rank: usize,
    tokens_per_second: f64,
    reshard_ms: f64,
    bytes_per_rank: usize,
}

/// One model's rows of the `--tp` table.
struct TpModel {
    name: String,
    num_parameters: i64,
    /// Bytes of every parameter of the whole model (one copy of tied embeddings).
    whole_bytes: usize,
    rows: Vec<TpRow>,
}

/// The TP sizes to run: TP 1 first (the anchor every other size is compared with), then the
/// others in increasing order, each once.
fn tp_sizes(requested: &[u64]) -> Vec<usize> {
    let mut sizes: Vec<usize> = requested.iter().map(|&n| n as usize).collect();
    sizes.push(1);
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// Mean milliseconds of `reshard::engine_buckets` for `world` ranks over `model`'s parameters
/// (3 rounds after one warm-up), and the most bytes any rank receives.
fn time_reshard(model: &CausalLm, world: usize, bucket_bytes: usize) -> Result<(f64, usize)> {
    let layout = TpLayout::new(model.config(), world)?;
    let params: Vec<_> = model.named_parameters().collect();
    let mut buckets = reshard::engine_buckets(&layout, &params, bucket_bytes)?;
    let rounds = 3;
    let start = Instant::now();
    for _ in 0..rounds {
        buckets = reshard::engine_buckets(&layout, &params, bucket_bytes)?;
    }
    let ms = start.elapsed().as_secs_f64() * 1e3 / rounds as f64;
    let bytes = buckets
        .iter()
        .map(|rank| rank.iter().map(|b| b.num_bytes()).sum::<usize>())
        .max()
        .unwrap_or(0);
    Ok((ms, bytes))
}

/// Greedy tokens of one engine of `world` actor processes on the checkpoint in `dir`: the best
/// tokens/s of `repeats` timed calls after a warm-up, and the tokens of the last call. The
/// group is killed before this returns, also on an error.
fn time_tp_engine(
    options: &Options,
    name: &str,
    dir: &std::path::Path,
    world: usize,
    threads_per_rank: usize,
    requests: &[GenerationRequest],
) -> Result<(f64, Vec<GenerationOutput>)> {
    let blocks_per_seq = (options.prompt_len + options.tp_new_tokens as usize).div_ceil(16);
    let config = EngineActorConfig {
        model_dir: dir.to_path_buf(),
        engine: EngineConfig {
            num_gpu_blocks: Some(blocks_per_seq * requests.len() + 8),
            // Every call prefills its prompts again: the repeats time the same work.
            enable_prefix_caching: false,
            tensor_parallel_size: world,
            ..EngineConfig::default()
        },
    };
    let group = EngineActor::create_group(&format!("bench-{name}-tp{world}"), &config, |_, o| {
        // libtorch reads its intra-op thread count from OMP_NUM_THREADS as the process starts.
        Ok(o.env("OMP_NUM_THREADS", &threads_per_rank.to_string()))
    })
    .with_context(|| format!("starting the {name} engine at TP {world}"))?;
    let run = || -> Result<(f64, Vec<GenerationOutput>)> {
        let engine = &group.members()[0];
        let generate = || -> Result<Vec<GenerationOutput>> {
            engine
                .generate(requests.to_vec())
                .get()?
                .map_err(|e| anyhow::anyhow!("{name} at TP {world}: generate failed: {e}"))
        };
        generate()?;
        let (mut best, mut outputs) = (0.0f64, Vec::new());
        for _ in 0..options.tp_repeats {
            let start = Instant::now();
            outputs = generate()?;
            best = best.max(generated(&outputs) as f64 / start.elapsed().as_secs_f64());
        }
        Ok((best, outputs))
    };
    let result = run();
    let _ = group.kill();
    result
}

/// The `--tp` run over one model: its rows, TP 1 first.
fn tp_model(options: &Options, name: &str, sizes: &[usize]) -> Result<TpModel> {
    let config = match name {
        "tiny" => tiny::tiny_config(ModelFamily::Qwen2),
        "25m" => tiny::bench_config_25m(),
        "110m" => tiny::bench_config_110m(),
        other => bail!("--tp-models are `tiny`, `25m` or `110m`, found `{other}`"),
    };
    let model = tiny::tiny_model(&config, 5)?;
    let num_parameters = config.num_parameters();
    let numel = model.params.numel() as i64;
    if numel != num_parameters {
        bail!("{name}: ModelConfig::num_parameters() says {num_parameters}, the model has {numel}");
    }
    let whole_bytes = model.named_parameters().map(|(_, t)| tensor_bytes(t)).sum();
    let dir = std::env::temp_dir().join(format!("rtrun-tp-bench-{name}-{}", std::process::id()));
    model.save_pretrained(&dir, &SaveOptions::default())?;
    let prompts = random_prompts(options.tp_batch, options.prompt_len, config.vocab_size, 40);
    // `min_tokens` keeps an end-of-sequence token from shortening a sequence: every call
    // generates exactly batch × new tokens.
    let params = SamplingParams {
        min_tokens: options.tp_new_tokens,
        ..SamplingParams::greedy(options.tp_new_tokens)
    };
    let requests: Vec<GenerationRequest> =
        prompts.into_iter().map(|p| GenerationRequest::new(p, params.clone())).collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rows = Vec::new();
    let mut anchor: Option<Vec<GenerationOutput>> = None;
    for &world in sizes {
        let threads_per_rank = (cores / world).max(1);
        let timed = time_tp_engine(options, name, &dir, world, threads_per_rank, &requests);
        let (tokens_per_second, outputs) = match timed {
            Ok(timed) => timed,
            Err(error) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(error);
            }
        };
        match &anchor {
            None => anchor = Some(outputs),
            Some(want) => {
                let (want, got) = (tokens(want), tokens(&outputs));
                if let Some(i) = (0..want.len()).find(|&i| got.get(i) != want.get(i)) {
                    let _ = std::fs::remove_dir_all(&dir);
                    bail!(
                        "{name}: TP {world} generated other greedy tokens than TP 1 for prompt \
                         {i}: TP 1 {:?}, TP {world} {:?}",
                        want[i],
                        got.get(i)
                    );
                }
            }
        }
        let (reshard_ms, bytes_per_rank) = time_reshard(&model, world, options.tp_bucket_bytes)?;
        eprintln!("  {name} TP {world}: {tokens_per_second:.0} tok/s");
        rows.push(TpRow { world, threads_per_rank, tokens_per_second, reshard_ms, bytes_per_rank });
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(TpModel { name: name.to_owned(), num_parameters, whole_bytes, rows })
}

fn tensor_bytes(tensor: &rtrun_rlhf_model::tch::Tensor) -> usize {
    tensor.numel() * tensor.kind().elt_size_in_bytes()
}

/// `--tp`: tokens/s and resharding cost of tensor-parallel engines, one table.
fn tensor_parallel(options: &Options) -> Result<()> {
    let started = Instant::now();
    let sizes = tp_sizes(&options.tp);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "engine_bench --tp: cpu, {cores} core(s), f32; TP sizes {sizes:?}, each rank an actor \
         process with max(1, {cores} / N) libtorch threads; {} prompts × {} prompt tokens × {} \
         new tokens, greedy, prefix caching off (tokens/s counts new tokens over prefill and \
         decode), best of {} calls after a warm-up; resharding: reshard::engine_buckets over \
         the whole model into {} MiB buckets for every rank, mean of 3; resharding in the \
         driver with {} thread(s)",
        options.tp_batch,
        options.prompt_len,
        options.tp_new_tokens,
        options.tp_repeats,
        options.tp_bucket_bytes >> 20,
        options.threads
    );
    println!(
        "note: the ranks share this machine's {cores} CPU core(s). On a CPU-only machine TP N \
         splits the same cores over N processes and adds two all-reduces per layer, so TP is \
         overhead here and TP N slower than TP 1 is the expected, honest result; TP pays where \
         every rank has its own accelerator (and memory)."
    );
    let mut table = Vec::new();
    for name in &options.tp_models {
        table.push(tp_model(options, name, &sizes)?);
    }
    println!(
        "\n| model | params | TP | threads/rank | tokens/s | vs TP 1 | reshard ms | bytes/rank \
         (of whole) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for TpModel { name, num_parameters, whole_bytes, rows } in &table {
        let anchor = rows.first().map_or(f64::NAN, |r| r.tokens_per_second);
        for row in rows {
            println!(
                "| {name} | {:.1}M | {} | {} | {:.0} | {:.2}x | {:.1} | {:.1} MB ({:.2}) |",
                *num_parameters as f64 / 1e6,
                row.world,
                row.threads_per_rank,
                row.tokens_per_second,
                row.tokens_per_second / anchor,
                row.reshard_ms,
                row.bytes_per_rank as f64 / 1e6,
                row.bytes_per_rank as f64 / *whole_bytes as f64
            );
        }
    }
    println!(
        "\ngreedy tokens of every TP size identical to TP 1's: yes ({:.0} s in all)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() -> Result<()> {
    // A worker process (this executable re-run by the runtime for an engine actor) serves its
    // assignment here and never returns: only the driver reads the command line.
    rtrun::run_worker_if_requested();
    let options = <Options as clap::Parser>::parse();
    rtrun_rlhf_model::tch::set_num_threads(options.threads);
    let _ = STATIC_DECODE.set(options.static_decode.as_deref().map(|on| on == "on"));
    if !options.tp.is_empty() {
        rtrun::init()?;
        let result = tensor_parallel(&options);
        rtrun::shutdown();
        return result;
    }
    if let Some(dir) = &options.hf {
        for name in &options.models {
            against_hf(&options, dir, name)?;
        }
        return Ok(());
    }
    println!("engine_bench: cpu, {} intra-op thread(s), f32", options.threads);
    for name in &options.models {
        throughput(&options, name)?;
    }
    for name in &options.models {
        prefix_caching(&options, name)?;
    }
    Ok(())
}
