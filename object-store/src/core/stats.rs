//! A serializable snapshot of the store for `rtrun memory`: totals, per-owner counts and one
//! line per object.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{HolderId, Residency, StoreCore};
use crate::id::ObjectId;

/// Where an object is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ObjectState {
    /// Created, being written, not yet readable.
    Created,
    /// Sealed and in memory.
    Sealed,
    /// Sealed and on disk only.
    Spilled,
    /// Sealed, being copied back from disk.
    Restoring,
}

impl ObjectState {
    /// A lowercase name for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectState::Created => "being created",
            ObjectState::Sealed => "sealed",
            ObjectState::Spilled => "spilled",
            ObjectState::Restoring => "being restored",
        }
    }
}

/// One object's line in the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectStats {
    /// The object.
    pub id: ObjectId,
    /// Its size in bytes.
    pub size: u64,
    /// Where it is.
    pub state: ObjectState,
    /// The process that created it.
    pub owner: HolderId,
    /// How many processes hold a reference (owner included).
    pub holders: usize,
    /// Reference counts per holder (negative while a removal overtook its addition).
    pub counts: BTreeMap<HolderId, i64>,
    /// Pins per reader.
    pub pins: BTreeMap<HolderId, u32>,
    /// Freed, waiting for its last reader.
    pub freed: bool,
}

/// What one owner has in the store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerStats {
    /// Objects it created that are still alive.
    pub objects: u64,
    /// Their bytes (in memory or spilled).
    pub bytes: u64,
}

/// Cumulative spill traffic of a store (counters for metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpillCounters {
    /// Objects written to spill files.
    pub spills: u64,
    /// Their bytes.
    pub spilled_bytes: u64,
    /// Objects read back from spill files.
    pub restores: u64,
    /// Their bytes.
    pub restored_bytes: u64,
}

/// The whole store at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStats {
    /// Usable capacity.
    pub capacity: u64,
    /// Arena bytes reserved by allocations (object sizes rounded up to 64).
    pub used_bytes: u64,
    /// The largest object that fits without spilling.
    pub largest_free: u64,
    /// Objects in the table (freed ones still pinned included).
    pub objects: u64,
    /// Sum of the sizes of objects in memory.
    pub bytes_in_memory: u64,
    /// Objects on disk only.
    pub spilled_objects: u64,
    /// Sum of the sizes of objects on disk only.
    pub bytes_spilled: u64,
    /// Spills and restores since the store started.
    pub transfers: SpillCounters,
    /// Objects with at least one pin.
    pub pinned_objects: u64,
    /// Per owner.
    pub per_owner: BTreeMap<HolderId, OwnerStats>,
    /// One line per object, ordered by id.
    pub per_object: Vec<ObjectStats>,
}

/// The `rtrun memory` text: totals, then one line per owner and per object.
impl std::fmt::Display for StoreStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "capacity {} B, used {} B, largest free {} B; {} objects: {} B in memory, {} spilled ({} B), {} pinned",
            self.capacity,
            self.used_bytes,
            self.largest_free,
            self.objects,
            self.bytes_in_memory,
            self.spilled_objects,
            self.bytes_spilled,
            self.pinned_objects
        )?;
        for (owner, stats) in &self.per_owner {
            writeln!(f, "owner {owner}: {} objects, {} B", stats.objects, stats.bytes)?;
        }
        for object in &self.per_object {
            let pins: u32 = object.pins.values().sum();
            writeln!(
                f,
                "{} {} B {} owner {} holders {} pins {}{}",
                object.id,
                object.size,
                object.state.as_str(),
                object.owner,
                object.holders,
                pins,
                if object.freed { " (freed, waiting for readers)" } else { "" }
            )?;
        }
        Ok(())
    }
}

pub(super) fn collect(core: &StoreCore) -> StoreStats {
    let mut stats = StoreStats {
        capacity: core.allocator.capacity(),
        used_bytes: core.allocator.used_bytes(),
        largest_free: core.allocator.largest_free(),
        objects: core.objects.len() as u64,
        bytes_spilled: core.bytes_spilled,
        transfers: core.transfers,
        ..StoreStats::default()
    };
    for (&id, entry) in &core.objects {
        match entry.residency {
            Residency::InMemory(_) => stats.bytes_in_memory += entry.size,
            Residency::Spilled => stats.spilled_objects += 1,
            Residency::Restoring(_) => {}
        }
        if !entry.pins.is_empty() {
            stats.pinned_objects += 1;
        }
        let owner = stats.per_owner.entry(entry.owner).or_default();
        owner.objects += 1;
        owner.bytes += entry.size;
        stats.per_object.push(ObjectStats {
            id,
            size: entry.size,
            state: entry.state(),
            owner: entry.owner,
            holders: entry.holders.len(),
            counts: entry.holders.clone(),
            pins: entry.pins.clone(),
            freed: entry.freed,
        });
    }
    stats.per_object.sort_by_key(|object| object.id);
    stats
}
