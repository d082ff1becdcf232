//! The per-process runtime: one [`Runtime`] per driver or worker process, reached through
//! [`current`]. It owns the process's endpoint, object table, pending calls and requests, and —
//! in the driver of an embedded session — the control plane ([`crate::head::Head`]).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use dashmap::DashMap;

use crate::actor::{ActorInfo, ActorSpec};
use crate::context::RuntimeContext;
use crate::error::{Error, Result};
use crate::head::{Head, HeadConfig, Responder};
use crate::ids::{ActorId, Counter, DRIVER_WORKER_ID, NodeId, ObjectId, WorkerId};
use crate::object::{ObjectBytes, ObjectRef, ObjectTable, Slot};
use crate::protocol::{Address, ClusterInfo, Frame, ObjectLocator, Outcome, Request, Response};
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
    run_worker_if_requested();
    if CURRENT.get().is_some() {
        return Ok(());
    }
    let runtime = Runtime::start_driver(config)?;
    let _ = CURRENT.set(runtime);
    Ok(())
}

/// Turns this process into a worker when it was started as one (the environment says so), and
/// never returns in that case. Test binaries call this before their harness starts (for
/// example from a `#[ctor]`), since their `main` is not theirs.
pub fn run_worker_if_requested() {
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
    pub(crate) hosted: OnceLock<Arc<dyn HostedActor>>,
    pub(crate) tasks: OnceLock<Arc<TaskExecutor>>,
    pub(crate) actor_context: parking_lot::Mutex<Option<crate::protocol::ActorStart>>,
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

/// The endpoint address of `worker` in `session`.
pub(crate) fn worker_address(session: &str, worker: WorkerId) -> Address {
    format!("unix:@rtrun-{session}-{}", worker.0)
}

impl Runtime {
    fn new(
        session: String,
        worker_id: WorkerId,
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
        let address = worker_address(&session, worker_id);
        let runtime = Arc::new(Runtime {
            session,
            worker_id,
            node_id: NodeId(0),
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
            hosted: OnceLock::new(),
            tasks: OnceLock::new(),
            actor_context: parking_lot::Mutex::new(None),
            namespace,
            tokio,
        });
        let handler = Arc::new(Handler(Arc::downgrade(&runtime)));
        let endpoint = Endpoint::bind(address, handler, transport)?;
        let _ = runtime.endpoint.set(endpoint);
        Ok(runtime)
    }

    fn start_driver(config: Config) -> Result<Arc<Runtime>> {
        let session = format!("{:016x}", random_u64());
        let namespace = config.namespace.clone().unwrap_or_else(|| "default".to_owned());
        let runtime = Runtime::new(
            session.clone(),
            DRIVER_WORKER_ID,
            namespace,
            config.transport.clone(),
            2,
        )?;
        let head = Head::start(&runtime, HeadConfig::from_runtime_config(&config)?)?;
        let _ = runtime.head.set(head);
        tracing::debug!(session = %session, "embedded runtime started");
        Ok(runtime)
    }

    /// Starts a worker process's runtime and connects it to the head.
    pub(crate) fn start_worker(spec: &WorkerSpec) -> Result<Arc<Runtime>> {
        let runtime = Runtime::new(
            spec.session.clone(),
            spec.worker,
            spec.namespace.clone(),
            TransportConfig::default(),
            2,
        )?;
        let conn = runtime.endpoint()?.connect(&spec.head_address)?;
        let _ = runtime.head_connection.set(conn);
        let _ = CURRENT.set(runtime.clone());
        Ok(runtime)
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
    pub(crate) fn put_encoded<T>(self: &Arc<Self>, bytes: Vec<u8>) -> ObjectRef<T> {
        let id = self.new_object_id();
        let slot = Arc::new(Slot::done(Ok(Arc::new(bytes))));
        ObjectRef::from_local(self.objects.create_owned(self, id, slot))
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

    /// Sends a request to the control plane and blocks for the response. Never call this from a
    /// connection's reader thread.
    pub(crate) fn head_call(self: &Arc<Self>, body: Request) -> Result<Response> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.head_request(
            body,
            Box::new(move |response| {
                let _ = tx.send(response);
            }),
        );
        match rx.recv() {
            Ok(Response::Error(e)) => Err(e),
            Ok(response) => Ok(response),
            Err(_) => Err(Error::Transport("the control plane went away".into())),
        }
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
                    Response::Outcome(Outcome::Value(bytes)) => Ok(Arc::new(bytes)),
                    Response::Outcome(Outcome::Error(e)) | Response::Error(e) => Err(e),
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

    fn on_frame(self: &Arc<Self>, conn: &Arc<Connection>, frame: Frame) {
        match frame {
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
            Some((_, PendingCall::Actor(call))) => call.slot.complete(outcome_to_result(outcome)),
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
                        Ok(bytes) => Outcome::Value(bytes.as_ref().clone()),
                        Err(e) => Outcome::Error(e.clone()),
                    }))
                }),
            },
            Request::FreeObjects { ids } => {
                for id in ids {
                    self.objects.free_owned(id);
                }
                responder.respond(Response::Done);
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

    fn on_close(self: &Arc<Self>, conn: &Arc<Connection>, reason: &str) {
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
        // The head learns of worker deaths from the reaper (waitpid), not from closed sockets.
        if self.head_connection.get().is_some_and(|h| h.id() == conn.id()) {
            // The control plane (the driver, in an embedded session) is gone: so is this worker.
            std::process::exit(0);
        }
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

/// Turns a call outcome into the object's result.
pub(crate) fn outcome_to_result(outcome: Outcome) -> Result<ObjectBytes> {
    match outcome {
        Outcome::Value(bytes) => Ok(Arc::new(bytes)),
        Outcome::Error(e) => Err(e),
    }
}
