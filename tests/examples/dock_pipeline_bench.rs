//! How much the GRPO stages overlap when they stream through the TransferDock, against running
//! the same stages one after another, on real worker processes doing real work with the tiny
//! model (see `tests/tests/common/grpo.rs` for the stages).
//!
//! Both modes use fresh stage actors (same roles and seeds) and a fresh dock actor:
//! - `pipelined`: every stage's `run` is called at once; later stages start on the first
//!   finished groups while rollout continues;
//! - `sequential`: stage k's ranks start only when stage k−1 has finished (the anchor: a
//!   synchronous trainer's phases).
//!
//! Printed: wall time of both from the first stage call to the last return, the per-stage
//! timeline chart of each, busy time over makespan, and each stage's head start over its
//! predecessor's end.
//!
//! Run: `cargo run --release -p rtrun-tests --example dock_pipeline_bench [prompts] [samples]
//! [max_new_tokens] [groups_per_batch] [repeats]`.

#[path = "../tests/common/grpo.rs"]
mod grpo;

use std::time::Instant;

use clap::Parser;
use grpo::{GrpoStage, GrpoStageRef};
use rtrun::{ActorOptions, ObjectRef};
use rtrun_rlhf_dock::{PipelineSummary, RemoteDock, StageSpec, StageTimeline};

/// How much the GRPO stages overlap when they stream through the TransferDock, against the same
/// stages run one after another (the anchor), on worker processes with the tiny model.
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    setup: Setup,
    /// Runs of each mode (sequential and pipelined alternate); 0 counts as 1.
    #[arg(default_value_t = 5)]
    repeats: usize,
}

/// The dock and its stages.
#[derive(clap::Args)]
struct Setup {
    /// Prompts in the dock.
    #[arg(default_value_t = 32)]
    prompts: usize,
    /// Samples per prompt.
    #[arg(default_value_t = 8)]
    samples: usize,
    /// Most tokens rollout generates per sample.
    #[arg(default_value_t = 24)]
    max_new_tokens: usize,
    /// Prompt groups per batch a stage takes from the dock.
    #[arg(default_value_t = 2)]
    groups_per_batch: usize,
}

fn start(setup: &Setup) -> anyhow::Result<(RemoteDock, Vec<(GrpoStageRef, StageSpec)>)> {
    let dock = RemoteDock::create(
        grpo::dock_config(setup.prompts, setup.samples),
        ActorOptions::default(),
    )?;
    grpo::put_prompts(&dock, setup.prompts, setup.samples)?;
    let mut stages = Vec::new();
    for (index, spec) in
        grpo::stage_specs(setup.samples, setup.groups_per_batch, 1).into_iter().enumerate()
    {
        let role = grpo::role_of(&spec.consumer, setup.samples, setup.max_new_tokens, 1e-3)?;
        let actor = GrpoStage::remote(role, 100 + index as u64)?;
        // Wait until the actor is up so process start-up is not part of the measurement.
        actor.train_stats().get()?;
        stages.push((actor, spec));
    }
    Ok((dock, stages))
}

fn collect(
    runs: &[ObjectRef<Result<StageTimeline, String>>],
) -> anyhow::Result<Vec<StageTimeline>> {
    rtrun::get_all(runs)?
        .into_iter()
        .collect::<Result<Vec<_>, String>>()
        .map_err(anyhow::Error::msg)
}

fn pipelined(setup: &Setup) -> anyhow::Result<(f64, Vec<StageTimeline>)> {
    let (dock, stages) = start(setup)?;
    let begin = Instant::now();
    let runs: Vec<_> =
        stages.iter().map(|(actor, spec)| actor.run(dock.clone(), spec.clone())).collect();
    let timelines = collect(&runs)?;
    Ok((begin.elapsed().as_secs_f64(), timelines))
}

fn sequential(setup: &Setup) -> anyhow::Result<(f64, Vec<StageTimeline>)> {
    let (dock, stages) = start(setup)?;
    let begin = Instant::now();
    let mut timelines = Vec::new();
    for (actor, spec) in &stages {
        timelines.extend(collect(&[actor.run(dock.clone(), spec.clone())])?);
    }
    Ok((begin.elapsed().as_secs_f64(), timelines))
}

fn show(label: &str, wall: f64, timelines: &[StageTimeline]) -> PipelineSummary {
    let summary = PipelineSummary::new(timelines);
    println!(
        "-- {label}: wall {:.3} s, makespan {:.3} s, busy {:.3} s, busy/makespan {:.2}, \
         after rollout {:.1} ms",
        wall,
        summary.makespan_us as f64 / 1e6,
        summary.busy_us as f64 / 1e6,
        summary.concurrency(),
        after_rollout_ms(&summary)
    );
    print!("{}", summary.chart(60));
    for (stage, head_start) in summary.head_starts_us() {
        println!(
            "   {stage:<18} started {:>8.1} ms before its predecessor ended",
            head_start as f64 / 1e3
        );
    }
    summary
}

/// How long the run went on after rollout's last batch: the part of the other stages that the
/// pipeline did not hide behind generation.
fn after_rollout_ms(summary: &PipelineSummary) -> f64 {
    let rollout_end = summary.stages.first().map_or(0, |s| s.last_end_us);
    summary.makespan_us.saturating_sub(rollout_end) as f64 / 1e3
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() -> anyhow::Result<()> {
    // A worker process (this executable re-run by the runtime) serves its assignment here and
    // never returns: only the driver reads the command line.
    rtrun::run_worker_if_requested();
    let Args { setup, repeats } = Args::parse();
    rtrun::init()?;
    let repeats = repeats.max(1);
    println!(
        "GRPO stages on the dock: {} prompts x {} samples, up to {} new tokens, batches of {} \
         groups, {} cpus, {repeats} repeats (sequential and pipelined alternate)",
        setup.prompts,
        setup.samples,
        setup.max_new_tokens,
        setup.groups_per_batch,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let (mut ratios, mut tails) = (Vec::new(), Vec::new());
    for repeat in 0..repeats {
        let (seq_wall, seq) = sequential(&setup)?;
        let (pipe_wall, pipe) = pipelined(&setup)?;
        let (seq_summary, pipe_summary) = (PipelineSummary::new(&seq), PipelineSummary::new(&pipe));
        let tail = (after_rollout_ms(&seq_summary), after_rollout_ms(&pipe_summary));
        println!(
            "repeat {repeat}: sequential {seq_wall:.3} s, pipelined {pipe_wall:.3} s, \
             pipelined / sequential {:.3}; after rollout {:.1} ms vs {:.1} ms",
            pipe_wall / seq_wall,
            tail.0,
            tail.1
        );
        ratios.push(pipe_wall / seq_wall);
        tails.push(tail);
        if repeat + 1 == repeats {
            show("sequential (anchor), last repeat", seq_wall, &seq);
            show("pipelined, last repeat", pipe_wall, &pipe);
        }
    }
    println!(
        "median pipelined / sequential wall time = {:.3}; median time after rollout: \
         sequential {:.1} ms, pipelined {:.1} ms",
        median(ratios),
        median(tails.iter().map(|t| t.0).collect()),
        median(tails.iter().map(|t| t.1).collect())
    );
    rtrun::shutdown();
    Ok(())
}
