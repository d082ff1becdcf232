//! The runtime's side of the node's object store: values whose encoded size is over
//! [`crate::Config::max_inline_object_bytes`] live in the node's shared-memory arena instead of
//! travelling inline in frames.
//!
//! The node process (the driver of an embedded session) opens the [`ObjectStore`] and hands its
//! memfd to every worker it spawns ([`StoreClient::inheritance`]); a worker attaches to it
//! ([`StoreClient::attach_worker`]). Every process reaches the store through its
//! [`StoreClient`]: in the node directly, in a worker with [`Request::Store`] messages on its
//! connection to the node. A put is create → write in place → seal; a read pins the object and
//! maps it (an [`ObjectView`]), never copying it.
//!
//! Reference accounting: each [`Hold`] in a process is exactly one count for that process in the
//! store (its [`HolderId`] is its worker id). A frame that carries a stored value makes the
//! sender add one count for the receiver *after* the write (`lend`), and the receiver wraps the
//! value in a fresh `Hold` when the frame arrives; dropping a `Hold` removes its count. The
//! sender's own hold is alive while the frame is sent, and its lend and later release travel in
//! order on the sender's connection to the node, so an object is never freed while a reference
//! is in flight; a receiver that drops its hold before the lend arrives leaves a −1 that the lend
//! cancels (see `rtrun_object_store::core`). When a worker exits, the node releases its counts
//! and pins and ignores anything that still arrives from or for it.

use std::collections::HashSet;
use std::os::fd::RawFd;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use rtrun_object_store::{
    ARENA_ENV, Allocation, Arena, HolderId, ObjectId, ObjectStore, ObjectView, ReleaseHook,
    StoreConfig, StoreError, StoreStats,
};

use crate::error::{Error, Result};
use crate::ids::WorkerId;
use crate::protocol::{NodeMemory, Request, Response, StoreOp, ask};
use crate::runtime::{Runtime, To};
use rtrun_proto::object::StoredValue;

/// Environment variable that tells a worker the inline limit of its node.
pub(crate) const INLINE_LIMIT_ENV: &str = "RTRUN_MAX_INLINE_OBJECT_BYTES";
/// Default of [`crate::Config::max_inline_object_bytes`]: 100 KiB, Ray's threshold between
/// in-band values and the plasma store.
pub(crate) const DEFAULT_MAX_INLINE_OBJECT_BYTES: usize = 100 * 1024;
/// Copies of at least this many bytes into the arena are split across threads (one memcpy
/// thread does not saturate memory bandwidth; Ray does the same for large puts).
pub(crate) const PARALLEL_COPY_MIN_BYTES: usize = 8 << 20;
/// Most threads a parallel copy uses.
pub(crate) const PARALLEL_COPY_MAX_THREADS: usize = 4;

/// The node daemon whose store holds this process's objects, in a cluster (set when the
/// process joins; unset: this node's store, as in an embedded session).
static HOME: std::sync::OnceLock<crate::protocol::Address> = std::sync::OnceLock::new();

/// Sets [`HOME`] (once: a process is part of one cluster).
pub(crate) fn set_home(address: crate::protocol::Address) {
    let _ = HOME.set(address);
}

impl Runtime {
    /// This process's access to the node's object store.
    pub(crate) fn store_client(&self) -> Result<&Arc<StoreClient>> {
        self.store().ok_or_else(|| {
            Error::ObjectStore("this process is not attached to its node's object store".into())
        })
    }

    /// The node's object-store snapshot (asked of the node from a worker).
    pub fn memory_stats(&self) -> Result<rtrun_object_store::StoreStats> {
        self.store_client()?.stats()
    }

    /// A worker process exited: the node releases its store references and pins.
    pub(crate) fn on_process_exit(&self, worker: WorkerId) {
        if let Some(store) = self.store() {
            store.process_exited(rtrun_proto::address::holder_of(worker));
        }
    }

    /// The arena fd and environment that a spawned worker needs to attach to the store.
    pub(crate) fn store_inheritance(&self) -> Option<(std::os::fd::RawFd, Vec<(String, String)>)> {
        self.store().map(|store| store.inheritance())
    }

    /// Whether a stored value lives in another node's store.
    pub(crate) fn is_foreign(&self, value: &crate::object::StoredValue) -> bool {
        match value.home.as_deref().map(crate::transport::Route::parse) {
            Some(Ok(crate::transport::Route::Quic { node, .. })) => node != self.node_id.0,
            _ => false,
        }
    }

    /// Sends a store operation to the node daemon at `home` (answers are only logged).
    pub(crate) fn notify_store_at(&self, home: &str, op: crate::protocol::StoreOp) {
        let holder = rtrun_proto::address::holder_of(self.worker_id);
        match self.endpoint().connect(&home.to_owned()) {
            // From a frame's send hook, which has no `Arc` of the runtime: the raw send.
            Ok(conn) => self.send_on(
                &conn,
                Request::Store { holder, op },
                Box::new(|response| {
                    if let Response::Error(error) = response {
                        tracing::debug!(%error, "store operation at another node failed");
                    }
                }),
            ),
            Err(e) => tracing::debug!("store at {home} unreachable: {e}"),
        }
    }

    /// The bytes of a value in another node's store: copied into this node's store (then
    /// mapped) when this process has one, else pulled into memory.
    pub(crate) fn fetch_foreign(
        self: &Arc<Self>,
        stored: &crate::object::StoredValue,
    ) -> Result<crate::object::ObjectBytes> {
        let home = stored.home.clone().unwrap_or_default();
        let lost = |reason: String| Error::ObjectLost { id: stored.id, reason };
        // A copy on a dead node is gone: say so at once (with the head's reason) rather than
        // after a connection attempt times out.
        if let Ok(crate::transport::Route::Quic { node, .. }) =
            crate::transport::Route::parse(&home)
            && let Err(e) = self.ask(To::Head, ask::NodeAlive { node })
        {
            return Err(lost(format!("its node is gone: {e}")));
        }
        if let Some(store) = self.store() {
            let op = crate::protocol::StoreOp::Pull { id: stored.id, from: home.clone() };
            self.ask(
                To::Node,
                Request::Store { holder: rtrun_proto::address::holder_of(self.worker_id), op },
            )
            .map_err(|e| lost(format!("copying it from {home}: {e}")))?;
            // The pull gave this process a count on the copy; it goes with the view.
            let count = crate::store::Hold::adopt(store, stored.id);
            return Ok(crate::object::ObjectBytes::mapped_copy(store.view(stored.id)?, count));
        }
        let bytes =
            crate::cluster::pull_to_memory(&home, stored.id).map_err(|e| lost(e.to_string()))?;
        Ok(crate::object::ObjectBytes::inline(bytes))
    }
}

fn store_error(error: StoreError) -> Error {
    Error::ObjectStore(error.to_string())
}

/// The node-side part: the store itself and the processes known to have exited.
struct NodeStore {
    store: ObjectStore,
    /// Exited workers; held while every remote operation runs so that a late message from (or
    /// a lend to) a dead process can never re-create a count that nobody will release.
    dead: Mutex<HashSet<HolderId>>,
}

/// One process's access to its node's object store.
pub(crate) struct StoreClient {
    arena: Arc<Arena>,
    node: Option<NodeStore>,
    holder: HolderId,
    max_inline: usize,
    runtime: Weak<Runtime>,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient")
            .field("holder", &self.holder)
            .field("node", &self.node.is_some())
            .field("max_inline", &self.max_inline)
            .finish()
    }
}

impl StoreClient {
    /// Opens the node's store (in the node process).
    pub(crate) fn open_node(
        runtime: Weak<Runtime>,
        holder: HolderId,
        config: StoreConfig,
        max_inline: usize,
    ) -> Result<Arc<StoreClient>> {
        let store = ObjectStore::open(config).map_err(store_error)?;
        Ok(Arc::new(StoreClient {
            arena: store.arena().clone(),
            node: Some(NodeStore { store, dead: Mutex::new(HashSet::new()) }),
            holder,
            max_inline,
            runtime,
        }))
    }

    /// Attaches to the arena this worker inherited; `None` when it was started without one.
    pub(crate) fn attach_worker(
        runtime: Weak<Runtime>,
        holder: HolderId,
    ) -> Result<Option<Arc<StoreClient>>> {
        let Some(arena) = Arena::attach_from_env().map_err(store_error)? else {
            return Ok(None);
        };
        let max_inline = match std::env::var(INLINE_LIMIT_ENV) {
            Ok(value) => value.parse().map_err(|_| {
                Error::Invalid(format!("{INLINE_LIMIT_ENV} must be a byte count, found `{value}`"))
            })?,
            Err(_) => DEFAULT_MAX_INLINE_OBJECT_BYTES,
        };
        Ok(Some(Arc::new(StoreClient {
            arena: Arc::new(arena),
            node: None,
            holder,
            max_inline,
            runtime,
        })))
    }

    /// The arena fd a spawned worker must inherit and the environment that tells it so.
    pub(crate) fn inheritance(&self) -> (RawFd, Vec<(String, String)>) {
        let env = vec![
            (ARENA_ENV.to_owned(), self.arena.env_value()),
            (INLINE_LIMIT_ENV.to_owned(), self.max_inline.to_string()),
        ];
        (self.arena.fd(), env)
    }

    /// Values whose encoding is longer than this go to the store.
    pub(crate) fn max_inline(&self) -> usize {
        self.max_inline
    }

    /// Creates an object of `size` bytes owned by this process, lets `write` fill it in place
    /// and seals it. The returned value holds this process's reference.
    pub(crate) fn put_with(
        self: &Arc<Self>,
        id: ObjectId,
        size: u64,
        write: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<StoredValue> {
        let allocation = match &self.node {
            Some(node) => node.store.create(id, size, self.holder).map_err(store_error)?,
            None => self.allocation(StoreOp::Create { id, size })?,
        };
        let written = self
            .arena
            .writer(allocation)
            .map_err(store_error)
            .and_then(|mut writer| write(&mut writer));
        if let Err(error) = written {
            self.abort(id);
            return Err(error);
        }
        match &self.node {
            Some(node) => node.store.seal(id).map_err(store_error)?,
            None => self.call(StoreOp::Seal { id }).map(|_| ())?,
        }
        let home = HOME.get().cloned();
        let hold = Arc::new(Hold { id, client: Some(self.clone()), remote: None });
        Ok(StoredValue { id, size, home, hold: Some(hold) })
    }

    /// Stores `bytes` as a new object.
    pub(crate) fn put_bytes(self: &Arc<Self>, id: ObjectId, bytes: &[u8]) -> Result<StoredValue> {
        self.put_with(id, bytes.len() as u64, |target| {
            copy_parallel(target, bytes);
            Ok(())
        })
    }

    /// Pins the object and maps it; the view unpins when dropped.
    pub(crate) fn view(self: &Arc<Self>, id: ObjectId) -> Result<ObjectView> {
        if let Some(node) = &self.node {
            return node.store.get(id, self.holder).map_err(store_error);
        }
        let allocation = self.allocation(StoreOp::Pin { id })?;
        let client = self.clone();
        let hook: ReleaseHook = Box::new(move |id| client.notify(StoreOp::Unpin { id }));
        ObjectView::new(self.arena.clone(), id, allocation, Some(hook)).map_err(|error| {
            self.notify(StoreOp::Unpin { id });
            store_error(error)
        })
    }

    /// Adds one count for `to`, which was just sent a reference to `id`.
    pub(crate) fn lend(&self, id: ObjectId, to: HolderId) {
        match &self.node {
            Some(node) => node.apply(self.holder, StoreOp::Lend { id, to }).log_error(),
            None => self.notify(StoreOp::Lend { id, to }),
        }
    }

    /// Takes a count of this process's own on a live object (for a reference that arrived
    /// without one); fails when the object is gone.
    pub(crate) fn borrow(self: &Arc<Self>, id: ObjectId) -> Result<Arc<Hold>> {
        let op = StoreOp::Lend { id, to: self.holder };
        let response = match &self.node {
            Some(node) => node.apply(self.holder, op),
            None => self.call(op)?,
        };
        match response {
            Response::Error(error) => Err(error),
            _ => Ok(Hold::adopt(self, id)),
        }
    }

    /// The node's store itself (node processes only).
    pub(crate) fn node_store(&self) -> Option<&ObjectStore> {
        self.node.as_ref().map(|node| &node.store)
    }

    fn release(&self, id: ObjectId) {
        match &self.node {
            Some(node) => node.apply(self.holder, StoreOp::Release { id }).log_error(),
            None => self.notify(StoreOp::Release { id }),
        }
    }

    fn abort(&self, id: ObjectId) {
        match &self.node {
            Some(node) => node.apply(self.holder, StoreOp::Abort { id }).log_error(),
            None => self.notify(StoreOp::Abort { id }),
        }
    }

    /// The node's snapshot (in the node process).
    pub(crate) fn node_memory(&self, runtime: &Runtime) -> Option<NodeMemory> {
        let node = self.node.as_ref()?;
        Some(NodeMemory {
            node: runtime.node_id,
            session: runtime.session.clone(),
            spill_dir: node.store.spill_dir().display().to_string(),
            stats: node.store.stats(),
        })
    }

    /// The store's snapshot, asked of the node when this is a worker.
    /// Serves this node's objects to other nodes' pulls (node processes only).
    pub(crate) fn object_source(&self) -> Result<Arc<dyn rtrun_net::ObjectSource>> {
        let node = self.node.as_ref().ok_or_else(|| {
            Error::ObjectStore("only the node process serves its store to other nodes".into())
        })?;
        Ok(Arc::new(rtrun_net::StoreSource::new(Arc::new(node.store.clone()), self.holder)))
    }

    pub(crate) fn stats(&self) -> Result<StoreStats> {
        match &self.node {
            Some(node) => Ok(node.store.stats()),
            None => self.ask::<Box<NodeMemory>>(StoreOp::Stats).map(|memory| memory.stats),
        }
    }

    /// Answers a store request from another process on this node.
    pub(crate) fn handle_remote(
        &self,
        runtime: &Runtime,
        holder: HolderId,
        op: StoreOp,
    ) -> Response {
        let Some(node) = &self.node else {
            return Response::Error(Error::Invalid(
                "store requests go to the node process, and this is not it".into(),
            ));
        };
        if let StoreOp::Stats = op {
            return match self.node_memory(runtime) {
                Some(memory) => Response::StoreStats(Box::new(memory)),
                None => Response::Error(Error::NotInitialised),
            };
        }
        node.apply(holder, op)
    }

    /// Releases every count and pin of an exited worker, and ignores it from now on.
    pub(crate) fn process_exited(&self, holder: HolderId) {
        if let Some(node) = &self.node {
            let mut dead = node.dead.lock();
            dead.insert(holder);
            let freed = node.store.release_process(holder);
            tracing::debug!(%holder, freed = freed.len(), "released an exited process's objects");
        }
    }

    fn allocation(&self, op: StoreOp) -> Result<Allocation> {
        self.ask(op)
    }

    /// A store request to the node, waiting for its typed answer (worker only).
    fn ask<R: crate::protocol::Reply>(&self, op: StoreOp) -> Result<R> {
        self.call(op).and_then(R::from_response)
    }

    /// A store request to the node, waiting for the answer (worker only).
    fn call(&self, op: StoreOp) -> Result<Response> {
        let runtime = self.runtime.upgrade().ok_or(Error::NotInitialised)?;
        runtime.ask(To::Node, Request::Store { holder: self.holder, op })
    }

    /// A store request to the node whose answer nobody waits for (worker only). Requests on
    /// one connection are handled in order, which the reference accounting relies on.
    fn notify(&self, op: StoreOp) {
        if let Some(runtime) = self.runtime.upgrade() {
            runtime.send(To::Node, Request::Store { holder: self.holder, op }, |answer| {
                if let Err(error) = answer {
                    tracing::debug!(%error, "store notification failed");
                }
            });
        }
    }
}

impl NodeStore {
    fn apply(&self, holder: HolderId, op: StoreOp) -> Response {
        let dead = self.dead.lock();
        if dead.contains(&holder) {
            return Response::Error(Error::ObjectStore(format!(
                "process {holder} has exited; its store request is ignored"
            )));
        }
        let store = &self.store;
        tracing::trace!(%holder, ?op, "store op");
        let result = match op {
            StoreOp::Create { id, size } => {
                store.create(id, size, holder).map(Response::Allocation)
            }
            StoreOp::Seal { id } => store.seal(id).map(|()| Response::Done),
            StoreOp::Abort { id } => store.free(id).map(|()| Response::Done),
            StoreOp::Pin { id } => store.pin(id, holder).map(Response::Allocation),
            StoreOp::Unpin { id } => store.unpin(id, holder).map(|()| Response::Done),
            StoreOp::Lend { id, to } if dead.contains(&to) => {
                tracing::debug!(object = %id, %to, "a reference was sent to an exited process");
                Ok(Response::Done)
            }
            StoreOp::Lend { id, to } => store.add_holder(id, to).map(|_| Response::Done),
            StoreOp::Release { id } => store.remove_holder(id, holder).map(|_| Response::Done),
            StoreOp::Stats => Ok(Response::Done),
            // The node's runtime serves pulls on a thread of their own (they wait on the
            // network) before a request reaches the store.
            StoreOp::Pull { .. } => {
                return Response::Error(Error::Invalid(
                    "object pulls are served by the node's runtime, not its store".into(),
                ));
            }
        };
        result.unwrap_or_else(|error| Response::Error(store_error(error)))
    }
}

trait LogError {
    fn log_error(self);
}

impl LogError for Response {
    fn log_error(self) {
        if let Response::Error(error) = self {
            tracing::warn!(%error, "object store bookkeeping failed");
        }
    }
}

/// One reference count of this process on a stored object; dropping it removes the count.
pub(crate) struct Hold {
    id: ObjectId,
    client: Option<Arc<StoreClient>>,
    /// For an object in another node's store: that node, told when the count drops.
    remote: Option<(Weak<Runtime>, crate::protocol::Address)>,
}

impl Hold {
    /// Wraps a count that another process added for this one (a received reference).
    pub(crate) fn adopt(client: &Arc<StoreClient>, id: ObjectId) -> Arc<Hold> {
        Arc::new(Hold { id, client: Some(client.clone()), remote: None })
    }

    /// Wraps a count that another process added for this one at another node's store.
    pub(crate) fn adopt_remote(runtime: &Arc<Runtime>, home: String, id: ObjectId) -> Arc<Hold> {
        Arc::new(Hold { id, client: None, remote: Some((Arc::downgrade(runtime), home)) })
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(client) = &self.client {
            client.release(self.id);
        }
        if let Some((runtime, home)) = &self.remote
            && let Some(runtime) = runtime.upgrade()
        {
            runtime.notify_store_at(home, StoreOp::Release { id: self.id });
        }
    }
}

/// Copies `source` into `target` (same length), on several threads when it is large.
pub(crate) fn copy_parallel(target: &mut [u8], source: &[u8]) {
    let threads = if source.len() >= PARALLEL_COPY_MIN_BYTES {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(PARALLEL_COPY_MAX_THREADS)
    } else {
        1
    };
    if threads <= 1 {
        target.copy_from_slice(source);
        return;
    }
    // Chunks are multiples of 4 KiB so that threads never share a page.
    let chunk = source.len().div_ceil(threads).next_multiple_of(4096);
    std::thread::scope(|scope| {
        let mut pairs = target.chunks_mut(chunk).zip(source.chunks(chunk));
        let first = pairs.next();
        for (to, from) in pairs {
            scope.spawn(move || to.copy_from_slice(from));
        }
        if let Some((to, from)) = first {
            to.copy_from_slice(from);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_copy_copies_every_byte() {
        for len in [0usize, 1, 4095, PARALLEL_COPY_MIN_BYTES + 12_345] {
            let source: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let mut target = vec![0u8; len];
            copy_parallel(&mut target, &source);
            assert!(target == source, "length {len}");
        }
    }

    fn node(capacity: u64) -> Arc<StoreClient> {
        let config = StoreConfig::with_capacity(capacity);
        StoreClient::open_node(Weak::new(), HolderId(0), config, 1024).unwrap()
    }

    fn count(client: &StoreClient, id: ObjectId, holder: HolderId) -> Option<i64> {
        let stats = client.stats().unwrap();
        let object = stats.per_object.iter().find(|object| object.id == id)?;
        Some(object.counts.get(&holder).copied().unwrap_or(0))
    }

    #[test]
    fn holds_lends_and_exited_processes_keep_counts_exact() {
        let client = node(1 << 20);
        let id = ObjectId(7);
        let worker = HolderId(3);
        let value = client.put_bytes(id, &[5u8; 4000]).unwrap();
        // A lend to a worker, then the worker's release overtaking a second lend.
        client.lend(id, worker);
        assert_eq!(count(&client, id, worker), Some(1));
        client.node.as_ref().unwrap().apply(worker, StoreOp::Release { id }).log_error();
        client.node.as_ref().unwrap().apply(worker, StoreOp::Release { id }).log_error();
        assert_eq!(count(&client, id, worker), Some(-1));
        client.lend(id, worker);
        assert_eq!(count(&client, id, worker), Some(0));
        // An exited worker's counts go, and nothing from or for it counts afterwards.
        client.lend(id, worker);
        client.process_exited(worker);
        assert_eq!(count(&client, id, worker), Some(0));
        client.lend(id, worker);
        let late = client.node.as_ref().unwrap().apply(worker, StoreOp::Pin { id });
        assert!(matches!(late, Response::Error(_)));
        assert_eq!(count(&client, id, worker), Some(0));
        assert_eq!(client.stats().unwrap().pinned_objects, 0);
        // The creator's hold is the last count.
        drop(value);
        assert_eq!(client.stats().unwrap().objects, 0);
    }

    #[test]
    fn a_view_pins_and_a_failed_write_leaves_nothing_behind() {
        let client = node(1 << 20);
        let value = client.put_bytes(ObjectId(1), &[9u8; 5000]).unwrap();
        let view = client.view(ObjectId(1)).unwrap();
        assert!(view.iter().all(|&b| b == 9));
        assert_eq!(client.stats().unwrap().pinned_objects, 1);
        drop(view);
        assert_eq!(client.stats().unwrap().pinned_objects, 0);
        let failed = client.put_with(ObjectId(2), 100, |_| Err(Error::Invalid("no".into())));
        assert!(failed.is_err());
        assert_eq!(client.stats().unwrap().objects, 1);
        let too_large = client.put_bytes(ObjectId(3), &vec![0u8; 2 << 20]).unwrap_err();
        assert!(too_large.to_string().contains("capacity"), "{too_large}");
        drop(value);
        assert!(client.borrow(ObjectId(1)).is_err(), "a freed object cannot be borrowed");
    }
}
