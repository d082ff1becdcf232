//! The thread-safe TransferDock: the data store plus the index, shared by reference between the
//! dock actor's concurrent method calls (or plain threads).
//!
//! Locks: one mutex per consumer (its ledger and generator) and one read-write lock over the
//! data and readiness. A get takes its consumer's mutex, then the data lock for reading, so the
//! DP ranks of one consumer are serialised (never handed the same row) while different
//! consumers and the copying of data run in parallel. A put takes only the data lock for
//! writing. A clear takes every consumer mutex in id order and then the data lock, the same
//! order as a get, so no two paths can deadlock.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use serde::{Deserialize, Serialize};

use crate::column::{ColumnKind, ColumnStorage, ColumnValues, PackedColumn};
use crate::config::{ColumnId, ConsumerId, DockConfig};
use crate::error::DockError;
use crate::index::{
    ClearScope, ConsumerLedger, ReadyTable, RowRequest, check_rows_distinct, check_rows_in_range,
    missing_consumer, select_rows,
};

fn missing_column(name: &str) -> DockError {
    DockError::UnknownColumn { name: name.to_owned(), known: String::new() }
}

/// The columns of one get, with the rows they came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExperienceBatch {
    /// The dock rows, in the order of every column's values; write results back to these.
    pub rows: Vec<usize>,
    /// The requested columns, in request order.
    pub columns: Vec<NamedColumn>,
}

/// One column of an [`ExperienceBatch`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NamedColumn {
    /// The column's name.
    pub name: String,
    /// Its values for the batch's rows.
    pub values: ColumnValues,
}

impl ExperienceBatch {
    /// The values of column `name`, if it was requested.
    pub fn column(&self, name: &str) -> Option<&ColumnValues> {
        self.columns.iter().find(|column| column.name == name).map(|column| &column.values)
    }
}

/// The packed wire form of an [`ExperienceBatch`]: each variable-length column is one flat
/// buffer plus row lengths, so a batch crosses a process boundary as a few large buffers rather
/// than one small vector per row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PackedBatch {
    /// The dock rows, in the order of every column's values; write results back to these.
    pub rows: Vec<usize>,
    /// The requested columns, in request order.
    pub columns: Vec<PackedNamedColumn>,
}

/// One packed column: a name and its values for a batch's rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PackedNamedColumn {
    /// The column's name.
    pub name: String,
    /// Its values, packed.
    pub values: PackedColumn,
}

impl PackedNamedColumn {
    /// Packs `values` under `name`.
    pub fn new(name: impl Into<String>, values: &ColumnValues) -> Self {
        Self { name: name.into(), values: values.pack() }
    }
}

impl PackedBatch {
    /// The packed values of column `name`, if it was requested.
    pub fn column(&self, name: &str) -> Option<&PackedColumn> {
        self.columns.iter().find(|column| column.name == name).map(|column| &column.values)
    }

    /// Restores per-row values (checks every column's lengths).
    pub fn unpack(&self) -> Result<ExperienceBatch, DockError> {
        let columns = self
            .columns
            .iter()
            .map(|column| {
                column
                    .values
                    .unpack()
                    .map(|values| NamedColumn { name: column.name.clone(), values })
                    .map_err(|source| DockError::MalformedPacked {
                        column: column.name.clone(),
                        source,
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(ExperienceBatch { rows: self.rows.clone(), columns })
    }
}

impl ExperienceBatch {
    /// The packed wire form of this batch.
    pub fn pack(&self) -> PackedBatch {
        PackedBatch {
            rows: self.rows.clone(),
            columns: self
                .columns
                .iter()
                .map(|column| PackedNamedColumn::new(column.name.clone(), &column.values))
                .collect(),
        }
    }
}

/// The rows a get selected and each requested column's values for them, by name.
type Selected<V> = (Vec<usize>, Vec<(String, V)>);

/// Data and readiness, kept under one lock so that a reader never sees a ready row whose data
/// is not written yet.
struct Store {
    ready: ReadyTable,
    data: Vec<ColumnStorage>,
}

/// The experience store between rollout and training: columns × rows of variable-length values,
/// readiness per (column, row), consumption per (consumer, row).
pub struct TransferDock {
    config: DockConfig,
    ledgers: Vec<Mutex<ConsumerLedger>>,
    store: RwLock<Store>,
}

impl std::fmt::Debug for TransferDock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferDock").field("config", &self.config).finish_non_exhaustive()
    }
}

impl TransferDock {
    /// An empty dock for a validated `config`.
    pub fn new(config: DockConfig) -> Result<Self, DockError> {
        config.validate()?;
        let ledgers = (0..config.consumers.len())
            .map(|id| Mutex::new(ConsumerLedger::new(&config, ConsumerId(id))))
            .collect();
        let store = Store {
            ready: ReadyTable::new(&config),
            data: config
                .columns
                .iter()
                .map(|column| ColumnStorage::new(column.kind, config.rows()))
                .collect(),
        };
        Ok(Self { config, ledgers, store: RwLock::new(store) })
    }

    /// The configuration this dock was built from.
    pub fn config(&self) -> &DockConfig {
        &self.config
    }

    /// Writes `columns` (name, one value per row) at `rows` and marks them ready, all columns
    /// or none: every column, kind and length is checked before anything is written.
    pub fn put_experience<S: AsRef<str>>(
        &self,
        rows: &[usize],
        columns: Vec<(S, ColumnValues)>,
    ) -> Result<(), DockError> {
        check_rows_distinct(rows, self.config.rows())?;
        let names: Vec<&str> = columns.iter().map(|(name, _)| name.as_ref()).collect();
        let ids = self.config.column_ids(&names)?;
        for ((name, values), id) in columns.iter().zip(&ids) {
            self.check_values(name.as_ref(), *id, rows, values.kind(), values.len())?;
        }
        let mut store = self.write_store();
        for ((_, values), id) in columns.into_iter().zip(ids) {
            if let Some(storage) = store.data.get_mut(id.0) {
                storage.write(rows, values);
            }
            store.ready.mark(id, rows);
        }
        Ok(())
    }

    /// [`Self::put_experience`] for packed columns (the form the dock actor receives): the
    /// payloads are checked (kinds, row counts, lengths) and then split straight into the rows'
    /// slots, all columns or none.
    pub fn put_experience_packed(
        &self,
        rows: &[usize],
        columns: &[PackedNamedColumn],
    ) -> Result<(), DockError> {
        check_rows_distinct(rows, self.config.rows())?;
        let names: Vec<&str> = columns.iter().map(|column| column.name.as_str()).collect();
        let ids = self.config.column_ids(&names)?;
        for (column, id) in columns.iter().zip(&ids) {
            let values = &column.values;
            self.check_values(&column.name, *id, rows, values.kind(), values.len())?;
            values.check().map_err(|source| DockError::MalformedPacked {
                column: column.name.clone(),
                source,
            })?;
        }
        let mut store = self.write_store();
        for (column, id) in columns.iter().zip(ids) {
            if let Some(storage) = store.data.get_mut(id.0) {
                storage.write_packed(rows, &column.values);
            }
            store.ready.mark(id, rows);
        }
        Ok(())
    }

    /// [`Self::get_experience`] returning the packed wire form, copied out of the slots in one
    /// pass with no per-row buffers.
    pub fn get_experience_packed<S: AsRef<str>>(
        &self,
        consumer: &str,
        columns: &[S],
        request: RowRequest<'_>,
    ) -> Result<Option<PackedBatch>, DockError> {
        self.get_with(consumer, columns, request, |storage, rows| storage.read_packed(rows)).map(
            |batch| {
                batch.map(|(rows, columns)| PackedBatch {
                    rows,
                    columns: columns
                        .into_iter()
                        .map(|(name, values)| PackedNamedColumn { name, values })
                        .collect(),
                })
            },
        )
    }

    /// Picks rows for `consumer` (see [`RowRequest`]) that are ready in every one of `columns`
    /// and that it has not received, in whole prompt groups, marks them consumed and returns
    /// their data. `Ok(None)` when not enough whole groups are ready yet.
    pub fn get_experience<S: AsRef<str>>(
        &self,
        consumer: &str,
        columns: &[S],
        request: RowRequest<'_>,
    ) -> Result<Option<ExperienceBatch>, DockError> {
        self.get_with(consumer, columns, request, |storage, rows| storage.read(rows)).map(|batch| {
            batch.map(|(rows, columns)| ExperienceBatch {
                rows,
                columns: columns
                    .into_iter()
                    .map(|(name, values)| NamedColumn { name, values })
                    .collect(),
            })
        })
    }

    /// The selection and copy-out shared by both forms of get; `read` copies one column's
    /// values for the chosen rows.
    fn get_with<S: AsRef<str>, V>(
        &self,
        consumer: &str,
        columns: &[S],
        request: RowRequest<'_>,
        read: impl Fn(&ColumnStorage, &[usize]) -> V,
    ) -> Result<Option<Selected<V>>, DockError> {
        let consumer_id = self.config.consumer_id(consumer)?;
        let column_ids = self.config.column_ids(columns)?;
        let mut ledger = self.lock_ledger(consumer, consumer_id)?;
        let store = self.read_store();
        let Some(rows) = select_rows(
            &self.config,
            &store.ready,
            &mut ledger,
            consumer_id,
            &column_ids,
            request,
        )?
        else {
            return Ok(None);
        };
        // The ledger lock is no longer needed: the rows are ours. The data lock stays held
        // until the copy is done so a clear cannot race it.
        drop(ledger);
        let mut values = Vec::with_capacity(columns.len());
        for (name, id) in columns.iter().zip(&column_ids) {
            // `column_ids` resolved every name against the config, which sized `data`.
            let storage = store.data.get(id.0).ok_or_else(|| missing_column(name.as_ref()))?;
            values.push((name.as_ref().to_owned(), read(storage, &rows)));
        }
        Ok(Some((rows, values)))
    }

    /// Whether `consumer` has received every row of the dock.
    pub fn all_consumed(&self, consumer: &str) -> Result<bool, DockError> {
        let id = self.config.consumer_id(consumer)?;
        Ok(self.lock_ledger(consumer, id)?.consumed().all_set())
    }

    /// How many rows `consumer` has received.
    pub fn consumed_rows(&self, consumer: &str) -> Result<usize, DockError> {
        let id = self.config.consumer_id(consumer)?;
        Ok(self.lock_ledger(consumer, id)?.consumed().count_ones())
    }

    /// How many rows of `column` are ready.
    pub fn ready_rows(&self, column: &str) -> Result<usize, DockError> {
        let id = self.config.column_id(column)?;
        Ok(self.read_store().ready.column(id).map_or(0, |c| c.count_ones()))
    }

    /// Drops the data and resets readiness and every consumer's consumption, for all rows or
    /// the given ones.
    pub fn clear(&self, scope: ClearScope<'_>) -> Result<(), DockError> {
        if let ClearScope::Rows(rows) = scope {
            check_rows_in_range(rows, self.config.rows())?;
        }
        // Lock order: consumers in id order, then the store (the same order as a get).
        let mut ledgers: Vec<MutexGuard<'_, ConsumerLedger>> =
            self.ledgers.iter().map(|l| l.lock().unwrap_or_else(PoisonError::into_inner)).collect();
        let mut store = self.write_store();
        store.ready.clear(scope);
        for storage in &mut store.data {
            match scope {
                ClearScope::All => storage.clear_all(),
                ClearScope::Rows(rows) => storage.clear_rows(rows),
            }
        }
        ledgers.iter_mut().for_each(|ledger| ledger.clear(scope));
        Ok(())
    }

    fn check_values(
        &self,
        name: &str,
        id: ColumnId,
        rows: &[usize],
        kind: ColumnKind,
        len: usize,
    ) -> Result<(), DockError> {
        if let Some(spec) = self.config.columns.get(id.0)
            && spec.kind != kind
        {
            return Err(DockError::KindMismatch {
                column: name.to_owned(),
                expected: spec.kind,
                found: kind,
            });
        }
        if len != rows.len() {
            return Err(DockError::ValueCountMismatch {
                column: name.to_owned(),
                rows: rows.len(),
                values: len,
            });
        }
        Ok(())
    }

    // Poisoning is recovered from rather than propagated: no code path panics while holding
    // these locks (every index is validated before the lock is taken), so the state behind a
    // poisoned lock is still consistent.
    fn lock_ledger(
        &self,
        name: &str,
        id: ConsumerId,
    ) -> Result<MutexGuard<'_, ConsumerLedger>, DockError> {
        self.ledgers
            .get(id.0)
            .map(|l| l.lock().unwrap_or_else(PoisonError::into_inner))
            .ok_or_else(|| missing_consumer(name))
    }

    fn read_store(&self) -> RwLockReadGuard<'_, Store> {
        self.store.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_store(&self) -> RwLockWriteGuard<'_, Store> {
        self.store.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dock() -> TransferDock {
        TransferDock::new(
            DockConfig::new(2, 2)
                .with_column("responses", ColumnKind::TokenIds)
                .with_column("old_log_prob", ColumnKind::Floats)
                .with_column("rm_scores", ColumnKind::Scalars)
                .with_consumer("reward")
                .with_consumer("train"),
        )
        .unwrap()
    }

    #[test]
    fn put_then_get_returns_the_data() {
        let dock = dock();
        dock.put_experience(
            &[1, 0],
            vec![("responses", ColumnValues::TokenIds(vec![vec![11, 12], vec![10]]))],
        )
        .unwrap();
        let batch =
            dock.get_experience("reward", &["responses"], RowRequest::Count(2)).unwrap().unwrap();
        assert_eq!(batch.rows, vec![0, 1]);
        assert_eq!(
            batch.column("responses"),
            Some(&ColumnValues::TokenIds(vec![vec![10], vec![11, 12]]))
        );
        assert_eq!(batch.column("rm_scores"), None);
        // Rows 2 and 3 are not ready: nothing more for `reward`, and `train` needs scores.
        assert_eq!(
            dock.get_experience("reward", &["responses"], RowRequest::Count(2)).unwrap(),
            None
        );
        assert_eq!(
            dock.get_experience("train", &["responses", "rm_scores"], RowRequest::Count(2))
                .unwrap(),
            None
        );
        dock.put_experience(&[0, 1], vec![("rm_scores", ColumnValues::Scalars(vec![0.5, 1.5]))])
            .unwrap();
        let batch = dock
            .get_experience("train", &["rm_scores", "responses"], RowRequest::Count(2))
            .unwrap()
            .unwrap();
        assert_eq!(batch.columns[0].values, ColumnValues::Scalars(vec![0.5, 1.5]));
        assert_eq!(dock.consumed_rows("train").unwrap(), 2);
        assert!(!dock.all_consumed("train").unwrap());
    }

    #[test]
    fn put_is_all_or_nothing() {
        let dock = dock();
        let error = dock
            .put_experience(
                &[0, 1],
                vec![
                    ("rm_scores", ColumnValues::Scalars(vec![1.0, 2.0])),
                    ("responses", ColumnValues::Floats(vec![vec![], vec![]])),
                ],
            )
            .unwrap_err();
        assert_eq!(error.to_string(), "column `responses` holds token ids, found float rows");
        assert_eq!(dock.ready_rows("rm_scores").unwrap(), 0);
        assert_eq!(
            dock.put_experience(&[0, 1], vec![("rm_scores", ColumnValues::Scalars(vec![1.0]))]),
            Err(DockError::ValueCountMismatch { column: "rm_scores".into(), rows: 2, values: 1 })
        );
        assert!(
            dock.put_experience(
                &[0, 0],
                vec![("rm_scores", ColumnValues::Scalars(vec![1.0, 1.0]))]
            )
            .is_err()
        );
        assert!(
            dock.put_experience(&[7], vec![("rm_scores", ColumnValues::Scalars(vec![1.0]))])
                .is_err()
        );
        assert!(
            dock.put_experience(&[0], vec![("nope", ColumnValues::Scalars(vec![1.0]))]).is_err()
        );
    }

    #[test]
    fn packed_put_and_get_round_trip() {
        let dock = dock();
        let responses = ColumnValues::TokenIds(vec![vec![1, 2, 3], vec![], vec![4], vec![5, 6]]);
        let scores = ColumnValues::Scalars(vec![0.1, 0.2, 0.3, 0.4]);
        let put = ExperienceBatch {
            rows: vec![3, 2, 1, 0],
            columns: vec![
                NamedColumn { name: "responses".into(), values: responses.clone() },
                NamedColumn { name: "rm_scores".into(), values: scores },
            ],
        }
        .pack();
        dock.put_experience_packed(&put.rows, &put.columns).unwrap();
        let got = dock
            .get_experience_packed("reward", &["responses"], RowRequest::Count(4))
            .unwrap()
            .unwrap();
        assert_eq!(got.rows, vec![0, 1, 2, 3]);
        // Packed straight from the slots: rows in get order, one flat buffer.
        assert_eq!(
            got.column("responses"),
            Some(&ColumnValues::TokenIds(vec![vec![5, 6], vec![4], vec![], vec![1, 2, 3]]).pack())
        );
        let unpacked = got.unpack().unwrap();
        assert_eq!(unpacked.pack(), got);
        // The plain get sees the same data.
        let plain = dock
            .get_experience("train", &["responses", "rm_scores"], RowRequest::Rows(&[2, 3]))
            .unwrap()
            .unwrap();
        assert_eq!(plain.column("rm_scores"), Some(&ColumnValues::Scalars(vec![0.2, 0.1])));
    }

    #[test]
    fn malformed_packed_put_writes_nothing() {
        let dock = dock();
        let good = PackedNamedColumn::new("rm_scores", &ColumnValues::Scalars(vec![1.0, 2.0]));
        let bad = PackedNamedColumn {
            name: "responses".into(),
            values: PackedColumn::TokenIds(crate::pad::PackedRows {
                flat: vec![1, 2],
                lengths: vec![1, 5],
            }),
        };
        let error = dock.put_experience_packed(&[0, 1], &[good.clone(), bad]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "column `responses` has a malformed packed payload: \
             row lengths add up to 6 elements, the flat buffer has 2"
        );
        assert_eq!(dock.ready_rows("rm_scores").unwrap(), 0);
        let wrong_kind = PackedNamedColumn {
            name: "old_log_prob".into(),
            values: PackedColumn::Scalars(vec![1.0, 2.0]),
        };
        assert!(matches!(
            dock.put_experience_packed(&[0, 1], &[wrong_kind]),
            Err(DockError::KindMismatch { .. })
        ));
        assert!(matches!(
            dock.put_experience_packed(&[0], &[good]),
            Err(DockError::ValueCountMismatch { .. })
        ));
    }

    #[test]
    fn clear_drops_data_and_state() {
        let dock = dock();
        let rows = [0, 1, 2, 3];
        dock.put_experience(
            &rows,
            vec![("rm_scores", ColumnValues::Scalars(vec![1.0, 2.0, 3.0, 4.0]))],
        )
        .unwrap();
        assert!(
            dock.get_experience("reward", &["rm_scores"], RowRequest::Count(4)).unwrap().is_some()
        );
        assert!(dock.all_consumed("reward").unwrap());
        dock.clear(ClearScope::Rows(&[2, 3])).unwrap();
        assert_eq!(dock.ready_rows("rm_scores").unwrap(), 2);
        assert_eq!(dock.consumed_rows("reward").unwrap(), 2);
        dock.clear(ClearScope::All).unwrap();
        assert_eq!(dock.ready_rows("rm_scores").unwrap(), 0);
        assert_eq!(dock.consumed_rows("reward").unwrap(), 0);
        assert!(dock.clear(ClearScope::Rows(&[4])).is_err());
    }
}
