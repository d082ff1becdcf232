//! Unit tests of the index: the worked examples; the property tests live in
//! `tests/index_properties.rs`.

use super::*;
use crate::column::ColumnKind;
use crate::config::{SampleOrder, SamplingConfig};

fn index(order: SampleOrder) -> DockIndex {
    let config = DockConfig::new(4, 2)
        .with_column("responses", ColumnKind::TokenIds)
        .with_column("rm_scores", ColumnKind::Scalars)
        .with_consumer("reward")
        .with_consumer("train")
        .with_sampling(SamplingConfig { order, ..SamplingConfig::default() });
    DockIndex::new(config).unwrap()
}

#[test]
fn nothing_ready_gives_none() {
    let mut index = index(SampleOrder::Ascending);
    assert_eq!(index.sample("reward", &["responses"], RowRequest::Count(2)).unwrap(), None);
    assert_eq!(index.consumed_rows("reward").unwrap(), 0);
}

#[test]
fn whole_groups_only() {
    let mut index = index(SampleOrder::Ascending);
    // Group 0 complete, group 1 half ready.
    index.mark_ready("responses", &[0, 1, 2]).unwrap();
    assert_eq!(index.sample("reward", &["responses"], RowRequest::Count(4)).unwrap(), None);
    assert_eq!(
        index.sample("reward", &["responses"], RowRequest::Count(2)).unwrap(),
        Some(vec![0, 1])
    );
    assert_eq!(index.sample("reward", &["responses"], RowRequest::Count(2)).unwrap(), None);
    index.mark_ready("responses", &[3]).unwrap();
    assert_eq!(
        index.sample("reward", &["responses"], RowRequest::Count(2)).unwrap(),
        Some(vec![2, 3])
    );
}

#[test]
fn readiness_needs_every_requested_column() {
    let mut index = index(SampleOrder::Ascending);
    index.mark_ready("responses", &[0, 1, 2, 3]).unwrap();
    index.mark_ready("rm_scores", &[2, 3]).unwrap();
    let rows = index.sample("train", &["responses", "rm_scores"], RowRequest::Count(2)).unwrap();
    assert_eq!(rows, Some(vec![2, 3]));
    // Consumers are independent: `reward` still gets group 0.
    let rows = index.sample("reward", &["responses"], RowRequest::Count(2)).unwrap();
    assert_eq!(rows, Some(vec![0, 1]));
}

#[test]
fn all_consumed_and_clear() {
    let mut index = index(SampleOrder::Random);
    index.mark_ready("responses", &[0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
    let mut seen = Vec::new();
    while let Some(rows) = index.sample("reward", &["responses"], RowRequest::Count(4)).unwrap() {
        seen.extend(rows);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..8).collect::<Vec<_>>());
    assert!(index.all_consumed("reward").unwrap());
    assert!(!index.all_consumed("train").unwrap());

    index.clear(ClearScope::Rows(&[0, 1])).unwrap();
    assert!(!index.all_consumed("reward").unwrap());
    assert!(!index.is_ready("responses", 0).unwrap());
    assert!(index.is_ready("responses", 2).unwrap());
    index.clear(ClearScope::All).unwrap();
    assert_eq!(index.ready_rows("responses").unwrap(), 0);
    assert_eq!(index.consumed_rows("reward").unwrap(), 0);
}

#[test]
fn explicit_rows() {
    let mut index = index(SampleOrder::Ascending);
    index.mark_ready("responses", &[0, 1, 2, 3]).unwrap();
    assert_eq!(index.sample("reward", &["responses"], RowRequest::Rows(&[4, 5])).unwrap(), None);
    assert_eq!(
        index.sample("reward", &["responses"], RowRequest::Rows(&[3, 2])).unwrap(),
        Some(vec![3, 2])
    );
    assert_eq!(
        index.sample("reward", &["responses"], RowRequest::Rows(&[2, 3])),
        Err(DockError::AlreadyConsumed { consumer: "reward".into(), row: 2 })
    );
    assert_eq!(
        index.sample("reward", &["responses"], RowRequest::Rows(&[0])),
        Err(DockError::PartialGroup { group: 0, expected: 2, found: 1 })
    );
    assert_eq!(
        index.sample("reward", &["responses"], RowRequest::Rows(&[0, 0])),
        Err(DockError::DuplicateRow { row: 0 })
    );
    // Sampling by count skips the group taken explicitly.
    assert_eq!(
        index.sample("reward", &["responses"], RowRequest::Count(2)).unwrap(),
        Some(vec![0, 1])
    );
}

#[test]
fn bad_requests_are_errors() {
    let mut index = index(SampleOrder::Ascending);
    assert!(matches!(
        index.sample("nobody", &["responses"], RowRequest::Count(2)),
        Err(DockError::UnknownConsumer { .. })
    ));
    assert!(matches!(
        index.sample("reward", &["nope"], RowRequest::Count(2)),
        Err(DockError::UnknownColumn { .. })
    ));
    assert_eq!(
        index.sample::<&str>("reward", &[], RowRequest::Count(2)),
        Err(DockError::NoColumns)
    );
    for count in [0, 3] {
        assert_eq!(
            index.sample("reward", &["responses"], RowRequest::Count(count)),
            Err(DockError::CountNotWholeGroups { count, samples_per_prompt: 2 })
        );
    }
    assert_eq!(
        index.sample("reward", &["responses"], RowRequest::Count(10)),
        Err(DockError::CountExceedsCapacity { count: 10, rows: 8 })
    );
    assert_eq!(
        index.mark_ready("responses", &[8]),
        Err(DockError::RowOutOfRange { row: 8, rows: 8 })
    );
    assert!(index.sample("reward", &["responses"], RowRequest::Rows(&[9])).is_err());
    assert!(index.sample("reward", &["responses"], RowRequest::Rows(&[])).is_err());
    assert!(index.clear(ClearScope::Rows(&[100])).is_err());
    assert!(index.all_consumed("nobody").is_err());
}

#[test]
fn short_final_batch_only_when_enabled() {
    let config = DockConfig::new(3, 2)
        .with_column("responses", ColumnKind::TokenIds)
        .with_consumer("reward");
    let mut strict = DockIndex::new(config.clone()).unwrap();
    let mut lenient = DockIndex::new(config.with_sampling(SamplingConfig {
        allow_short_final_batch: true,
        ..SamplingConfig::default()
    }))
    .unwrap();
    for index in [&mut strict, &mut lenient] {
        index.mark_ready("responses", &[0, 1, 2, 3]).unwrap();
        assert!(index.sample("reward", &["responses"], RowRequest::Count(4)).unwrap().is_some());
    }
    // One group left but not ready yet: nobody gets a short batch.
    assert_eq!(lenient.sample("reward", &["responses"], RowRequest::Count(4)).unwrap(), None);
    for index in [&mut strict, &mut lenient] {
        index.mark_ready("responses", &[4, 5]).unwrap();
    }
    assert_eq!(strict.sample("reward", &["responses"], RowRequest::Count(4)).unwrap(), None);
    assert_eq!(
        lenient.sample("reward", &["responses"], RowRequest::Count(4)).unwrap(),
        Some(vec![4, 5])
    );
    assert!(lenient.all_consumed("reward").unwrap());
}

#[test]
fn random_order_is_reproducible_and_varies() {
    let run = |seed: u64| {
        let config = DockConfig::new(64, 1)
            .with_column("c", ColumnKind::Scalars)
            .with_consumer("x")
            .with_sampling(SamplingConfig { seed, ..SamplingConfig::default() });
        let mut index = DockIndex::new(config).unwrap();
        index.mark_ready("c", &(0..64).collect::<Vec<_>>()).unwrap();
        index.sample("x", &["c"], RowRequest::Count(8)).unwrap()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
    assert_ne!(run(1), Some((0..8).collect()));
}

#[test]
fn up_to_hands_out_whatever_whole_groups_are_ready_and_slots_can_be_reused() {
    let mut index = index(SampleOrder::Ascending);
    let up_to = |n| RowRequest::UpTo(n);
    assert_eq!(index.sample("reward", &["responses"], up_to(6)).unwrap(), None);
    // One whole group and half of another: the whole one, though three were asked for.
    index.mark_ready("responses", &[4, 5, 6]).unwrap();
    assert_eq!(index.sample("reward", &["responses"], up_to(6)).unwrap(), Some(vec![4, 5]));
    assert_eq!(index.sample("reward", &["responses"], up_to(6)).unwrap(), None);
    // More ready than asked for: the sampling order picks (lowest first here).
    index.mark_ready("responses", &[0, 1, 2, 3, 7]).unwrap();
    assert_eq!(index.sample("reward", &["responses"], up_to(2)).unwrap(), Some(vec![0, 1]));
    assert_eq!(index.sample("reward", &["responses"], up_to(8)).unwrap(), Some(vec![2, 3, 6, 7]));
    // A cleared group is a free slot: refilled, it is handed out again.
    index.clear(ClearScope::Rows(&[4, 5])).unwrap();
    assert_eq!(index.sample("reward", &["responses"], up_to(8)).unwrap(), None);
    index.mark_ready("responses", &[4, 5]).unwrap();
    assert_eq!(index.sample("reward", &["responses"], up_to(8)).unwrap(), Some(vec![4, 5]));
    // The count is checked as a count's is.
    assert!(index.sample("reward", &["responses"], up_to(3)).is_err());
    assert!(index.sample("reward", &["responses"], up_to(0)).is_err());
    assert!(index.sample("reward", &["responses"], up_to(10)).is_err());
}
