//! Writes the no-download walkthrough: a small Hugging Face Qwen2 checkpoint (BPE tokenizer,
//! ChatML chat template, generation config, a short supervised warm-up) and GSM8K-format
//! `train.jsonl` / `test.jsonl`, for `deploy/examples/rlhf/grpo-hf.yaml`.
//!
//! `cargo run --release -p rtrun-rlhf --example make_walkthrough -- [OUT_DIR] [--warmup-steps N]
//! [--tools]` (default `walkthrough/`; `--tools`: a checkpoint warmed up to call the calculator,
//! for `deploy/examples/rlhf/grpo-tools.yaml`).

use std::path::PathBuf;

use clap::Parser;
use rtrun_rlhf::demo::walkthrough::{WalkthroughConfig, write_walkthrough};

/// Writes the no-download walkthrough: a small Hugging Face Qwen2 checkpoint (BPE tokenizer,
/// ChatML chat template, generation config, a short supervised warm-up) and GSM8K-format
/// `train.jsonl` / `test.jsonl`, for `deploy/examples/rlhf/grpo-hf.yaml`.
#[derive(Parser)]
struct Args {
    /// The directory to write.
    #[arg(default_value = "walkthrough")]
    out_dir: PathBuf,
    /// Optimizer steps of the supervised warm-up (0 skips it: the checkpoint stays random).
    #[arg(long, value_name = "N", default_value_t = WalkthroughConfig::default().warmup.steps)]
    warmup_steps: u64,
    /// Warm the checkpoint up to call the `calculator` tool (Qwen2.5's tool-call format).
    #[arg(long)]
    tools: bool,
}

fn main() -> anyhow::Result<()> {
    let Args { out_dir: out, warmup_steps, tools } = Args::parse();
    let mut config = WalkthroughConfig { tool_calls: tools, ..WalkthroughConfig::default() };
    config.warmup.steps = warmup_steps;
    let files = write_walkthrough(&out, &config)?;
    if files.warmup.steps == 0 {
        println!("checkpoint: {} (untrained: no warm-up)", files.model_dir.display());
    } else {
        println!(
            "checkpoint: {} (warm-up: {} steps, token loss {:.3} -> {:.3})",
            files.model_dir.display(),
            files.warmup.steps,
            files.warmup.first_loss,
            files.warmup.last_loss
        );
    }
    println!("prompts:    {} and {}", files.train_data.display(), files.test_data.display());
    Ok(())
}
