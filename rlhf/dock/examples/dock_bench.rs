//! TransferDock throughput: rows per second through put + get for 1,024 prompts × 8 samples
//! with 4 columns (prompt token ids 64–256, response token ids 64–512, response log-probs of the
//! same length, one reward scalar), the figure asked for by issue 9.
//!
//! Each round fills an empty dock in rollout-sized puts (64 prompts × 4 columns each), then one
//! consumer drains it in dispatch-sized gets (32 groups = 256 rows, random group order). The
//! anchor measured side by side is a plain clone of the same rows (the copy-out cost any store
//! pays), so the ratio says how much the index and locking add on top of moving the bytes.
//!
//! Run: `cargo run --release -p rtrun-rlhf-dock --example dock_bench [rounds]`.

use std::sync::Arc;
use std::thread;
use std::time::Instant;

use clap::Parser;
use rtrun_rlhf_dock::{
    ClearScope, ColumnKind, ColumnValues, DockConfig, DockIndex, RowRequest, SplitMix64,
    TransferDock,
};

const PROMPTS: usize = 1024;
const SAMPLES: usize = 8;
const PUT_PROMPTS: usize = 64;
const GET_ROWS: usize = 256;
const DP_RANKS: usize = 4;
const COLUMNS: [&str; 4] = ["prompts", "responses", "old_log_prob", "rm_scores"];

/// TransferDock throughput in this process: rows/s through put + get of 1,024 prompts x 8
/// samples with 4 columns, the index alone, and a plain clone of the rows as the anchor.
#[derive(Parser)]
struct Args {
    /// Measured rounds of each case (after one warm-up).
    #[arg(default_value_t = 10)]
    rounds: usize,
}

/// One put: its rows and its (column, values) pairs.
type Put = (Vec<usize>, Vec<(&'static str, ColumnValues)>);

struct Data {
    prompts: Vec<Vec<i64>>,
    responses: Vec<Vec<i64>>,
    log_probs: Vec<Vec<f32>>,
    scores: Vec<f32>,
}

impl Data {
    fn generate(seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let rows = PROMPTS * SAMPLES;
        let mut prompts = Vec::with_capacity(rows);
        let mut responses = Vec::with_capacity(rows);
        let mut log_probs = Vec::with_capacity(rows);
        let mut scores = Vec::with_capacity(rows);
        for prompt in 0..PROMPTS {
            let prompt_len = 64 + rng.below(193) as usize;
            let prompt_ids: Vec<i64> = (0..prompt_len).map(|_| rng.below(32_000) as i64).collect();
            for _ in 0..SAMPLES {
                let len = 64 + rng.below(449) as usize;
                prompts.push(prompt_ids.clone());
                responses.push((0..len).map(|_| rng.below(32_000) as i64).collect());
                log_probs.push((0..len).map(|i| -((i % 17) as f32) / 7.0).collect());
                scores.push((prompt % 3) as f32);
            }
        }
        Self { prompts, responses, log_probs, scores }
    }

    fn bytes(&self) -> usize {
        let tokens: usize = self.prompts.iter().chain(&self.responses).map(Vec::len).sum();
        let floats: usize = self.log_probs.iter().map(Vec::len).sum();
        tokens * 8 + floats * 4 + self.scores.len() * 4
    }

    /// The puts of one fill, each a range of rows with its four columns.
    fn puts(&self) -> Vec<Put> {
        (0..PROMPTS / PUT_PROMPTS)
            .map(|chunk| {
                let range = chunk * PUT_PROMPTS * SAMPLES..(chunk + 1) * PUT_PROMPTS * SAMPLES;
                (
                    range.clone().collect(),
                    vec![
                        ("prompts", ColumnValues::TokenIds(self.prompts[range.clone()].to_vec())),
                        (
                            "responses",
                            ColumnValues::TokenIds(self.responses[range.clone()].to_vec()),
                        ),
                        (
                            "old_log_prob",
                            ColumnValues::Floats(self.log_probs[range.clone()].to_vec()),
                        ),
                        ("rm_scores", ColumnValues::Scalars(self.scores[range].to_vec())),
                    ],
                )
            })
            .collect()
    }
}

fn config() -> DockConfig {
    DockConfig::new(PROMPTS, SAMPLES)
        .with_column("prompts", ColumnKind::TokenIds)
        .with_column("responses", ColumnKind::TokenIds)
        .with_column("old_log_prob", ColumnKind::Floats)
        .with_column("rm_scores", ColumnKind::Scalars)
        .with_consumer("actor_train")
}

/// Seconds for the index alone (no data): mark every put's rows ready in the four columns,
/// then sample the whole dock in dispatch-sized requests.
fn index_round(index: &mut DockIndex) -> f64 {
    index.clear(ClearScope::All).expect("clear all never fails");
    let start = Instant::now();
    for chunk in 0..PROMPTS / PUT_PROMPTS {
        let rows: Vec<usize> =
            (chunk * PUT_PROMPTS * SAMPLES..(chunk + 1) * PUT_PROMPTS * SAMPLES).collect();
        for column in COLUMNS {
            index.mark_ready(column, &rows).expect("bench rows are valid");
        }
    }
    while index
        .sample("actor_train", &COLUMNS, RowRequest::Count(GET_ROWS))
        .expect("bench requests are valid")
        .is_some()
    {}
    start.elapsed().as_secs_f64()
}

fn dock() -> TransferDock {
    TransferDock::new(config()).expect("the benchmark config is valid")
}

/// Seconds for (put all rows, get all rows with `ranks` concurrent getters).
fn round(dock: &Arc<TransferDock>, data: &Data, ranks: usize) -> (f64, f64) {
    let puts = data.puts(); // built outside the timed region: a put moves, never copies
    dock.clear(ClearScope::All).expect("clear all never fails");
    let start = Instant::now();
    for (rows, columns) in puts {
        dock.put_experience(&rows, columns).expect("bench puts are valid");
    }
    let put = start.elapsed().as_secs_f64();
    let start = Instant::now();
    thread::scope(|scope| {
        for _ in 0..ranks {
            let dock = Arc::clone(dock);
            scope.spawn(move || {
                let mut rows = 0;
                while let Some(batch) = dock
                    .get_experience("actor_train", &COLUMNS, RowRequest::Count(GET_ROWS))
                    .expect("bench gets are valid")
                {
                    rows += batch.rows.len();
                }
                rows
            });
        }
    });
    let get = start.elapsed().as_secs_f64();
    assert!(dock.all_consumed("actor_train").expect("consumer exists"));
    (put, get)
}

/// The anchor: clone every row of the four columns, in the same batch size as the gets.
fn clone_round(data: &Data) -> f64 {
    let start = Instant::now();
    let rows = PROMPTS * SAMPLES;
    let mut sink = 0usize;
    for start_row in (0..rows).step_by(GET_ROWS) {
        let range = start_row..start_row + GET_ROWS;
        let batch = (
            data.prompts[range.clone()].to_vec(),
            data.responses[range.clone()].to_vec(),
            data.log_probs[range.clone()].to_vec(),
            data.scores[range].to_vec(),
        );
        sink += batch.0.len() + batch.1.len() + batch.2.len() + batch.3.len();
    }
    std::hint::black_box(sink);
    start.elapsed().as_secs_f64()
}

fn stats(samples: &[f64]) -> (f64, f64) {
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    let var = samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / samples.len() as f64;
    (mean, var.sqrt())
}

fn main() {
    let Args { rounds } = Args::parse();
    let data = Data::generate(42);
    let rows = (PROMPTS * SAMPLES) as f64;
    let gb = data.bytes() as f64 / 1e9;
    println!(
        "TransferDock: {PROMPTS} prompts x {SAMPLES} samples, 4 columns, {:.1} MB payload, {rounds} rounds (+1 warm-up)",
        gb * 1e3
    );
    let mut index = DockIndex::new(config()).expect("the benchmark config is valid");
    index_round(&mut index);
    let index_rates: Vec<f64> = (0..rounds).map(|_| rows / index_round(&mut index)).collect();
    let (index_rate, index_sd) = stats(&index_rates);
    println!("index only (mark_ready + sample, no data) rows/s {index_rate:.0} +- {index_sd:.0}");
    let dock = Arc::new(dock());
    for ranks in [1, DP_RANKS] {
        round(&dock, &data, ranks);
        let (mut puts, mut gets, mut both, mut anchor) = (vec![], vec![], vec![], vec![]);
        for _ in 0..rounds {
            let (put, get) = round(&dock, &data, ranks);
            puts.push(rows / put);
            gets.push(rows / get);
            both.push(rows / (put + get));
            anchor.push(rows / clone_round(&data));
        }
        let (put, put_sd) = stats(&puts);
        let (get, get_sd) = stats(&gets);
        let (total, total_sd) = stats(&both);
        let (clone, clone_sd) = stats(&anchor);
        println!("-- {ranks} getter thread(s)");
        println!("put            rows/s {put:>12.0} +- {put_sd:.0}");
        println!("get            rows/s {get:>12.0} +- {get_sd:.0}  ({:.2} GB/s)", get * gb / rows);
        println!("put + get      rows/s {total:>12.0} +- {total_sd:.0}");
        println!(
            "anchor clone   rows/s {clone:>12.0} +- {clone_sd:.0}  (get / clone = {:.2})",
            get / clone
        );
    }
}
