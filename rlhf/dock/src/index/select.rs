//! The pieces of the index and the selection rule shared by [`super::DockIndex`] and the
//! thread-safe [`crate::TransferDock`]: readiness per column, consumption per consumer, and the
//! function that picks whole ready, unconsumed prompt groups for one consumer.
//!
//! Keeping readiness and each consumer's ledger as separate values (rather than one struct
//! behind one lock) is what lets the dock give every consumer its own lock: a selection only
//! mutates the ledger of the consumer it serves and only reads readiness.

use crate::bitmap::RowBitmap;
use crate::config::{ColumnId, ConsumerId, DockConfig, SampleOrder};
use crate::error::DockError;
use rtrun_rlhf_rng::SplitMix64;

/// Which rows a consumer asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowRequest<'a> {
    /// Any `count` rows (a positive multiple of the samples per prompt) that are ready in every
    /// requested column and not yet consumed, chosen by the sampling policy.
    Count(usize),
    /// Exactly these rows (whole prompt groups, in this order), e.g. a DP rank's fixed range
    /// when the order must be guaranteed.
    Rows(&'a [usize]),
    /// Whatever whole groups are ready in every requested column and not yet consumed, at most
    /// `count` rows (a positive multiple of the samples per prompt), chosen by the sampling
    /// policy; `None` only when no group is. What a stream's consumer asks for: a dock whose
    /// groups arrive one by one, for as long as the run lasts, has no final batch to wait for.
    UpTo(usize),
}

/// Which rows a clear resets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClearScope<'a> {
    /// Every row: readiness, consumption and data.
    All,
    /// Only these rows (any rows, not necessarily whole groups).
    Rows(&'a [usize]),
}

/// Readiness: one bitmap per column, bit set when the row's value has been put.
#[derive(Clone, Debug)]
pub(crate) struct ReadyTable {
    columns: Vec<RowBitmap>,
}

impl ReadyTable {
    pub(crate) fn new(config: &DockConfig) -> Self {
        Self { columns: vec![RowBitmap::new(config.rows()); config.columns.len()] }
    }

    /// Marks `rows` of `column` ready. Rows were validated by the caller.
    pub(crate) fn mark(&mut self, column: ColumnId, rows: &[usize]) {
        if let Some(bitmap) = self.columns.get_mut(column.0) {
            rows.iter().for_each(|row| bitmap.set(*row));
        }
    }

    pub(crate) fn column(&self, column: ColumnId) -> Option<&RowBitmap> {
        self.columns.get(column.0)
    }

    /// Rows ready in every one of `columns` (none when `columns` is empty or unknown).
    fn ready_in_all(&self, columns: &[ColumnId], rows: usize) -> RowBitmap {
        let mut ready: Option<RowBitmap> = None;
        for column in columns {
            let Some(bitmap) = self.columns.get(column.0) else {
                return RowBitmap::new(rows);
            };
            match ready.as_mut() {
                None => ready = Some(bitmap.clone()),
                Some(ready) => ready.and_assign(bitmap),
            }
        }
        ready.unwrap_or_else(|| RowBitmap::new(rows))
    }

    pub(crate) fn clear(&mut self, scope: ClearScope<'_>) {
        for bitmap in &mut self.columns {
            match scope {
                ClearScope::All => bitmap.clear(),
                ClearScope::Rows(rows) => rows.iter().for_each(|row| bitmap.unset(*row)),
            }
        }
    }
}

/// One consumer's state: which rows it has received, and its own sampling generator.
#[derive(Clone, Debug)]
pub(crate) struct ConsumerLedger {
    consumed: RowBitmap,
    rng: SplitMix64,
}

impl ConsumerLedger {
    pub(crate) fn new(config: &DockConfig, id: ConsumerId) -> Self {
        Self {
            consumed: RowBitmap::new(config.rows()),
            rng: SplitMix64::new(config.consumer_seed(id)),
        }
    }

    pub(crate) fn consumed(&self) -> &RowBitmap {
        &self.consumed
    }

    pub(crate) fn clear(&mut self, scope: ClearScope<'_>) {
        match scope {
            ClearScope::All => self.consumed.clear(),
            ClearScope::Rows(rows) => rows.iter().for_each(|row| self.consumed.unset(*row)),
        }
    }
}

/// Checks that every row is inside the dock.
pub(crate) fn check_rows_in_range(rows: &[usize], total: usize) -> Result<(), DockError> {
    match rows.iter().find(|row| **row >= total) {
        Some(row) => Err(DockError::RowOutOfRange { row: *row, rows: total }),
        None => Ok(()),
    }
}

/// Checks that every row is inside the dock and appears once.
pub(crate) fn check_rows_distinct(rows: &[usize], total: usize) -> Result<RowBitmap, DockError> {
    check_rows_in_range(rows, total)?;
    let mut seen = RowBitmap::new(total);
    for row in rows {
        if seen.get(*row) {
            return Err(DockError::DuplicateRow { row: *row });
        }
        seen.set(*row);
    }
    Ok(seen)
}

/// Picks rows for `consumer` and marks them consumed in its ledger, all or nothing.
///
/// Returns `Ok(None)` when not enough whole groups are ready yet (the caller retries later) and
/// an error for a request that can never be served.
pub(crate) fn select_rows(
    config: &DockConfig,
    ready: &ReadyTable,
    ledger: &mut ConsumerLedger,
    consumer: ConsumerId,
    columns: &[ColumnId],
    request: RowRequest<'_>,
) -> Result<Option<Vec<usize>>, DockError> {
    match request {
        RowRequest::Count(count) => select_count(config, ready, ledger, columns, count, false),
        RowRequest::UpTo(count) => select_count(config, ready, ledger, columns, count, true),
        RowRequest::Rows(rows) => select_explicit(config, ready, ledger, consumer, columns, rows),
    }
}

fn select_count(
    config: &DockConfig,
    ready: &ReadyTable,
    ledger: &mut ConsumerLedger,
    columns: &[ColumnId],
    count: usize,
    up_to: bool,
) -> Result<Option<Vec<usize>>, DockError> {
    let n = config.samples_per_prompt;
    let total = config.rows();
    if count == 0 || !count.is_multiple_of(n) {
        return Err(DockError::CountNotWholeGroups { count, samples_per_prompt: n });
    }
    if count > total {
        return Err(DockError::CountExceedsCapacity { count, rows: total });
    }
    let wanted = count / n;
    let mut usable = ready.ready_in_all(columns, total);
    usable.and_not_assign(&ledger.consumed);
    let group_rows = |group: usize| group * n..(group + 1) * n;
    let mut groups: Vec<usize> =
        (0..config.prompts).filter(|group| usable.all_set_in(group_rows(*group))).collect();
    if groups.len() >= wanted {
        pick_groups(&mut groups, wanted, config.sampling.order, &mut ledger.rng);
    } else if up_to {
        // Fewer than asked for: every usable group (none: nothing to hand out yet).
        if groups.is_empty() {
            return Ok(None);
        }
    } else {
        // A short final batch is only handed out when nothing else can ever become usable:
        // every group this consumer has not received yet is ready now.
        let unconsumed = (0..config.prompts)
            .filter(|group| !ledger.consumed.all_set_in(group_rows(*group)))
            .count();
        let short_final = config.sampling.allow_short_final_batch
            && !groups.is_empty()
            && groups.len() == unconsumed;
        if !short_final {
            return Ok(None);
        }
    }
    let rows: Vec<usize> = groups.iter().flat_map(|group| group_rows(*group)).collect();
    rows.iter().for_each(|row| ledger.consumed.set(*row));
    Ok(Some(rows))
}

/// Keeps `wanted` of `groups` (which holds at least that many) by the sampling order, in
/// ascending order.
fn pick_groups(groups: &mut Vec<usize>, wanted: usize, order: SampleOrder, rng: &mut SplitMix64) {
    if order == SampleOrder::Random {
        // Partial Fisher–Yates: the first `wanted` slots become a uniform random subset.
        for slot in 0..wanted {
            let other = slot + rng.below((groups.len() - slot) as u64) as usize;
            groups.swap(slot, other);
        }
    }
    groups.truncate(wanted);
    groups.sort_unstable();
}

fn select_explicit(
    config: &DockConfig,
    ready: &ReadyTable,
    ledger: &mut ConsumerLedger,
    consumer: ConsumerId,
    columns: &[ColumnId],
    rows: &[usize],
) -> Result<Option<Vec<usize>>, DockError> {
    let n = config.samples_per_prompt;
    let total = config.rows();
    if rows.is_empty() {
        return Err(DockError::CountNotWholeGroups { count: 0, samples_per_prompt: n });
    }
    let requested = check_rows_distinct(rows, total)?;
    for row in rows {
        let group = row / n;
        let group_rows = group * n..(group + 1) * n;
        if !requested.all_set_in(group_rows.clone()) {
            return Err(DockError::PartialGroup {
                group,
                expected: n,
                found: group_rows.filter(|r| requested.get(*r)).count(),
            });
        }
    }
    if let Some(row) = rows.iter().find(|row| ledger.consumed.get(**row)) {
        return Err(DockError::AlreadyConsumed {
            consumer: config.consumers.get(consumer.0).cloned().unwrap_or_default(),
            row: *row,
        });
    }
    let ready_rows = ready.ready_in_all(columns, total);
    if !rows.iter().all(|row| ready_rows.get(*row)) {
        return Ok(None);
    }
    rows.iter().for_each(|row| ledger.consumed.set(*row));
    Ok(Some(rows.to_vec()))
}
