//! The dock's index logic as a pure state machine: readiness per (column, row), consumption per
//! (consumer, row), and sampling of whole ready prompt groups. No I/O, no threads, no clocks, so
//! it is property-tested directly; [`crate::TransferDock`] runs the same selection rule under
//! its per-consumer locks.

mod select;

pub use select::{ClearScope, RowRequest};
pub(crate) use select::{
    ConsumerLedger, ReadyTable, check_rows_distinct, check_rows_in_range, select_rows,
};

use crate::config::{ConsumerId, DockConfig};
use crate::error::DockError;

/// The single-threaded index: which rows are ready in which column and which rows each consumer
/// has received.
#[derive(Clone, Debug)]
pub struct DockIndex {
    config: DockConfig,
    ready: ReadyTable,
    ledgers: Vec<ConsumerLedger>,
}

impl DockIndex {
    /// An empty index (nothing ready, nothing consumed) for a validated `config`.
    pub fn new(config: DockConfig) -> Result<Self, DockError> {
        config.validate()?;
        let ready = ReadyTable::new(&config);
        let ledgers = (0..config.consumers.len())
            .map(|id| ConsumerLedger::new(&config, ConsumerId(id)))
            .collect();
        Ok(Self { config, ready, ledgers })
    }

    /// The configuration this index was built from.
    pub fn config(&self) -> &DockConfig {
        &self.config
    }

    /// The number of rows, prompts × samples per prompt.
    pub fn rows(&self) -> usize {
        self.config.rows()
    }

    /// Marks `rows` of `column` ready (their values have been put). Marking a ready row again
    /// is allowed (an overwrite).
    pub fn mark_ready(&mut self, column: &str, rows: &[usize]) -> Result<(), DockError> {
        let column = self.config.column_id(column)?;
        check_rows_in_range(rows, self.rows())?;
        self.ready.mark(column, rows);
        Ok(())
    }

    /// Picks rows for `consumer` that are ready in every one of `columns` and that it has not
    /// received, in whole prompt groups, and marks them consumed in the same step.
    ///
    /// `Ok(None)` means not enough whole groups are ready yet: nothing is marked and the caller
    /// asks again later.
    pub fn sample<S: AsRef<str>>(
        &mut self,
        consumer: &str,
        columns: &[S],
        request: RowRequest<'_>,
    ) -> Result<Option<Vec<usize>>, DockError> {
        let consumer_id = self.config.consumer_id(consumer)?;
        let column_ids = self.config.column_ids(columns)?;
        // A resolved id always has a ledger (both come from the same config); the error arm
        // only keeps this total.
        let Some(ledger) = self.ledgers.get_mut(consumer_id.0) else {
            return Err(missing_consumer(consumer));
        };
        select_rows(&self.config, &self.ready, ledger, consumer_id, &column_ids, request)
    }

    /// Whether `consumer` has received every row of the dock.
    pub fn all_consumed(&self, consumer: &str) -> Result<bool, DockError> {
        Ok(self.ledger(consumer)?.consumed().all_set())
    }

    /// How many rows `consumer` has received.
    pub fn consumed_rows(&self, consumer: &str) -> Result<usize, DockError> {
        Ok(self.ledger(consumer)?.consumed().count_ones())
    }

    /// Whether `consumer` has received `row` (false for rows past the end).
    pub fn is_consumed(&self, consumer: &str, row: usize) -> Result<bool, DockError> {
        Ok(self.ledger(consumer)?.consumed().get(row))
    }

    /// Whether `row` of `column` is ready (false for rows past the end).
    pub fn is_ready(&self, column: &str, row: usize) -> Result<bool, DockError> {
        let column = self.config.column_id(column)?;
        Ok(self.ready.column(column).is_some_and(|c| c.get(row)))
    }

    /// How many rows of `column` are ready.
    pub fn ready_rows(&self, column: &str) -> Result<usize, DockError> {
        let column = self.config.column_id(column)?;
        Ok(self.ready.column(column).map_or(0, |c| c.count_ones()))
    }

    /// Resets readiness in every column and consumption for every consumer, for all rows or
    /// the given ones (a new rollout batch reuses the dock).
    pub fn clear(&mut self, scope: ClearScope<'_>) -> Result<(), DockError> {
        if let ClearScope::Rows(rows) = scope {
            check_rows_in_range(rows, self.rows())?;
        }
        self.ready.clear(scope);
        self.ledgers.iter_mut().for_each(|l| l.clear(scope));
        Ok(())
    }

    fn ledger(&self, consumer: &str) -> Result<&ConsumerLedger, DockError> {
        let id = self.config.consumer_id(consumer)?;
        self.ledgers.get(id.0).ok_or_else(|| missing_consumer(consumer))
    }
}

/// The error for a consumer id without a ledger, which a config-built index never has.
pub(crate) fn missing_consumer(name: &str) -> DockError {
    DockError::UnknownConsumer { name: name.to_owned(), known: String::new() }
}

#[cfg(test)]
mod tests;
