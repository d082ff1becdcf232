//! The head core at 2,000 and 10,000 simulated nodes (Ray's 2026 RL scheduling benchmark's
//! shapes, `rtrun_head_core::scale`): group-creation and actor-scheduling throughput, time per
//! decision (p50 / p99 / max) by phase, the core's memory per node and per actor, and how the
//! cost of one decision changes from the smallest cluster to the largest.
//!
//! ```text
//! cargo run --release -p rtrun-head-core --example head_scale -- \
//!     [--nodes 2000,10000] [--layouts node,rack,plain] [--deaths-per-mille 5] [--json FILE]
//! ```

use std::collections::BTreeMap;
use std::time::Instant;

use cap::Cap;
use clap::Parser;
use rtrun_head_core::HeadCore;
use rtrun_head_core::scale::{Layout, Phase, Probe, Scale, Shape};

/// Counts the bytes the process holds, so the core's memory is measured, not estimated.
#[global_allocator]
static ALLOCATOR: Cap<std::alloc::System> = Cap::new(std::alloc::System, usize::MAX);

fn live() -> isize {
    ALLOCATOR.allocated() as isize
}

#[derive(Parser)]
#[command(about = "The head core at cluster scale (no I/O): throughput and time per decision")]
struct Args {
    /// Cluster sizes (simulated nodes of 8 GPUs and 96 CPUs).
    #[arg(long, value_delimiter = ',', default_value = "2000,10000")]
    nodes: Vec<usize>,
    /// Layouts: `node` (a group per node), `rack` (a group per 32-node rack), `plain` (40,000
    /// one-CPU actors, no groups).
    #[arg(long, value_delimiter = ',', default_value = "node,rack,plain")]
    layouts: Vec<String>,
    /// Nodes that die once the actors are alive, per thousand.
    #[arg(long, default_value_t = 5)]
    deaths_per_mille: usize,
    /// Also write the figures as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// Times every decision and samples memory at the end of each phase.
struct Timing {
    started: Option<Instant>,
    times: BTreeMap<Phase, Vec<u64>>,
    live_at_end: BTreeMap<Phase, isize>,
}

impl Probe for Timing {
    fn before(&mut self, _phase: Phase) {
        self.started = Some(Instant::now());
    }
    fn after(&mut self, phase: Phase, _core: &HeadCore) {
        if let Some(started) = self.started.take() {
            let nanos = started.elapsed().as_nanos() as u64;
            self.times.entry(phase).or_default().push(nanos);
        }
    }
    fn phase_done(&mut self, phase: Phase, _core: &HeadCore) {
        self.live_at_end.insert(phase, live());
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn layout_of(name: &str) -> anyhow::Result<Layout> {
    Ok(match name {
        "node" => Layout::GroupPerNode,
        "rack" => Layout::GroupPerRack { rack: 32 },
        "plain" => Layout::PlainActors { actors: 40_000 },
        other => anyhow::bail!("--layouts: unknown layout `{other}` (node, rack or plain)"),
    })
}

#[derive(serde::Serialize)]
struct Row {
    nodes: usize,
    layout: String,
    groups: usize,
    actors: usize,
    groups_per_s: f64,
    actors_per_s: f64,
    decisions: usize,
    /// Phase → (count, p50 µs, p99 µs, max µs, mean µs).
    phases: BTreeMap<String, (usize, f64, f64, f64, f64)>,
    bytes_per_node: f64,
    bytes_per_actor: f64,
    actors_restarted: usize,
    actors_not_restarted: usize,
    wall_s: f64,
}

fn run(nodes: usize, layout_name: &str, deaths_per_mille: usize) -> anyhow::Result<Row> {
    let layout = layout_of(layout_name)?;
    let deaths = (nodes * deaths_per_mille / 1000).max(1);
    let shape = Shape::ray_benchmark(nodes, layout, deaths);
    let start_live = live();
    let wall = Instant::now();
    let mut scale = Scale::new(shape);
    let mut timing = Timing { started: None, times: BTreeMap::new(), live_at_end: BTreeMap::new() };
    let reached = scale.run(&mut timing);
    let wall_s = wall.elapsed().as_secs_f64();
    let total = |phase: Phase| -> f64 {
        timing.times.get(&phase).map_or(0.0, |t| t.iter().sum::<u64>() as f64 / 1e9)
    };
    let groups = shape.groups();
    let actors = shape.actors();
    let groups_per_s = if groups == 0 { 0.0 } else { groups as f64 / total(Phase::CreateGroup) };
    let actors_per_s =
        actors as f64 / (total(Phase::CreateActor) + total(Phase::StartActor)).max(1e-12);
    let mut phases = BTreeMap::new();
    for phase in Phase::ALL {
        let Some(times) = timing.times.get_mut(&phase) else { continue };
        times.sort_unstable();
        let mean = times.iter().sum::<u64>() as f64 / times.len() as f64;
        let us = |ns: u64| ns as f64 / 1e3;
        phases.insert(
            format!("{phase:?}"),
            (
                times.len(),
                us(percentile(times, 0.5)),
                us(percentile(times, 0.99)),
                us(*times.last().unwrap_or(&0)),
                mean / 1e3,
            ),
        );
    }
    let live = |phase: Phase| timing.live_at_end.get(&phase).copied().unwrap_or(start_live);
    let bytes_per_node = (live(Phase::Join) - start_live) as f64 / nodes as f64;
    let bytes_per_actor =
        (live(Phase::StartActor) - live(Phase::CreateGroup)) as f64 / actors as f64;
    drop(scale);
    Ok(Row {
        nodes,
        layout: layout_name.to_owned(),
        groups,
        actors,
        groups_per_s,
        actors_per_s,
        decisions: reached.decisions,
        phases,
        bytes_per_node,
        bytes_per_actor,
        actors_restarted: reached.actors_restarted,
        actors_not_restarted: reached.actors_not_restarted,
        wall_s,
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut rows = Vec::new();
    for layout in &args.layouts {
        for &nodes in &args.nodes {
            let row = run(nodes, layout, args.deaths_per_mille)?;
            println!(
                "{:>6} nodes  {:<5}  {:>6} groups {:>9.0}/s  {:>6} actors {:>9.0}/s  \
                 {:>7} decisions  {:>5.0} B/node  {:>5.0} B/actor  restarted {} (not {})  \
                 {:.1} s",
                row.nodes,
                row.layout,
                row.groups,
                row.groups_per_s,
                row.actors,
                row.actors_per_s,
                row.decisions,
                row.bytes_per_node,
                row.bytes_per_actor,
                row.actors_restarted,
                row.actors_not_restarted,
                row.wall_s
            );
            for (phase, (count, p50, p99, max, mean)) in &row.phases {
                println!(
                    "        {phase:<12} {count:>7} decisions  p50 {p50:>8.1} µs  \
                     p99 {p99:>8.1} µs  max {max:>9.1} µs  mean {mean:>8.1} µs"
                );
            }
            rows.push(row);
        }
        // How one decision's cost grows from the smallest cluster to the largest.
        let of_layout: Vec<&Row> = rows.iter().filter(|r| &r.layout == layout).collect();
        if let (Some(small), Some(large)) = (of_layout.first(), of_layout.last())
            && small.nodes < large.nodes
        {
            for phase in ["CreateGroup", "CreateActor", "StartActor", "NodeDeath"] {
                if let (Some(a), Some(b)) = (small.phases.get(phase), large.phases.get(phase)) {
                    println!(
                        "        {phase:<12} mean per decision at {} nodes / at {}: {:.2}×",
                        large.nodes,
                        small.nodes,
                        b.4 / a.4.max(1e-9)
                    );
                }
            }
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}
