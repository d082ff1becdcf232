//! The store core: the object table as a pure state machine (no I/O, no memory access).
//!
//! Every operation either changes the table or returns a decision for the executor
//! ([`crate::ObjectStore`]) to carry out: which objects to spill or evict before an allocation
//! fits, that a spilled object must be restored before it can be pinned, which spill files to
//! delete once objects are freed. The executor reports back (`spilled`, `restored`, ...), so the
//! core always knows where every object's bytes are.
//!
//! Lifetime rules: the creator (owner) holds the first reference; every process that receives a
//! reference adds one count under its own [`HolderId`] and removes it when it drops the
//! reference. Counts are signed: a receiver's removal may reach the store before the sender's
//! addition on its behalf (they travel on different connections), which leaves that holder at
//! −1 until the addition arrives. The object is freed when every holder's count is back to zero
//! (no entry left), but its memory is only reused once the last reader has unpinned it. A
//! crashed process's counts and pins are dropped by [`StoreCore::release_process`]; an object
//! its owner never sealed is aborted then.

mod stats;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::alloc::{Allocation, Allocator, reserved_len};
use crate::error::{Result, StoreError};
use crate::id::ObjectId;

pub use stats::{ObjectState, ObjectStats, OwnerStats, SpillCounters, StoreStats};

/// A process (worker, driver or node) that holds references to or pins on objects.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct HolderId(pub u64);

impl fmt::Display for HolderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

impl fmt::Debug for HolderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HolderId({self})")
    }
}

/// Whether this node's copy is the object's only copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CopyKind {
    /// The primary copy, created on this node: spilled to disk under memory pressure.
    Primary,
    /// A copy pulled from another node: evicted under memory pressure (it can be pulled again).
    Secondary,
}

/// Where a new object (or a restored one) goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// The space is reserved at this allocation.
    Allocated(Allocation),
    /// Spill or evict these objects (in this order), report each with
    /// [`StoreCore::spilled`] / [`StoreCore::evicted`], then ask again.
    MakeRoom(Vec<Victim>),
}

/// An object chosen to leave memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Victim {
    /// The object.
    pub id: ObjectId,
    /// Where its bytes are now.
    pub allocation: Allocation,
    /// What to do with it.
    pub action: VictimAction,
}

/// How a victim leaves memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VictimAction {
    /// Write its bytes to a spill file first.
    Spill,
    /// Drop it: it is a secondary copy.
    Evict,
}

/// The answer to a pin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinOutcome {
    /// Pinned: the bytes are at this allocation until the matching unpin.
    Pinned(Allocation),
    /// The object is spilled: call [`StoreCore::restore`] and pin again.
    RestoreFirst,
}

/// An object that left the table for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freed {
    /// The object.
    pub id: ObjectId,
    /// It was spilled: its spill file must be deleted.
    pub had_spill_file: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Residency {
    InMemory(Allocation),
    Restoring(Allocation),
    Spilled,
}

#[derive(Debug, Clone)]
struct Entry {
    size: u64,
    sealed: bool,
    residency: Residency,
    copy: CopyKind,
    owner: HolderId,
    /// Reference counts per holder; never zero (a zero entry is removed), negative while a
    /// removal has overtaken the matching addition.
    holders: BTreeMap<HolderId, i64>,
    pins: BTreeMap<HolderId, u32>,
    /// Position in the LRU order; set exactly while sealed and in memory.
    lru_tick: Option<u64>,
    /// The last holder is gone; the entry stays only until the last unpin.
    freed: bool,
}

impl Entry {
    fn state(&self) -> ObjectState {
        match (self.sealed, self.residency) {
            (false, _) => ObjectState::Created,
            (true, Residency::InMemory(_)) => ObjectState::Sealed,
            (true, Residency::Restoring(_)) => ObjectState::Restoring,
            (true, Residency::Spilled) => ObjectState::Spilled,
        }
    }
}

/// The object table, the allocator and the LRU order of one node's store.
#[derive(Debug, Clone)]
pub struct StoreCore {
    allocator: Allocator,
    objects: HashMap<ObjectId, Entry>,
    /// Sealed, in-memory objects by last use (oldest first).
    lru: BTreeMap<u64, ObjectId>,
    clock: u64,
    bytes_spilled: u64,
    /// Since the store started: spills and restores, and their bytes.
    transfers: SpillCounters,
}

impl StoreCore {
    /// An empty store of `capacity` bytes.
    pub fn new(capacity: u64) -> StoreCore {
        StoreCore {
            allocator: Allocator::new(capacity),
            objects: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            bytes_spilled: 0,
            transfers: SpillCounters::default(),
        }
    }

    /// Usable capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.allocator.capacity()
    }

    /// Whether a live (not freed) object with this id exists, in memory or spilled.
    pub fn contains(&self, id: ObjectId) -> bool {
        self.objects.get(&id).is_some_and(|entry| !entry.freed)
    }

    /// Reserves space for a new object of `size` bytes owned by `owner`, or says what to spill.
    pub fn create(
        &mut self,
        id: ObjectId,
        size: u64,
        owner: HolderId,
        copy: CopyKind,
    ) -> Result<Placement> {
        if self.objects.contains_key(&id) {
            return Err(StoreError::ObjectExists(id));
        }
        let placement = self.place(size)?;
        if let Placement::Allocated(allocation) = placement {
            self.objects.insert(
                id,
                Entry {
                    size,
                    sealed: false,
                    residency: Residency::InMemory(allocation),
                    copy,
                    owner,
                    holders: BTreeMap::from([(owner, 1)]),
                    pins: BTreeMap::new(),
                    lru_tick: None,
                    freed: false,
                },
            );
        }
        Ok(placement)
    }

    /// Makes a created object immutable and readable.
    pub fn seal(&mut self, id: ObjectId) -> Result<()> {
        let entry = self.live_entry_mut(id)?;
        if entry.sealed {
            return Err(StoreError::NotCreating { id, found: entry.state().as_str() });
        }
        entry.sealed = true;
        self.touch(id);
        Ok(())
    }

    /// Pins a sealed object for `reader`; its memory is not reused until the matching unpin.
    pub fn pin(&mut self, id: ObjectId, reader: HolderId) -> Result<PinOutcome> {
        let entry = self.live_entry_mut(id)?;
        if !entry.sealed {
            return Err(StoreError::NotSealed { id, found: entry.state().as_str() });
        }
        match entry.residency {
            Residency::InMemory(allocation) => {
                *entry.pins.entry(reader).or_insert(0) += 1;
                self.touch(id);
                Ok(PinOutcome::Pinned(allocation))
            }
            Residency::Restoring(_) | Residency::Spilled => Ok(PinOutcome::RestoreFirst),
        }
    }

    /// Releases one pin of `reader`; frees the object if it was waiting for its last reader.
    pub fn unpin(&mut self, id: ObjectId, reader: HolderId) -> Result<Option<Freed>> {
        let entry = self.objects.get_mut(&id).ok_or(StoreError::ObjectNotFound(id))?;
        let count =
            entry.pins.get_mut(&reader).ok_or(StoreError::NotPinned { id, holder: reader })?;
        *count -= 1;
        if *count == 0 {
            entry.pins.remove(&reader);
        }
        Ok(self.finalize_if_done(id))
    }

    /// Adds one reference count for `holder` (a borrower, or one more reference of a holder).
    pub fn add_holder(&mut self, id: ObjectId, holder: HolderId) -> Result<Option<Freed>> {
        self.change_count(id, holder, 1)
    }

    /// Drops one of `holder`'s reference counts; the object is freed when no count is left.
    pub fn remove_holder(&mut self, id: ObjectId, holder: HolderId) -> Result<Option<Freed>> {
        self.change_count(id, holder, -1)
    }

    /// Every holder's reference count on a live object (`None` when it is missing or freed).
    pub fn holder_counts(&self, id: ObjectId) -> Option<BTreeMap<HolderId, i64>> {
        self.objects.get(&id).filter(|entry| !entry.freed).map(|entry| entry.holders.clone())
    }

    fn change_count(
        &mut self,
        id: ObjectId,
        holder: HolderId,
        delta: i64,
    ) -> Result<Option<Freed>> {
        let entry = self.live_entry_mut(id)?;
        let count = entry.holders.entry(holder).or_insert(0);
        *count += delta;
        if *count == 0 {
            entry.holders.remove(&holder);
        }
        if entry.holders.is_empty() {
            entry.freed = true;
        }
        Ok(self.finalize_if_done(id))
    }

    /// Frees the object now, whoever holds it (its memory waits for the last unpin).
    pub fn free(&mut self, id: ObjectId) -> Result<Option<Freed>> {
        let entry = self.live_entry_mut(id)?;
        entry.holders.clear();
        entry.freed = true;
        Ok(self.finalize_if_done(id))
    }

    /// Drops every hold and pin of a process that is gone, and aborts the objects it created but
    /// never sealed. Returns what was freed.
    pub fn release_process(&mut self, holder: HolderId) -> Vec<Freed> {
        let mut touched = Vec::new();
        for (&id, entry) in &mut self.objects {
            let held = entry.holders.remove(&holder).is_some();
            let pinned = entry.pins.remove(&holder).is_some();
            let abandoned = !entry.sealed && entry.owner == holder;
            if abandoned {
                entry.holders.clear();
            }
            if held || pinned || abandoned {
                if entry.holders.is_empty() {
                    entry.freed = true;
                }
                touched.push(id);
            }
        }
        touched.sort();
        touched.into_iter().filter_map(|id| self.finalize_if_done(id)).collect()
    }

    /// The executor wrote a victim's bytes to its spill file: release its memory.
    pub fn spilled(&mut self, id: ObjectId) -> Result<()> {
        let allocation = self.evictable(id)?;
        self.allocator.free(allocation)?;
        self.untouch(id);
        let entry = self.live_entry_mut(id)?;
        entry.residency = Residency::Spilled;
        let size = entry.size;
        self.bytes_spilled += size;
        self.transfers.spills += 1;
        self.transfers.spilled_bytes += size;
        Ok(())
    }

    /// The executor dropped a secondary copy: it leaves the table.
    pub fn evicted(&mut self, id: ObjectId) -> Result<()> {
        let allocation = self.evictable(id)?;
        self.allocator.free(allocation)?;
        self.untouch(id);
        self.objects.remove(&id);
        Ok(())
    }

    /// Reserves memory to bring a spilled object back, or says what to spill first. After
    /// `Allocated`, the executor copies the spill file in and calls [`StoreCore::restored`] (or
    /// [`StoreCore::restore_failed`]).
    pub fn restore(&mut self, id: ObjectId) -> Result<Placement> {
        let entry = self.live_entry_mut(id)?;
        if entry.residency != Residency::Spilled {
            return Err(StoreError::NotSealed { id, found: entry.state().as_str() });
        }
        let size = entry.size;
        let placement = self.place(size)?;
        if let Placement::Allocated(allocation) = placement {
            self.live_entry_mut(id)?.residency = Residency::Restoring(allocation);
        }
        Ok(placement)
    }

    /// The spill file's bytes are back in memory.
    pub fn restored(&mut self, id: ObjectId) -> Result<()> {
        let entry = self.live_entry_mut(id)?;
        let Residency::Restoring(allocation) = entry.residency else {
            return Err(StoreError::NotSealed { id, found: entry.state().as_str() });
        };
        entry.residency = Residency::InMemory(allocation);
        let size = entry.size;
        self.bytes_spilled -= size;
        self.transfers.restores += 1;
        self.transfers.restored_bytes += size;
        self.touch(id);
        Ok(())
    }

    /// Restoring failed: the memory is released and the object stays spilled.
    pub fn restore_failed(&mut self, id: ObjectId) -> Result<()> {
        let entry = self.live_entry_mut(id)?;
        let Residency::Restoring(allocation) = entry.residency else {
            return Err(StoreError::NotSealed { id, found: entry.state().as_str() });
        };
        entry.residency = Residency::Spilled;
        self.allocator.free(allocation)?;
        Ok(())
    }

    /// The object's current allocation, if it is in memory.
    pub fn allocation(&self, id: ObjectId) -> Option<Allocation> {
        match self.objects.get(&id)?.residency {
            Residency::InMemory(allocation) => Some(allocation),
            Residency::Restoring(_) | Residency::Spilled => None,
        }
    }

    /// A snapshot of the table for `rtrun memory`.
    pub fn stats(&self) -> StoreStats {
        stats::collect(self)
    }

    fn live_entry_mut(&mut self, id: ObjectId) -> Result<&mut Entry> {
        match self.objects.get_mut(&id) {
            None => Err(StoreError::ObjectNotFound(id)),
            Some(entry) if entry.freed => Err(StoreError::ObjectFreed(id)),
            Some(entry) => Ok(entry),
        }
    }

    /// The allocation of a sealed, unpinned, in-memory object (one that may leave memory).
    fn evictable(&mut self, id: ObjectId) -> Result<Allocation> {
        let entry = self.live_entry_mut(id)?;
        match entry.residency {
            Residency::InMemory(allocation) if entry.sealed && entry.pins.is_empty() => {
                Ok(allocation)
            }
            _ => Err(StoreError::NotSealed { id, found: entry.state().as_str() }),
        }
    }

    /// Allocates `size` bytes, or picks LRU victims whose departure makes it fit.
    fn place(&mut self, size: u64) -> Result<Placement> {
        let needed = reserved_len(size);
        let capacity = self.allocator.capacity();
        if needed > capacity {
            return Err(StoreError::TooLarge { size, capacity });
        }
        if let Some(allocation) = self.allocator.allocate(size) {
            return Ok(Placement::Allocated(allocation));
        }
        // Tentatively free unpinned objects in LRU order until the object fits, then undo: the
        // executor frees them for real once their bytes are safe.
        let mut victims = Vec::new();
        let mut fits = false;
        for id in self.lru.values() {
            // Every LRU id is in the table (`touch`/`untouch` keep them in step); skip if not.
            let Some(entry) = self.objects.get(id) else { continue };
            let Residency::InMemory(allocation) = entry.residency else { continue };
            if !entry.pins.is_empty() {
                continue;
            }
            self.allocator.free(allocation)?;
            let action = match entry.copy {
                CopyKind::Primary => VictimAction::Spill,
                CopyKind::Secondary => VictimAction::Evict,
            };
            victims.push(Victim { id: *id, allocation, action });
            if self.allocator.can_allocate(size) {
                fits = true;
                break;
            }
        }
        for victim in &victims {
            self.allocator.claim(victim.allocation)?;
        }
        if fits {
            return Ok(Placement::MakeRoom(victims));
        }
        let pinned = self
            .objects
            .values()
            .filter(|entry| !entry.sealed || !entry.pins.is_empty())
            .filter_map(|entry| match entry.residency {
                Residency::InMemory(allocation) | Residency::Restoring(allocation) => {
                    Some(allocation.reserved_len())
                }
                Residency::Spilled => None,
            })
            .sum();
        Err(StoreError::StoreFull { needed, capacity, pinned })
    }

    /// Moves a sealed in-memory object to the most-recently-used end.
    fn touch(&mut self, id: ObjectId) {
        self.untouch(id);
        self.clock += 1;
        let tick = self.clock;
        if let Some(entry) = self.objects.get_mut(&id)
            && entry.sealed
            && matches!(entry.residency, Residency::InMemory(_))
        {
            entry.lru_tick = Some(tick);
            self.lru.insert(tick, id);
        }
    }

    fn untouch(&mut self, id: ObjectId) {
        if let Some(tick) = self.objects.get_mut(&id).and_then(|entry| entry.lru_tick.take()) {
            self.lru.remove(&tick);
        }
    }

    /// Removes a freed object whose last reader is gone.
    fn finalize_if_done(&mut self, id: ObjectId) -> Option<Freed> {
        let entry = self.objects.get(&id)?;
        if !entry.freed || !entry.pins.is_empty() {
            return None;
        }
        self.untouch(id);
        let entry = self.objects.remove(&id)?;
        let had_spill_file = match entry.residency {
            Residency::InMemory(allocation) | Residency::Restoring(allocation) => {
                if let Err(error) = self.allocator.free(allocation) {
                    // Only a broken invariant of this module can get here; keep running with a
                    // leaked range rather than abort the node.
                    tracing::error!(object = %id, %error, "freeing an object's allocation failed");
                }
                matches!(entry.residency, Residency::Restoring(_))
            }
            Residency::Spilled => {
                self.bytes_spilled -= entry.size;
                true
            }
        };
        Some(Freed { id, had_spill_file })
    }
}
