//! The driver of the many-node test and benchmark (issue 44): on the cluster named by
//! `RTRUN_ADDRESS` it creates one placement group per node (a single bundle of the node's whole
//! CPU, Ray's "pg-per-node"), `--actors-per-node` actors in each bundle, and calls every actor.
//! It prints what it measured as `key value` lines (and one `json {...}` line):
//!
//! - `groups N created_s S groups_per_s R`: creating every group and waiting for each;
//! - `actors N alive_s S actors_per_s R`: from the first creation to every actor's first
//!   answer (Ray's benchmark: actors created, then `ray.get` on a call to each);
//! - `calls N p50_us A p99_us B`: one call at a time to each actor in turn, several rounds;
//! - `nodes K`: the distinct nodes the actors answered from (one per group), then `ok`.
//!
//! With `--hold SECONDS` it keeps everything that long before it exits (the test polls
//! `rtrun status`, the metrics and the dashboard meanwhile).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::time::{Duration, Instant};

use clap::Parser;
use rtrun::placement_group::Strategy;
use rtrun::{ActorOptions, PlacementGroupOptions};

#[derive(Parser)]
struct Args {
    /// Groups to create, one per node.
    #[arg(long, value_name = "N")]
    #[arg(value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    nodes: usize,
    /// CPUs of each node's bundle (the node's whole CPU).
    #[arg(long, default_value_t = 4.0, value_name = "N")]
    cpus_per_node: f64,
    /// Actors in each bundle, sharing its CPUs equally.
    #[arg(long, default_value_t = 4, value_name = "N")]
    #[arg(value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    actors_per_node: usize,
    /// Rounds of calls to every actor for the latency figures.
    #[arg(long, default_value_t = 5, value_name = "N")]
    rounds: usize,
    /// Seconds to wait for the groups and for the actors.
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    timeout: u64,
    /// Keep everything this long after `ok`, then exit.
    #[arg(long, value_name = "SECONDS")]
    hold: Option<u64>,
}

struct Worker;

#[rtrun::actor]
impl Worker {
    pub fn new() -> Self {
        Worker
    }

    /// The node this actor runs on.
    pub fn node(&self) -> String {
        rtrun::context().map(|c| c.node_id.to_string()).unwrap_or_default()
    }

    /// Answers at once (the call-latency probe).
    pub fn ping(&self, n: u64) -> u64 {
        n + 1
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((sorted.len().saturating_sub(1)) as f64 * p).round() as usize;
    sorted.get(rank).copied().unwrap_or(0.0)
}

fn main() -> anyhow::Result<()> {
    rtrun::run_worker_if_requested();
    let args = Args::parse();
    rtrun::init()?;
    let mut out = std::io::stdout().lock();
    let timeout = Duration::from_secs(args.timeout);

    let start = Instant::now();
    let groups = (0..args.nodes)
        .map(|i| {
            rtrun::placement_group(
                PlacementGroupOptions::uniform(1, &[("CPU", args.cpus_per_node)])?
                    .strategy(Strategy::StrictPack)
                    .name(&format!("node-group-{i}")),
            )
        })
        .collect::<rtrun::Result<Vec<_>>>()?;
    for (i, group) in groups.iter().enumerate() {
        anyhow::ensure!(group.wait(timeout)?, "group {i} was not created within {timeout:?}");
    }
    let created = start.elapsed().as_secs_f64();
    let groups_per_s = groups.len() as f64 / created;
    writeln!(out, "groups {} created_s {created:.3} groups_per_s {groups_per_s:.1}", groups.len())?;

    let share = args.cpus_per_node / args.actors_per_node as f64;
    let start = Instant::now();
    let mut actors = Vec::new();
    for group in &groups {
        for _ in 0..args.actors_per_node {
            let options = ActorOptions::default().num_cpus(share).bundle(group, 0);
            actors.push(Worker::remote_with(options)?);
        }
    }
    let first: Vec<_> = actors.iter().map(|a| a.node()).collect();
    let mut nodes = Vec::with_capacity(actors.len());
    for (i, answer) in first.into_iter().enumerate() {
        nodes.push(answer.get().map_err(|e| anyhow::anyhow!("actor {i}: {e}"))?);
    }
    let alive = start.elapsed().as_secs_f64();
    let actors_per_s = actors.len() as f64 / alive;
    writeln!(out, "actors {} alive_s {alive:.3} actors_per_s {actors_per_s:.1}", actors.len())?;

    // The actors of one group share its node, and the groups cover distinct nodes.
    let mut by_group: BTreeMap<usize, BTreeSet<&str>> = BTreeMap::new();
    for (i, node) in nodes.iter().enumerate() {
        by_group.entry(i / args.actors_per_node).or_default().insert(node);
    }
    for (group, on) in &by_group {
        anyhow::ensure!(on.len() == 1, "group {group}'s actors answered from {on:?}");
    }
    let distinct: BTreeSet<&str> = nodes.iter().map(String::as_str).collect();
    anyhow::ensure!(
        distinct.len() == args.nodes,
        "{} groups landed on {} distinct nodes",
        args.nodes,
        distinct.len()
    );

    let mut latencies = Vec::with_capacity(args.rounds * actors.len());
    for round in 0..args.rounds {
        for (i, actor) in actors.iter().enumerate() {
            let n = (round * actors.len() + i) as u64;
            let start = Instant::now();
            let answer = actor.ping(n).get()?;
            latencies.push(start.elapsed().as_secs_f64() * 1e6);
            anyhow::ensure!(answer == n + 1, "actor {i} answered {answer} to {n}");
        }
    }
    latencies.sort_by(f64::total_cmp);
    let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
    writeln!(out, "calls {} p50_us {p50:.1} p99_us {p99:.1}", latencies.len())?;
    writeln!(out, "nodes {}", distinct.len())?;
    writeln!(
        out,
        "json {{\"nodes\": {}, \"groups_per_s\": {groups_per_s:.2}, \"actors\": {}, \
         \"actors_per_s\": {actors_per_s:.2}, \"call_p50_us\": {p50:.1}, \"call_p99_us\": {p99:.1}}}",
        args.nodes,
        actors.len(),
    )?;
    writeln!(out, "ok")?;
    out.flush()?;
    if let Some(seconds) = args.hold {
        std::thread::sleep(Duration::from_secs(seconds));
    }
    Ok(())
}
