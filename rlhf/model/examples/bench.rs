//! Forward + backward throughput on CPU for the tiny config and a ~25M-parameter config.
//!
//! Run: `cargo run --release -p rtrun-rlhf-model --example bench [-- --iters N --threads T]`.
//! Prints tokens/s for forward only (no grad) and for forward + backward of the next-token loss.

use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use rtrun_rlhf_model::tch::{self, Device, Kind, Tensor};
use rtrun_rlhf_model::tiny::{bench_config_25m, tiny_config};
use rtrun_rlhf_model::train::masked_cross_entropy;
use rtrun_rlhf_model::{CausalLm, ModelConfig, ModelFamily};

/// Forward and forward + backward throughput on CPU, in tokens/s, for the tiny config and a
/// ~25M-parameter config.
#[derive(Parser)]
struct Args {
    /// Timed iterations per case (after one warm-up).
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(i64).range(1..))]
    iters: i64,
    /// libtorch's intra-op threads; 0 keeps libtorch's default.
    #[arg(long, value_name = "T", default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..))]
    threads: i32,
}

struct Case {
    name: &'static str,
    config: ModelConfig,
    batch: i64,
    seq: i64,
}

fn run(model: &CausalLm, ids: &Tensor, backward: bool) -> Result<()> {
    let mask = ids.ones_like();
    if backward {
        let logits = model.forward(ids, &mask, None)?;
        let seq = ids.size()[1];
        let loss = masked_cross_entropy(
            &logits.narrow(1, 0, seq - 1),
            &ids.narrow(1, 1, seq - 1),
            &mask.narrow(1, 1, seq - 1),
        )?;
        loss.backward();
        for (_, p) in model.named_parameters() {
            p.shallow_clone().zero_grad();
        }
    } else {
        let _logits = tch::no_grad(|| model.forward(ids, &mask, None))?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let Args { iters, threads } = Args::parse();
    if threads > 0 {
        tch::set_num_threads(threads);
    }
    let cases = [
        Case {
            name: "tiny (Llama, 2x64)",
            config: tiny_config(ModelFamily::Llama),
            batch: 8,
            seq: 128,
        },
        Case { name: "25M (Qwen2, 6x512)", config: bench_config_25m(), batch: 4, seq: 256 },
    ];
    println!("libtorch threads: {}", tch::get_num_threads());
    for case in cases {
        let model = CausalLm::new_random(&case.config, Device::Cpu, Kind::Float, 1)?;
        let ids = Tensor::randint(
            case.config.vocab_size,
            [case.batch, case.seq],
            (Kind::Int64, Device::Cpu),
        );
        let tokens = (case.batch * case.seq * iters) as f64;
        for backward in [false, true] {
            run(&model, &ids, backward)?; // warm-up
            let start = Instant::now();
            for _ in 0..iters {
                run(&model, &ids, backward)?;
            }
            let secs = start.elapsed().as_secs_f64();
            println!(
                "{:<20} params {:>10}  batch {}x{}  {:<16} {:>10.0} tokens/s",
                case.name,
                case.config.num_parameters(),
                case.batch,
                case.seq,
                if backward { "forward+backward" } else { "forward" },
                tokens / secs
            );
        }
    }
    Ok(())
}
