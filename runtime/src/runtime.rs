//! The per-process runtime: one [`Runtime`] per driver or worker process, reached through
//! [`current`]. It owns the process's endpoint, object table, pending calls and requests, and —
//! in the driver of an embedded session — the control plane (`head::Head`).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use dashmap::DashMap;

use crate::actor::{ActorInfo, ActorSpec};
use crate::context::RuntimeContext;
use crate::error::{Error, Result};
use crate::head::{Head, HeadConfig, Responder};
use crate::ids::{ActorId, Counter, DRIVER_WORKER_ID, NodeId, ObjectId, WorkerId};
use crate::object::{ObjectRef, ObjectTable, Slot, Value};
use crate::protocol::{Address, ClusterInfo, Frame, ObjectLocator, Outcome, Request, Response};
use crate::store::{DEFAULT_MAX_INLINE_OBJECT_BYTES, Hold, StoreClient};
use crate::submit::{PendingCall, Submitters};
use crate::task::TaskSpec;
use crate::transport::{Connection, Endpoint, FrameHandler, TransportConfig};
use crate::worker::{HostedActor, TaskExecutor, WorkerSpec};

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

static CURRENT: OnceLock<Arc<Runtime>> = OnceLock::new();

/// The runtime of this process.
pub fn current() -> Result<&'static Arc<Runtime>> {
    CURRENT.get().ok_or(Error::NotInitialised)
}

/// Starts the runtime with default settings: in a driver, an embedded control plane and node
/// with this machine's resources (like `ray.init()`); in a worker process, serves the worker's
/// assignment and never returns.
pub fn init() -> Result<()> {
    init_with(Config::default())
}

/// Like [`init`], with settings. Calling it again in the same process is a no-op.
pub fn init_with(config: Config) -> Result<()> {
    // Already a driver, or a worker (whose actor may call this): nothing to start.
    if CURRENT.get().is_some() {
        return Ok(());
    }
    run_worker_if_requested();
    let address = config.address.clone().or_else(|| {
        std::env::var(crate::cluster::ADDRESS_ENV).ok().filter(|a| !a.trim().is_empty())
    });
    let runtime = match address {
        Some(address) => crate::cluster::start_driver(&config, &address, true)?,
        None => Runtime::start_driver(config)?,
    };
    let _ = CURRENT.set(runtime);
    Ok(())
}

/// Turns this process into a worker when it was started as one (the environment says so), and
/// never returns in that case. Test binaries call this before their harness starts (for
/// example from a `#[ctor]`), since their `main` is not theirs.
pub fn run_worker_if_requested() {
    // A worker's own code calling this (through `init`) is already served.
    if CURRENT.get().is_some() {
        return;
    }
    if let Some(spec) = WorkerSpec::from_env() {
        crate::worker::run(spec);
    }
}

/// Stops every worker process of an embedded session. Later calls fail.
pub fn shutdown() {
    if let Some(head) = current().ok().and_then(|runtime| runtime.head.get()) {
        head.shutdown();
    }
}

/// An `ObjectRef` that already failed with `error` (for calls that could not be submitted).
pub(crate) fn failed_ref<T>(error: Error) -> ObjectRef<T> {
    match current() {
        Ok(runtime) => {
            let id = runtime.new_object_id();
            ObjectRef::from_local(runtime.objects.create_owned(
                runtime,
                id,
                Arc::new(Slot::done(Err(error))),
            ))
        }
        Err(_) => ObjectRef::from_local(crate::object::detached_object(Err(error))),
    }
}

type ResponseCallback = Box<dyn FnOnce(Response) + Send>;

/// The exit code of a process that lost its cluster head, or that the head declared dead
/// (`EX_TEMPFAIL` of sysexits.h: restarting it later may succeed; a restarted `rtrun join`
/// joins as a new node).
pub const EXIT_HEAD_LOST: i32 = 75;

/// What this process is in its session; decides what losing the head means for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProcessKind {
    /// The driver of an embedded session: its own control plane.
    EmbeddedDriver,
    /// `rtrun head`.
    ClusterHead,
    /// `rtrun join`.
    NodeDaemon,
    /// A driver or command-line client of a cluster.
    ClusterDriver,
    /// A worker process, of an embedded session or of a cluster.
    Worker,
}

struct PendingRequest {
    connection: u64,
    /// Behind a mutex only to make the entry `Sync`; it is taken exactly once.
    callback: parking_lot::Mutex<Option<ResponseCallback>>,
}

impl PendingRequest {
    fn answer(self, response: Response) {
        if let Some(callback) = self.callback.into_inner() {
            callback(response);
        }
    }
}

/// One process's runtime.
pub struct Runtime {
    kind: ProcessKind,
    /// Set when this process asked the head to exit (`rtrun stop`): its going is no error.
    head_exit_expected: std::sync::atomic::AtomicBool,
    pub(crate) session: String,
    pub(crate) worker_id: WorkerId,
    pub(crate) node_id: NodeId,
    address: Address,
    object_prefix: u64,
    counter: Counter,
    endpoint: OnceLock<Arc<Endpoint>>,
    pub(crate) objects: ObjectTable,
    pub(crate) calls: DashMap<u64, PendingCall>,
    pub(crate) submitters: Submitters,
    requests: DashMap<u64, PendingRequest>,
    pub(crate) head: OnceLock<Arc<Head>>,
    head_connection: OnceLock<Arc<Connection>>,
    /// A cluster worker's connection to its node daemon (store operations go there).
    node_connection: OnceLock<Arc<Connection>>,
    /// A node daemon's worker supervision.
    node_agent: OnceLock<Arc<crate::cluster::node::NodeAgent>>,
    pub(crate) hosted: OnceLock<Arc<dyn HostedActor>>,
    pub(crate) tasks: OnceLock<Arc<TaskExecutor>>,
    pub(crate) actor_context: parking_lot::Mutex<Option<crate::protocol::ActorStart>>,
    /// This process's access to the node's object store.
    store: OnceLock<Arc<StoreClient>>,
    namespace: String,
    tokio: tokio::runtime::Runtime,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Runtime({} {})", self.session, self.worker_id)
    }
}

struct Handler(Weak<Runtime>);

impl FrameHandler for Handler {
    fn on_frame(&self, conn: &Arc<Connection>, frame: Frame) {
        if let Some(runtime) = self.0.upgrade() {
            runtime.on_frame(conn, frame);
        }
    }

    fn on_close(&self, conn: &Arc<Connection>, reason: &str) {
        if let Some(runtime) = self.0.upgrade() {
            runtime.on_close(conn, reason);
        }
    }

    fn on_sent(&self, conn: &Connection, frame: &Frame) {
        if let Some(runtime) = self.0.upgrade() {
            runtime.on_sent(conn, frame);
        }
    }

    fn handles_inline(&self, frame: &Frame) -> bool {
        match frame {
            // Completing an actor call's slot wakes its waiters; a task reply to the head
            // would run the scheduler, which may block, so those stay on the thread.
            Frame::Reply { call_id, .. } => self.0.upgrade().is_some_and(|runtime| {
                matches!(
                    runtime.calls.get(call_id).as_deref(),
                    Some(crate::submit::PendingCall::Actor(_))
                )
            }),
            // A call to the actor this worker hosts only queues it for the actor's executor.
            Frame::Call(call) => {
                matches!(call.target, crate::protocol::CallTarget::Actor { .. })
                    && self.0.upgrade().is_some_and(|runtime| runtime.hosted.get().is_some())
            }
            _ => false,
        }
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

/// The abstract socket name of `worker` in `session`.
pub(crate) fn socket_name(session: &str, worker: WorkerId) -> String {
    format!("rtrun-{session}-{}", worker.0)
}

/// The endpoint address of `worker` in an embedded `session`.
pub(crate) fn worker_address(session: &str, worker: WorkerId) -> Address {
    format!("unix:@{}", socket_name(session, worker))
}

impl Runtime {
    #[allow(clippy::too_many_arguments)]
    fn new(
        kind: ProcessKind,
        session: String,
        worker_id: WorkerId,
        node_id: NodeId,
        address: Address,
        namespace: String,
        transport: TransportConfig,
        tokio_threads: usize,
    ) -> Result<Arc<Runtime>> {
        let tokio = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(tokio_threads)
            .thread_name("rtrun-async")
            .enable_all()
            .build()
            .map_err(|e| Error::System(format!("cannot start the async runtime: {e}")))?;
        let runtime = Arc::new(Runtime {
            kind,
            head_exit_expected: std::sync::atomic::AtomicBool::new(false),
            session,
            worker_id,
            node_id,
            address: address.clone(),
            object_prefix: random_u64(),
            counter: Counter::starting_at(1),
            endpoint: OnceLock::new(),
            objects: ObjectTable::default(),
            calls: DashMap::new(),
            submitters: Submitters::default(),
            requests: DashMap::new(),
            head: OnceLock::new(),
            head_connection: OnceLock::new(),
            node_connection: OnceLock::new(),
            node_agent: OnceLock::new(),
            hosted: OnceLock::new(),
            tasks: OnceLock::new(),
            actor_context: parking_lot::Mutex::new(None),
            store: OnceLock::new(),
            namespace,
            tokio,
        });
        let handler = Arc::new(Handler(Arc::downgrade(&runtime)));
        let endpoint = Endpoint::bind(address, handler, transport)?;
        let _ = runtime.endpoint.set(endpoint);
        if let Some(member) = crate::cluster::member() {
            runtime.endpoint()?.attach_net(member.link.clone());
        }
        Ok(runtime)
    }

    fn start_driver(config: Config) -> Result<Arc<Runtime>> {
        let session = format!("{:016x}", random_u64());
        let address = worker_address(&session, DRIVER_WORKER_ID);
        Runtime::start_head_process(ProcessKind::EmbeddedDriver, &config, session, address)
    }

    /// A cluster head's runtime: an embedded session's, at a cluster address.
    pub(crate) fn start_cluster_head(
        config: &Config,
        session: String,
        address: Address,
    ) -> Result<Arc<Runtime>> {
        let runtime =
            Runtime::start_head_process(ProcessKind::ClusterHead, config, session, address)?;
        let _ = CURRENT.set(runtime.clone());
        Ok(runtime)
    }

    /// A node daemon's runtime: the node's store and worker supervision, connected to the head.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_cluster_node(
        config: &Config,
        session: String,
        worker: WorkerId,
        node: u64,
        address: Address,
        head_address: Address,
        agent: crate::cluster::node::NodeAgentConfig,
    ) -> Result<Arc<Runtime>> {
        let namespace = config.namespace.clone().unwrap_or_else(|| "default".to_owned());
        let runtime = Runtime::new(
            ProcessKind::NodeDaemon,
            session,
            worker,
            NodeId(node),
            address,
            namespace,
            config.transport.clone(),
            2,
        )?;
        runtime.open_store(config, worker)?;
        let agent = crate::cluster::node::NodeAgent::start(&runtime, agent)?;
        let _ = runtime.node_agent.set(agent);
        let conn = runtime.endpoint()?.connect(&head_address)?;
        let _ = runtime.head_connection.set(conn);
        let _ = CURRENT.set(runtime.clone());
        Ok(runtime)
    }

    /// A driver (or command-line client) of a cluster: no store of its own, the head remote.
    pub(crate) fn start_cluster_driver(
        config: &Config,
        session: String,
        worker: WorkerId,
        node: u64,
        address: Address,
        head_address: Address,
    ) -> Result<Arc<Runtime>> {
        let namespace = config.namespace.clone().unwrap_or_else(|| "default".to_owned());
        let runtime = Runtime::new(
            ProcessKind::ClusterDriver,
            session,
            worker,
            NodeId(node),
            address,
            namespace,
            config.transport.clone(),
            2,
        )?;
        let conn = runtime.endpoint()?.connect(&head_address)?;
        let _ = runtime.head_connection.set(conn);
        Ok(runtime)
    }

    /// Opens the node's object store in this process (an embedded driver, a head, a node).
    fn open_store(self: &Arc<Self>, config: &Config, worker: WorkerId) -> Result<()> {
        // An explicit capacity is reserved up front (an error now rather than memory pressure
        // later); the default one, 30 % of RAM, is only address space until objects use it, as
        // in Ray, so that a driver does not take gigabytes it may never need.
        let mut store_config = match config.object_store_memory {
            Some(bytes) => rtrun_object_store::StoreConfig::with_capacity(bytes),
            None => rtrun_object_store::StoreConfig {
                reserve: false,
                ..rtrun_object_store::StoreConfig::default()
            },
        };
        store_config.spill_dir = config.object_spill_dir.clone();
        let max_inline = config.max_inline_object_bytes.unwrap_or(DEFAULT_MAX_INLINE_OBJECT_BYTES);
        let store = StoreClient::open_node(
            Arc::downgrade(self),
            crate::store::holder_of(worker),
            store_config,
            max_inline,
        )?;
        let _ = self.store.set(store);
        Ok(())
    }

    fn start_head_process(
        kind: ProcessKind,
        config: &Config,
        session: String,
        address: Address,
    ) -> Result<Arc<Runtime>> {
        let namespace = config.namespace.clone().unwrap_or_else(|| "default".to_owned());
        let runtime = Runtime::new(
            kind,
            session.clone(),
            DRIVER_WORKER_ID,
            NodeId(0),
            address,
            namespace,
            config.transport.clone(),
            2,
        )?;
        runtime.open_store(config, DRIVER_WORKER_ID)?;
        let head = Head::start(&runtime, HeadConfig::from_runtime_config(config)?)?;
        let _ = runtime.head.set(head);
        tracing::debug!(session = %session, "embedded runtime started");
        Ok(runtime)
    }

    /// Starts a worker process's runtime and connects it to the head.
    pub(crate) fn start_worker(spec: &WorkerSpec) -> Result<Arc<Runtime>> {
        let name = socket_name(&spec.session, spec.worker);
        let (node, node_address, address) = match crate::cluster::start_worker_link(&name)? {
            Some((node, node_address, address)) => (NodeId(node), Some(node_address), address),
            None => (NodeId(0), None, worker_address(&spec.session, spec.worker)),
        };
        let runtime = Runtime::new(
            ProcessKind::Worker,
            spec.session.clone(),
            spec.worker,
            node,
            address,
            spec.namespace.clone(),
            TransportConfig::default(),
            2,
        )?;
        let holder = crate::store::holder_of(spec.worker);
        if let Some(store) = StoreClient::attach_worker(Arc::downgrade(&runtime), holder)? {
            let _ = runtime.store.set(store);
        }
        if let Some(node_address) = node_address {
            let conn = runtime.endpoint()?.connect(&node_address)?;
            let _ = runtime.node_connection.set(conn);
        }
        let conn = runtime.endpoint()?.connect(&spec.head_address)?;
        let _ = runtime.head_connection.set(conn);
        let _ = CURRENT.set(runtime.clone());
        Ok(runtime)
    }

    /// The node this process runs on.
    pub fn node(&self) -> NodeId {
        self.node_id
    }

    /// This process's endpoint address.
    pub fn address(&self) -> &Address {
        &self.address
    }

    pub(crate) fn endpoint(&self) -> Result<&Arc<Endpoint>> {
        self.endpoint.get().ok_or(Error::NotInitialised)
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

    pub(crate) fn context(&self) -> RuntimeContext {
        let start = self.actor_context.lock();
        let allocation = start.as_ref().and_then(|s| s.allocation.as_ref());
        RuntimeContext {
            node_id: self.node_id,
            worker_id: self.worker_id,
            actor_id: start.as_ref().map(|s| s.actor),
            incarnation: start.as_ref().map(|s| s.incarnation).unwrap_or(0),
            actor_name: start.as_ref().and_then(|s| s.name.clone()),
            group: start.as_ref().and_then(|s| s.group.clone()),
            session: self.session.clone(),
            placement_node: allocation.map(|a| a.node.to_string()),
            gpus: allocation.map(|a| a.gpus.clone()).unwrap_or_default(),
            resources: allocation.map(|a| a.resources.clone()).unwrap_or_default(),
            bundle: allocation.and_then(|a| a.bundle),
            node_ip: crate::cluster::member()
                .map_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), |member| {
                    member.bind_ip
                }),
        }
    }

    /// This process's access to the node's object store.
    pub(crate) fn store_client(&self) -> Result<&Arc<StoreClient>> {
        self.store.get().ok_or_else(|| {
            Error::ObjectStore("this process is not attached to its node's object store".into())
        })
    }

    /// Encoded bytes as a value: inline when small or when they carry references (`refs`),
    /// else written into the node's store.
    pub(crate) fn value_of(
        self: &Arc<Self>,
        bytes: Vec<u8>,
        refs: Vec<crate::object::StoredValue>,
    ) -> Result<Value> {
        if !refs.is_empty() {
            return Ok(Value::Nested { bytes: Arc::new(bytes), refs: Arc::new(refs) });
        }
        match self.store.get() {
            Some(store) if bytes.len() > store.max_inline() => {
                Ok(Value::Stored(store.put_bytes(self.new_object_id(), &bytes)?))
            }
            _ => Ok(Value::inline(bytes)),
        }
    }

    /// The placement group this process's actor captures its children into, if any.
    pub(crate) fn captured_placement(&self) -> Option<crate::placement_group::BundleSchedule> {
        let group = self.actor_context.lock().as_ref().and_then(|start| start.capture_group)?;
        Some(crate::placement_group::BundleSchedule {
            group,
            bundle_index: None,
            capture_child_tasks: true,
        })
    }

    /// Stores encoded bytes as a new object owned by this process.
    pub(crate) fn put_encoded<T>(
        self: &Arc<Self>,
        bytes: Vec<u8>,
        refs: Vec<crate::object::StoredValue>,
    ) -> Result<ObjectRef<T>> {
        let value = self.value_of(bytes, refs)?;
        let id = self.new_object_id();
        let slot = Arc::new(Slot::done(Ok(value)));
        Ok(ObjectRef::from_local(self.objects.create_owned(self, id, slot)))
    }

    /// Stores `size` raw bytes that `write` produces in place: in the node's store when over
    /// the inline limit, else inline.
    pub(crate) fn put_raw<T>(
        self: &Arc<Self>,
        size: u64,
        write: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<ObjectRef<T>> {
        let id = self.new_object_id();
        let value = match self.store.get() {
            Some(store) if size > store.max_inline() as u64 => {
                Value::Stored(store.put_with(id, size, write)?)
            }
            _ => {
                let len = usize::try_from(size).map_err(|_| {
                    Error::Invalid(format!("an object of {size} bytes does not fit in memory"))
                })?;
                let mut bytes = vec![0u8; len];
                write(&mut bytes)?;
                Value::inline(bytes)
            }
        };
        let slot = Arc::new(Slot::done(Ok(value)));
        Ok(ObjectRef::from_local(self.objects.create_owned(self, id, slot)))
    }

    /// The node's object-store snapshot (asked of the node from a worker).
    pub fn memory_stats(&self) -> Result<rtrun_object_store::StoreStats> {
        self.store_client()?.stats()
    }

    /// A worker process exited: the node releases its store references and pins.
    pub(crate) fn on_process_exit(&self, worker: WorkerId) {
        if let Some(store) = self.store.get() {
            store.process_exited(crate::store::holder_of(worker));
        }
    }

    /// The arena fd and environment that a spawned worker needs to attach to the store.
    pub(crate) fn store_inheritance(&self) -> Option<(std::os::fd::RawFd, Vec<(String, String)>)> {
        self.store.get().map(|store| store.inheritance())
    }

    /// Sends a request to the control plane; `callback` gets the response (or an error response
    /// when the head connection closes first).
    pub(crate) fn head_request(self: &Arc<Self>, body: Request, callback: ResponseCallback) {
        if let Some(head) = self.head.get() {
            head.handle(None, body, Responder::local(callback));
            return;
        }
        match self.head_connection.get() {
            Some(conn) => self.request_on(conn, body, callback),
            None => callback(Response::Error(Error::NotInitialised)),
        }
    }

    /// Sends a request to this process's node (its store): the node daemon's connection in a
    /// cluster worker, else the control plane's (which is also the node).
    pub(crate) fn node_request(self: &Arc<Self>, body: Request, callback: ResponseCallback) {
        match self.node_connection.get() {
            Some(conn) => self.request_on(conn, body, callback),
            None => self.head_request(body, callback),
        }
    }

    /// Like [`Runtime::node_request`], blocking for the answer.
    pub(crate) fn node_call(self: &Arc<Self>, body: Request) -> Result<Response> {
        wait_response("the node", |callback| self.node_request(body, callback))
    }

    /// Sends a request to the control plane and blocks for the response. Never call this from a
    /// connection's reader thread.
    pub(crate) fn head_call(self: &Arc<Self>, body: Request) -> Result<Response> {
        let result =
            wait_response("the control plane", |callback| self.head_request(body, callback));
        // A request that failed because the head's connection closed (before its reader
        // thread got to say so) ends the process the same way.
        if let Err(e) = &result
            && let Some(conn) = self.head_connection.get().filter(|c| c.is_closed())
        {
            self.on_head_lost(conn, &e.to_string());
        }
        result
    }

    /// Sends a request on `conn` and blocks for the response.
    pub(crate) fn call_on(&self, conn: &Arc<Connection>, body: Request) -> Result<Response> {
        wait_response("the peer", |callback| self.request_on(conn, body, callback))
    }

    /// Sends a request on `conn`.
    pub(crate) fn request_on(
        &self,
        conn: &Arc<Connection>,
        body: Request,
        callback: ResponseCallback,
    ) {
        let req_id = self.next_id();
        self.requests.insert(
            req_id,
            PendingRequest {
                connection: conn.id(),
                callback: parking_lot::Mutex::new(Some(callback)),
            },
        );
        if let Err(e) = conn.send(&Frame::Request { req_id, body })
            && let Some((_, pending)) = self.requests.remove(&req_id)
        {
            pending.answer(Response::Error(e));
        }
    }

    /// Fetches an object's value from its owner into `slot`.
    pub(crate) fn fetch_object(&self, id: ObjectId, owner: &Address, slot: Arc<Slot>) {
        let conn = match self.endpoint().and_then(|e| e.connect(owner)) {
            Ok(conn) => conn,
            Err(e) => {
                slot.complete(Err(Error::ObjectLost {
                    id,
                    reason: format!("its owner {owner} is unreachable: {e}"),
                }));
                return;
            }
        };
        self.request_on(
            &conn,
            Request::FetchObject { id },
            Box::new(move |response| {
                let result = match response {
                    Response::Outcome(outcome) => outcome_to_result(outcome),
                    Response::Error(e) => Err(e),
                    other => Err(Error::Transport(format!("unexpected fetch response {other:?}"))),
                };
                let result = result.map_err(|e| match e {
                    Error::Transport(reason) => Error::ObjectLost { id, reason },
                    e => e,
                });
                slot.complete(result);
            }),
        );
    }

    /// Frees an object, here if we own it, else at its owner.
    pub(crate) fn free_object(&self, locator: &ObjectLocator) {
        if &locator.owner == self.address() {
            self.objects.free_owned(locator.id);
        } else if let Ok(conn) = self.endpoint().and_then(|e| e.connect(&locator.owner)) {
            self.request_on(
                &conn,
                Request::FreeObjects { ids: vec![locator.id] },
                Box::new(|_| {}),
            );
        }
    }

    pub(crate) fn create_actor(self: &Arc<Self>, mut spec: ActorSpec) -> Result<ActorInfo> {
        if crate::registry::actor_type(&spec.type_name).is_none() {
            return Err(Error::Invalid(format!(
                "actor type {} is not compiled into this binary",
                spec.type_name
            )));
        }
        if spec.options.namespace.is_none() && spec.options.name.is_some() {
            spec.options.namespace = Some(self.namespace.clone());
        }
        match self.head_call(Request::CreateActor(Box::new(spec)))? {
            Response::Actor(info) => Ok(info),
            other => Err(Error::Transport(format!("unexpected response {other:?}"))),
        }
    }

    pub(crate) fn get_actor_by_name(
        self: &Arc<Self>,
        name: &str,
        namespace: Option<&str>,
    ) -> Result<ActorInfo> {
        let namespace = namespace.unwrap_or(&self.namespace).to_owned();
        match self.head_call(Request::GetActorByName { name: name.to_owned(), namespace })? {
            Response::Actor(info) => Ok(info),
            other => Err(Error::Transport(format!("unexpected response {other:?}"))),
        }
    }

    /// Every actor the control plane knows, dead ones included.
    pub(crate) fn list_actors(self: &Arc<Self>) -> Result<Vec<crate::protocol::ActorSummary>> {
        match self.head_call(Request::ListActors)? {
            Response::Actors(actors) => Ok(actors),
            other => Err(Error::Transport(format!("unexpected response {other:?}"))),
        }
    }

    /// Every live placement group.
    pub(crate) fn list_placement_groups(
        self: &Arc<Self>,
    ) -> Result<Vec<crate::placement_group::PlacementGroupState>> {
        match self.head_call(Request::ListPlacementGroups)? {
            Response::PlacementGroups(groups) => Ok(groups),
            other => Err(Error::Transport(format!("unexpected response {other:?}"))),
        }
    }

    /// Every submitted job.
    pub(crate) fn list_jobs(self: &Arc<Self>) -> Result<Vec<crate::protocol::JobInfo>> {
        match self.head_call(Request::ListJobs)? {
            Response::Jobs(jobs) => Ok(jobs),
            other => Err(Error::Transport(format!("unexpected response {other:?}"))),
        }
    }

    /// Whether this process holds the control plane (a cluster head or an embedded driver).
    pub(crate) fn holds_control_plane(&self) -> bool {
        self.head.get().is_some()
    }

    /// The object store's snapshot when this process is a node (its store lives here).
    pub(crate) fn node_store_stats(&self) -> Result<Option<rtrun_object_store::StoreStats>> {
        let Ok(client) = self.store_client() else { return Ok(None) };
        Ok(client.node_store().map(|store| store.stats()))
    }

    /// The namespace names default to.
    pub(crate) fn namespace(&self) -> &str {
        &self.namespace
    }

    pub(crate) fn kill_actor(self: &Arc<Self>, actor: ActorId, no_restart: bool) -> Result<()> {
        self.head_call(Request::KillActor { actor, no_restart }).map(|_| ())
    }

    /// Submits a task; its result arrives as the head's response.
    pub(crate) fn submit_task<T>(
        self: &Arc<Self>,
        function: String,
        args: Vec<crate::protocol::Arg>,
        options: crate::task::TaskOptions,
    ) -> ObjectRef<T> {
        if crate::registry::task(&function).is_none() {
            return failed_ref(Error::Invalid(format!(
                "remote function {function} is not compiled into this binary"
            )));
        }
        let id = self.new_object_id();
        let spec = TaskSpec { task: id, function, args, options };
        let slot = Arc::new(Slot::default());
        let object = self.objects.create_owned(self, id, slot.clone());
        let target = spec.function.clone();
        self.head_request(
            Request::SubmitTask(Box::new(spec)),
            Box::new(move |response| {
                slot.complete(match response {
                    Response::Outcome(outcome) => outcome_to_result(outcome),
                    Response::Error(e) => Err(e),
                    other => Err(Error::Transport(format!(
                        "unexpected response to task {target}: {other:?}"
                    ))),
                })
            }),
        );
        ObjectRef::from_local(object)
    }

    /// A summary of the cluster's resources and workers.
    pub fn cluster_info(self: &Arc<Self>) -> Result<ClusterInfo> {
        match self.head_call(Request::ClusterInfo)? {
            Response::ClusterInfo(info) => Ok(info),
            other => Err(Error::Transport(format!("unexpected response {other:?}"))),
        }
    }

    fn on_frame(self: &Arc<Self>, conn: &Arc<Connection>, mut frame: Frame) {
        // Every stored value that arrives came with a count its sender added for this process,
        // at the store of the value's home node.
        frame.visit_stored_mut(&mut |value| {
            if value.hold.is_some() {
                return;
            }
            if self.is_foreign(value) {
                let home = value.home.clone().unwrap_or_default();
                value.hold = Some(Hold::adopt_remote(self, home, value.id));
            } else if let Some(store) = self.store.get() {
                value.hold = Some(Hold::adopt(store, value.id));
            }
        });
        match frame {
            Frame::Hello { address } => conn.set_peer(address),
            Frame::Call(call) => crate::worker::on_call(self, conn, call),
            Frame::Reply { call_id, outcome } => self.on_reply(call_id, outcome),
            Frame::Cancel { call_id } => {
                if let Some(hosted) = self.hosted.get() {
                    hosted.cancel(call_id);
                } else if let Some(tasks) = self.tasks.get() {
                    tasks.cancel(call_id);
                }
            }
            Frame::Request { req_id, body } => self.on_request(conn, req_id, body),
            Frame::Response { req_id, body } => {
                if let Some((_, pending)) = self.requests.remove(&req_id) {
                    pending.answer(body);
                }
            }
        }
    }

    fn on_reply(self: &Arc<Self>, call_id: u64, outcome: Outcome) {
        match self.calls.remove(&call_id) {
            Some((_, PendingCall::Actor(call))) => {
                call.latency.observe(call.started.elapsed().as_secs_f64());
                call.slot.complete(outcome_to_result(outcome))
            }
            Some((_, PendingCall::HeadTask)) => {
                if let Some(head) = self.head.get() {
                    head.on_task_reply(call_id, outcome);
                }
            }
            None => {}
        }
    }

    fn on_request(self: &Arc<Self>, conn: &Arc<Connection>, req_id: u64, body: Request) {
        let responder = Responder::remote(conn.clone(), req_id);
        match body {
            Request::FetchObject { id } => match self.objects.find_slot(id) {
                None => {
                    responder.respond(Response::Outcome(Outcome::Error(Error::ObjectFreed(id))))
                }
                Some(slot) => slot.on_done(move |result| {
                    responder.respond(Response::Outcome(match result {
                        Ok(Value::Inline(bytes)) => Outcome::Value(bytes.as_ref().clone()),
                        Ok(Value::Nested { bytes, refs }) => Outcome::Nested {
                            bytes: bytes.as_ref().clone(),
                            refs: refs.as_ref().clone(),
                        },
                        Ok(Value::Stored(stored)) => Outcome::Stored(stored.clone()),
                        Err(e) => Outcome::Error(e.clone()),
                    }))
                }),
            },
            Request::Store { holder, op: crate::protocol::StoreOp::Pull { id, from } } => {
                // A transfer from another node: not on this connection's reader thread.
                let runtime = self.clone();
                std::thread::spawn(move || {
                    responder.respond(
                        match crate::cluster::pull_into_node(&runtime, id, &from, holder) {
                            Ok(()) => Response::Done,
                            Err(e) => Response::Error(e),
                        },
                    )
                });
            }
            Request::Store { holder, op } => match self.store.get() {
                Some(store) => responder.respond(store.handle_remote(self, holder, op)),
                None => responder.respond(Response::Error(Error::ObjectStore(
                    "this process has no object store".into(),
                ))),
            },
            Request::FreeObjects { ids } => {
                for id in ids {
                    self.objects.free_owned(id);
                }
                responder.respond(Response::Done);
            }
            body @ (Request::SpawnWorker { .. }
            | Request::KillProcess { .. }
            | Request::ProcessExited { .. }
            | Request::StopNode { .. }) => match self.node_agent.get() {
                Some(agent) => agent.handle(body, Box::new(move |r| responder.respond(r))),
                None => responder.respond(Response::Error(Error::Invalid(format!(
                    "{} is not a node daemon; cannot answer {body:?}",
                    self.worker_id
                )))),
            },
            // A node's logs: its daemon's; the head serves its own node's.
            body @ (Request::ReadLog { .. } | Request::ListLogs)
                if let Some(agent) = self.node_agent.get() =>
            {
                agent.handle(body, Box::new(move |r| responder.respond(r)))
            }
            body => match self.head.get() {
                Some(head) => head.handle(Some(conn), body, responder),
                None => responder.respond(Response::Error(Error::Invalid(format!(
                    "{} is not the control plane; cannot answer {body:?}",
                    self.worker_id
                )))),
            },
        }
    }

    /// A frame went out on `conn`: add a count for the receiver of every stored value in it
    /// (the sender's own count is alive until the frame is dropped, after this).
    fn on_sent(&self, conn: &Connection, frame: &Frame) {
        frame.visit_stored(&mut |value| {
            let Some(peer) = conn.peer().as_deref().and_then(crate::store::holder_of_address) else {
                tracing::warn!(object = %value.id, "a stored value was sent to a peer of unknown identity");
                return;
            };
            match (&value.home, self.store.get()) {
                (Some(home), _) if self.is_foreign(value) => {
                    self.notify_store_at(home, crate::protocol::StoreOp::Lend { id: value.id, to: peer })
                }
                (_, Some(store)) => store.lend(value.id, peer),
                (_, None) => {}
            }
        });
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
        let holder = crate::store::holder_of(self.worker_id);
        match self.endpoint().and_then(|e| e.connect(&home.to_owned())) {
            Ok(conn) => self.request_on(
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
            && let Err(e) = self.head_call(Request::NodeAlive { node })
        {
            return Err(lost(format!("its node is gone: {e}")));
        }
        if let Some(store) = self.store.get() {
            let op = crate::protocol::StoreOp::Pull { id: stored.id, from: home.clone() };
            self.node_call(Request::Store { holder: crate::store::holder_of(self.worker_id), op })
                .map_err(|e| lost(format!("copying it from {home}: {e}")))?;
            // The pull gave this process a count on the copy; it goes with the view.
            let count = crate::store::Hold::adopt(store, stored.id);
            return Ok(crate::object::ObjectBytes::mapped_copy(store.view(stored.id)?, count));
        }
        let bytes =
            crate::cluster::pull_to_memory(&home, stored.id).map_err(|e| lost(e.to_string()))?;
        Ok(crate::object::ObjectBytes::inline(bytes))
    }

    fn on_close(self: &Arc<Self>, conn: &Arc<Connection>, reason: &str) {
        // First, so that no caller that would see its request fail can exit with another code.
        // The head learns of worker deaths from the reaper (waitpid), not from closed sockets.
        if self.head_connection.get().is_some_and(|h| h.id() == conn.id()) {
            self.on_head_lost(conn, reason);
        }
        let failed: Vec<u64> =
            self.requests.iter().filter(|r| r.connection == conn.id()).map(|r| *r.key()).collect();
        for req_id in failed {
            if let Some((_, pending)) = self.requests.remove(&req_id) {
                pending.answer(Response::Error(Error::Transport(format!(
                    "connection to {} closed: {reason}",
                    conn.peer().unwrap_or_default()
                ))));
            }
        }
        self.submitters.on_connection_closed(self, conn);
        // A driver of a cluster went away: its job's actors go with it.
        if let Some(head) = self.head.get()
            && let Some(holder) = conn.peer().as_deref().and_then(crate::store::holder_of_address)
        {
            head.on_driver_gone(WorkerId(holder.0));
        }
    }

    /// Tells this process that the head is about to exit at its request (`rtrun stop`), so
    /// that the connection closing is not reported as a failure.
    pub(crate) fn expect_head_exit(&self) {
        self.head_exit_expected.store(true, std::sync::atomic::Ordering::Release);
    }

    /// The connection to the control plane closed. A process of a cluster cannot go on
    /// without it: it says so and exits with [`EXIT_HEAD_LOST`] (schedulers, CI and
    /// Kubernetes read exit codes), a node daemon after stopping its workers. A worker of an
    /// embedded session exits quietly: its driver leaving is how a session ends.
    fn on_head_lost(&self, conn: &Connection, reason: &str) {
        let expected = self.head_exit_expected.load(std::sync::atomic::Ordering::Acquire);
        if expected || crate::cluster::exiting() {
            if self.kind == ProcessKind::Worker {
                std::process::exit(0);
            }
            return;
        }
        let peer = conn.peer().unwrap_or_default();
        let head = match crate::transport::Route::parse(&peer) {
            Ok(crate::transport::Route::Quic { addr, .. }) => addr.to_string(),
            _ => peer,
        };
        let message = match self.kind {
            ProcessKind::Worker if crate::cluster::member().is_none() => std::process::exit(0),
            ProcessKind::EmbeddedDriver | ProcessKind::ClusterHead => return,
            ProcessKind::Worker => {
                format!(
                    "worker {}: lost the connection to the cluster head at {head}: {reason}; exiting",
                    self.worker_id
                )
            }
            ProcessKind::NodeDaemon => {
                if let Some(agent) = self.node_agent.get() {
                    agent.stop();
                }
                format!(
                    "rtrun join: lost the connection to the cluster head at {head}: {reason}; \
                     stopped this node's workers and exiting (restart `rtrun join` to rejoin)"
                )
            }
            ProcessKind::ClusterDriver => {
                format!("rtrun: lost the connection to the cluster head at {head}: {reason}")
            }
        };
        // Printed, not only logged: the process ends here, and it may have no log subscriber.
        eprintln!("{message}");
        std::process::exit(EXIT_HEAD_LOST);
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

/// Sends a request through `send` and blocks for its response; an error response is an `Err`.
fn wait_response(who: &str, send: impl FnOnce(ResponseCallback)) -> Result<Response> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    send(Box::new(move |response| {
        let _ = tx.send(response);
    }));
    match rx.recv() {
        Ok(Response::Error(e)) => Err(e),
        Ok(response) => Ok(response),
        Err(_) => Err(Error::Transport(format!("{who} went away"))),
    }
}

/// Turns a call outcome into the object's result.
pub(crate) fn outcome_to_result(outcome: Outcome) -> Result<Value> {
    match outcome {
        Outcome::Value(bytes) => Ok(Value::inline(bytes)),
        Outcome::Nested { bytes, refs } => {
            Ok(Value::Nested { bytes: Arc::new(bytes), refs: Arc::new(refs) })
        }
        Outcome::Stored(stored) => Ok(Value::Stored(stored)),
        Outcome::Error(e) => Err(e),
    }
}
