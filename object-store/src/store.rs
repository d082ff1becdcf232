//! The node-side store: the pure core behind a mutex, the arena, and a spill directory; it
//! carries out the core's decisions (spill, evict, restore, delete spill files).
//!
//! Spilling and restoring happen under the store's lock: simple and obviously consistent, at
//! the price of stalling other store calls during disk I/O. Objects are immutable, so a spill
//! file is written once and deleted when the object is restored or freed.
//!
//! Every spill file is checksummed (XXH3-64) and checked on restore, so a file changed on disk
//! is an [`StoreError::ObjectCorrupted`] error, never wrong bytes. The checksum is kept in
//! memory next to the spill file's path rather than in a header of the file: a spill file is
//! only ever read back by the store that wrote it (no store adopts another's directory), so the
//! checksum has nowhere else to travel, the file stays the object's exact bytes (its length
//! check stays exact), and no damage to the file can also damage the checksum it is checked
//! against.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use crate::alloc::Allocation;
use crate::arena::{Arena, ArenaOptions};
use crate::config::{StoreConfig, default_capacity, spill_parent};
use crate::core::{
    CopyKind, Freed, HolderId, PinOutcome, Placement, StoreCore, StoreStats, Victim, VictimAction,
};
use crate::error::{Result, StoreError};
use crate::id::ObjectId;
use crate::tensor::{TensorError, TensorHeader};
use crate::view::{ObjectView, ReleaseHook};

/// One node's object store; cheap to clone (all clones share the store).
#[derive(Clone)]
pub struct ObjectStore {
    shared: Arc<Shared>,
}

struct Shared {
    arena: Arc<Arena>,
    core: Mutex<StoreCore>,
    spill: SpillDir,
}

impl std::fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStore")
            .field("arena", &self.shared.arena)
            .field("spill_dir", &self.shared.spill.path)
            .finish()
    }
}

impl ObjectStore {
    /// Creates the arena and chooses the spill directory (created when the first object
    /// spills).
    pub fn open(config: StoreConfig) -> Result<ObjectStore> {
        let parent = spill_parent(config.spill_dir.as_deref());
        let spill = SpillDir::new(&parent);
        let capacity = config.capacity.unwrap_or_else(default_capacity);
        let options = ArenaOptions {
            reserve: config.reserve,
            prefault: config.prefault,
            shrink_on_reserve_failure: config.shrink_on_reserve_failure,
            // The fallback arena file is unlinked at once, so it needs no directory of its own.
            fallback_dir: parent,
            force_disk_file: false,
        };
        let arena = Arc::new(Arena::create_with(capacity, &options)?);
        tracing::info!(capacity = arena.capacity(), spill_dir = %spill.path.display(), "object store open");
        let core = Mutex::new(StoreCore::new(arena.capacity()));
        Ok(ObjectStore { shared: Arc::new(Shared { arena, core, spill }) })
    }

    /// The shared-memory arena (hand its fd to workers, or write objects through it).
    pub fn arena(&self) -> &Arc<Arena> {
        &self.shared.arena
    }

    /// Usable capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.shared.arena.capacity()
    }

    /// Where this store's spill files go; the directory exists only once an object spilled.
    pub fn spill_dir(&self) -> &Path {
        &self.shared.spill.path
    }

    /// Reserves room for a new primary object of `size` bytes, spilling older objects if needed.
    /// The caller (in any process on the node) then writes the bytes and calls [`Self::seal`].
    pub fn create(&self, id: ObjectId, size: u64, owner: HolderId) -> Result<Allocation> {
        self.create_as(id, size, owner, CopyKind::Primary)
    }

    /// Like [`Self::create`] for a copy pulled from another node: evicted, not spilled, when
    /// memory runs short.
    pub fn create_copy(&self, id: ObjectId, size: u64, owner: HolderId) -> Result<Allocation> {
        self.create_as(id, size, owner, CopyKind::Secondary)
    }

    /// Makes a created object immutable and readable.
    pub fn seal(&self, id: ObjectId) -> Result<()> {
        self.shared.core.lock().seal(id)
    }

    /// Creates, writes and seals an object from this process in one call.
    pub fn put(&self, id: ObjectId, owner: HolderId, bytes: &[u8]) -> Result<()> {
        let allocation = self.create(id, bytes.len() as u64, owner)?;
        self.shared.arena.writer(allocation)?.copy_from_slice(bytes);
        self.seal(id)
    }

    /// Creates, writes and seals a typed tensor object (header, then the data 64-byte aligned).
    pub fn put_tensor(
        &self,
        id: ObjectId,
        owner: HolderId,
        header: &TensorHeader,
        data: &[u8],
    ) -> Result<()> {
        if data.len() as u64 != header.byte_len() {
            let found = data.len() as u64;
            return Err(TensorError::ByteLenMismatch { expected: header.byte_len(), found }.into());
        }
        let allocation = self.create(id, header.object_size(), owner)?;
        let written = header.write_object(&mut self.shared.arena.writer(allocation)?, data);
        if let Err(error) = written {
            // Sizes were checked above, so this is unreachable in practice; never leave a
            // half-written object behind.
            let _ = self.free(id);
            return Err(error.into());
        }
        self.seal(id)
    }

    /// Pins a sealed object for `reader`, restoring it from disk first if it was spilled.
    pub fn pin(&self, id: ObjectId, reader: HolderId) -> Result<Allocation> {
        let mut core = self.shared.core.lock();
        loop {
            match core.pin(id, reader)? {
                PinOutcome::Pinned(allocation) => return Ok(allocation),
                PinOutcome::RestoreFirst => match core.restore(id)? {
                    Placement::Allocated(allocation) => self.restore(&mut core, id, allocation)?,
                    Placement::MakeRoom(victims) => self.make_room(&mut core, victims)?,
                },
            }
        }
    }

    /// Releases one pin of `reader`.
    pub fn unpin(&self, id: ObjectId, reader: HolderId) -> Result<()> {
        let freed = self.shared.core.lock().unpin(id, reader)?;
        self.delete_spill_files(freed);
        Ok(())
    }

    /// Pins the object for `reader` and returns a view that unpins when dropped.
    pub fn get(&self, id: ObjectId, reader: HolderId) -> Result<ObjectView> {
        let allocation = self.pin(id, reader)?;
        let store = self.clone();
        let hook: ReleaseHook = Box::new(move |id| {
            if let Err(error) = store.unpin(id, reader) {
                tracing::warn!(object = %id, %error, "unpin after a view dropped failed");
            }
        });
        ObjectView::new(self.shared.arena.clone(), id, allocation, Some(hook)).inspect_err(|_| {
            let _ = self.unpin(id, reader);
        })
    }

    /// Adds one reference count for `holder`; returns whether that freed the object (a count
    /// that cancels a removal which overtook it can bring the last holder to zero).
    pub fn add_holder(&self, id: ObjectId, holder: HolderId) -> Result<bool> {
        let freed = self.shared.core.lock().add_holder(id, holder)?;
        let was_freed = freed.is_some();
        self.delete_spill_files(freed);
        Ok(was_freed)
    }

    /// Drops one of `holder`'s reference counts; returns whether that freed the object.
    pub fn remove_holder(&self, id: ObjectId, holder: HolderId) -> Result<bool> {
        let freed = self.shared.core.lock().remove_holder(id, holder)?;
        let was_freed = freed.is_some();
        self.delete_spill_files(freed);
        Ok(was_freed)
    }

    /// Frees an object whoever holds it (memory waits for the last reader).
    pub fn free(&self, id: ObjectId) -> Result<()> {
        let freed = self.shared.core.lock().free(id)?;
        self.delete_spill_files(freed);
        Ok(())
    }

    /// Drops every reference and pin of a process that exited or crashed; returns the objects
    /// freed as a result.
    pub fn release_process(&self, holder: HolderId) -> Vec<ObjectId> {
        let freed = self.shared.core.lock().release_process(holder);
        let ids = freed.iter().map(|freed| freed.id).collect();
        self.delete_spill_files(freed);
        ids
    }

    /// Whether a live object with this id exists (in memory or spilled).
    pub fn contains(&self, id: ObjectId) -> bool {
        self.shared.core.lock().contains(id)
    }

    /// A snapshot for `rtrun memory`.
    pub fn stats(&self) -> StoreStats {
        self.shared.core.lock().stats()
    }

    fn create_as(
        &self,
        id: ObjectId,
        size: u64,
        owner: HolderId,
        copy: CopyKind,
    ) -> Result<Allocation> {
        let mut core = self.shared.core.lock();
        loop {
            match core.create(id, size, owner, copy)? {
                Placement::Allocated(allocation) => return Ok(allocation),
                Placement::MakeRoom(victims) => self.make_room(&mut core, victims)?,
            }
        }
    }

    /// Spills or evicts victims; each one whose bytes are safe is reported to the core before
    /// the next, so a failure part-way leaves every object accounted for.
    fn make_room(&self, core: &mut StoreCore, victims: Vec<Victim>) -> Result<()> {
        for victim in victims {
            match victim.action {
                VictimAction::Spill => {
                    self.write_spill_file(victim.id, victim.allocation)?;
                    core.spilled(victim.id)?;
                    tracing::debug!(object = %victim.id, size = victim.allocation.size, "spilled");
                }
                VictimAction::Evict => {
                    core.evicted(victim.id)?;
                    tracing::debug!(object = %victim.id, "evicted secondary copy");
                }
            }
        }
        Ok(())
    }

    fn write_spill_file(&self, id: ObjectId, allocation: Allocation) -> Result<()> {
        let spill = &self.shared.spill;
        spill.create_dir()?;
        let path = spill.file(id);
        let bytes = self.shared.arena.bytes(allocation)?;
        let checksum = xxh3_64(bytes);
        let result = File::create(&path).and_then(|mut file| file.write_all(bytes));
        result.map_err(|source| {
            let _ = std::fs::remove_file(&path);
            StoreError::Spill { path, source }
        })?;
        spill.checksums.lock().insert(id, checksum);
        Ok(())
    }

    /// Reads a spill file back into `allocation`; the core makes the object readable only when
    /// its bytes check out, so corrupt bytes written into the allocation are never seen.
    fn restore(&self, core: &mut StoreCore, id: ObjectId, allocation: Allocation) -> Result<()> {
        let path = self.shared.spill.file(id);
        match self.read_spill_file(id, &path, allocation) {
            Ok(()) => {
                core.restored(id)?;
                self.shared.spill.checksums.lock().remove(&id);
                if let Err(error) = std::fs::remove_file(&path) {
                    tracing::warn!(path = %path.display(), %error, "removing a restored spill file failed");
                }
                tracing::debug!(object = %id, size = allocation.size, "restored");
                Ok(())
            }
            Err(error) => {
                core.restore_failed(id)?;
                tracing::error!(object = %id, %error, "restoring a spilled object failed");
                Err(error)
            }
        }
    }

    fn read_spill_file(&self, id: ObjectId, path: &Path, allocation: Allocation) -> Result<()> {
        let spill_error = |source| StoreError::Spill { path: path.to_path_buf(), source };
        let mut file = File::open(path).map_err(spill_error)?;
        let len = file.metadata().map_err(spill_error)?.len();
        if len != allocation.size {
            return Err(spill_error(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("spill file holds {len} bytes, expected {}", allocation.size),
            )));
        }
        let mut writer = self.shared.arena.writer(allocation)?;
        file.read_exact(&mut writer).map_err(spill_error)?;
        let found = xxh3_64(&writer[..]);
        match self.shared.spill.checksums.lock().get(&id) {
            Some(&expected) if expected == found => Ok(()),
            Some(&expected) => {
                Err(StoreError::ObjectCorrupted { id, path: path.to_path_buf(), expected, found })
            }
            None => Err(spill_error(std::io::Error::other(
                "no checksum was recorded when the object spilled, so its bytes cannot be trusted",
            ))),
        }
    }

    fn delete_spill_files(&self, freed: impl IntoIterator<Item = Freed>) {
        for freed in freed.into_iter().filter(|freed| freed.had_spill_file) {
            self.shared.spill.checksums.lock().remove(&freed.id);
            let path = self.shared.spill.file(freed.id);
            if let Err(error) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), %error, "removing a freed object's spill file failed");
            }
        }
    }
}

/// A per-store directory for spill files, created by the first spill and removed with the
/// store, and the checksum of each spill file in it.
struct SpillDir {
    path: PathBuf,
    /// XXH3-64 of each spill file's bytes as written, by object; an entry lives exactly as long
    /// as the file.
    checksums: Mutex<HashMap<ObjectId, u64>>,
}

impl SpillDir {
    /// Names this store's directory under `parent` without creating it (most stores never
    /// spill, and a node process usually exits without dropping its store, so a directory made
    /// up front would be left behind by every run), and removes dead processes' directories.
    fn new(parent: &Path) -> SpillDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        remove_stale_spill_dirs(parent);
        let name = format!(
            "rtrun-spill-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        SpillDir { path: parent.join(name), checksums: Mutex::new(HashMap::new()) }
    }

    /// Creates the directory (and a missing parent) before a spill; cheap when it exists, and
    /// it brings back a directory removed from under a running store.
    fn create_dir(&self) -> Result<()> {
        std::fs::create_dir_all(&self.path)
            .map_err(|source| StoreError::Spill { path: self.path.clone(), source })
    }

    fn file(&self, id: ObjectId) -> PathBuf {
        self.path.join(format!("{id}.obj"))
    }
}

/// Removes spill directories whose process is gone. A store's directory is removed when the
/// store drops, but a node process that spilled and is then killed (or exits without dropping
/// its store, which lives in a process-wide static) leaves its directory behind; the next store
/// opened in the same parent directory cleans it up. Directories of live processes are never touched.
fn remove_stale_spill_dirs(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix("rtrun-spill-"))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let path = entry.path();
            match std::fs::remove_dir_all(&path) {
                Ok(()) => {
                    tracing::info!(path = %path.display(), "removed a dead process's spill directory")
                }
                Err(error) => {
                    tracing::debug!(path = %path.display(), %error, "cannot remove a stale spill directory")
                }
            }
        }
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        match std::fs::remove_dir_all(&self.path) {
            // Never created: nothing spilled.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                tracing::warn!(path = %self.path.display(), %error, "removing the spill directory failed")
            }
            Ok(()) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE: HolderId = HolderId(0);

    fn store(capacity: u64) -> ObjectStore {
        ObjectStore::open(StoreConfig::with_capacity(capacity)).unwrap()
    }

    fn pattern(seed: u64, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed * 7) as u8).collect()
    }

    #[test]
    fn objects_spill_and_come_back_intact() {
        let store = store(1 << 20);
        for n in 0..6 {
            store.put(ObjectId(n), NODE, &pattern(n as u64, 300_000)).unwrap();
        }
        let stats = store.stats();
        assert_eq!(stats.objects, 6);
        assert!(stats.spilled_objects >= 3);
        for n in 0..6 {
            let view = store.get(ObjectId(n), NODE).unwrap();
            assert_eq!(&*view, &pattern(n as u64, 300_000)[..]);
        }
        assert_eq!(store.stats().pinned_objects, 0);
    }

    #[test]
    fn pinned_objects_are_never_spilled_and_full_is_an_error() {
        let store = store(1 << 20);
        store.put(ObjectId(1), NODE, &vec![1; 600_000]).unwrap();
        let view = store.get(ObjectId(1), NODE).unwrap();
        let error = store.create(ObjectId(2), 600_000, NODE).unwrap_err();
        assert!(matches!(error, StoreError::StoreFull { .. }), "{error}");
        assert!(matches!(
            store.create(ObjectId(3), 2 << 20, NODE),
            Err(StoreError::TooLarge { .. })
        ));
        drop(view);
        store.create(ObjectId(2), 600_000, NODE).unwrap();
        assert_eq!(store.stats().spilled_objects, 1);
    }

    #[test]
    fn a_tensor_put_is_viewed_in_place_and_aligned() {
        use crate::tensor::{DType, TensorView};
        let store = store(1 << 20);
        let header = TensorHeader::new(DType::BF16, vec![4, 8]).unwrap();
        let data: Vec<u8> = (0..64).collect();
        store.put_tensor(ObjectId(1), NODE, &header, &data).unwrap();
        assert!(store.put_tensor(ObjectId(2), NODE, &header, &data[1..]).is_err());
        let view = store.get(ObjectId(1), NODE).unwrap();
        let tensor = TensorView::parse(&view).unwrap();
        assert_eq!((tensor.header, tensor.data), (header, &data[..]));
        assert_eq!(tensor.data.as_ptr() as usize % 64, 0);
    }

    #[test]
    fn spill_directories_of_dead_processes_are_removed() {
        let parent = std::env::temp_dir().join(format!("rtrun-stale-test-{}", std::process::id()));
        // Pid 0 is never a process; this process's own directory must survive.
        let stale = parent.join("rtrun-spill-0-3");
        let alive = parent.join(format!("rtrun-spill-{}-9", std::process::id()));
        std::fs::create_dir_all(&stale).unwrap();
        std::fs::write(stale.join("x.obj"), b"left behind").unwrap();
        std::fs::create_dir_all(&alive).unwrap();
        remove_stale_spill_dirs(&parent);
        assert!(!stale.exists());
        assert!(alive.exists());
        std::fs::remove_dir_all(&parent).unwrap();
    }

    #[test]
    fn freeing_a_spilled_object_deletes_its_file_and_drop_removes_the_directory() {
        let store = store(1 << 20);
        store.put(ObjectId(1), NODE, &vec![1; 800_000]).unwrap();
        store.put(ObjectId(2), NODE, &vec![2; 800_000]).unwrap();
        let spill_dir = store.spill_dir().to_path_buf();
        assert_eq!(std::fs::read_dir(&spill_dir).unwrap().count(), 1);
        assert!(store.remove_holder(ObjectId(1), NODE).unwrap());
        assert_eq!(std::fs::read_dir(&spill_dir).unwrap().count(), 0);
        assert!(!store.contains(ObjectId(1)));
        drop(store);
        assert!(!spill_dir.exists());
    }
}
