//! A driver for the tracing test: it and its workers log through `tracing` (filtered by
//! `RUST_LOG`, on stderr); it makes one actor call and runs one task, each of which logs a
//! line, and prints their results. The test follows each by its ids through the lines.

use tracing_subscriber::EnvFilter;

struct Echo;

#[rtrun::actor]
impl Echo {
    pub fn new() -> Self {
        Echo
    }

    pub fn add(&self, a: u64, b: u64) -> u64 {
        tracing::info!("adding {a} and {b}");
        a + b
    }
}

#[rtrun::remote]
fn double(x: u64) -> u64 {
    tracing::info!("doubling {x}");
    2 * x
}

fn main() -> anyhow::Result<()> {
    // Before the worker check: workers (this executable re-run) log the same way.
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    rtrun::run_worker_if_requested();
    rtrun::init_with(rtrun::Config { num_cpus: Some(2.0), ..Default::default() })?;
    let echo = Echo::remote()?;
    println!("sum {}", echo.add(2, 3).get()?);
    println!("double {}", double::remote(21).get()?);
    rtrun::shutdown();
    Ok(())
}
