//! A fixed-length bitmap over dock rows: one bit per row, 64 rows per word.
//!
//! Readiness (per column) and consumption (per consumer) are both row bitmaps. Words let the
//! sampler combine all requested columns and the consumer's ledger with a few word-wise ANDs
//! instead of touching every (column, row) cell.

use std::ops::Range;

const WORD_BITS: usize = 64;

/// One bit per row. Bits past `len` in the last word are always zero.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowBitmap {
    words: Vec<u64>,
    len: usize,
}

impl RowBitmap {
    /// An all-zero bitmap over `len` rows.
    pub fn new(len: usize) -> Self {
        Self { words: vec![0; len.div_ceil(WORD_BITS)], len }
    }

    /// Builds a bitmap from raw words, clearing any bits past `len` so the invariant holds.
    /// Missing words are zero and extra words are dropped.
    pub fn from_words(mut words: Vec<u64>, len: usize) -> Self {
        words.resize(len.div_ceil(WORD_BITS), 0);
        let mut bitmap = Self { words, len };
        bitmap.clear_tail();
        bitmap
    }

    /// The number of rows this bitmap covers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the bitmap covers no rows at all.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backing words, least significant bit first.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Whether `row` is set; rows past the end read as unset.
    pub fn get(&self, row: usize) -> bool {
        row < self.len
            && self
                .words
                .get(row / WORD_BITS)
                .is_some_and(|word| word & (1 << (row % WORD_BITS)) != 0)
    }

    /// Sets `row`; rows past the end are ignored (callers validate row indices first).
    pub fn set(&mut self, row: usize) {
        if row < self.len
            && let Some(word) = self.words.get_mut(row / WORD_BITS)
        {
            *word |= 1 << (row % WORD_BITS);
        }
    }

    /// Clears `row`; rows past the end are ignored.
    pub fn unset(&mut self, row: usize) {
        if let Some(word) = self.words.get_mut(row / WORD_BITS) {
            *word &= !(1 << (row % WORD_BITS));
        }
    }

    /// Clears every row.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// The number of set rows.
    pub fn count_ones(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether every row is set (true for an empty bitmap).
    pub fn all_set(&self) -> bool {
        self.count_ones() == self.len
    }

    /// Whether every row in `range` is set. An empty range is trivially set; a range reaching
    /// past the end is not.
    pub fn all_set_in(&self, range: Range<usize>) -> bool {
        if range.start >= range.end {
            return true;
        }
        if range.end > self.len {
            return false;
        }
        let first = range.start / WORD_BITS;
        let last = (range.end - 1) / WORD_BITS;
        (first..=last).all(|index| {
            let low = if index == first { range.start % WORD_BITS } else { 0 };
            let high = if index == last { (range.end - 1) % WORD_BITS } else { WORD_BITS - 1 };
            let mask = (u64::MAX >> (WORD_BITS - 1 - high)) & (u64::MAX << low);
            self.words.get(index).is_some_and(|word| word & mask == mask)
        })
    }

    /// `self &= other`, word by word. Both bitmaps must cover the same rows; extra words on
    /// either side are treated as zero.
    pub fn and_assign(&mut self, other: &RowBitmap) {
        for (index, word) in self.words.iter_mut().enumerate() {
            *word &= other.words.get(index).copied().unwrap_or(0);
        }
    }

    /// `self &= !other`, word by word (rows set in `other` are removed).
    pub fn and_not_assign(&mut self, other: &RowBitmap) {
        for (word, other) in self.words.iter_mut().zip(&other.words) {
            *word &= !other;
        }
    }

    fn clear_tail(&mut self) {
        let used = self.len % WORD_BITS;
        if used != 0
            && let Some(last) = self.words.last_mut()
        {
            *last &= (1 << used) - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn set_get_unset() {
        let mut bitmap = RowBitmap::new(130);
        assert_eq!(bitmap.words().len(), 3);
        bitmap.set(0);
        bitmap.set(64);
        bitmap.set(129);
        bitmap.set(130); // past the end: ignored
        assert!(bitmap.get(0) && bitmap.get(64) && bitmap.get(129));
        assert!(!bitmap.get(130) && !bitmap.get(1));
        assert_eq!(bitmap.count_ones(), 3);
        bitmap.unset(64);
        assert!(!bitmap.get(64));
        bitmap.clear();
        assert_eq!(bitmap.count_ones(), 0);
    }

    #[test]
    fn from_words_clears_tail() {
        let bitmap = RowBitmap::from_words(vec![u64::MAX, u64::MAX], 70);
        assert_eq!(bitmap.count_ones(), 70);
        assert!(bitmap.all_set());
    }

    #[test]
    fn all_set_in_edges() {
        let mut bitmap = RowBitmap::new(10);
        assert!(bitmap.all_set_in(3..3));
        assert!(!bitmap.all_set_in(8..11));
        for row in 2..6 {
            bitmap.set(row);
        }
        assert!(bitmap.all_set_in(2..6));
        assert!(!bitmap.all_set_in(1..6));
        assert!(!bitmap.all_set_in(2..7));
    }

    proptest! {
        #[test]
        fn all_set_in_matches_per_row(
            len in 0usize..300,
            set in proptest::collection::vec(any::<bool>(), 300),
            start in 0usize..310,
            span in 0usize..200,
        ) {
            let mut bitmap = RowBitmap::new(len);
            for (row, on) in set.iter().enumerate().take(len) {
                if *on {
                    bitmap.set(row);
                }
            }
            let end = start + span;
            let expected = if start >= end {
                true
            } else {
                end <= len && (start..end).all(|row| bitmap.get(row))
            };
            prop_assert_eq!(bitmap.all_set_in(start..end), expected);
        }

        #[test]
        fn and_not_matches_per_row(
            a in proptest::collection::vec(any::<bool>(), 0..200),
            b in proptest::collection::vec(any::<bool>(), 200),
        ) {
            let len = a.len();
            let mut left = RowBitmap::new(len);
            let mut right = RowBitmap::new(len);
            for row in 0..len {
                if a[row] { left.set(row); }
                if b[row] { right.set(row); }
            }
            let mut both = left.clone();
            both.and_assign(&right);
            let mut only = left.clone();
            only.and_not_assign(&right);
            for row in 0..len {
                prop_assert_eq!(both.get(row), a[row] && b[row]);
                prop_assert_eq!(only.get(row), a[row] && !b[row]);
            }
        }
    }
}
