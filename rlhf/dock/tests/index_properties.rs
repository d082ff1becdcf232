//! Property tests of the pure index against a plain reference model: random interleavings of
//! puts (readiness), samples by count and by explicit rows, and clears.
//!
//! Properties: a row is never handed twice to one consumer; never before it is ready in every
//! requested column; groups stay whole; a request is refused only when the model agrees that not
//! enough whole groups are usable; clear resets readiness and consumption.

use proptest::prelude::*;
use rtrun_rlhf_dock::{
    ClearScope, ColumnKind, DockConfig, DockError, DockIndex, RowRequest, SampleOrder,
    SamplingConfig,
};

const COLUMNS: [&str; 3] = ["responses", "old_log_prob", "rm_scores"];
const CONSUMERS: [&str; 2] = ["reward", "train"];

#[derive(Clone, Debug)]
enum Op {
    /// Mark these rows ready in one column.
    Ready { column: usize, rows: Vec<usize> },
    /// Ask for `groups` whole groups over a non-empty column subset (bit mask).
    Sample { consumer: usize, columns: u8, groups: usize },
    /// Ask for these groups explicitly.
    SampleRows { consumer: usize, columns: u8, groups: Vec<usize> },
    /// Clear these rows, or everything.
    Clear { rows: Option<Vec<usize>> },
}

fn op(rows: usize, prompts: usize) -> impl Strategy<Value = Op> {
    let row_list = proptest::collection::vec(0..rows, 0..rows.max(1) * 2);
    prop_oneof![
        6 => (0..COLUMNS.len(), row_list.clone()).prop_map(|(column, rows)| {
            let mut rows = rows;
            rows.sort_unstable();
            rows.dedup();
            Op::Ready { column, rows }
        }),
        6 => (0..CONSUMERS.len(), 1u8..8, 1..=prompts)
            .prop_map(|(consumer, columns, groups)| Op::Sample { consumer, columns, groups }),
        2 => (0..CONSUMERS.len(), 1u8..8, proptest::collection::btree_set(0..prompts, 1..=prompts))
            .prop_map(|(consumer, columns, groups)| Op::SampleRows {
                consumer,
                columns,
                groups: groups.into_iter().collect(),
            }),
        1 => proptest::option::of(row_list).prop_map(|rows| Op::Clear { rows }),
    ]
}

fn scenario() -> impl Strategy<Value = (usize, usize, bool, bool, u64, Vec<Op>)> {
    (1usize..7, 1usize..5, any::<bool>(), any::<bool>(), any::<u64>()).prop_flat_map(
        |(prompts, n, random, short, seed)| {
            (
                Just(prompts),
                Just(n),
                Just(random),
                Just(short),
                Just(seed),
                proptest::collection::vec(op(prompts * n, prompts), 1..60),
            )
        },
    )
}

struct Model {
    n: usize,
    prompts: usize,
    ready: Vec<Vec<bool>>,
    consumed: Vec<Vec<bool>>,
}

impl Model {
    fn usable_groups(&self, consumer: usize, columns: &[usize]) -> Vec<usize> {
        (0..self.prompts)
            .filter(|group| {
                (group * self.n..(group + 1) * self.n).all(|row| {
                    !self.consumed[consumer][row] && columns.iter().all(|c| self.ready[*c][row])
                })
            })
            .collect()
    }

    fn unconsumed_groups(&self, consumer: usize) -> usize {
        (0..self.prompts)
            .filter(|group| {
                (group * self.n..(group + 1) * self.n).any(|row| !self.consumed[consumer][row])
            })
            .count()
    }
}

fn column_subset(mask: u8) -> Vec<usize> {
    (0..COLUMNS.len()).filter(|c| mask & (1 << c) != 0).collect()
}

/// Checks a handed-out batch against the model and records it as consumed.
fn check_handed(
    model: &mut Model,
    consumer: usize,
    columns: &[usize],
    rows: &[usize],
) -> Result<(), TestCaseError> {
    let n = model.n;
    prop_assert!(!rows.is_empty());
    prop_assert_eq!(rows.len() % n, 0, "not whole groups: {:?}", rows);
    for row in rows {
        prop_assert!(!model.consumed[consumer][*row], "row {} handed twice", row);
        for column in columns {
            prop_assert!(model.ready[*column][*row], "row {} handed before ready", row);
        }
    }
    let mut sorted = rows.to_vec();
    sorted.sort_unstable();
    for group in sorted.chunks(n) {
        let first = group[0];
        prop_assert_eq!(first % n, 0, "group does not start at a boundary: {:?}", group);
        prop_assert_eq!(group.to_vec(), (first..first + n).collect::<Vec<_>>());
    }
    for row in rows {
        model.consumed[consumer][*row] = true;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn index_matches_model((prompts, n, random, short, seed, ops) in scenario()) {
        let rows = prompts * n;
        let mut config = DockConfig::new(prompts, n).with_sampling(SamplingConfig {
            order: if random { SampleOrder::Random } else { SampleOrder::Ascending },
            seed,
            allow_short_final_batch: short,
        });
        for column in COLUMNS {
            config = config.with_column(column, ColumnKind::Floats);
        }
        for consumer in CONSUMERS {
            config = config.with_consumer(consumer);
        }
        let mut index = DockIndex::new(config).unwrap();
        let mut model = Model {
            n,
            prompts,
            ready: vec![vec![false; rows]; COLUMNS.len()],
            consumed: vec![vec![false; rows]; CONSUMERS.len()],
        };

        for op in ops {
            match op {
                Op::Ready { column, rows } => {
                    index.mark_ready(COLUMNS[column], &rows).unwrap();
                    rows.iter().for_each(|row| model.ready[column][*row] = true);
                }
                Op::Sample { consumer, columns, groups } => {
                    let columns = column_subset(columns);
                    let names: Vec<&str> = columns.iter().map(|c| COLUMNS[*c]).collect();
                    let usable = model.usable_groups(consumer, &columns);
                    let got = index
                        .sample(CONSUMERS[consumer], &names, RowRequest::Count(groups * n))
                        .unwrap();
                    match got {
                        Some(handed) => {
                            let short_final = short
                                && usable.len() < groups
                                && usable.len() == model.unconsumed_groups(consumer);
                            if short_final {
                                prop_assert_eq!(handed.len(), usable.len() * n);
                            } else {
                                prop_assert_eq!(handed.len(), groups * n);
                            }
                            if !random {
                                let expected: Vec<usize> = usable
                                    .iter()
                                    .take(groups)
                                    .flat_map(|g| g * n..(g + 1) * n)
                                    .collect();
                                prop_assert_eq!(&handed, &expected);
                            }
                            check_handed(&mut model, consumer, &columns, &handed)?;
                        }
                        None => {
                            // Refused only when the model agrees there is not enough.
                            prop_assert!(usable.len() < groups);
                            prop_assert!(
                                !(short
                                    && !usable.is_empty()
                                    && usable.len() == model.unconsumed_groups(consumer))
                            );
                        }
                    }
                }
                Op::SampleRows { consumer, columns, groups } => {
                    let columns = column_subset(columns);
                    let names: Vec<&str> = columns.iter().map(|c| COLUMNS[*c]).collect();
                    let request: Vec<usize> = groups.iter().flat_map(|g| g * n..(g + 1) * n).collect();
                    let any_consumed = request.iter().any(|row| model.consumed[consumer][*row]);
                    let all_ready = request
                        .iter()
                        .all(|row| columns.iter().all(|c| model.ready[*c][*row]));
                    let got = index.sample(CONSUMERS[consumer], &names, RowRequest::Rows(&request));
                    match got {
                        Err(DockError::AlreadyConsumed { .. }) => prop_assert!(any_consumed),
                        Err(other) => prop_assert!(false, "unexpected error {}", other),
                        Ok(None) => prop_assert!(!any_consumed && !all_ready),
                        Ok(Some(handed)) => {
                            prop_assert!(!any_consumed && all_ready);
                            prop_assert_eq!(&handed, &request);
                            check_handed(&mut model, consumer, &columns, &handed)?;
                        }
                    }
                }
                Op::Clear { rows: Some(rows) } => {
                    index.clear(ClearScope::Rows(&rows)).unwrap();
                    for row in rows {
                        model.ready.iter_mut().for_each(|c| c[row] = false);
                        model.consumed.iter_mut().for_each(|c| c[row] = false);
                    }
                }
                Op::Clear { rows: None } => {
                    index.clear(ClearScope::All).unwrap();
                    model.ready.iter_mut().for_each(|c| c.fill(false));
                    model.consumed.iter_mut().for_each(|c| c.fill(false));
                }
            }
            // The index's observable state equals the model's after every step.
            for (k, consumer) in CONSUMERS.iter().enumerate() {
                prop_assert_eq!(
                    index.all_consumed(consumer).unwrap(),
                    model.consumed[k].iter().all(|c| *c)
                );
                for row in 0..rows {
                    prop_assert_eq!(index.is_consumed(consumer, row).unwrap(), model.consumed[k][row]);
                }
            }
            for (c, column) in COLUMNS.iter().enumerate() {
                for row in 0..rows {
                    prop_assert_eq!(index.is_ready(column, row).unwrap(), model.ready[c][row]);
                }
            }
        }
    }

    /// Draining a fully ready dock by count hands every row exactly once, whatever the order.
    #[test]
    fn drain_hands_every_row_once(
        prompts in 1usize..40,
        n in 1usize..9,
        per_request in 1usize..6,
        seed: u64,
    ) {
        let config = DockConfig::new(prompts, n)
            .with_column("c", ColumnKind::Scalars)
            .with_consumer("x")
            .with_sampling(SamplingConfig { seed, allow_short_final_batch: true, ..SamplingConfig::default() });
        let mut index = DockIndex::new(config).unwrap();
        index.mark_ready("c", &(0..prompts * n).collect::<Vec<_>>()).unwrap();
        let count = per_request.min(prompts) * n;
        let mut seen = vec![0u32; prompts * n];
        // Every answer hands at least one group, so a correct index stops within `prompts`
        // answers; the bound turns a bug into a failure instead of an endless loop.
        let mut answers = 0;
        while let Some(rows) = index.sample("x", &["c"], RowRequest::Count(count)).unwrap() {
            rows.iter().for_each(|row| seen[*row] += 1);
            answers += 1;
            prop_assert!(answers <= prompts, "more answers than groups");
        }
        prop_assert!(seen.iter().all(|s| *s == 1));
        prop_assert!(index.all_consumed("x").unwrap());
    }

    /// Hostile requests are errors or `None`, never panics.
    #[test]
    fn hostile_requests_never_panic(
        rows in proptest::collection::vec(any::<usize>(), 0..10),
        count: usize,
        names in proptest::collection::vec("[a-z_]{0,8}", 0..4),
    ) {
        let config = DockConfig::new(3, 2)
            .with_column("c", ColumnKind::Scalars)
            .with_consumer("x");
        let mut index = DockIndex::new(config).unwrap();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let _ = index.mark_ready("c", &rows);
        let _ = index.sample("x", &names, RowRequest::Count(count));
        let _ = index.sample("x", &["c"], RowRequest::Count(count));
        let _ = index.sample("x", &["c"], RowRequest::Rows(&rows));
        let _ = index.clear(ClearScope::Rows(&rows));
    }
}
