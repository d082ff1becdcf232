//! Typed column values: what one column holds for a set of rows, and the dock's per-column
//! storage of variable-length rows.
//!
//! A batch of values is typed once per column (`Vec<Vec<i64>>`), not once per row, so a put or a
//! get carries no per-row tags and moves the rows' buffers without copying them.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::pad::{PackError, PackedRows, pack, unpack};

/// The type of value each row of a column holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ColumnKind {
    /// A variable-length row of token ids (prompts, responses, input ids).
    TokenIds,
    /// A variable-length row of floats (log-probs, values, advantages, per-token rewards).
    Floats,
    /// One float per row (scores, lengths as floats, metrics).
    Scalars,
}

impl fmt::Display for ColumnKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ColumnKind::TokenIds => "token ids",
            ColumnKind::Floats => "float rows",
            ColumnKind::Scalars => "scalars",
        })
    }
}

/// The values of one column for a list of rows, in the order of those rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ColumnValues {
    /// One token-id row per dock row.
    TokenIds(Vec<Vec<i64>>),
    /// One float row per dock row.
    Floats(Vec<Vec<f32>>),
    /// One float per dock row.
    Scalars(Vec<f32>),
}

impl ColumnValues {
    /// The kind of these values.
    pub fn kind(&self) -> ColumnKind {
        match self {
            ColumnValues::TokenIds(_) => ColumnKind::TokenIds,
            ColumnValues::Floats(_) => ColumnKind::Floats,
            ColumnValues::Scalars(_) => ColumnKind::Scalars,
        }
    }

    /// The number of rows.
    pub fn len(&self) -> usize {
        match self {
            ColumnValues::TokenIds(rows) => rows.len(),
            ColumnValues::Floats(rows) => rows.len(),
            ColumnValues::Scalars(values) => values.len(),
        }
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of elements over all rows (a scalar row counts as one).
    pub fn elements(&self) -> usize {
        match self {
            ColumnValues::TokenIds(rows) => rows.iter().map(Vec::len).sum(),
            ColumnValues::Floats(rows) => rows.iter().map(Vec::len).sum(),
            ColumnValues::Scalars(values) => values.len(),
        }
    }

    /// Packs the rows into one flat buffer plus lengths, the form to send over the wire.
    pub fn pack(&self) -> PackedColumn {
        match self {
            ColumnValues::TokenIds(rows) => PackedColumn::TokenIds(pack(rows)),
            ColumnValues::Floats(rows) => PackedColumn::Floats(pack(rows)),
            ColumnValues::Scalars(values) => PackedColumn::Scalars(values.clone()),
        }
    }
}

/// A column's values packed for transfer: variable-length rows as one flat buffer plus
/// lengths, scalars as they are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum PackedColumn {
    /// Packed token-id rows.
    TokenIds(PackedRows<i64>),
    /// Packed float rows.
    Floats(PackedRows<f32>),
    /// One float per row.
    Scalars(Vec<f32>),
}

impl PackedColumn {
    /// The kind of the packed values.
    pub fn kind(&self) -> ColumnKind {
        match self {
            PackedColumn::TokenIds(_) => ColumnKind::TokenIds,
            PackedColumn::Floats(_) => ColumnKind::Floats,
            PackedColumn::Scalars(_) => ColumnKind::Scalars,
        }
    }

    /// The number of rows (as the lengths say; [`Self::check`] verifies them).
    pub fn len(&self) -> usize {
        match self {
            PackedColumn::TokenIds(packed) => packed.lengths.len(),
            PackedColumn::Floats(packed) => packed.lengths.len(),
            PackedColumn::Scalars(values) => values.len(),
        }
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks that the lengths add up to the flat buffer (the check every packed payload from
    /// another process goes through before it is split into rows).
    pub fn check(&self) -> Result<(), PackError> {
        match self {
            PackedColumn::TokenIds(packed) => packed.check(),
            PackedColumn::Floats(packed) => packed.check(),
            PackedColumn::Scalars(_) => Ok(()),
        }
    }

    /// Restores the rows; fails when the lengths do not add up to the flat buffer.
    pub fn unpack(&self) -> Result<ColumnValues, PackError> {
        Ok(match self {
            PackedColumn::TokenIds(packed) => {
                ColumnValues::TokenIds(unpack(&packed.flat, &packed.lengths)?)
            }
            PackedColumn::Floats(packed) => {
                ColumnValues::Floats(unpack(&packed.flat, &packed.lengths)?)
            }
            PackedColumn::Scalars(values) => ColumnValues::Scalars(values.clone()),
        })
    }
}

/// One column's storage in the dock: a slot per row. Whether a slot holds data is tracked by
/// the readiness bitmap, not here; an unready slot holds an empty row or 0.
#[derive(Clone, Debug)]
pub(crate) enum ColumnStorage {
    TokenIds(Vec<Vec<i64>>),
    Floats(Vec<Vec<f32>>),
    Scalars(Vec<f32>),
}

impl ColumnStorage {
    pub(crate) fn new(kind: ColumnKind, rows: usize) -> Self {
        match kind {
            ColumnKind::TokenIds => ColumnStorage::TokenIds(vec![Vec::new(); rows]),
            ColumnKind::Floats => ColumnStorage::Floats(vec![Vec::new(); rows]),
            ColumnKind::Scalars => ColumnStorage::Scalars(vec![0.0; rows]),
        }
    }

    /// Moves `values` into the slots of `rows`. The caller has checked that the kinds match,
    /// that there is one value per row and that every row is in range; a mismatch writes
    /// nothing for the extra items.
    pub(crate) fn write(&mut self, rows: &[usize], values: ColumnValues) {
        match (self, values) {
            (ColumnStorage::TokenIds(slots), ColumnValues::TokenIds(values)) => {
                write_slots(slots, rows, values)
            }
            (ColumnStorage::Floats(slots), ColumnValues::Floats(values)) => {
                write_slots(slots, rows, values)
            }
            (ColumnStorage::Scalars(slots), ColumnValues::Scalars(values)) => {
                write_slots(slots, rows, values)
            }
            _ => {}
        }
    }

    /// Copies out the values of `rows`, in order. Rows out of range (which validated callers
    /// never pass) read as empty.
    pub(crate) fn read(&self, rows: &[usize]) -> ColumnValues {
        match self {
            ColumnStorage::TokenIds(slots) => ColumnValues::TokenIds(read_slots(slots, rows)),
            ColumnStorage::Floats(slots) => ColumnValues::Floats(read_slots(slots, rows)),
            ColumnStorage::Scalars(slots) => ColumnValues::Scalars(read_slots(slots, rows)),
        }
    }

    /// Copies out the values of `rows` straight into the packed wire form (one copy, no
    /// per-row buffers). Rows out of range read as empty, as in [`Self::read`].
    pub(crate) fn read_packed(&self, rows: &[usize]) -> PackedColumn {
        match self {
            ColumnStorage::TokenIds(slots) => PackedColumn::TokenIds(pack_slots(slots, rows)),
            ColumnStorage::Floats(slots) => PackedColumn::Floats(pack_slots(slots, rows)),
            ColumnStorage::Scalars(slots) => PackedColumn::Scalars(read_slots(slots, rows)),
        }
    }

    /// Splits a packed payload into the slots of `rows`. The caller has checked the kind, the
    /// row count and the lengths ([`PackedColumn::check`]); a mismatch writes nothing extra.
    pub(crate) fn write_packed(&mut self, rows: &[usize], values: &PackedColumn) {
        match (self, values) {
            (ColumnStorage::TokenIds(slots), PackedColumn::TokenIds(packed)) => {
                unpack_into_slots(slots, rows, packed)
            }
            (ColumnStorage::Floats(slots), PackedColumn::Floats(packed)) => {
                unpack_into_slots(slots, rows, packed)
            }
            (ColumnStorage::Scalars(slots), PackedColumn::Scalars(values)) => {
                write_slots(slots, rows, values.clone())
            }
            _ => {}
        }
    }

    /// Drops the data of `rows`, returning their memory.
    pub(crate) fn clear_rows(&mut self, rows: &[usize]) {
        match self {
            ColumnStorage::TokenIds(slots) => clear_slots(slots, rows),
            ColumnStorage::Floats(slots) => clear_slots(slots, rows),
            ColumnStorage::Scalars(slots) => clear_slots(slots, rows),
        }
    }

    /// Drops the data of every row.
    pub(crate) fn clear_all(&mut self) {
        match self {
            ColumnStorage::TokenIds(slots) => slots.iter_mut().for_each(|s| *s = Vec::new()),
            ColumnStorage::Floats(slots) => slots.iter_mut().for_each(|s| *s = Vec::new()),
            ColumnStorage::Scalars(slots) => slots.fill(0.0),
        }
    }
}

fn write_slots<T>(slots: &mut [T], rows: &[usize], values: Vec<T>) {
    for (row, value) in rows.iter().zip(values) {
        if let Some(slot) = slots.get_mut(*row) {
            *slot = value;
        }
    }
}

fn read_slots<T: Clone + Default>(slots: &[T], rows: &[usize]) -> Vec<T> {
    rows.iter().map(|row| slots.get(*row).cloned().unwrap_or_default()).collect()
}

fn pack_slots<T: Copy>(slots: &[Vec<T>], rows: &[usize]) -> PackedRows<T> {
    let row = |row: &usize| slots.get(*row).map_or(&[][..], Vec::as_slice);
    let total = rows.iter().map(|r| row(r).len()).sum();
    let mut flat = Vec::with_capacity(total);
    let mut lengths = Vec::with_capacity(rows.len());
    for r in rows {
        flat.extend_from_slice(row(r));
        lengths.push(row(r).len());
    }
    PackedRows { flat, lengths }
}

fn unpack_into_slots<T: Copy>(slots: &mut [Vec<T>], rows: &[usize], packed: &PackedRows<T>) {
    let mut rest = packed.flat.as_slice();
    for (row, length) in rows.iter().zip(&packed.lengths) {
        // A checked payload's lengths sum to `flat.len()`; an unchecked one stops here
        // instead of panicking.
        let Some((value, tail)) = rest.split_at_checked(*length) else { return };
        if let Some(slot) = slots.get_mut(*row) {
            slot.clear();
            slot.extend_from_slice(value);
        }
        rest = tail;
    }
}

fn clear_slots<T: Default>(slots: &mut [T], rows: &[usize]) {
    for row in rows {
        if let Some(slot) = slots.get_mut(*row) {
            *slot = T::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_round_trip() {
        let mut storage = ColumnStorage::new(ColumnKind::TokenIds, 4);
        storage.write(&[2, 0], ColumnValues::TokenIds(vec![vec![5, 6], vec![7]]));
        assert_eq!(
            storage.read(&[0, 2, 1]),
            ColumnValues::TokenIds(vec![vec![7], vec![5, 6], vec![]])
        );
        storage.clear_rows(&[2]);
        assert_eq!(storage.read(&[2]), ColumnValues::TokenIds(vec![vec![]]));
        storage.clear_all();
        assert_eq!(storage.read(&[0]), ColumnValues::TokenIds(vec![vec![]]));
    }

    #[test]
    fn scalars_and_kinds() {
        let mut storage = ColumnStorage::new(ColumnKind::Scalars, 2);
        storage.write(&[1], ColumnValues::Scalars(vec![0.5]));
        // A kind mismatch writes nothing (the dock rejects it before getting here).
        storage.write(&[0], ColumnValues::Floats(vec![vec![1.0]]));
        assert_eq!(storage.read(&[0, 1]), ColumnValues::Scalars(vec![0.0, 0.5]));
        assert_eq!(ColumnValues::Scalars(vec![1.0]).kind(), ColumnKind::Scalars);
        assert_eq!(ColumnKind::Floats.to_string(), "float rows");
    }

    #[test]
    fn packed_storage_round_trip() {
        let mut storage = ColumnStorage::new(ColumnKind::Floats, 4);
        let packed = ColumnValues::Floats(vec![vec![1.0, 2.0], vec![], vec![3.0]]).pack();
        packed.check().unwrap();
        assert_eq!((packed.len(), packed.kind()), (3, ColumnKind::Floats));
        storage.write_packed(&[3, 1, 0], &packed);
        assert_eq!(storage.read_packed(&[3, 1, 0]), packed);
        assert_eq!(
            storage.read(&[0, 1, 2, 3]),
            ColumnValues::Floats(vec![vec![3.0], vec![], vec![], vec![1.0, 2.0]])
        );
        // Lengths that overrun the buffer write only the rows that fit.
        let bad = PackedColumn::Floats(PackedRows { flat: vec![9.0], lengths: vec![1, 5] });
        assert!(bad.check().is_err());
        storage.write_packed(&[2, 3], &bad);
        assert_eq!(storage.read(&[2, 3]), ColumnValues::Floats(vec![vec![9.0], vec![1.0, 2.0]]));
    }

    #[test]
    fn pack_unpack_column() {
        let values = ColumnValues::Floats(vec![vec![1.0, 2.0], vec![], vec![3.0]]);
        assert_eq!(values.elements(), 3);
        let packed = values.pack();
        assert_eq!(packed.unpack().unwrap(), values);
        let scalars = ColumnValues::Scalars(vec![1.0, 2.0]);
        assert_eq!(scalars.pack().unpack().unwrap(), scalars);
    }
}
