//! The dock as an rtrun actor ([`DockActor`]) and its blocking client ([`RemoteDock`]).
//!
//! The actor is a thin shell over [`TransferDock`]: every method takes `&self` and forwards, so
//! the runtime runs calls on its `&self` pool (up to `max_concurrency` at once) and the dock's
//! own locks decide what may overlap — the DP ranks of one consumer are serialised by that
//! consumer's mutex, different consumers sample in parallel, puts take the data lock. A get
//! never blocks waiting for rows (it answers `None`), so a pool thread is never parked on a
//! slow producer.
//!
//! Batches travel packed ([`PackedBatch`]): one flat buffer plus lengths per column, written
//! straight into and read straight out of the dock's row slots.

use serde::{Deserialize, Serialize};

use crate::config::DockConfig;
use crate::dock::{PackedBatch, TransferDock};
use crate::error::DockError;
use crate::index::{ClearScope, RowRequest};

/// How many rows are ready per column and consumed per consumer: the dock's progress, for
/// monitoring a pipeline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DockProgress {
    /// Rows in the dock.
    pub rows: usize,
    /// `(column, ready rows)` in column order.
    pub ready: Vec<(String, usize)>,
    /// `(consumer, consumed rows)` in consumer order.
    pub consumed: Vec<(String, usize)>,
}

impl TransferDock {
    /// The dock's progress: ready rows per column, consumed rows per consumer.
    pub fn progress(&self) -> Result<DockProgress, DockError> {
        let config = self.config();
        let ready = config
            .columns
            .iter()
            .map(|column| Ok((column.name.clone(), self.ready_rows(&column.name)?)))
            .collect::<Result<_, DockError>>()?;
        let consumed = config
            .consumers
            .iter()
            .map(|consumer| Ok((consumer.clone(), self.consumed_rows(consumer)?)))
            .collect::<Result<_, DockError>>()?;
        Ok(DockProgress { rows: config.rows(), ready, consumed })
    }
}

/// Turns the wire form of a get's row selection into a [`RowRequest`]: explicit rows when
/// given (and then `count` must agree), otherwise any `count` rows.
fn row_request(count: usize, rows: Option<&[usize]>) -> Result<RowRequest<'_>, DockError> {
    match rows {
        None => Ok(RowRequest::Count(count)),
        Some(rows) if rows.len() == count => Ok(RowRequest::Rows(rows)),
        Some(rows) => Err(DockError::RequestMismatch { count, rows: rows.len() }),
    }
}

/// The TransferDock hosted as an actor. Create it with [`RemoteDock::create`], which sets a
/// `max_concurrency` large enough for every stage's ranks to call at once.
pub struct DockActor {
    dock: TransferDock,
}

#[rtrun::actor(pub)]
impl DockActor {
    /// A dock for `config` (validated; an invalid config fails the actor's creation).
    pub fn new(config: DockConfig) -> Result<DockActor, DockError> {
        Ok(DockActor { dock: TransferDock::new(config)? })
    }

    /// The dock's configuration.
    pub fn config(&self) -> DockConfig {
        self.dock.config().clone()
    }

    /// Writes the batch's columns at its rows and marks them ready, all columns or none.
    pub fn put_experience(&self, batch: PackedBatch) -> Result<(), DockError> {
        self.dock.put_experience_packed(&batch.rows, &batch.columns)
    }

    /// Hands `consumer` `count` rows that are ready in every one of `columns` and that it has
    /// not received, in whole prompt groups (or exactly `rows`, when given); `None` when not
    /// enough are ready yet.
    pub fn get_experience(
        &self,
        consumer: String,
        columns: Vec<String>,
        count: usize,
        rows: Option<Vec<usize>>,
    ) -> Result<Option<PackedBatch>, DockError> {
        let request = row_request(count, rows.as_deref())?;
        self.dock.get_experience_packed(&consumer, &columns, request)
    }

    /// Hands `consumer` whatever whole prompt groups are ready in every one of `columns` and
    /// that it has not received, at most `max_rows` rows ([`RowRequest::UpTo`]); `None` when no
    /// group is.
    pub fn get_available(
        &self,
        consumer: String,
        columns: Vec<String>,
        max_rows: usize,
    ) -> Result<Option<PackedBatch>, DockError> {
        self.dock.get_experience_packed(&consumer, &columns, RowRequest::UpTo(max_rows))
    }

    /// Whether `consumer` has received every row.
    pub fn all_consumed(&self, consumer: String) -> Result<bool, DockError> {
        self.dock.all_consumed(&consumer)
    }

    /// Drops data, readiness and consumption of every row (`None`) or of the given rows.
    pub fn clear(&self, rows: Option<Vec<usize>>) -> Result<(), DockError> {
        match rows.as_deref() {
            None => self.dock.clear(ClearScope::All),
            Some(rows) => self.dock.clear(ClearScope::Rows(rows)),
        }
    }

    /// Ready rows per column and consumed rows per consumer.
    pub fn progress(&self) -> Result<DockProgress, DockError> {
        self.dock.progress()
    }
}

/// An error from a call to the dock, local or remote.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DockCallError {
    /// The dock rejected the request.
    #[error(transparent)]
    Dock(#[from] DockError),
    /// The call did not complete: the dock actor died, the call was cancelled, ...
    #[error("dock actor call failed: {0}")]
    Runtime(#[from] rtrun::Error),
}

/// A blocking client of a [`DockActor`]: serializable, so it can be handed to stage actors in
/// other processes, which then talk to the dock directly.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RemoteDock {
    actor: DockActorRef,
}

impl RemoteDock {
    /// `max_concurrency` of the dock actor when the caller's options leave it unset: how many
    /// dock calls run at once (the other calls queue). It should cover every rank of every
    /// stage polling at the same time; a get or put holds a pool thread only while it copies.
    pub const DEFAULT_MAX_CONCURRENCY: usize = 32;

    /// Creates a dock actor for `config` in a new worker process and waits until it is up (an
    /// invalid config is reported here).
    pub fn create(
        config: DockConfig,
        mut options: rtrun::ActorOptions,
    ) -> Result<RemoteDock, DockCallError> {
        options.max_concurrency.get_or_insert(Self::DEFAULT_MAX_CONCURRENCY);
        let actor = DockActor::remote_with(options, config)?;
        let dock = RemoteDock { actor };
        dock.config()?;
        Ok(dock)
    }

    /// A client of an existing dock actor.
    pub fn from_ref(actor: DockActorRef) -> RemoteDock {
        RemoteDock { actor }
    }

    /// The actor reference.
    pub fn actor(&self) -> &DockActorRef {
        &self.actor
    }

    /// The dock's configuration.
    pub fn config(&self) -> Result<DockConfig, DockCallError> {
        Ok(self.actor.config().get()?)
    }

    /// See [`DockActor::put_experience`].
    pub fn put_experience(&self, batch: PackedBatch) -> Result<(), DockCallError> {
        Ok(self.actor.put_experience(batch).get()??)
    }

    /// See [`DockActor::get_experience`].
    pub fn get_experience(
        &self,
        consumer: &str,
        columns: &[String],
        count: usize,
        rows: Option<Vec<usize>>,
    ) -> Result<Option<PackedBatch>, DockCallError> {
        Ok(self
            .actor
            .get_experience(consumer.to_owned(), columns.to_vec(), count, rows)
            .get()??)
    }

    /// See [`DockActor::get_available`].
    pub fn get_available(
        &self,
        consumer: &str,
        columns: &[String],
        max_rows: usize,
    ) -> Result<Option<PackedBatch>, DockCallError> {
        Ok(self.actor.get_available(consumer.to_owned(), columns.to_vec(), max_rows).get()??)
    }

    /// See [`DockActor::all_consumed`].
    pub fn all_consumed(&self, consumer: &str) -> Result<bool, DockCallError> {
        Ok(self.actor.all_consumed(consumer.to_owned()).get()??)
    }

    /// See [`DockActor::clear`].
    pub fn clear(&self, rows: Option<Vec<usize>>) -> Result<(), DockCallError> {
        Ok(self.actor.clear(rows).get()??)
    }

    /// See [`DockActor::progress`].
    pub fn progress(&self) -> Result<DockProgress, DockCallError> {
        Ok(self.actor.progress().get()??)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_request_from_wire() {
        assert_eq!(row_request(4, None), Ok(RowRequest::Count(4)));
        assert_eq!(row_request(2, Some(&[2, 3])), Ok(RowRequest::Rows(&[2, 3])));
        assert_eq!(
            row_request(4, Some(&[2, 3])).unwrap_err().to_string(),
            "asked for 4 rows but named 2 explicit rows"
        );
    }
}
