//! TransferDock throughput through the dock **actor**: rows per second through put + get for
//! 1,024 prompts × 8 samples with 4 columns (prompt ids 64–256, response ids 64–512, response
//! log-probs, one score), packed on the wire, against the in-process dock as the reference.
//!
//! Each round: the driver puts the rows in rollout-sized packed puts (64 prompts = 512 rows),
//! then `ranks` getter threads drain the dock in dispatch-sized gets (32 groups = 256 rows).
//! Measured side by side in the same run:
//! - `in-process`: the same packed puts and gets on a `TransferDock` in this process;
//! - `actor`: the same calls on a `DockActor` in a worker process (`RemoteDock`);
//! - `anchor`: encoding + decoding the same packed batches with the runtime's value codec, the
//!   serialization any transfer of these bytes pays (the actor's overhead beyond it is the
//!   socket, the copies on each side and the call machinery).
//!
//! Run: `cargo run --release -p rtrun-rlhf-dock --example dock_actor_bench [rounds]`.

use std::time::Instant;

use clap::Parser;
use rtrun_rlhf_dock::{
    ClearScope, ColumnKind, ColumnValues, DockConfig, ExperienceStore, PackedBatch,
    PackedNamedColumn, RemoteDock, SplitMix64, TransferDock,
};

const PROMPTS: usize = 1024;
const SAMPLES: usize = 8;
const PUT_PROMPTS: usize = 64;
const GET_ROWS: usize = 256;
const COLUMNS: [&str; 4] = ["prompts", "responses", "old_log_prob", "rm_scores"];

/// TransferDock throughput through the dock actor (rows/s through packed puts and gets of
/// 1,024 prompts x 8 samples, 4 columns) against the in-process dock and the codec round trip.
#[derive(Parser)]
struct Args {
    /// Measured rounds of each mode (after one warm-up).
    #[arg(default_value_t = 5)]
    rounds: usize,
}

fn config() -> DockConfig {
    DockConfig::new(PROMPTS, SAMPLES)
        .with_column("prompts", ColumnKind::TokenIds)
        .with_column("responses", ColumnKind::TokenIds)
        .with_column("old_log_prob", ColumnKind::Floats)
        .with_column("rm_scores", ColumnKind::Scalars)
        .with_consumer("actor_train")
}

/// The packed puts of one fill and the payload size in bytes.
fn puts(seed: u64) -> (Vec<PackedBatch>, usize) {
    let mut rng = SplitMix64::new(seed);
    let mut batches = Vec::new();
    let mut bytes = 0;
    for chunk in 0..PROMPTS / PUT_PROMPTS {
        let (mut prompts, mut responses, mut log_probs, mut scores) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for prompt in 0..PUT_PROMPTS {
            let prompt_len = 64 + rng.below(193) as usize;
            let ids: Vec<i64> = (0..prompt_len).map(|_| rng.below(32_000) as i64).collect();
            for _ in 0..SAMPLES {
                let len = 64 + rng.below(449) as usize;
                prompts.push(ids.clone());
                responses.push((0..len).map(|_| rng.below(32_000) as i64).collect::<Vec<_>>());
                log_probs.push((0..len).map(|i| -((i % 17) as f32) / 7.0).collect::<Vec<_>>());
                scores.push((prompt % 3) as f32);
                bytes += prompt_len * 8 + len * 12 + 4;
            }
        }
        let first = chunk * PUT_PROMPTS * SAMPLES;
        batches.push(PackedBatch {
            rows: (first..first + PUT_PROMPTS * SAMPLES).collect(),
            columns: vec![
                PackedNamedColumn::new("prompts", &ColumnValues::TokenIds(prompts)),
                PackedNamedColumn::new("responses", &ColumnValues::TokenIds(responses)),
                PackedNamedColumn::new("old_log_prob", &ColumnValues::Floats(log_probs)),
                PackedNamedColumn::new("rm_scores", &ColumnValues::Scalars(scores)),
            ],
        });
    }
    (batches, bytes)
}

/// Seconds for (put every batch, drain the dock with `ranks` concurrent getters).
fn round<S: ExperienceStore + Sync>(
    store: &S,
    clear: &dyn Fn(),
    batches: &[PackedBatch],
    ranks: usize,
) -> (f64, f64) {
    clear();
    let columns: Vec<String> = COLUMNS.map(String::from).to_vec();
    let start = Instant::now();
    for batch in batches {
        store.put(batch.clone()).expect("bench puts are valid");
    }
    let put = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let rows: usize = std::thread::scope(|scope| {
        let getters: Vec<_> = (0..ranks)
            .map(|_| {
                scope.spawn(|| {
                    let mut rows = 0;
                    while let Some(batch) =
                        store.get("actor_train", &columns, GET_ROWS).expect("bench gets are valid")
                    {
                        rows += batch.rows.len();
                    }
                    rows
                })
            })
            .collect();
        getters.into_iter().map(|g| g.join().expect("getter threads do not panic")).sum()
    });
    let get = start.elapsed().as_secs_f64();
    assert_eq!(rows, PROMPTS * SAMPLES, "the getters drained the dock");
    (put, get)
}

/// The anchor: encode and decode every put batch with the runtime's codec.
fn codec_round(batches: &[PackedBatch]) -> f64 {
    let start = Instant::now();
    for batch in batches {
        let bytes = rtrun::codec::encode(batch).expect("packed batches encode");
        let back: PackedBatch = rtrun::codec::decode(&bytes).expect("and decode");
        std::hint::black_box(back);
    }
    start.elapsed().as_secs_f64()
}

fn stats(samples: &[f64]) -> (f64, f64) {
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    let var = samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / samples.len() as f64;
    (mean, var.sqrt())
}

fn report(label: &str, rows: f64, samples: &[(f64, f64)]) -> f64 {
    let puts: Vec<f64> = samples.iter().map(|(p, _)| rows / p).collect();
    let gets: Vec<f64> = samples.iter().map(|(_, g)| rows / g).collect();
    let both: Vec<f64> = samples.iter().map(|(p, g)| rows / (p + g)).collect();
    let ((put, put_sd), (get, get_sd), (total, total_sd)) =
        (stats(&puts), stats(&gets), stats(&both));
    println!(
        "{label:<28} put {put:>10.0} +- {put_sd:<8.0} get {get:>10.0} +- {get_sd:<8.0} put+get {total:>10.0} +- {total_sd:.0} rows/s"
    );
    total
}

fn main() -> anyhow::Result<()> {
    // A worker process (this executable re-run by the runtime) serves its assignment here and
    // never returns: only the driver reads the command line.
    rtrun::run_worker_if_requested();
    let Args { rounds } = Args::parse();
    rtrun::init()?;
    let (batches, bytes) = puts(42);
    let rows = (PROMPTS * SAMPLES) as f64;
    println!(
        "TransferDock put + get: {PROMPTS} prompts x {SAMPLES} samples, 4 columns, {:.1} MB, \
         puts of {} rows, gets of {GET_ROWS} rows, {rounds} rounds (+1 warm-up)",
        bytes as f64 / 1e6,
        PUT_PROMPTS * SAMPLES
    );
    let local = TransferDock::new(config())?;
    let remote = RemoteDock::create(config(), rtrun::ActorOptions::default())?;
    let clear_local = || local.clear(ClearScope::All).expect("clear all never fails");
    let clear_remote = || remote.clear(None).expect("the dock actor is up");
    codec_round(&batches);
    let codec: Vec<f64> = (0..rounds).map(|_| rows / codec_round(&batches)).collect();
    let (codec, codec_sd) = stats(&codec);
    println!(
        "{:<28} encode+decode {codec:>10.0} +- {codec_sd:.0} rows/s",
        "anchor: codec round trip"
    );
    for ranks in [1, 4] {
        round(&local, &clear_local, &batches, ranks);
        let samples: Vec<_> =
            (0..rounds).map(|_| round(&local, &clear_local, &batches, ranks)).collect();
        let local_rate = report(&format!("in-process, {ranks} getter(s)"), rows, &samples);
        round(&remote, &clear_remote, &batches, ranks);
        let samples: Vec<_> =
            (0..rounds).map(|_| round(&remote, &clear_remote, &batches, ranks)).collect();
        let remote_rate = report(&format!("actor, {ranks} getter(s)"), rows, &samples);
        println!(
            "  actor / in-process = {:.3}, actor / codec anchor = {:.3}",
            remote_rate / local_rate,
            remote_rate / codec
        );
    }
    rtrun::shutdown();
    Ok(())
}
