//! The `rtrun` command: cluster operations (growing with the multi-node work), `rtrun memory`,
//! and the microbenchmark that compares rtrun with `ray microbenchmark`.

mod memory;
mod microbenchmark;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "rtrun",
    version,
    about = "rtrun: a Rust runtime for distributed actors and tasks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the runtime microbenchmarks (Ray's metric names and output format).
    Microbenchmark {
        /// Runs only the metrics whose name contains this text (like Ray's TESTS_TO_RUN).
        pattern: Option<String>,
        /// Seconds per measured round (Ray: 2).
        #[arg(long, default_value_t = 2.0)]
        round_seconds: f64,
    },
    /// Shows the object store of a running session: objects per node, sizes, pins, spilled
    /// bytes.
    Memory {
        /// The session to inspect (the hex name in its sockets); needed only when several run.
        #[arg(long)]
        session: Option<String>,
    },
}

fn main() -> anyhow::Result<()> {
    // Worker processes are this binary re-run; they serve here and never parse arguments.
    rtrun::run_worker_if_requested();
    let cli = Cli::parse();
    match cli.command {
        Command::Microbenchmark { pattern, round_seconds } => {
            let pattern =
                pattern.or_else(|| std::env::var("TESTS_TO_RUN").ok()).unwrap_or_default();
            microbenchmark::run(&pattern, round_seconds)
        }
        Command::Memory { session } => memory::run(session.as_deref()),
    }
}
