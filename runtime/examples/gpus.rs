//! Prints the GPUs `rtrun::init` would find on this machine (index, UUID, and where they were
//! found), and what a node started with `--num-gpus N` (the first argument) would offer. A quick
//! check of GPU detection on a new machine: `cargo run -p rtrun --example gpus [N]`.

fn main() -> anyhow::Result<()> {
    let requested: Option<f64> = std::env::args().nth(1).map(|n| n.parse()).transpose()?;
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
