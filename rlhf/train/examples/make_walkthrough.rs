//! Writes the no-download walkthrough: a small Hugging Face Qwen2 checkpoint (BPE tokenizer,
//! ChatML chat template, generation config, a short supervised warm-up) and GSM8K-format
//! `train.jsonl` / `test.jsonl`, for `deploy/examples/rlhf/grpo-hf.yaml`.
//!
//! `cargo run --release -p rtrun-rlhf --example make_walkthrough -- [OUT_DIR] [--warmup-steps N]`
//! (default `walkthrough/`).

use std::path::PathBuf;

use rtrun_rlhf::walkthrough::{WalkthroughConfig, write_walkthrough};

fn main() -> anyhow::Result<()> {
    let mut out = PathBuf::from("walkthrough");
    let mut config = WalkthroughConfig::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--warmup-steps" => {
                let value =
                    args.next().ok_or_else(|| anyhow::anyhow!("--warmup-steps needs a number"))?;
                config.warmup.steps = value.parse().map_err(|e| {
                    anyhow::anyhow!("--warmup-steps: expected a number, found `{value}` ({e})")
                })?;
            }
            flag if flag.starts_with("--") => anyhow::bail!("unknown flag `{flag}`"),
            dir => out = PathBuf::from(dir),
        }
    }
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
