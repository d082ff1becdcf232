//! Padding and packing of variable-length rows.
//!
//! Two forms travel between the dock and the workers. *Packed* rows are one flat buffer plus
//! the length of each row: the cheapest form to transfer (no padding bytes). *Padded* rows are a
//! dense `batch × width` row-major buffer plus a mask, the form a model consumes; `width` is the
//! longest row rounded up to a multiple (the tensor- or context-parallel size) so that the
//! sequence dimension splits evenly.

use serde::{Deserialize, Serialize};

/// An error from unpacking or padding rows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum PackError {
    /// Padding to a multiple of zero.
    #[error("expected a positive padding multiple, found 0")]
    ZeroMultiple,
    /// Lengths that do not add up to the flat buffer.
    #[error("row lengths add up to {expected} elements, the flat buffer has {found}")]
    LengthMismatch {
        /// The sum of the lengths (saturated on overflow).
        expected: usize,
        /// The flat buffer's length.
        found: usize,
    },
    /// A padded shape whose element count overflows `usize`.
    #[error("padded shape {batch} × {width} overflows the address space")]
    ShapeOverflow {
        /// Rows in the batch.
        batch: usize,
        /// Padded row width.
        width: usize,
    },
}

/// Variable-length rows packed into one flat buffer, with each row's length.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PackedRows<T> {
    /// The rows' elements, back to back.
    pub flat: Vec<T>,
    /// The length of each row, in order.
    pub lengths: Vec<usize>,
}

impl<T: Copy> PackedRows<T> {
    /// Checks that the lengths add up to exactly the flat buffer.
    pub fn check(&self) -> Result<(), PackError> {
        check_lengths(self.flat.len(), &self.lengths)
    }

    /// Restores the rows; see [`unpack`].
    pub fn unpack(&self) -> Result<Vec<Vec<T>>, PackError> {
        unpack(&self.flat, &self.lengths)
    }

    /// Pads the packed rows straight into a dense batch; see [`pad_packed`].
    pub fn pad(&self, pad_value: T, multiple_of: usize) -> Result<PaddedBatch<T>, PackError> {
        pad_packed(self, pad_value, multiple_of)
    }
}

/// Rows padded into a dense row-major `batch × width` buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PaddedBatch<T> {
    /// `batch × width` elements, row-major; row `i` is `values[i * width..(i + 1) * width]`.
    pub values: Vec<T>,
    /// Number of rows.
    pub batch: usize,
    /// Padded row width: the longest row rounded up to the requested multiple.
    pub width: usize,
    /// The real length of each row.
    pub lengths: Vec<usize>,
    /// `batch × width` flags, row-major: 1 where `values` holds a real element, 0 on padding
    /// (an attention mask).
    pub mask: Vec<u8>,
}

impl<T: Copy> PaddedBatch<T> {
    /// Row `index` without its padding, if it exists.
    pub fn row(&self, index: usize) -> Option<&[T]> {
        let length = *self.lengths.get(index)?;
        let start = index.checked_mul(self.width)?;
        self.values.get(start..start.checked_add(length)?)
    }

    /// The rows without padding (the inverse of [`pad_batch`]).
    pub fn unpad(&self) -> Vec<Vec<T>> {
        (0..self.batch)
            .map(|index| self.row(index).map(<[T]>::to_vec).unwrap_or_default())
            .collect()
    }
}

/// Concatenates `rows` into one flat buffer and records their lengths.
pub fn pack<T: Copy>(rows: &[Vec<T>]) -> PackedRows<T> {
    let total = rows.iter().map(Vec::len).sum();
    let mut flat = Vec::with_capacity(total);
    for row in rows {
        flat.extend_from_slice(row);
    }
    PackedRows { flat, lengths: rows.iter().map(Vec::len).collect() }
}

/// Splits `flat` back into rows of `lengths`; the lengths must add up to exactly `flat.len()`.
pub fn unpack<T: Copy>(flat: &[T], lengths: &[usize]) -> Result<Vec<Vec<T>>, PackError> {
    check_lengths(flat.len(), lengths)?;
    let mut rows = Vec::with_capacity(lengths.len());
    let mut rest = flat;
    for length in lengths {
        // `check_lengths` proved the lengths sum to `flat.len()`, so each split is in bounds.
        let (row, tail) = rest.split_at(*length);
        rows.push(row.to_vec());
        rest = tail;
    }
    Ok(rows)
}

/// Pads `rows` with `pad_value` to a common width, the longest row rounded up to a multiple of
/// `multiple_of` (1 for no rounding).
pub fn pad_batch<T: Copy>(
    rows: &[Vec<T>],
    pad_value: T,
    multiple_of: usize,
) -> Result<PaddedBatch<T>, PackError> {
    let lengths: Vec<usize> = rows.iter().map(Vec::len).collect();
    pad_rows(rows.iter().map(Vec::as_slice), lengths, pad_value, multiple_of)
}

/// Pads packed rows into a dense batch without materialising the rows first (unpack + pad in
/// one pass, what a worker does after receiving a packed batch).
pub fn pad_packed<T: Copy>(
    packed: &PackedRows<T>,
    pad_value: T,
    multiple_of: usize,
) -> Result<PaddedBatch<T>, PackError> {
    check_lengths(packed.flat.len(), &packed.lengths)?;
    let mut offset = 0;
    let slices = packed.lengths.iter().map(|length| {
        // In bounds: the lengths sum to `flat.len()` (checked above).
        let slice = &packed.flat[offset..offset + length];
        offset += length;
        slice
    });
    pad_rows(slices, packed.lengths.clone(), pad_value, multiple_of)
}

fn pad_rows<'a, T: Copy + 'a>(
    rows: impl Iterator<Item = &'a [T]>,
    lengths: Vec<usize>,
    pad_value: T,
    multiple_of: usize,
) -> Result<PaddedBatch<T>, PackError> {
    if multiple_of == 0 {
        return Err(PackError::ZeroMultiple);
    }
    let batch = lengths.len();
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let width = longest
        .div_ceil(multiple_of)
        .checked_mul(multiple_of)
        .ok_or(PackError::ShapeOverflow { batch, width: longest })?;
    let elements = batch.checked_mul(width).ok_or(PackError::ShapeOverflow { batch, width })?;
    let mut values = Vec::with_capacity(elements);
    let mut mask = Vec::with_capacity(elements);
    for row in rows {
        values.extend_from_slice(row);
        values.resize(values.len() + (width - row.len()), pad_value);
        mask.resize(mask.len() + row.len(), 1);
        mask.resize(mask.len() + (width - row.len()), 0);
    }
    Ok(PaddedBatch { values, batch, width, lengths, mask })
}

fn check_lengths(flat: usize, lengths: &[usize]) -> Result<(), PackError> {
    let total = lengths.iter().try_fold(0usize, |sum, length| sum.checked_add(*length));
    match total {
        Some(total) if total == flat => Ok(()),
        Some(total) => Err(PackError::LengthMismatch { expected: total, found: flat }),
        None => Err(PackError::LengthMismatch { expected: usize::MAX, found: flat }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pad_to_multiple() {
        let rows = vec![vec![1, 1, 1], vec![2, 2, 2, 2], vec![3]];
        let padded = pad_batch(&rows, -1, 2).unwrap();
        assert_eq!((padded.batch, padded.width), (3, 4));
        assert_eq!(padded.values, vec![1, 1, 1, -1, 2, 2, 2, 2, 3, -1, -1, -1]);
        assert_eq!(padded.mask, vec![1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]);
        let padded = pad_batch(&rows, 0, 3).unwrap();
        assert_eq!(padded.width, 6);
        assert_eq!(padded.unpad(), rows);
    }

    #[test]
    fn pad_edge_cases() {
        assert_eq!(pad_batch::<i64>(&[], 0, 1).unwrap().width, 0);
        assert_eq!(pad_batch(&[vec![1]], 0, 0), Err(PackError::ZeroMultiple));
        let empty_rows = pad_batch::<i64>(&[vec![], vec![]], 0, 4).unwrap();
        assert_eq!((empty_rows.batch, empty_rows.width), (2, 0));
        assert_eq!(empty_rows.unpad(), vec![Vec::<i64>::new(), vec![]]);
    }

    #[test]
    fn unpack_rejects_inconsistent_lengths() {
        assert_eq!(
            unpack(&[1, 2, 3], &[1, 1]),
            Err(PackError::LengthMismatch { expected: 2, found: 3 })
        );
        assert!(unpack(&[1, 2, 3], &[usize::MAX, 4]).is_err());
        let packed = PackedRows { flat: vec![1.0f32], lengths: vec![2] };
        assert!(packed.pad(0.0, 1).is_err());
    }

    fn rows_strategy() -> impl Strategy<Value = Vec<Vec<i64>>> {
        proptest::collection::vec(proptest::collection::vec(any::<i64>(), 0..40), 0..20)
    }

    proptest! {
        #[test]
        fn pack_unpack_round_trip(rows in rows_strategy()) {
            let packed = pack(&rows);
            prop_assert_eq!(packed.flat.len(), rows.iter().map(Vec::len).sum::<usize>());
            prop_assert_eq!(packed.unpack().unwrap(), rows);
        }

        #[test]
        fn pad_unpad_round_trip(rows in rows_strategy(), multiple in 1usize..9) {
            let padded = pad_batch(&rows, i64::MIN, multiple).unwrap();
            prop_assert_eq!(padded.width % multiple, 0);
            prop_assert!(padded.width >= rows.iter().map(Vec::len).max().unwrap_or(0));
            prop_assert!(padded.width < rows.iter().map(Vec::len).max().unwrap_or(0) + multiple);
            prop_assert_eq!(padded.values.len(), padded.batch * padded.width);
            prop_assert_eq!(
                padded.mask.iter().map(|m| usize::from(*m)).sum::<usize>(),
                rows.iter().map(Vec::len).sum::<usize>()
            );
            prop_assert_eq!(padded.unpad(), rows);
        }

        #[test]
        fn pad_packed_equals_pad(rows in rows_strategy(), multiple in 1usize..9) {
            let direct = pad_batch(&rows, 0, multiple).unwrap();
            let via_packed = pack(&rows).pad(0, multiple).unwrap();
            prop_assert_eq!(direct, via_packed);
        }

        #[test]
        fn unpack_never_panics(
            flat in proptest::collection::vec(any::<i64>(), 0..50),
            lengths in proptest::collection::vec(any::<usize>(), 0..10),
        ) {
            let _ = unpack(&flat, &lengths);
            let _ = pad_packed(&PackedRows { flat, lengths }, 0, 3);
        }
    }
}
