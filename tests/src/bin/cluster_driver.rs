//! The driver of the multi-node test: joins the cluster named by `RTRUN_ADDRESS`, creates a
//! SPREAD placement group with one bundle per node, calls an actor in each bundle, moves a
//! 256 MiB object between nodes and checks its checksum on both ends. Prints `nodes ...`,
//! `checksum ...` and `ok` lines the test reads. Arguments: `--nodes N` bundles (default 3),
//! `--group NAME` (default `spread`), `--bytes N` for the object's size, `--read FILE` to print
//! a file's first line, `--say N` to have every actor print N lines, `--hold SECONDS` to keep
//! everything that long afterwards (the fault tests kill things meanwhile).
//!
//! Service modes, for actor lifetimes (each prints one `count N pid P` line, then the live named
//! actors as `named NAMESPACE/NAME TYPE [detached]` lines, and exits): `--shared NAME` gets or
//! creates a detached [`Counter`] named NAME and bumps it; `--owned NAME` creates a counter
//! named NAME that dies with this driver and bumps it; `--lookup NAME` bumps an existing one.

use std::io::Write;

use clap::Parser;
use rtrun::placement_group::Strategy;
use rtrun::{ActorOptions, PlacementGroupOptions};

/// The driver of the multi-node test: joins the cluster named by `RTRUN_ADDRESS` (else runs an
/// embedded session), spreads a placement group with one bundle per node, calls an actor in each
/// bundle, moves an object between nodes and checks its checksum on both ends. With `--shared`,
/// `--owned` or `--lookup` it bumps a named counter actor instead and exits.
#[derive(Parser)]
struct Args {
    /// Bundles of the placement group, one per node.
    #[arg(long, env = "CLUSTER_NODES", default_value_t = 3, value_name = "N")]
    #[arg(value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    nodes: usize,
    /// The placement group's name.
    #[arg(long, default_value = "spread", value_name = "NAME")]
    group: String,
    /// Size of the object moved between nodes, in bytes.
    #[arg(long, env = "CLUSTER_OBJECT_BYTES", default_value_t = 256 << 20, value_name = "N")]
    bytes: usize,
    /// Print the first line of FILE, relative to the current directory (a submitted job's
    /// working directory).
    #[arg(long, value_name = "FILE")]
    read: Option<String>,
    /// Have every actor print N lines on stdout and one on stderr.
    #[arg(long, value_name = "N")]
    say: Option<u32>,
    /// Keep the placement group and actors this long after `ok`, then exit.
    #[arg(long, value_name = "SECONDS")]
    hold: Option<u64>,
    /// Service mode: get or create a detached counter named NAME and bump it.
    #[arg(long, value_name = "NAME", group = "service")]
    shared: Option<String>,
    /// Service mode: create a counter named NAME that dies with this driver and bump it.
    #[arg(long, value_name = "NAME", group = "service")]
    owned: Option<String>,
    /// Service mode: bump the existing counter named NAME.
    #[arg(long, value_name = "NAME", group = "service")]
    lookup: Option<String>,
    /// Service mode: the counter also runs a task and this prints `task pid P` (the task
    /// worker's pid).
    #[arg(long)]
    task: bool,
    /// Service mode: CPUs the counter asks for (a head with no CPUs then places it on a node).
    #[arg(long, default_value_t = 0.0, value_name = "N")]
    counter_cpus: f64,
    /// Head-restart mode: puts key `before`, creates a counter of `--counter-cpus` CPUs,
    /// prints `ready pid P`, and calls it with a call that takes SECONDS (the test kills and
    /// restarts the head meanwhile); then prints `slow count N pid P`, reads `before` back
    /// (`kv V`), creates a second counter and bumps both (`after count N pid P`, `second count
    /// N pid P`), runs a task from the first (`task pid P`) and prints `ok`.
    #[arg(long, value_name = "SECONDS", group = "service")]
    across_restart: Option<f64>,
}

/// A deterministic 64-bit checksum (FNV-1a over 8-byte words).
fn checksum(bytes: &[u8]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for chunk in bytes.chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        hash ^= u64::from_le_bytes(word);
        hash = hash.wrapping_mul(0x100_0000_01b3);
    }
    hash ^ bytes.len() as u64
}

struct Probe;

#[rtrun::actor]
impl Probe {
    pub fn new() -> Self {
        Probe
    }

    /// The node this actor runs on, and its pid.
    pub fn where_am_i(&self) -> (String, u32) {
        let node = rtrun::context().map(|c| c.node_id.to_string()).unwrap_or_default();
        (node, std::process::id())
    }

    /// `len` pseudo-random bytes.
    pub fn make(&self, len: usize, seed: u64) -> Vec<u8> {
        rtrun_tests::xorshift_bytes(seed, len)
    }

    /// Reads an object made on another node through its reference (a copy into this node's
    /// store, then a mapping) and returns its length.
    pub fn pull_len(&self, refs: Vec<rtrun::ObjectRef<Vec<u8>>>) -> usize {
        refs.first().and_then(|r| r.get_view().ok()).map_or(0, |bytes| bytes.len())
    }

    /// The value of an environment variable in this actor's process.
    pub fn env(&self, name: String) -> Option<String> {
        std::env::var(name).ok()
    }

    /// Prints `lines` lines on stdout (`probe says I on NODE`) and one on stderr.
    pub fn say(&self, lines: u32) -> u32 {
        let node = rtrun::context().map(|c| c.node_id.to_string()).unwrap_or_default();
        for i in 0..lines {
            println!("probe says {i} on {node}");
        }
        eprintln!("probe warns on {node}");
        lines
    }

    /// The checksum of bytes produced elsewhere.
    pub fn checksum(&self, bytes: Vec<u8>) -> u64 {
        checksum(&bytes)
    }
}

/// A shared service's state: the number of calls it has served.
struct Counter {
    calls: u64,
}

#[rtrun::actor]
impl Counter {
    pub fn new() -> Self {
        Counter { calls: 0 }
    }

    /// Counts a call; returns the count and this process's id.
    pub fn bump(&mut self) -> (u64, u32) {
        self.calls += 1;
        (self.calls, std::process::id())
    }

    /// Sleeps `seconds`, then counts a call like [`Counter::bump`].
    pub fn slow_bump(&mut self, seconds: f64) -> (u64, u32) {
        std::thread::sleep(std::time::Duration::from_secs_f64(seconds));
        self.bump()
    }

    /// Runs a task (owned by this actor) and returns its worker's pid.
    pub fn task_pid(&mut self) -> Result<u32, String> {
        let free = rtrun::TaskOptions { num_cpus: 0.0, ..Default::default() };
        let (_, pid) = env_in_task::remote_with(free, String::from("PATH"))
            .get()
            .map_err(|e| e.to_string())?;
        Ok(pid)
    }
}

/// The service modes (see the module's documentation); `None` when no mode was asked for.
fn service(args: &Args, out: &mut impl Write) -> anyhow::Result<Option<()>> {
    let counter = if let Some(name) = &args.shared {
        let options = ActorOptions::default().name(name).detached().get_if_exists();
        Counter::remote_with(options.num_cpus(args.counter_cpus))?
    } else if let Some(name) = &args.owned {
        Counter::remote_with(ActorOptions::default().name(name))?
    } else if let Some(name) = &args.lookup {
        rtrun::get_actor::<Counter>(name, None)?
    } else if let Some(seconds) = args.across_restart {
        across_restart(args, seconds, out)?;
        return Ok(Some(()));
    } else {
        return Ok(None);
    };
    let (count, pid) = counter.bump().get()?;
    writeln!(out, "count {count} pid {pid}")?;
    if args.task {
        let task = counter.task_pid().get()?.map_err(anyhow::Error::msg)?;
        writeln!(out, "task pid {task}")?;
    }
    for named in rtrun::list_named_actors(true)? {
        let lifetime = if named.detached { " detached" } else { "" };
        writeln!(out, "named {}/{} {}{lifetime}", named.namespace, named.name, named.type_name)?;
    }
    Ok(Some(()))
}

/// The head-restart mode (see [`Args::across_restart`]).
fn across_restart(args: &Args, seconds: f64, out: &mut impl Write) -> anyhow::Result<()> {
    rtrun::kv::put("before", b"kept")?;
    let options = || ActorOptions::default().num_cpus(args.counter_cpus);
    let counter = Counter::remote_with(options())?;
    let (_, pid) = counter.bump().get()?;
    writeln!(out, "ready pid {pid}")?;
    out.flush()?;
    let (count, pid) = counter.slow_bump(seconds).get()?;
    writeln!(out, "slow count {count} pid {pid}")?;
    let kept = rtrun::kv::get("before")?.map(|v| String::from_utf8_lossy(&v).into_owned());
    writeln!(out, "kv {}", kept.unwrap_or_else(|| "<none>".into()))?;
    let second = Counter::remote_with(options())?;
    let (count, pid) = counter.bump().get()?;
    writeln!(out, "after count {count} pid {pid}")?;
    let (count, pid) = second.bump().get()?;
    writeln!(out, "second count {count} pid {pid}")?;
    let task = counter.task_pid().get()?.map_err(anyhow::Error::msg)?;
    writeln!(out, "task pid {task}")?;
    writeln!(out, "ok")?;
    Ok(())
}

/// The variable `name` as a task worker sees it, and the worker's pid.
#[rtrun::remote]
fn env_in_task(name: String) -> (Option<String>, u32) {
    (std::env::var(&name).ok(), std::process::id())
}

fn main() -> anyhow::Result<()> {
    // A worker process (this executable re-run by the runtime) serves its assignment here and
    // never returns: only the driver reads the command line.
    rtrun::run_worker_if_requested();
    let args = Args::parse();
    rtrun::init()?;
    let mut out = std::io::stdout().lock();
    if service(&args, &mut out)?.is_some() {
        return Ok(());
    }
    let nodes = args.nodes;
    let name = &args.group;
    let group = rtrun::placement_group(
        PlacementGroupOptions::uniform(nodes, &[("CPU", 1.0)])?
            .strategy(Strategy::Spread)
            .name(name),
    )?;
    group.wait(std::time::Duration::from_secs(60))?;
    let probes = (0..nodes)
        .map(|i| Probe::remote_with(ActorOptions::default().bundle(&group, i)))
        .collect::<rtrun::Result<Vec<_>>>()?;
    let places = probes.iter().map(|p| p.where_am_i().get()).collect::<rtrun::Result<Vec<_>>>()?;
    let names: Vec<&str> = places.iter().map(|(node, _)| node.as_str()).collect();
    writeln!(out, "nodes {}", names.join(" "))?;
    out.flush()?;
    let len = args.bytes;
    let made = probes[0].make(len, 0x9e37_79b9_7f4a_7c15);
    // Calls to one actor run in order: this answer means the object exists.
    probes[0].where_am_i().get()?;
    let start = std::time::Instant::now();
    let pulled = probes[nodes - 1].pull_len(vec![made.clone()]).get()?;
    let mut node_to_node = start.elapsed().as_secs_f64();
    // Two more objects (a node keeps the copy it pulled, so each measured pull is a new one).
    if std::env::var_os("CLUSTER_BENCH_SECONDS").is_some() {
        for seed in 1..3u64 {
            let other = probes[0].make(len, seed);
            probes[0].where_am_i().get()?;
            let start = std::time::Instant::now();
            probes[nodes - 1].pull_len(vec![other]).get()?;
            node_to_node = node_to_node.min(start.elapsed().as_secs_f64());
        }
    }
    let mut to_driver = f64::MAX;
    let rounds = if std::env::var_os("CLUSTER_BENCH_SECONDS").is_some() { 3 } else { 1 };
    for _ in 0..rounds {
        let start = std::time::Instant::now();
        let view = made.get_view()?;
        to_driver = to_driver.min(start.elapsed().as_secs_f64());
        drop(view);
    }
    writeln!(
        out,
        "object pulls (best of 3 when benchmarking): node to node {:.2} GB/s ({pulled} bytes), node to driver {:.2} GB/s",
        pulled as f64 / node_to_node / 1e9,
        len as f64 / to_driver / 1e9
    )?;
    let remote_sum = probes[nodes - 1].checksum(&made).get()?;
    let local = made.get()?;
    let local_sum = checksum(&local);
    writeln!(out, "checksum {local_sum:x} {remote_sum:x} {}", local.len())?;
    anyhow::ensure!(local.len() == len, "expected {len} bytes, found {}", local.len());
    anyhow::ensure!(local_sum == remote_sum, "checksums differ across nodes");
    shared_reads(&probes[0], &group, nodes - 1, &mut out)?;
    // `CLUSTER_ECHO_ENV=NAME`: the variable NAME as the driver and a worker see it (a job's
    // `--env` reaches both).
    if let Ok(name) = std::env::var("CLUSTER_ECHO_ENV") {
        let driver = std::env::var(&name).unwrap_or_default();
        let worker = probes[nodes - 1].env(name.clone()).get()?.unwrap_or_default();
        writeln!(out, "driver env {name}={driver}")?;
        writeln!(out, "worker env {name}={worker}")?;
        // No CPU: the placement group holds every node's.
        let free = rtrun::TaskOptions { num_cpus: 0.0, ..Default::default() };
        let (task, pid) = env_in_task::remote_with(free, name.clone()).get()?;
        writeln!(out, "task env {name}={} pid {pid}", task.unwrap_or_default())?;
    }
    // `say N`: every probe prints N lines (its output reaches this driver's stderr, prefixed).
    if let Some(lines) = args.say {
        for probe in &probes {
            probe.say(lines).get()?;
        }
        writeln!(out, "said")?;
    }
    // `read FILE`: the first line of FILE, relative to the current directory (a submitted
    // job's working directory).
    if let Some(file) = &args.read {
        let text = std::fs::read_to_string(file)?;
        let cwd = std::env::current_dir()?;
        writeln!(out, "read {file}: {} (in {})", text.lines().next().unwrap_or(""), cwd.display())?;
    }
    writeln!(out, "ok")?;
    out.flush()?;
    // `CLUSTER_FAILOVER=1`: names a joined node whose actor and object it keeps, waits for a
    // line on stdin (the test kills that node meanwhile), then checks that the actor is dead
    // and the object lost, with errors that say so.
    // With one `slot` resource on each joined node, a keeper and a restartable mover take one
    // node each; the victim is the mover's node.
    if std::env::var_os("CLUSTER_FAILOVER").is_some() {
        let slot = || ActorOptions::default().resource("slot", 1.0);
        let keeper = Probe::remote_with(slot())?;
        let mover = Probe::remote_with(slot().max_restarts(1))?;
        keeper.where_am_i().get()?;
        let (node, _) = mover.where_am_i().get()?;
        let victim = probes
            .iter()
            .zip(&places)
            .find(|(_, (at, _))| *at == node)
            .map(|(probe, _)| probe)
            .ok_or_else(|| anyhow::anyhow!("no spread actor on {node}"))?;
        let object = victim.make(1 << 20, 7);
        victim.where_am_i().get()?;
        writeln!(out, "victim {node}")?;
        out.flush()?;
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        match victim.where_am_i().get() {
            Err(rtrun::Error::ActorDied { reason, .. }) => writeln!(out, "actor died: {reason}")?,
            other => anyhow::bail!("expected ActorDied, found {other:?}"),
        }
        match object.get() {
            Err(rtrun::Error::ObjectLost { reason, .. }) => writeln!(out, "object lost: {reason}")?,
            other => anyhow::bail!("expected ObjectLost, found {:?}", other.map(|b| b.len())),
        }
        // The mover restarts once a slot is free elsewhere: free the keeper's.
        keeper.kill()?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let moved_to = loop {
            match mover.where_am_i().get() {
                Ok((at, _)) => break at,
                Err(e) if std::time::Instant::now() < deadline => {
                    writeln!(out, "mover not back yet: {e}")?;
                    std::thread::sleep(std::time::Duration::from_millis(200));
                }
                Err(e) => return Err(e.into()),
            }
        };
        anyhow::ensure!(moved_to != node, "the mover is still on the dead node {node}");
        writeln!(out, "mover restarted on {moved_to}")?;
        writeln!(out, "failover ok")?;
        out.flush()?;
    }
    // `CLUSTER_BENCH_SECONDS=s`: sync calls (one in flight) to the actor on the last node, the
    // cross-node counterpart of Ray's "1:1 actor calls sync".
    if let Some(seconds) =
        std::env::var("CLUSTER_BENCH_SECONDS").ok().and_then(|s| s.parse::<f64>().ok())
    {
        let target = &probes[nodes - 1];
        for _ in 0..200 {
            target.where_am_i().get()?;
        }
        let start = std::time::Instant::now();
        let mut calls = 0u64;
        while start.elapsed().as_secs_f64() < seconds {
            target.where_am_i().get()?;
            calls += 1;
        }
        let rate = calls as f64 / start.elapsed().as_secs_f64();
        writeln!(out, "cross-node 1:1 actor calls sync per second {rate:.0}")?;
    }
    // `hold SECONDS`: keeps its placement group and actors for that long after `ok`, then
    // exits normally.
    if let Some(seconds) = args.hold {
        writeln!(out, "holding")?;
        out.flush()?;
        std::thread::sleep(std::time::Duration::from_secs(seconds));
    }
    Ok(())
}

/// Rounds of [`shared_reads`].
const SHARED_READ_ROUNDS: u64 = 100;

/// Two readers on one node resolve the same object, made on another node, at the same time:
/// both pulls copy it into their node's store once between them (a weight bucket read by two
/// engines). Each round is a fresh object, so every round races the two pulls again; each
/// reader's checksum must match the maker's. Prints `shared reads ok N`.
fn shared_reads(
    maker: &ProbeRef,
    group: &rtrun::PlacementGroup,
    bundle: usize,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let readers = [
        Probe::remote_with(ActorOptions::default().bundle(group, bundle))?,
        Probe::remote_with(ActorOptions::default().bundle(group, bundle))?,
    ];
    let len = 300_000;
    let start = std::time::Instant::now();
    for seed in 0..SHARED_READ_ROUNDS {
        let made = maker.make(len, seed + 1);
        let expected = checksum(&made.get()?);
        let sums = readers.iter().map(|r| r.checksum(&made)).collect::<Vec<_>>();
        for (reader, sum) in sums.into_iter().enumerate() {
            let sum =
                sum.get().map_err(|e| anyhow::anyhow!("round {seed}, reader {reader}: {e}"))?;
            anyhow::ensure!(sum == expected, "round {seed}, reader {reader}: checksum differs");
        }
    }
    writeln!(
        out,
        "shared reads ok {SHARED_READ_ROUNDS} in {:.1} s",
        start.elapsed().as_secs_f64()
    )?;
    Ok(())
}
