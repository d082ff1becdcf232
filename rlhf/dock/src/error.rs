//! The errors of the dock's library boundary.
//!
//! Every request that reaches the dock may come from another process, so every malformed request
//! is an error value (never a panic) that says what was expected and what was found.

use serde::{Deserialize, Serialize};

use crate::column::ColumnKind;
use crate::pad::PackError;

/// An error from configuring, writing to, reading from or clearing the dock. Serializable, so
/// the dock actor returns it to remote callers as the same typed value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum DockError {
    /// The configuration cannot describe a dock.
    #[error("invalid dock config: {reason}")]
    InvalidConfig {
        /// What is wrong with it.
        reason: String,
    },
    /// A column name that the dock was not configured with.
    #[error("unknown column `{name}`, expected one of [{known}]")]
    UnknownColumn {
        /// The name asked for.
        name: String,
        /// The configured column names, comma-separated.
        known: String,
    },
    /// A consumer name that the dock was not configured with.
    #[error("unknown consumer `{name}`, expected one of [{known}]")]
    UnknownConsumer {
        /// The name asked for.
        name: String,
        /// The configured consumer names, comma-separated.
        known: String,
    },
    /// A request named no columns at all.
    #[error("expected at least one column, found none")]
    NoColumns,
    /// The same column appears twice in one request.
    #[error("column `{name}` appears more than once in one request")]
    DuplicateColumn {
        /// The repeated column.
        name: String,
    },
    /// A row index past the end of the dock.
    #[error("row {row} is out of range, the dock has {rows} rows")]
    RowOutOfRange {
        /// The row asked for.
        row: usize,
        /// The number of rows (prompts × samples per prompt).
        rows: usize,
    },
    /// The same row appears twice in one request.
    #[error("row {row} appears more than once in one request")]
    DuplicateRow {
        /// The repeated row.
        row: usize,
    },
    /// A row count that is not a positive whole number of prompt groups.
    #[error(
        "expected a positive multiple of {samples_per_prompt} rows (whole prompt groups), found {count}"
    )]
    CountNotWholeGroups {
        /// The requested row count.
        count: usize,
        /// Rows per prompt group.
        samples_per_prompt: usize,
    },
    /// More rows requested than the dock can ever hold.
    #[error("requested {count} rows, the dock holds only {rows}")]
    CountExceedsCapacity {
        /// The requested row count.
        count: usize,
        /// The number of rows in the dock.
        rows: usize,
    },
    /// Explicit rows that split a prompt group.
    #[error(
        "explicit rows must be whole prompt groups: group {group} needs {expected} rows, found {found}"
    )]
    PartialGroup {
        /// The prompt group that was split.
        group: usize,
        /// Rows per prompt group.
        expected: usize,
        /// How many of its rows the request named.
        found: usize,
    },
    /// An explicit row that this consumer already received.
    #[error("consumer `{consumer}` already received row {row}")]
    AlreadyConsumed {
        /// The consumer.
        consumer: String,
        /// The row it already received.
        row: usize,
    },
    /// Values of the wrong type for a column.
    #[error("column `{column}` holds {expected}, found {found}")]
    KindMismatch {
        /// The column written to.
        column: String,
        /// The column's configured kind.
        expected: ColumnKind,
        /// The kind of the values given.
        found: ColumnKind,
    },
    /// A get that names explicit rows and a row count that disagree.
    #[error("asked for {count} rows but named {rows} explicit rows")]
    RequestMismatch {
        /// The requested row count.
        count: usize,
        /// How many explicit rows were named.
        rows: usize,
    },
    /// A packed payload whose row lengths do not add up to its flat buffer.
    #[error("column `{column}` has a malformed packed payload: {source}")]
    MalformedPacked {
        /// The column written to.
        column: String,
        /// What is inconsistent.
        source: PackError,
    },
    /// A different number of values than rows.
    #[error("column `{column}` expected {rows} values (one per row), found {values}")]
    ValueCountMismatch {
        /// The column written to.
        column: String,
        /// The number of rows named.
        rows: usize,
        /// The number of values given.
        values: usize,
    },
}
