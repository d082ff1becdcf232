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

use std::time::Instant;

use anyhow::{Context, Result, bail};
use rtrun_rlhf_engine::rng::SplitMix64;
use rtrun_rlhf_engine::{
    EngineConfig, GenerationOutput, GenerationRequest, LlmEngine, SamplingParams,
    reference_generate,
};
use rtrun_rlhf_model::tch::{Device, Kind};
use rtrun_rlhf_model::{CausalLm, ModelConfig, ModelFamily, tiny};

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
        ..EngineConfig::default()
    }
}

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

fn main() -> Result<()> {
    let options = <Options as clap::Parser>::parse();
    rtrun_rlhf_model::tch::set_num_threads(options.threads);
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
