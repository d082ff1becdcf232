//! The per-process runtime: one [`Runtime`] per driver or worker process, reached through
//! [`current`]. It owns the process's endpoint, object table, pending calls and requests, and —
//! in the driver of an embedded session — the control plane (`head::Head`). How each kind of
//! process starts is in `start.rs`, the requests it sends in `requests.rs`, what arrives on its
//! connections in `frames.rs`.

mod frames;
mod requests;
mod role;
mod start;

pub use start::{init, init_with, run_worker_if_requested, shutdown};

pub(crate) use requests::To;
pub use role::{EXIT_HEAD_LOST, Ending};
pub(crate) use role::{ProcessRole, WorkerRole};

use frames::PendingRequest;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use dashmap::DashMap;

use crate::error::{Error, Result};
use crate::ids::{Counter, NodeId, ObjectId, WorkerId};
use crate::object::table::ObjectTable;
use crate::protocol::{Address, Response};
use crate::submit::state::{ActorCall, Submitters};
use crate::transport::{Endpoint, TransportConfig};
pub(crate) use rtrun_proto::address::{socket_name, worker_address};

/// Settings for [`init_with`] (Ray's `ray.init(...)` arguments).
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// CPUs this node offers (default: the machine's cores).
    pub num_cpus: Option<f64>,
    /// GPUs this node offers, a whole number (default: the GPUs detected on the machine, see
    /// [`crate::gpus`]). Fewer than detected uses the first ones; more adds fake GPUs with
    /// synthetic UUIDs, so placement works the same on a machine without GPUs.
    pub num_gpus: Option<f64>,
    /// Custom resources this node offers.
    pub resources: BTreeMap<String, f64>,
    /// Namespace for named actors (default `default`).
    pub namespace: Option<String>,
    /// Transport tunables.
    pub transport: TransportConfig,
    /// Bytes of the node's shared-memory object store (`--object-store-memory`), reserved at
    /// start. Default: 30 % of the smaller of RAM and the cgroup memory limit, between 64 MiB
    /// and 200 GiB (Ray's rule), allocated as objects use it. The store is a memfd, so
    /// /dev/shm's mount size does not limit it.
    pub object_store_memory: Option<u64>,
    /// Where objects go when the store is full: the node makes its own directory
    /// `rtrun-spill-<pid>-<n>` in this one when the first object spills (a run that never
    /// spills leaves nothing on disk). Default: the `RTRUN_OBJECT_SPILL_DIR` environment
    /// variable, else the system temp dir. A node process exits without closing its store, so
    /// a spill directory it used outlives it until the next store opened in the same place
    /// removes the directories of dead processes. Spill files are checksummed: one changed on
    /// disk makes the read fail with an error naming the object, never return wrong bytes.
    pub object_spill_dir: Option<std::path::PathBuf>,
    /// Values whose encoding is longer than this many bytes go to the object store instead of
    /// travelling inline in frames (default `DEFAULT_MAX_INLINE_OBJECT_BYTES`, 100 KiB as in
    /// Ray).
    pub max_inline_object_bytes: Option<usize>,
    /// A cluster head's `host:port` to join instead of starting an embedded session (Ray's
    /// `ray.init(address=...)`); default: the `RTRUN_ADDRESS` environment variable.
    pub address: Option<String>,
    /// The join token, when this process has no credentials yet (default: `RTRUN_TOKEN`, then
    /// the credentials directory's token file).
    pub token: Option<String>,
    /// The credentials directory (default: `RTRUN_CREDENTIALS_DIR`, else
    /// `~/.rtrun/credentials`).
    pub credentials_dir: Option<std::path::PathBuf>,
    /// How long joining a cluster waits for the head to answer, handshakes and retries
    /// included (default: `RTRUN_CONNECT_TIMEOUT` in seconds, else
    /// [`crate::cluster::DEFAULT_CONNECT_TIMEOUT`]).
    pub connect_timeout: Option<Duration>,
}

pub(super) static CURRENT: OnceLock<Arc<Runtime>> = OnceLock::new();

/// The runtime of this process.
pub fn current() -> Result<&'static Arc<Runtime>> {
    CURRENT.get().ok_or(Error::NotInitialised)
}

pub(super) type ResponseCallback = Box<dyn FnOnce(Response) + Send>;

/// One process's runtime.
pub struct Runtime {
    /// This runtime (for the threads it starts from `&self`: a reconnect to the head).
    me: std::sync::Weak<Runtime>,
    /// What this process is, with what that role holds; set once as it starts.
    role: OnceLock<ProcessRole>,
    /// How this process's part in the session ended, once it has.
    ended: role::EndSignal,
    /// Set when this process asked the head to exit (`rtrun stop`): its going is no error.
    head_exit_expected: std::sync::atomic::AtomicBool,
    pub(crate) session: String,
    pub(crate) worker_id: WorkerId,
    pub(crate) node_id: NodeId,
    address: Address,
    object_prefix: u64,
    counter: Counter,
    endpoint: Arc<Endpoint>,
    pub(crate) objects: ObjectTable,
    pub(crate) calls: DashMap<u64, ActorCall>,
    pub(crate) submitters: Submitters,
    requests: DashMap<u64, PendingRequest>,
    /// Requests to a head that restarts, held until this process has reconnected to it (then
    /// sent again) or gives up (then failed).
    parked: parking_lot::Mutex<Vec<(crate::protocol::HeadRequest, ResponseCallback)>>,
    pub(crate) actor_context: parking_lot::Mutex<Option<crate::protocol::ActorStart>>,
    namespace: String,
    tokio: tokio::runtime::Runtime,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Runtime({} {})", self.session, self.worker_id)
    }
}

/// A random 64-bit value from the OS, for session names and object id prefixes.
pub(crate) fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        if f.read_exact(&mut bytes).is_ok() {
            return u64::from_le_bytes(bytes);
        }
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 32)
}

impl Runtime {
    /// The node this process runs on.
    pub fn node(&self) -> NodeId {
        self.node_id
    }

    /// This process's endpoint address.
    pub fn address(&self) -> &Address {
        &self.address
    }

    pub(crate) fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }

    pub(crate) fn tokio(&self) -> &tokio::runtime::Runtime {
        &self.tokio
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.counter.next()
    }

    pub(crate) fn new_object_id(&self) -> ObjectId {
        ObjectId::new(self.object_prefix, self.counter.next())
    }

    /// The id of the object holding the result of call `call_id`.
    pub(crate) fn object_id_for(&self, call_id: u64) -> ObjectId {
        ObjectId::new(self.object_prefix, call_id)
    }

    /// Whether this process made `id`.
    pub(crate) fn owns_object_id(&self, id: ObjectId) -> bool {
        id.process_prefix() == self.object_prefix
    }

    /// The placement group this process's actor captures its children into, if any.
    pub(crate) fn captured_placement(
        &self,
    ) -> Option<rtrun_proto::placement_group::BundleSchedule> {
        let group = self.actor_context.lock().as_ref().and_then(|start| start.capture_group)?;
        Some(rtrun_proto::placement_group::BundleSchedule {
            group,
            bundle_index: None,
            capture_child_tasks: true,
        })
    }

    /// Blocks the calling thread until `deadline` or until `condition` holds, polling.
    pub(crate) fn poll_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if condition() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        condition()
    }
}
