//! Concurrency tests of the thread-safe dock: several DP ranks per consumer and several consumers
//! run as threads against one dock while a producer (and upstream stages) put rows.
//!
//! Properties: the ranks of one consumer never receive the same row and together receive every
//! row exactly once; a consumer never receives a row before all its columns are written (the
//! data it gets is the data that was put); groups stay whole.

use std::collections::HashSet;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rtrun_rlhf_dock::{
    ColumnKind, ColumnValues, DockConfig, RowRequest, SampleOrder, SamplingConfig, TransferDock,
};

/// A generous bound on how long a scenario may spin; a correct dock finishes in milliseconds.
const DEADLINE: Duration = Duration::from_secs(60);

fn response(row: usize) -> Vec<i64> {
    vec![row as i64; 1 + row % 7]
}

fn score(row: usize) -> f32 {
    row as f32 + 1.0
}

fn pipeline_dock(prompts: usize, n: usize, seed: u64, random: bool) -> TransferDock {
    TransferDock::new(
        DockConfig::new(prompts, n)
            .with_column("responses", ColumnKind::TokenIds)
            .with_column("rm_scores", ColumnKind::Scalars)
            .with_column("advantages", ColumnKind::Floats)
            .with_consumer("rule_reward")
            .with_consumer("compute_advantage")
            .with_consumer("actor_train")
            .with_sampling(SamplingConfig {
                order: if random { SampleOrder::Random } else { SampleOrder::Ascending },
                seed,
                allow_short_final_batch: false,
            }),
    )
    .unwrap()
}

/// One DP rank of a stage: reads `inputs`, checks them, optionally writes `output`, until the
/// stage has consumed everything. Returns the rows it received.
fn run_rank(
    dock: &TransferDock,
    consumer: &str,
    inputs: &[&str],
    output: Option<&str>,
    count: usize,
) -> Vec<usize> {
    let started = Instant::now();
    let n = dock.config().samples_per_prompt;
    let mut received = Vec::new();
    while !dock.all_consumed(consumer).unwrap() {
        assert!(started.elapsed() < DEADLINE, "{consumer} did not finish");
        let Some(batch) = dock.get_experience(consumer, inputs, RowRequest::Count(count)).unwrap()
        else {
            thread::yield_now();
            continue;
        };
        assert_eq!(batch.rows.len() % n, 0);
        for group in batch.rows.chunks(n) {
            assert_eq!(group[0] % n, 0, "group split: {group:?}");
            assert!(group.windows(2).all(|w| w[1] == w[0] + 1), "group split: {group:?}");
        }
        if let Some(ColumnValues::TokenIds(rows)) = batch.column("responses") {
            for (row, value) in batch.rows.iter().zip(rows) {
                assert_eq!(value, &response(*row), "row {row} read before it was written");
            }
        }
        if let Some(ColumnValues::Scalars(scores)) = batch.column("rm_scores") {
            for (row, value) in batch.rows.iter().zip(scores) {
                assert_eq!(*value, score(*row), "row {row} read before it was written");
            }
        }
        if let Some(ColumnValues::Floats(advantages)) = batch.column("advantages") {
            for (row, value) in batch.rows.iter().zip(advantages) {
                assert_eq!(value, &vec![score(*row) * 2.0], "row {row} read early");
            }
        }
        match output {
            Some("rm_scores") => dock
                .put_experience(
                    &batch.rows,
                    vec![(
                        "rm_scores",
                        ColumnValues::Scalars(batch.rows.iter().map(|r| score(*r)).collect()),
                    )],
                )
                .unwrap(),
            Some("advantages") => dock
                .put_experience(
                    &batch.rows,
                    vec![(
                        "advantages",
                        ColumnValues::Floats(
                            batch.rows.iter().map(|r| vec![score(*r) * 2.0]).collect(),
                        ),
                    )],
                )
                .unwrap(),
            _ => {}
        }
        received.extend(batch.rows);
    }
    received
}

/// Runs rollout → rule_reward → compute_advantage → actor_train with `ranks` threads per stage
/// and checks that each stage's ranks partition the rows.
fn run_pipeline(
    prompts: usize,
    n: usize,
    ranks: usize,
    groups_per_get: usize,
    seed: u64,
    random: bool,
) {
    let dock = Arc::new(pipeline_dock(prompts, n, seed, random));
    let count = groups_per_get * n;
    let stages: [(&'static str, &'static [&'static str], Option<&'static str>); 3] = [
        ("rule_reward", &["responses"], Some("rm_scores")),
        ("compute_advantage", &["rm_scores", "responses"], Some("advantages")),
        ("actor_train", &["responses", "advantages", "rm_scores"], None),
    ];
    thread::scope(|scope| {
        // The rollout producer writes whole groups, in a scrambled order, a few at a time.
        let producer = {
            let dock = Arc::clone(&dock);
            scope.spawn(move || {
                let mut order: Vec<usize> = (0..prompts).collect();
                let mut rng = rtrun_rlhf_dock::SplitMix64::new(seed);
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i as u64 + 1) as usize);
                }
                for group in order {
                    let rows: Vec<usize> = (group * n..(group + 1) * n).collect();
                    let values = rows.iter().map(|r| response(*r)).collect();
                    dock.put_experience(&rows, vec![("responses", ColumnValues::TokenIds(values))])
                        .unwrap();
                }
            })
        };
        let mut handles = Vec::new();
        for (consumer, inputs, output) in stages {
            for _ in 0..ranks {
                let dock = Arc::clone(&dock);
                handles.push((
                    consumer,
                    scope.spawn(move || run_rank(&dock, consumer, inputs, output, count)),
                ));
            }
        }
        producer.join().unwrap();
        let mut per_consumer: Vec<(&str, Vec<usize>)> = Vec::new();
        for (consumer, handle) in handles {
            let rows = handle.join().unwrap();
            match per_consumer.iter_mut().find(|(c, _)| *c == consumer) {
                Some((_, all)) => all.extend(rows),
                None => per_consumer.push((consumer, rows)),
            }
        }
        for (consumer, rows) in per_consumer {
            let distinct: HashSet<usize> = rows.iter().copied().collect();
            assert_eq!(distinct.len(), rows.len(), "{consumer}: a row was handed to two ranks");
            assert_eq!(distinct.len(), prompts * n, "{consumer}: rows missing");
        }
    });
}

#[test]
fn pipeline_of_four_ranks_per_stage() {
    run_pipeline(64, 4, 4, 2, 7, true);
}

#[test]
fn pipeline_ascending_order() {
    run_pipeline(32, 8, 3, 1, 1, false);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn concurrent_ranks_never_collide(
        prompts in 1usize..24,
        n in 1usize..5,
        ranks in 1usize..5,
        groups_per_get in 1usize..4,
        seed: u64,
        random: bool,
    ) {
        // Every dispatch size must divide the prompt count, or the tail never drains.
        let groups_per_get = if prompts.is_multiple_of(groups_per_get) { groups_per_get } else { 1 };
        run_pipeline(prompts, n, ranks, groups_per_get, seed, random);
    }
}
