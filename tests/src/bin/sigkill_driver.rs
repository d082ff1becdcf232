//! A driver for the SIGKILL test: starts actors and task workers, prints their process ids and
//! the session, then waits to be killed. With `--late-actor` it first waits for a line on stdin
//! and then starts one more actor and prints `late <pid>` (or `late-error <error>`): the
//! replaced-binary test deletes this executable in between.

use std::io::Write;

use clap::Parser;

/// A driver for the SIGKILL test: starts actors and task workers, prints their process ids and
/// the session, then waits to be killed.
#[derive(Parser)]
struct Args {
    /// Wait for a line on stdin, then start one more actor and print `late <pid>` (or
    /// `late-error <error>`).
    #[arg(long)]
    late_actor: bool,
}

#[derive(Default)]
struct Idle;

#[rtrun::actor]
impl Idle {
    pub fn new() -> Self {
        Idle
    }

    pub fn pid(&self) -> u32 {
        std::process::id()
    }
}

#[rtrun::remote]
fn task_pid() -> u32 {
    std::process::id()
}

fn main() -> anyhow::Result<()> {
    // A worker process (this executable re-run by the runtime) serves its assignment here and
    // never returns: only the driver reads the command line.
    rtrun::run_worker_if_requested();
    let Args { late_actor } = Args::parse();
    rtrun::init_with(rtrun::Config { num_cpus: Some(2.0), ..Default::default() })?;
    let actors = (0..3).map(|_| Idle::remote()).collect::<Result<Vec<_>, _>>()?;
    let mut pids: Vec<u32> = actors.iter().map(|a| a.pid().get()).collect::<Result<_, _>>()?;
    pids.push(task_pid::remote().get()?);
    let big = rtrun::put(&vec![7u8; 1 << 20])?;
    let _ = big;
    let session = rtrun::context()?.session;
    let mut out = std::io::stdout().lock();
    writeln!(out, "session {session}")?;
    writeln!(out, "pids {}", pids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "))?;
    out.flush()?;
    if late_actor {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        match Idle::remote().and_then(|late| late.pid().get()) {
            Ok(pid) => writeln!(out, "late {pid}")?,
            Err(e) => writeln!(out, "late-error {e}")?,
        }
        out.flush()?;
    }
    drop(out);
    loop {
        std::thread::park();
    }
}
