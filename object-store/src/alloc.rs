//! The arena allocator: a pure core (no I/O, no memory access) that hands out 64-byte-aligned
//! offsets inside the arena.
//!
//! Best fit over free extents indexed by size, with immediate coalescing of neighbours on free.
//! Best fit with the lowest offset as tie-break keeps big objects at the start of the arena, so a
//! large object put repeatedly lands on the same, already-faulted pages.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Alignment of every allocation, in bytes: one cache line, and enough for any tensor dtype.
pub const ALIGNMENT: u64 = 64;

/// A placed object: where its bytes live in the arena. `size` is the object's own length; the
/// allocator reserves `size` rounded up to [`ALIGNMENT`] (at least one unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Allocation {
    /// Offset of the first byte within the arena, a multiple of [`ALIGNMENT`].
    pub offset: u64,
    /// The object's length in bytes.
    pub size: u64,
}

impl Allocation {
    /// The number of arena bytes this allocation reserves.
    pub fn reserved_len(&self) -> u64 {
        reserved_len(self.size)
    }

    /// One past the last reserved byte.
    pub fn reserved_end(&self) -> u64 {
        self.offset.saturating_add(self.reserved_len())
    }
}

/// Arena bytes reserved for an object of `size` bytes.
pub fn reserved_len(size: u64) -> u64 {
    size.max(1).div_ceil(ALIGNMENT).saturating_mul(ALIGNMENT)
}

/// Why the allocator refused to free or claim a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// The range is not an allocated range of this arena (double free, wrong offset, misaligned,
    /// out of bounds).
    #[error("range {offset}+{len} is not allocated in an arena of {capacity} bytes")]
    NotAllocated {
        /// First byte of the range.
        offset: u64,
        /// Reserved length of the range.
        len: u64,
        /// Arena capacity.
        capacity: u64,
    },
    /// The range is not entirely free, so it cannot be claimed.
    #[error("range {offset}+{len} is not free, expected a free range to claim")]
    NotFree {
        /// First byte of the range.
        offset: u64,
        /// Reserved length of the range.
        len: u64,
    },
}

/// Free-extent bookkeeping for an arena of fixed capacity.
#[derive(Debug, Clone)]
pub struct Allocator {
    capacity: u64,
    /// Free extents by offset → length; never adjacent (always coalesced), never empty.
    free_by_offset: BTreeMap<u64, u64>,
    /// The same extents as (length, offset), for best fit.
    free_by_size: BTreeSet<(u64, u64)>,
    free_bytes: u64,
}

impl Allocator {
    /// An allocator for `capacity` bytes, rounded down to [`ALIGNMENT`].
    pub fn new(capacity: u64) -> Allocator {
        let capacity = capacity / ALIGNMENT * ALIGNMENT;
        let mut allocator = Allocator {
            capacity,
            free_by_offset: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            free_bytes: 0,
        };
        if capacity > 0 {
            allocator.insert_free(0, capacity);
        }
        allocator
    }

    /// Usable capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes in free extents.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Bytes reserved by live allocations.
    pub fn used_bytes(&self) -> u64 {
        self.capacity - self.free_bytes
    }

    /// The largest free extent, the biggest object that fits right now.
    pub fn largest_free(&self) -> u64 {
        self.free_by_size.last().map_or(0, |&(len, _)| len)
    }

    /// The free extents in offset order.
    pub fn free_extents(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.free_by_offset.iter().map(|(&offset, &len)| (offset, len))
    }

    /// Whether an object of `size` bytes fits now.
    pub fn can_allocate(&self, size: u64) -> bool {
        self.largest_free() >= reserved_len(size)
    }

    /// Places an object of `size` bytes, or `None` when no free extent is large enough.
    pub fn allocate(&mut self, size: u64) -> Option<Allocation> {
        let len = reserved_len(size);
        let &(extent_len, offset) = self.free_by_size.range((len, 0)..).next()?;
        self.remove_free(offset, extent_len);
        if extent_len > len {
            self.insert_free(offset + len, extent_len - len);
        }
        Some(Allocation { offset, size })
    }

    /// Returns an allocation's range to the free extents, merging with its neighbours.
    pub fn free(&mut self, allocation: Allocation) -> Result<(), AllocError> {
        let offset = allocation.offset;
        let len = allocation.reserved_len();
        let end = allocation.reserved_end();
        let not_allocated = AllocError::NotAllocated { offset, len, capacity: self.capacity };
        if !offset.is_multiple_of(ALIGNMENT)
            || end > self.capacity
            || offset.checked_add(len).is_none()
        {
            return Err(not_allocated);
        }
        let before = self.free_by_offset.range(..=offset).next_back().map(|(&o, &l)| (o, l));
        if before.is_some_and(|(o, l)| o + l > offset) {
            return Err(not_allocated);
        }
        let after = self.free_by_offset.range(offset..).next().map(|(&o, &l)| (o, l));
        if after.is_some_and(|(o, _)| o < end) {
            return Err(not_allocated);
        }
        let mut start = offset;
        let mut merged_end = end;
        if let Some((o, l)) = before.filter(|(o, l)| o + l == offset) {
            self.remove_free(o, l);
            start = o;
        }
        if let Some((o, l)) = after.filter(|(o, _)| *o == end) {
            self.remove_free(o, l);
            merged_end = o + l;
        }
        self.insert_free(start, merged_end - start);
        Ok(())
    }

    /// Marks exactly the range of `allocation` as used again (undoing a tentative free).
    pub fn claim(&mut self, allocation: Allocation) -> Result<(), AllocError> {
        let offset = allocation.offset;
        let len = allocation.reserved_len();
        let end = allocation.reserved_end();
        let not_free = AllocError::NotFree { offset, len };
        let (extent_offset, extent_len) = self
            .free_by_offset
            .range(..=offset)
            .next_back()
            .map(|(&o, &l)| (o, l))
            .ok_or(not_free)?;
        if extent_offset + extent_len < end || !offset.is_multiple_of(ALIGNMENT) {
            return Err(not_free);
        }
        self.remove_free(extent_offset, extent_len);
        if offset > extent_offset {
            self.insert_free(extent_offset, offset - extent_offset);
        }
        if extent_offset + extent_len > end {
            self.insert_free(end, extent_offset + extent_len - end);
        }
        Ok(())
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.free_by_offset.insert(offset, len);
        self.free_by_size.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.free_by_offset.remove(&offset);
        self.free_by_size.remove(&(len, offset));
        self.free_bytes -= len;
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_freed_big_object_is_placed_at_the_same_offset_again() {
        let mut allocator = Allocator::new(1 << 30);
        let small = allocator.allocate(100).unwrap();
        let big = allocator.allocate(800 << 20).unwrap();
        allocator.free(big).unwrap();
        assert_eq!(allocator.allocate(800 << 20).unwrap().offset, big.offset);
        assert_eq!(small.offset, 0);
    }

    #[test]
    fn double_free_and_foreign_ranges_are_refused() {
        let mut allocator = Allocator::new(4096);
        let a = allocator.allocate(64).unwrap();
        allocator.free(a).unwrap();
        assert!(allocator.free(a).is_err());
        assert!(allocator.free(Allocation { offset: 8, size: 8 }).is_err());
        assert!(allocator.free(Allocation { offset: 4096, size: 8 }).is_err());
        assert!(allocator.free(Allocation { offset: u64::MAX - 63, size: 64 }).is_err());
    }

    #[test]
    fn claim_undoes_a_free() {
        let mut allocator = Allocator::new(4096);
        let a = allocator.allocate(100).unwrap();
        let b = allocator.allocate(100).unwrap();
        allocator.free(a).unwrap();
        allocator.claim(a).unwrap();
        assert!(allocator.claim(b).is_err());
        assert_eq!(allocator.used_bytes(), 256);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Allocate(u64),
        Free(usize),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec(
            prop_oneof![(0u64..5000).prop_map(Op::Allocate), any::<usize>().prop_map(Op::Free)],
            0..200,
        )
    }

    proptest! {
        #[test]
        fn live_allocations_never_overlap_and_freeing_all_restores_one_extent(ops in ops()) {
            let capacity = 64 * 1024;
            let mut allocator = Allocator::new(capacity);
            let mut live: Vec<Allocation> = Vec::new();
            for op in ops {
                match op {
                    Op::Allocate(size) => {
                        let fits = allocator.can_allocate(size);
                        match allocator.allocate(size) {
                            Some(allocation) => {
                                prop_assert!(fits);
                                prop_assert_eq!(allocation.offset % ALIGNMENT, 0);
                                prop_assert!(allocation.reserved_end() <= capacity);
                                for other in &live {
                                    prop_assert!(allocation.reserved_end() <= other.offset
                                        || other.reserved_end() <= allocation.offset);
                                }
                                live.push(allocation);
                            }
                            None => prop_assert!(!fits),
                        }
                    }
                    Op::Free(index) if !live.is_empty() => {
                        let allocation = live.swap_remove(index % live.len());
                        allocator.free(allocation).unwrap();
                    }
                    Op::Free(_) => {}
                }
                let reserved: u64 = live.iter().map(Allocation::reserved_len).sum();
                prop_assert_eq!(reserved, allocator.used_bytes());
                let extents: Vec<_> = allocator.free_extents().collect();
                for pair in extents.windows(2) {
                    prop_assert!(pair[0].0 + pair[0].1 < pair[1].0, "extents must be coalesced");
                }
            }
            for allocation in live {
                allocator.free(allocation).unwrap();
            }
            prop_assert_eq!(allocator.free_extents().collect::<Vec<_>>(), vec![(0, capacity)]);
        }
    }
}
