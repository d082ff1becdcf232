//! Objects between nodes' stores: [`StoreSource`] serves pulls from this node's
//! [`ObjectStore`], and [`pull_into_store`] pulls an object from a peer straight into it.
//!
//! Both sides are zero-copy on this node. The holder sends each chunk from a `Bytes` that
//! borrows the arena while the object stays pinned (the pin goes with the last clone of the
//! `Bytes`, which quinn keeps until the peer acknowledged the data). The puller reads each
//! chunk from the QUIC stream into its place in the new allocation's arena range.
//!
//! Store calls may block: spilling and restoring run under the store's lock, so any call can
//! wait for disk I/O. Inside a multi-thread tokio runtime they run under
//! [`tokio::task::block_in_place`], so other tasks move to another worker meanwhile; elsewhere
//! (a current-thread runtime, where `block_in_place` would panic, or no runtime at all) they
//! run inline.
//!
//! Concurrent pulls of one object into one store share the transfer: the first pull does it
//! and later ones wait for it, then only add their holder (or, if it failed, try again
//! themselves). The registry of pulls in flight is process-wide and keyed by the store's
//! arena, which is enough because only the node process owns an `ObjectStore` and pulls into
//! it.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use bytes::Bytes;
use parking_lot::Mutex;
use rtrun_object_store::{
    HolderId, ObjectId, ObjectStore, ObjectView, PullConfig, PullState, StoreError,
};
use tokio::runtime::{Handle, RuntimeFlavor};
use tracing::{debug, warn};

use crate::connection::{Connection, ObjectSource};
use crate::error::{NetError, Result};
use crate::pull::ObjectPull;

/// An [`ObjectSource`] over this node's object store: serves sealed objects (restoring spilled
/// ones) with every chunk pinned while it is being sent.
#[derive(Debug, Clone)]
pub struct StoreSource {
    store: Arc<ObjectStore>,
    reader: HolderId,
}

impl StoreSource {
    /// Serves objects of `store`, pinning them under `reader`. `reader` should be an id of its
    /// own (not a worker's), so that releasing a worker's holds never drops pins of chunks in
    /// flight.
    pub fn new(store: Arc<ObjectStore>, reader: HolderId) -> StoreSource {
        StoreSource { store, reader }
    }

    /// The store served.
    pub fn store(&self) -> &Arc<ObjectStore> {
        &self.store
    }

    /// The holder id pins are taken under.
    pub fn reader(&self) -> HolderId {
        self.reader
    }

    fn view(&self, object: ObjectId) -> std::result::Result<ObjectView, StoreError> {
        blocking(|| self.store.get(object, self.reader))
    }
}

impl ObjectSource for StoreSource {
    /// The size of a sealed object; a spilled one is restored into memory first, so the chunk
    /// reads that follow usually find it there. `None` for an object that is missing, freed or
    /// still being written; also when restoring fails (the reason is logged, the puller hears
    /// that the object is not here).
    fn size(&self, object: ObjectId) -> Option<u64> {
        match self.view(object) {
            Ok(view) => Some(view.len() as u64),
            Err(
                StoreError::ObjectNotFound(_)
                | StoreError::ObjectFreed(_)
                | StoreError::NotSealed { .. },
            ) => None,
            Err(error) => {
                warn!(%object, %error, "cannot serve an object of this node's store");
                None
            }
        }
    }

    /// Bytes `offset..offset + len` of the object, borrowing the arena: the object stays
    /// pinned until the returned `Bytes` and all its clones are dropped.
    fn read(&self, object: ObjectId, offset: u64, len: u64) -> std::result::Result<Bytes, String> {
        let view = self.view(object).map_err(|error| error.to_string())?;
        let size = view.len() as u64;
        let end = offset.checked_add(len).filter(|&end| end <= size).ok_or_else(|| {
            format!(
                "bytes {offset}..{offset}+{len} are out of range of object {object}, which has {size} bytes"
            )
        })?;
        // Both bounds are at most the view's length, a `usize`.
        let range = offset as usize..end as usize;
        Ok(Bytes::from_owner(PinnedRange { view, range }))
    }
}

/// A pinned object view narrowed to one range: the owner of a zero-copy chunk.
struct PinnedRange {
    view: ObjectView,
    range: std::ops::Range<usize>,
}

impl AsRef<[u8]> for PinnedRange {
    fn as_ref(&self) -> &[u8] {
        &self.view[self.range.clone()]
    }
}

/// Pulls object `id` from the peer of `conn` into `store` as a secondary copy held by `owner`
/// (evicted, not spilled, under memory pressure: the primary lives on another node).
///
/// When the store already has the object, this only adds `owner` as a holder. Otherwise the
/// chunks are written straight into the new allocation, which is sealed when complete. A failed
/// stream is resumed once on a fresh one with only the missing chunks. On failure (or when the
/// returned future is dropped) the partial object is freed, so nothing is left in the store;
/// the error names the object and the peer. Concurrent calls for the same object and store
/// wait for the first transfer and share it (see the module docs). Returns the bytes that
/// crossed the network (0 when the store had the object).
pub async fn pull_into_store(
    conn: &Connection,
    store: &ObjectStore,
    id: ObjectId,
    owner: HolderId,
    config: PullConfig,
) -> Result<u64> {
    let wrap = |source: NetError| NetError::ObjectPull {
        object: id,
        peer: conn.peer_name().to_string(),
        source: Box::new(source),
    };
    let turn = loop {
        match PullTurn::take(store, id) {
            Ok(turn) => break turn,
            Err(running) => {
                debug!(object = %id, "waiting for a pull of the same object in flight");
                drop(running.lock().await);
            }
        }
    };
    match blocking(|| store.add_holder(id, owner)) {
        Ok(_) => return Ok(0),
        // Not here (or evicted just now): pull it. A freed object still pinned by readers
        // cannot be created again, and `create_copy` says so.
        Err(StoreError::ObjectNotFound(_)) => {}
        Err(error) => return Err(wrap(error.into())),
    }
    transfer(conn, store, id, owner, config, turn).await.map_err(wrap)
}

/// The transfer itself, on the caller's `turn` for this object.
async fn transfer(
    conn: &Connection,
    store: &ObjectStore,
    id: ObjectId,
    owner: HolderId,
    config: PullConfig,
    turn: PullTurn,
) -> Result<u64> {
    let mut pull = conn.open_pull(id, config.chunk_size).await?;
    let size = pull.size();
    let mut state = PullState::new(id, size, config)?;
    let allocation = blocking(|| store.create_copy(id, size, owner))?;
    let mut partial = PartialObject { store, id, sealed: false, _turn: turn };
    {
        // Declared after `partial`, so the writer is gone before a failed object is freed.
        let mut writer = store.arena().writer(allocation)?;
        if let Err(error) = pull.run(&mut state, &mut writer).await {
            if matches!(error, NetError::Pull(_)) {
                return Err(error);
            }
            warn!(object = %id, peer = conn.peer_name(), %error, received = state.bytes_received(), "pull stream failed; resuming on a fresh stream");
            let mut resumed = resume(conn, id, size, config).await?;
            resumed.run(&mut state, &mut writer).await?;
        }
    }
    blocking(|| store.seal(id))?;
    partial.sealed = true;
    Ok(size)
}

/// A fresh pull stream for the same object, which must still have the same size.
async fn resume(
    conn: &Connection,
    id: ObjectId,
    size: u64,
    config: PullConfig,
) -> Result<ObjectPull> {
    let pull = conn.open_pull(id, config.chunk_size).await?;
    if pull.size() != size {
        return Err(NetError::Protocol {
            peer: conn.peer_name().to_string(),
            reason: format!("object {id} had {size} bytes, now {}", pull.size()),
        });
    }
    Ok(pull)
}

/// An object created for a pull and not sealed yet: freed when dropped unsealed. It holds the
/// pull's turn, which ends only after the free (fields drop after `drop`), so a waiting pull
/// never sees the partial object.
struct PartialObject<'a> {
    store: &'a ObjectStore,
    id: ObjectId,
    sealed: bool,
    _turn: PullTurn,
}

impl Drop for PartialObject<'_> {
    fn drop(&mut self) {
        // Called directly, not through `blocking`: a drop may run while a runtime shuts down,
        // where `block_in_place` is not allowed, and freeing an unsealed object does no I/O.
        if !self.sealed
            && let Err(error) = self.store.free(self.id)
        {
            warn!(object = %self.id, %error, "freeing a partially pulled object failed");
        }
    }
}

type PullKey = (usize, ObjectId);

/// Pulls in flight in this process, by store (its arena's address) and object.
static PULLS_IN_FLIGHT: LazyLock<Mutex<HashMap<PullKey, Arc<tokio::sync::Mutex<()>>>>> =
    LazyLock::new(Default::default);

/// The sole right to pull one object into one store; others wait on its lock.
struct PullTurn {
    key: PullKey,
    lock: Arc<tokio::sync::Mutex<()>>,
    _held: tokio::sync::OwnedMutexGuard<()>,
}

impl PullTurn {
    /// Takes the turn, or returns the lock of the pull in flight to wait on.
    fn take(
        store: &ObjectStore,
        id: ObjectId,
    ) -> std::result::Result<PullTurn, Arc<tokio::sync::Mutex<()>>> {
        let key = (Arc::as_ptr(store.arena()).addr(), id);
        let mut pulls = PULLS_IN_FLIGHT.lock();
        if let Some(running) = pulls.get(&key) {
            return Err(running.clone());
        }
        let lock = Arc::new(tokio::sync::Mutex::new(()));
        // A lock nobody else has seen yet is free.
        let held = lock.clone().try_lock_owned().expect("a fresh lock is free");
        pulls.insert(key, lock.clone());
        Ok(PullTurn { key, lock, _held: held })
    }
}

impl Drop for PullTurn {
    /// Leaves the registry before the lock is released (the fields drop after this body), so a
    /// waiter that wakes up finds the store's final state and no stale entry.
    fn drop(&mut self) {
        let mut pulls = PULLS_IN_FLIGHT.lock();
        if pulls.get(&self.key).is_some_and(|lock| Arc::ptr_eq(lock, &self.lock)) {
            pulls.remove(&self.key);
        }
    }
}

/// Runs a store call that may block on disk I/O; see the module docs.
fn blocking<R>(call: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(call)
        }
        _ => call(),
    }
}
