//! Prints the GPUs `rtrun::init` would find on this machine (index, UUID, and where they were
//! found), and what a node started with `--num-gpus N` (the first argument) would offer. A quick
//! check of GPU detection on a new machine: `cargo run -p rtrun --example gpus [N]`.

use clap::Parser;

/// Prints the GPUs `rtrun::init` would find on this machine (index, UUID, and where they were
/// found), and what a node started with `--num-gpus N` would offer.
#[derive(Parser)]
struct Args {
    /// The `--num-gpus` of the node to show: fewer GPUs than found, or fake ones added (default:
    /// those found, less any that `CUDA_VISIBLE_DEVICES` hides).
    #[arg(value_name = "N")]
    num_gpus: Option<f64>,
}

fn main() -> anyhow::Result<()> {
    let Args { num_gpus: requested } = Args::parse();
    let (detected, source) = rtrun::gpus::detect_gpus();
    println!("detected {} GPU(s) via {source:?}", detected.len());
    for gpu in &detected {
        println!("  {gpu}");
    }
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let node = rtrun::gpus::node_gpus("node-0", detected, visible.as_deref(), requested)?;
    println!("a node here offers {} GPU(s):", node.len());
    for gpu in &node {
        println!("  {gpu}");
    }
    Ok(())
}
