//! `rtrun memory`: finds a running session on this machine and prints its object store.

use anyhow::Context;

/// Prints the object store of `session` (or of the only running session).
pub fn run(session: Option<&str>) -> anyhow::Result<()> {
    let session = rtrun::session::pick_session(session)?;
    let memory = rtrun::session::node_memory(&session)
        .with_context(|| format!("querying session {session}"))?;
    println!("session {}", memory.session);
    println!("{}: spill directory {}", memory.node, memory.spill_dir);
    print!("{}", memory.stats);
    Ok(())
}
