//! The messages processes exchange. Only the runtime's `transport` module knows how they are
//! framed and encoded; everything else builds and matches these types.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::ids::{ActorId, ObjectId, WorkerId};
use crate::object::StoredValue;
use rtrun_object_store::{Allocation, HolderId, StoreStats};

pub use crate::address::Address;
pub use serde_bytes::ByteBuf;

/// One frame on a connection.
#[derive(Debug, Serialize, Deserialize)]
pub enum Frame {
    /// Run a method or a task.
    Call(CallFrame),
    /// The outcome of an actor call, sent back on the connection the call came in on.
    Reply {
        /// The call's id, chosen by the caller.
        call_id: u64,
        /// Its result.
        outcome: Outcome,
    },
    /// The outcome of a task the head dispatched: its own frame, so the head's task calls and
    /// a process's actor calls have separate tables and id spaces.
    TaskReply {
        /// The head's id of the dispatch.
        call_id: u64,
        /// Its result.
        outcome: Outcome,
    },
    /// Ask not to run a call that has not started (or to abort an async one).
    Cancel {
        /// The call's id.
        call_id: u64,
    },
    /// A request to the control plane, to an object's owner, or from the head to a worker.
    Request {
        /// Chosen by the requester, echoed in the response.
        req_id: u64,
        /// What is asked.
        body: Request,
    },
    /// The answer to a request.
    Response {
        /// The request's id.
        req_id: u64,
        /// The answer.
        body: Response,
    },
    /// The first frame on every connection: who connected. The acceptor needs the peer's
    /// identity to account the store references that frames it sends carry.
    Hello {
        /// The connecting process's listening endpoint.
        address: Address,
    },
}

impl Frame {
    /// Calls `visit` on every stored value this frame carries (arguments, outcomes).
    pub fn visit_stored(&self, visit: &mut dyn FnMut(&StoredValue)) {
        let visit_args = |args: &[Arg], visit: &mut dyn FnMut(&StoredValue)| {
            for arg in args {
                match arg {
                    Arg::Stored(value) => visit(value),
                    Arg::Nested { refs, .. } => refs.iter().for_each(&mut *visit),
                    Arg::Inline(_) | Arg::Ref(_) => {}
                }
            }
        };
        let visit_outcome = |outcome: &Outcome, visit: &mut dyn FnMut(&StoredValue)| match outcome {
            Outcome::Stored(value) => visit(value),
            Outcome::Nested { refs, .. } => refs.iter().for_each(visit),
            Outcome::Value(_) | Outcome::Error(_) => {}
        };
        match self {
            Frame::Call(call) => visit_args(&call.args, visit),
            Frame::Reply { outcome, .. } | Frame::TaskReply { outcome, .. } => {
                visit_outcome(outcome, visit)
            }
            Frame::Request { body: Request::Head(HeadRequest::SubmitTask(spec)), .. } => {
                visit_args(&spec.args, visit)
            }
            Frame::Request { body: Request::Head(HeadRequest::CreateActor(spec)), .. } => {
                visit_args(&spec.ctor_args, visit)
            }
            Frame::Response { body: Response::Outcome(outcome), .. } => {
                visit_outcome(outcome, visit)
            }
            Frame::Response { body: Response::Assignment(Assignment::Actor(start)), .. } => {
                visit_args(&start.ctor_args, visit)
            }
            _ => {}
        }
    }

    /// Like [`Frame::visit_stored`], mutably (to attach the receiver's references).
    pub fn visit_stored_mut(&mut self, visit: &mut dyn FnMut(&mut StoredValue)) {
        let visit_args = |args: &mut [Arg], visit: &mut dyn FnMut(&mut StoredValue)| {
            for arg in args {
                match arg {
                    Arg::Stored(value) => visit(value),
                    Arg::Nested { refs, .. } => refs.iter_mut().for_each(&mut *visit),
                    Arg::Inline(_) | Arg::Ref(_) => {}
                }
            }
        };
        let visit_outcome =
            |outcome: &mut Outcome, visit: &mut dyn FnMut(&mut StoredValue)| match outcome {
                Outcome::Stored(value) => visit(value),
                Outcome::Nested { refs, .. } => refs.iter_mut().for_each(visit),
                Outcome::Value(_) | Outcome::Error(_) => {}
            };
        match self {
            Frame::Call(call) => visit_args(&mut call.args, visit),
            Frame::Reply { outcome, .. } | Frame::TaskReply { outcome, .. } => {
                visit_outcome(outcome, visit)
            }
            Frame::Request { body: Request::Head(HeadRequest::SubmitTask(spec)), .. } => {
                visit_args(&mut spec.args, visit)
            }
            Frame::Request { body: Request::Head(HeadRequest::CreateActor(spec)), .. } => {
                visit_args(&mut spec.ctor_args, visit)
            }
            Frame::Response { body: Response::Outcome(outcome), .. } => {
                visit_outcome(outcome, visit)
            }
            Frame::Response { body: Response::Assignment(Assignment::Actor(start)), .. } => {
                visit_args(&mut start.ctor_args, visit)
            }
            _ => {}
        }
    }
}

/// A call to run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CallFrame {
    /// Chosen by the caller (unique per caller process).
    pub call_id: u64,
    /// What to run.
    pub target: CallTarget,
    /// One entry per argument, already encoded.
    pub args: Vec<Arg>,
}

/// What a call runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum CallTarget {
    /// A method of an actor hosted by the receiving worker.
    Actor {
        /// The actor.
        actor: ActorId,
        /// Index of the method in the actor's `impl` block.
        method: u16,
    },
    /// A registered remote function.
    Task {
        /// Its registered name.
        function: String,
    },
}

/// An argument: its encoded value, or a reference the callee resolves before the call runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Arg {
    /// The encoded value.
    Inline(#[serde(with = "serde_bytes")] Vec<u8>),
    /// An object to fetch from its owner.
    Ref(ObjectLocator),
    /// A value in the node's object store, read in place by the callee.
    Stored(StoredValue),
    /// The encoded value and the stored values of the references serialized in it.
    Nested {
        /// The encoded value.
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
        /// Its references' stored values (each with a count for the receiver).
        refs: Vec<StoredValue>,
    },
}

/// Where to obtain an object: its id and the endpoint of the process that owns it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ObjectLocator {
    /// The object.
    pub id: ObjectId,
    /// The owner's endpoint.
    pub owner: Address,
}

/// The result of a call or of an object fetch.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Outcome {
    /// The encoded value.
    Value(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The value is in the node's object store.
    Stored(StoredValue),
    /// The encoded value and the stored values of the references serialized in it.
    Nested {
        /// The encoded value.
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
        /// Its references' stored values (each with a count for the receiver).
        refs: Vec<StoredValue>,
    },
    /// The call failed.
    Error(Error),
}

/// Everything a worker needs to construct an actor.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ActorStart {
    /// The actor.
    pub actor: ActorId,
    /// Counts restarts: 0 for the first start.
    pub incarnation: u64,
    /// The registered type name.
    pub type_name: String,
    /// Encoded constructor arguments.
    pub ctor_args: Vec<Arg>,
    /// Concurrency limit for `&self` methods (None: 1 for sync, 1000 for async methods).
    pub max_concurrency: Option<usize>,
    /// Group membership, when the actor belongs to an actor group.
    pub group: Option<crate::context::GroupMembership>,
    /// The actor's name, when it has one.
    pub name: Option<String>,
    /// The resources, GPUs and bundle the actor was given (what its runtime context reports).
    pub allocation: Option<rtrun_placement::Allocation>,
    /// The placement group its child actors and tasks go to by default (Ray's
    /// `placement_group_capture_child_tasks`).
    pub capture_group: Option<rtrun_placement::GroupId>,
}

/// A request, by the service that answers it.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// To the control plane.
    Head(HeadRequest),
    /// To a node's daemon (the head answers for its own node's logs).
    Node(NodeRequest),
    /// An operation on the node's object store, from a process on the node.
    Store {
        /// The process asking (its references and pins are accounted under this id).
        holder: HolderId,
        /// What to do.
        op: StoreOp,
    },
    /// To an object's owner.
    Owner(OwnerRequest),
}

/// Requests to the control plane (the head). `Clone`: a process reconnecting to a head that
/// restarted sends the requests it had in flight again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum HeadRequest {
    /// A freshly started worker announces itself; answered with its assignment.
    RegisterWorker {
        /// Given to it at spawn.
        worker: WorkerId,
        /// Its listening endpoint.
        address: Address,
        /// Its process id.
        pid: u32,
    },
    /// Sets a key of the head's key-value store (Ray's internal KV).
    KvPut {
        /// The key.
        key: String,
        /// The value.
        #[serde(with = "serde_bytes")]
        value: Vec<u8>,
    },
    /// Reads a key of the head's key-value store; answered with [`Response::KvValue`].
    KvGet {
        /// The key.
        key: String,
    },
    /// Removes a key of the head's key-value store; answered with [`Response::KvValue`] (the
    /// value it had).
    KvDelete {
        /// The key.
        key: String,
    },
    /// A worker finished constructing its actor (or failed to).
    ActorStarted {
        /// The actor.
        actor: ActorId,
        /// Which start this was.
        incarnation: u64,
        /// `Err` with the panic or error text when the constructor failed.
        result: Result<(), String>,
    },
    /// Create an actor.
    CreateActor(Box<crate::actor::ActorSpec>),
    /// Look an actor up by name.
    GetActorByName {
        /// Its name.
        name: String,
        /// Its namespace.
        namespace: String,
    },
    /// Answered once the actor is alive with an incarnation above `after`, or dead.
    WaitActorAlive {
        /// The actor.
        actor: ActorId,
        /// The last incarnation the asker knew (answers only for newer ones).
        after: Option<u64>,
    },
    /// Kill an actor's worker process.
    KillActor {
        /// The actor.
        actor: ActorId,
        /// Whether to forbid restarts (`kill` semantics) or allow them (simulated crash).
        no_restart: bool,
    },
    /// Run a task somewhere in the cluster; answered with its outcome.
    SubmitTask(Box<crate::task::TaskSpec>),
    /// Cancel a task submitted with `SubmitTask`.
    CancelTask {
        /// The task (its return object's id).
        task: ObjectId,
        /// Kill the worker running it.
        force: bool,
    },
    /// Cluster summary, for `rtrun status` and tests.
    ClusterInfo,
    /// Create a placement group; answered at once with its state (pending or created).
    CreatePlacementGroup(Box<crate::placement_group::PlacementGroupOptions>),
    /// Answered with the group's state once it is created, or an error once it is removed.
    WaitPlacementGroup {
        /// The group.
        group: rtrun_placement::GroupId,
    },
    /// Remove a placement group: stops its actors and tasks and frees its bundles.
    RemovePlacementGroup {
        /// The group.
        group: rtrun_placement::GroupId,
    },
    /// The group's state now.
    GetPlacementGroup {
        /// The group.
        group: rtrun_placement::GroupId,
    },
    /// The live group with this name.
    GetPlacementGroupByName {
        /// Its name.
        name: String,
    },
    /// Every live placement group.
    ListPlacementGroups,
    /// Every actor the control plane knows (`rtrun list actors`).
    ListActors,
    /// Queued and running tasks, and every function's task counts (`rtrun list tasks`,
    /// `rtrun summary tasks`).
    ListTasks,
    /// Every worker process (`rtrun list workers`).
    ListWorkers,
    /// Node daemon → head: a worker it spawned started.
    WorkerSpawned {
        /// The worker.
        worker: WorkerId,
        /// Its process id on that node.
        pid: u32,
    },
    /// Node daemon → head: a worker it spawned exited (or could not start).
    WorkerExited {
        /// The worker.
        worker: WorkerId,
        /// How it ended.
        status: WorkerExit,
    },
    /// Run a job's driver binary (uploaded before, by digest) on the head's node.
    SubmitJob {
        /// The binary's digest.
        binary: String,
        /// Its arguments.
        args: Vec<String>,
        /// Extra environment, for the driver and every worker of the job.
        env: Vec<(String, String)>,
        /// The job's name, unique in the cluster (default: generated).
        submission_id: Option<String>,
        /// The digest of its working-directory package (uploaded before), unpacked for this
        /// job where its driver runs, which starts there.
        working_dir: Option<String>,
    },
    /// Stops a running job: its driver is killed, and with it its workers on every node and
    /// its placement groups. Answered with the job's [`JobInfo`].
    StopJob {
        /// The job.
        job: u64,
    },
    /// A job's output from a byte offset, and its state.
    JobLogs {
        /// The job.
        job: u64,
        /// Bytes already read.
        offset: u64,
    },
    /// Every submitted job.
    ListJobs,
    /// Forgets an ended job: its record and its log go (Ray's `ray job delete`). A running
    /// job is refused. Answered with the job's last [`JobInfo`].
    DeleteJob {
        /// The job.
        job: u64,
    },
    /// Answered with `Done` while the node is alive, with the reason once it died.
    NodeAlive {
        /// The node.
        node: u64,
    },
    /// Stop every node and the head.
    StopCluster,
}

impl HeadRequest {
    /// Every request's [`HeadRequest::kind`] (the head core's simulator draws each).
    pub const KINDS: [&'static str; 30] = [
        "RegisterWorker",
        "KvPut",
        "KvGet",
        "KvDelete",
        "ActorStarted",
        "CreateActor",
        "GetActorByName",
        "WaitActorAlive",
        "KillActor",
        "SubmitTask",
        "CancelTask",
        "ClusterInfo",
        "CreatePlacementGroup",
        "WaitPlacementGroup",
        "RemovePlacementGroup",
        "GetPlacementGroup",
        "GetPlacementGroupByName",
        "ListPlacementGroups",
        "ListActors",
        "ListTasks",
        "ListWorkers",
        "WorkerSpawned",
        "WorkerExited",
        "SubmitJob",
        "StopJob",
        "JobLogs",
        "ListJobs",
        "DeleteJob",
        "NodeAlive",
        "StopCluster",
    ];

    /// The request's name, for logs and spans (its payload may be large: a task's arguments).
    pub fn kind(&self) -> &'static str {
        match self {
            HeadRequest::RegisterWorker { .. } => "RegisterWorker",
            HeadRequest::KvPut { .. } => "KvPut",
            HeadRequest::KvGet { .. } => "KvGet",
            HeadRequest::KvDelete { .. } => "KvDelete",
            HeadRequest::ActorStarted { .. } => "ActorStarted",
            HeadRequest::CreateActor(_) => "CreateActor",
            HeadRequest::GetActorByName { .. } => "GetActorByName",
            HeadRequest::WaitActorAlive { .. } => "WaitActorAlive",
            HeadRequest::KillActor { .. } => "KillActor",
            HeadRequest::SubmitTask(_) => "SubmitTask",
            HeadRequest::CancelTask { .. } => "CancelTask",
            HeadRequest::ClusterInfo => "ClusterInfo",
            HeadRequest::CreatePlacementGroup(_) => "CreatePlacementGroup",
            HeadRequest::WaitPlacementGroup { .. } => "WaitPlacementGroup",
            HeadRequest::RemovePlacementGroup { .. } => "RemovePlacementGroup",
            HeadRequest::GetPlacementGroup { .. } => "GetPlacementGroup",
            HeadRequest::GetPlacementGroupByName { .. } => "GetPlacementGroupByName",
            HeadRequest::ListPlacementGroups => "ListPlacementGroups",
            HeadRequest::ListActors => "ListActors",
            HeadRequest::ListTasks => "ListTasks",
            HeadRequest::ListWorkers => "ListWorkers",
            HeadRequest::WorkerSpawned { .. } => "WorkerSpawned",
            HeadRequest::WorkerExited { .. } => "WorkerExited",
            HeadRequest::SubmitJob { .. } => "SubmitJob",
            HeadRequest::StopJob { .. } => "StopJob",
            HeadRequest::JobLogs { .. } => "JobLogs",
            HeadRequest::ListJobs => "ListJobs",
            HeadRequest::DeleteJob { .. } => "DeleteJob",
            HeadRequest::NodeAlive { .. } => "NodeAlive",
            HeadRequest::StopCluster => "StopCluster",
        }
    }
}

/// Requests to a node's daemon, from the head or a command-line client.
#[derive(Debug, Serialize, Deserialize)]
pub enum NodeRequest {
    /// Head → node daemon: start a worker (its binary is the job's, fetched from the head).
    SpawnWorker {
        /// Its id.
        worker: WorkerId,
        /// Its environment.
        env: Vec<(String, String)>,
        /// The digest of the job binary it runs.
        job: Option<String>,
    },
    /// Head → node daemon: kill one of the node's worker processes.
    KillProcess {
        /// Its process id on that node.
        pid: u32,
    },
    /// Head → node daemons: a process of the cluster exited; drop its store references.
    ProcessExited {
        /// The process.
        worker: WorkerId,
    },
    /// Head → node daemon: kill every worker and exit (0 when an operator stopped the cluster,
    /// non-zero when `declared_dead` says why the head gave this node up).
    StopNode {
        /// Why the head declared the node dead (`None`: `rtrun stop`).
        declared_dead: Option<String>,
    },
    /// One of a node's log files (`worker-N.log`, `job-N.log`, rotated `….K`) from a byte
    /// offset; answered by the node's daemon (the head for its own node).
    ReadLog {
        /// The file's name in the node's log directory.
        file: String,
        /// Bytes already read.
        offset: u64,
    },
    /// A node's log files and their sizes.
    ListLogs,
    /// Head → the node daemons, workers and drivers of the cluster it recovered: it restarted
    /// at `head` (its address, as before); their old connection to it is dead, so they
    /// reconnect now rather than when that connection times out.
    HeadRestarted {
        /// The restarted head's address.
        head: Address,
    },
}

/// Requests to the owner of an object (the process that created it).
#[derive(Debug, Serialize, Deserialize)]
pub enum OwnerRequest {
    /// Ask an object's owner for its value.
    FetchObject {
        /// The object.
        id: ObjectId,
    },
    /// Free objects owned by the receiver.
    FreeObjects {
        /// The objects.
        ids: Vec<ObjectId>,
    },
}

impl From<HeadRequest> for Request {
    fn from(request: HeadRequest) -> Request {
        Request::Head(request)
    }
}

impl From<NodeRequest> for Request {
    fn from(request: NodeRequest) -> Request {
        Request::Node(request)
    }
}

impl From<OwnerRequest> for Request {
    fn from(request: OwnerRequest) -> Request {
        Request::Owner(request)
    }
}

/// Operations a process asks of its node's object store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum StoreOp {
    /// Reserve room for a new object of `size` bytes owned by the asker; answered with
    /// [`Response::Allocation`].
    Create {
        /// The new object.
        id: ObjectId,
        /// Its size in bytes.
        size: u64,
    },
    /// Make a created object readable.
    Seal {
        /// The object.
        id: ObjectId,
    },
    /// Drop an object that was created but could not be written.
    Abort {
        /// The object.
        id: ObjectId,
    },
    /// Pin a sealed object for reading (restoring it from disk first); answered with
    /// [`Response::Allocation`].
    Pin {
        /// The object.
        id: ObjectId,
    },
    /// Release one pin.
    Unpin {
        /// The object.
        id: ObjectId,
    },
    /// Add one reference count for `to`, which is being sent a reference.
    Lend {
        /// The object.
        id: ObjectId,
        /// The receiving process.
        to: HolderId,
    },
    /// Drop one of the asker's reference counts.
    Release {
        /// The object.
        id: ObjectId,
    },
    /// A snapshot of the store, answered with [`Response::StoreStats`].
    Stats,
    /// Copy an object from another node's store into this one (unless it is here already) and
    /// give the asker a count on the copy; answered with [`Response::Done`].
    Pull {
        /// The object.
        id: ObjectId,
        /// The node daemon whose store has it.
        from: Address,
    },
}

/// Answers to [`Request`]s.
#[derive(Debug, Serialize, Deserialize)]
pub enum Response {
    /// What a newly registered worker must do.
    Assignment(Assignment),
    /// A generic success.
    Done,
    /// A created or looked-up actor.
    Actor(crate::actor::ActorInfo),
    /// The actor is alive at this address.
    ActorAlive {
        /// Its worker's endpoint.
        address: Address,
        /// Which start of the actor this is.
        incarnation: u64,
    },
    /// An object's value or a task's result.
    Outcome(Outcome),
    /// Cluster resources and counts.
    ClusterInfo(ClusterInfo),
    /// Where a created or pinned object lives in the node's arena.
    Allocation(Allocation),
    /// The node's object-store snapshot.
    StoreStats(Box<NodeMemory>),
    /// One placement group's state.
    PlacementGroup(Box<crate::placement_group::PlacementGroupState>),
    /// Every live placement group's state, oldest first.
    PlacementGroups(Vec<crate::placement_group::PlacementGroupState>),
    /// Actors, for `rtrun list actors`.
    Actors(Vec<ActorSummary>),
    /// Tasks, for `rtrun list tasks`.
    Tasks(TaskTable),
    /// Worker processes, for `rtrun list workers`.
    Workers(Vec<WorkerSummary>),
    /// Jobs.
    Jobs(Vec<JobInfo>),
    /// A key's value in the head's key-value store (`None`: no such key).
    KvValue(Option<ByteBuf>),
    /// Part of a job's output.
    Logs {
        /// The bytes.
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
        /// The job's state.
        job: JobInfo,
    },
    /// Part of a node's log file.
    LogChunk {
        /// The bytes (at most 1 MiB).
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
        /// The file's size now.
        size: u64,
        /// The file's inode: it changes when the name is rotated to a new file.
        inode: u64,
    },
    /// A node's log files with their sizes.
    LogFiles(Vec<(String, u64)>),
    /// The request failed.
    Error(Error),
}

/// What a typed call expects a [`Response`] to carry: each payload type names its variant, so
/// a caller writes `runtime.call::<ClusterInfo>(request)` (or
/// `rtrun::session::ask`) instead of matching the answer by hand with a fallback of its own.
pub trait Reply: Sized {
    /// The payload; the error the response carries; or an error naming what came instead.
    fn from_response(response: Response) -> crate::error::Result<Self>;
}

/// The error for an answer that is not the expected variant.
fn unexpected(expected: &str, found: Response) -> Error {
    match found {
        Response::Error(e) => e,
        other => Error::Transport(format!("expected a `{expected}` answer, found {other:?}")),
    }
}

macro_rules! replies {
    ($($payload:ty => $variant:ident),* $(,)?) => {$(
        impl Reply for $payload {
            fn from_response(response: Response) -> crate::error::Result<Self> {
                match response {
                    Response::$variant(payload) => Ok(payload),
                    other => Err(unexpected(stringify!($variant), other)),
                }
            }
        }
    )*};
}

replies! {
    crate::actor::ActorInfo => Actor,
    ClusterInfo => ClusterInfo,
    Box<NodeMemory> => StoreStats,
    Box<crate::placement_group::PlacementGroupState> => PlacementGroup,
    Vec<crate::placement_group::PlacementGroupState> => PlacementGroups,
    Vec<ActorSummary> => Actors,
    TaskTable => Tasks,
    Vec<WorkerSummary> => Workers,
    Vec<JobInfo> => Jobs,
    Option<ByteBuf> => KvValue,
    Vec<(String, u64)> => LogFiles,
    Assignment => Assignment,
    Allocation => Allocation,
    Outcome => Outcome,
}

/// Any answer: for a request whose answers differ by what it asks (a store operation), which
/// the caller matches. An error answer is the error.
impl Reply for Response {
    fn from_response(response: Response) -> crate::error::Result<Self> {
        match response {
            Response::Error(e) => Err(e),
            other => Ok(other),
        }
    }
}

/// A request whose answer's type is part of its own type: the runtime's one client call
/// (`Runtime::ask`, and `rtrun::session::ask` for a running session) returns
/// `Result<Self::Reply>`, so a caller cannot expect a different answer than the one the
/// receiver gives. [`ask`] has one type per request kind; a raw [`Request`] asks for any
/// [`Response`].
pub trait Ask: Into<Request> {
    /// What the answer carries.
    type Reply: Reply + Send + 'static;
}

impl Ask for Request {
    type Reply = Response;
}

/// Declares, for each request kind, its type (the variant's fields), how it travels and the
/// type of its answer.
macro_rules! asks {
    (@wrap HeadRequest, $request:expr) => { Request::Head($request) };
    (@wrap NodeRequest, $request:expr) => { Request::Node($request) };
    (@wrap OwnerRequest, $request:expr) => { Request::Owner($request) };
    () => {};
    (
        $(#[$doc:meta])*
        $to:ident :: $name:ident { $($field:ident : $ty:ty),* $(,)? } => $reply:ty;
        $($rest:tt)*
    ) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name { $(pub $field: $ty),* }

        impl From<$name> for Request {
            fn from(request: $name) -> Request {
                asks!(@wrap $to, $to::$name { $($field: request.$field),* })
            }
        }

        impl Ask for $name {
            type Reply = $reply;
        }

        asks!($($rest)*);
    };
    (
        $(#[$doc:meta])*
        $to:ident :: $name:ident ( $one:ident : $one_ty:ty ) => $reply:ty;
        $($rest:tt)*
    ) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name { pub $one: $one_ty }

        impl From<$name> for Request {
            fn from(request: $name) -> Request {
                asks!(@wrap $to, $to::$name(request.$one))
            }
        }

        impl Ask for $name {
            type Reply = $reply;
        }

        asks!($($rest)*);
    };
    (
        $(#[$doc:meta])*
        $to:ident :: $name:ident => $reply:ty;
        $($rest:tt)*
    ) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name;

        impl From<$name> for Request {
            fn from(_: $name) -> Request {
                asks!(@wrap $to, $to::$name)
            }
        }

        impl Ask for $name {
            type Reply = $reply;
        }

        asks!($($rest)*);
    };
}

/// One type per request kind, each with the type of its answer (see [`Ask`]). The fields and
/// their meaning are the wire variant's of the same name.
pub mod ask {
    use super::*;
    use crate::ids::{ActorId, ObjectId, WorkerId};
    use rtrun_placement::GroupId;

    asks! {
        /// [`HeadRequest::RegisterWorker`].
        HeadRequest::RegisterWorker { worker: WorkerId, address: Address, pid: u32 } => Assignment;
        /// [`HeadRequest::KvPut`].
        HeadRequest::KvPut { key: String, value: Vec<u8> } => ();
        /// [`HeadRequest::KvGet`].
        HeadRequest::KvGet { key: String } => Option<ByteBuf>;
        /// [`HeadRequest::KvDelete`].
        HeadRequest::KvDelete { key: String } => Option<ByteBuf>;
        /// [`HeadRequest::ActorStarted`].
        HeadRequest::ActorStarted { actor: ActorId, incarnation: u64, result: Result<(), String> }
            => ();
        /// [`HeadRequest::CreateActor`].
        HeadRequest::CreateActor(spec: Box<crate::actor::ActorSpec>) => crate::actor::ActorInfo;
        /// [`HeadRequest::GetActorByName`].
        HeadRequest::GetActorByName { name: String, namespace: String } => crate::actor::ActorInfo;
        /// [`HeadRequest::WaitActorAlive`].
        HeadRequest::WaitActorAlive { actor: ActorId, after: Option<u64> } => AliveAt;
        /// [`HeadRequest::KillActor`].
        HeadRequest::KillActor { actor: ActorId, no_restart: bool } => ();
        /// [`HeadRequest::SubmitTask`].
        HeadRequest::SubmitTask(spec: Box<crate::task::TaskSpec>) => Outcome;
        /// [`HeadRequest::CancelTask`].
        HeadRequest::CancelTask { task: ObjectId, force: bool } => ();
        /// [`HeadRequest::ClusterInfo`].
        HeadRequest::ClusterInfo => super::ClusterInfo;
        /// [`HeadRequest::CreatePlacementGroup`].
        HeadRequest::CreatePlacementGroup(
            options: Box<crate::placement_group::PlacementGroupOptions>
        ) => Box<crate::placement_group::PlacementGroupState>;
        /// [`HeadRequest::WaitPlacementGroup`].
        HeadRequest::WaitPlacementGroup { group: GroupId }
            => Box<crate::placement_group::PlacementGroupState>;
        /// [`HeadRequest::RemovePlacementGroup`].
        HeadRequest::RemovePlacementGroup { group: GroupId } => ();
        /// [`HeadRequest::GetPlacementGroup`].
        HeadRequest::GetPlacementGroup { group: GroupId }
            => Box<crate::placement_group::PlacementGroupState>;
        /// [`HeadRequest::GetPlacementGroupByName`].
        HeadRequest::GetPlacementGroupByName { name: String }
            => Box<crate::placement_group::PlacementGroupState>;
        /// [`HeadRequest::ListPlacementGroups`].
        HeadRequest::ListPlacementGroups => Vec<crate::placement_group::PlacementGroupState>;
        /// [`HeadRequest::ListActors`].
        HeadRequest::ListActors => Vec<ActorSummary>;
        /// [`HeadRequest::ListTasks`].
        HeadRequest::ListTasks => TaskTable;
        /// [`HeadRequest::ListWorkers`].
        HeadRequest::ListWorkers => Vec<WorkerSummary>;
        /// [`HeadRequest::WorkerSpawned`].
        HeadRequest::WorkerSpawned { worker: WorkerId, pid: u32 } => ();
        /// [`HeadRequest::WorkerExited`].
        HeadRequest::WorkerExited { worker: WorkerId, status: WorkerExit } => ();
        /// [`HeadRequest::SubmitJob`].
        HeadRequest::SubmitJob {
            binary: String,
            args: Vec<String>,
            env: Vec<(String, String)>,
            submission_id: Option<String>,
            working_dir: Option<String>,
        } => Vec<JobInfo>;
        /// [`HeadRequest::StopJob`].
        HeadRequest::StopJob { job: u64 } => Vec<JobInfo>;
        /// [`HeadRequest::JobLogs`].
        HeadRequest::JobLogs { job: u64, offset: u64 } => JobOutput;
        /// [`HeadRequest::ListJobs`].
        HeadRequest::ListJobs => Vec<JobInfo>;
        /// [`HeadRequest::DeleteJob`].
        HeadRequest::DeleteJob { job: u64 } => Vec<JobInfo>;
        /// [`HeadRequest::NodeAlive`].
        HeadRequest::NodeAlive { node: u64 } => ();
        /// [`HeadRequest::StopCluster`].
        HeadRequest::StopCluster => ();
        /// [`NodeRequest::SpawnWorker`].
        NodeRequest::SpawnWorker {
            worker: WorkerId,
            env: Vec<(String, String)>,
            job: Option<String>,
        } => ();
        /// [`NodeRequest::KillProcess`].
        NodeRequest::KillProcess { pid: u32 } => ();
        /// [`NodeRequest::ProcessExited`].
        NodeRequest::ProcessExited { worker: WorkerId } => ();
        /// [`NodeRequest::StopNode`].
        NodeRequest::StopNode { declared_dead: Option<String> } => ();
        /// [`NodeRequest::ReadLog`].
        NodeRequest::ReadLog { file: String, offset: u64 } => LogChunk;
        /// [`NodeRequest::ListLogs`].
        NodeRequest::ListLogs => Vec<(String, u64)>;
        /// [`OwnerRequest::FetchObject`].
        OwnerRequest::FetchObject { id: ObjectId } => Outcome;
        /// [`OwnerRequest::FreeObjects`].
        OwnerRequest::FreeObjects { ids: Vec<ObjectId> } => ();
    }

    /// A node's object-store snapshot ([`StoreOp::Stats`]), asked as `holder`.
    #[derive(Debug)]
    pub struct NodeStoreStats {
        /// Who asks.
        pub holder: HolderId,
    }

    impl From<NodeStoreStats> for Request {
        fn from(request: NodeStoreStats) -> Request {
            Request::Store { holder: request.holder, op: StoreOp::Stats }
        }
    }

    impl Ask for NodeStoreStats {
        type Reply = Box<NodeMemory>;
    }
}

/// A job's output from an offset, and the job's state ([`Response::Logs`]).
#[derive(Debug)]
pub struct JobOutput {
    /// The bytes.
    pub bytes: Vec<u8>,
    /// The job's state.
    pub job: JobInfo,
}

impl Reply for JobOutput {
    fn from_response(response: Response) -> crate::error::Result<Self> {
        match response {
            Response::Logs { bytes, job } => Ok(JobOutput { bytes, job }),
            other => Err(unexpected("Logs", other)),
        }
    }
}

/// Where an actor is alive ([`Response::ActorAlive`]).
#[derive(Debug)]
pub struct AliveAt {
    /// Its worker's endpoint.
    pub address: Address,
    /// Which start of the actor this is.
    pub incarnation: u64,
}

impl Reply for AliveAt {
    fn from_response(response: Response) -> crate::error::Result<Self> {
        match response {
            Response::ActorAlive { address, incarnation } => Ok(AliveAt { address, incarnation }),
            other => Err(unexpected("ActorAlive", other)),
        }
    }
}

/// Part of a node's log file ([`Response::LogChunk`]).
#[derive(Debug)]
pub struct LogChunk {
    /// The bytes (at most 1 MiB).
    pub bytes: Vec<u8>,
    /// The file's size now.
    pub size: u64,
    /// The file's inode: it changes when the name is rotated to a new file.
    pub inode: u64,
}

impl Reply for LogChunk {
    fn from_response(response: Response) -> crate::error::Result<Self> {
        match response {
            Response::LogChunk { bytes, size, inode } => Ok(LogChunk { bytes, size, inode }),
            other => Err(unexpected("LogChunk", other)),
        }
    }
}

impl Reply for () {
    fn from_response(response: Response) -> crate::error::Result<Self> {
        match response {
            Response::Done => Ok(()),
            other => Err(unexpected("Done", other)),
        }
    }
}

/// What a worker does after registering.
#[derive(Debug, Serialize, Deserialize)]
pub enum Assignment {
    /// Host this actor.
    Actor(Box<ActorStart>),
    /// Run tasks the head sends.
    Tasks,
}

/// A snapshot of the cluster for status commands and tests.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClusterInfo {
    /// Total resources, by name, as floats.
    pub total: BTreeMap<String, f64>,
    /// Resources not currently held, by name.
    pub available: BTreeMap<String, f64>,
    /// Live worker processes (actors and task workers).
    pub workers: usize,
    /// Actors that are alive.
    pub alive_actors: usize,
    /// Process ids of live workers.
    pub worker_pids: Vec<u32>,
    /// The nodes (one in an embedded session).
    pub nodes: Vec<NodeInfo>,
    /// Tasks now and since the head started.
    pub tasks: TaskCounts,
}

/// Tasks by state: waiting or running now, answered since the head started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskCounts {
    /// Waiting for resources or a worker.
    pub queued: u64,
    /// Running in a worker.
    pub running: u64,
    /// Answered with a value.
    pub finished: u64,
    /// Answered with an error (failed after its retries, cancelled, unplaceable).
    pub failed: u64,
}

/// One node of the cluster.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Its id.
    pub node: crate::ids::NodeId,
    /// Its name (from its certificate).
    pub name: String,
    /// Its daemon's address.
    pub address: Address,
    /// Whether it is alive.
    pub alive: bool,
    /// Why it died.
    pub death_reason: Option<String>,
    /// Its resources.
    pub total: BTreeMap<String, f64>,
    /// Its resources not held.
    pub available: BTreeMap<String, f64>,
}

/// One actor, for listings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ActorSummary {
    /// Its id.
    pub actor: ActorId,
    /// Its type.
    pub type_name: String,
    /// Its name.
    pub name: Option<String>,
    /// PENDING, STARTING, ALIVE or DEAD (reason).
    pub state: String,
    /// The node it runs on.
    pub node: Option<crate::ids::NodeId>,
    /// Its worker's process id.
    pub pid: Option<u32>,
    /// How many times it was restarted.
    pub restarts: u64,
    /// Its worker now, or its last one once dead: whose log (`worker-N.log`) holds its output.
    pub worker: Option<crate::ids::WorkerId>,
    /// The node of that worker.
    pub log_node: Option<crate::ids::NodeId>,
    /// The driver that created it (its job's driver process).
    pub driver: Option<crate::ids::WorkerId>,
    /// The namespace of its name (named actors only).
    pub namespace: Option<String>,
    /// It outlives its driver.
    pub detached: bool,
}

/// One queued or running task, for listings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskSummary {
    /// Its id (the id of the object its result is stored as).
    pub task: ObjectId,
    /// The registered function.
    pub function: String,
    /// QUEUED or RUNNING.
    pub state: String,
    /// Runs so far that failed and were retried.
    pub retries: u32,
    /// The worker running it.
    pub worker: Option<WorkerId>,
    /// That worker's node.
    pub node: Option<crate::ids::NodeId>,
    /// That worker's process id.
    pub pid: Option<u32>,
    /// The driver that submitted it (its job's driver process).
    pub driver: Option<WorkerId>,
}

/// The control plane's tasks: those queued or running now, and counts by function since the
/// head started (finished tasks are not kept one by one).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TaskTable {
    /// Queued tasks in queue order, then running ones by id.
    pub live: Vec<TaskSummary>,
    /// Every function's tasks by state.
    pub by_function: BTreeMap<String, TaskCounts>,
}

/// One worker process, for listings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSummary {
    /// Its id (its log is `worker-N.log` on its node).
    pub worker: WorkerId,
    /// Its node.
    pub node: crate::ids::NodeId,
    /// Its process id, once started.
    pub pid: Option<u32>,
    /// `actor`, `task` or `idle` (a pooled task worker waiting for work).
    pub kind: String,
    /// The actor it hosts.
    pub actor: Option<ActorId>,
    /// The task it runs.
    pub task: Option<ObjectId>,
    /// The driver whose job it belongs to (`None`: the embedded driver).
    pub driver: Option<WorkerId>,
    /// Whether it has registered with the head (it is starting until then).
    pub registered: bool,
}

/// A submitted job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobInfo {
    /// Its id.
    pub job: u64,
    /// Its binary's digest.
    pub binary: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Where it is.
    pub state: JobState,
    /// Its log file on the head's host.
    pub log: String,
    /// Its name (`--submission-id`, or generated).
    pub submission_id: String,
}

/// Where a job is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobState {
    /// Its driver runs.
    Running,
    /// Its driver exited with this code.
    Exited {
        /// The exit code.
        code: i32,
    },
    /// Its driver was killed or could not start.
    Failed {
        /// Why.
        reason: String,
    },
    /// Stopped on request (`rtrun job stop`).
    Stopped,
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobState::Running => write!(f, "RUNNING"),
            JobState::Exited { code: 0 } => write!(f, "SUCCEEDED"),
            JobState::Exited { code } => write!(f, "FAILED (exit code {code})"),
            JobState::Failed { reason } => write!(f, "FAILED ({reason})"),
            JobState::Stopped => write!(f, "STOPPED"),
        }
    }
}

/// How a worker process ended, as its spawner saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkerExit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
    /// It never started, could not be waited for, or went with its node: why.
    Lost(String),
}

impl WorkerExit {
    /// How `status` (from `wait`) ended.
    pub fn of(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => WorkerExit::Code(code),
            (None, Some(signal)) => WorkerExit::Signal(signal),
            _ => WorkerExit::Lost(format!("worker process ended: {status}")),
        }
    }

    /// The exit code, when it exited by itself.
    pub fn code(&self) -> Option<i32> {
        match self {
            WorkerExit::Code(code) => Some(*code),
            _ => None,
        }
    }
}

impl std::fmt::Display for WorkerExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerExit::Code(code) => write!(f, "worker process exited with code {code}"),
            WorkerExit::Signal(signal) => write!(f, "worker process was killed by signal {signal}"),
            WorkerExit::Lost(reason) => f.write_str(reason),
        }
    }
}

/// What `rtrun memory` shows for one node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeMemory {
    /// The node.
    pub node: crate::ids::NodeId,
    /// The session.
    pub session: String,
    /// Where spilled objects go.
    pub spill_dir: String,
    /// The store's snapshot.
    pub stats: StoreStats,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A typed call gets its payload, the error the answer carries, or an error naming the
    /// variant it expected and what came instead.
    #[test]
    fn typed_replies_take_their_variant_and_name_what_came_instead() {
        let jobs = <Vec<JobInfo>>::from_response(Response::Jobs(Vec::new())).unwrap();
        assert!(jobs.is_empty());
        <()>::from_response(Response::Done).unwrap();
        let error = ClusterInfo::from_response(Response::Error(Error::Cancelled)).unwrap_err();
        assert!(matches!(error, Error::Cancelled), "{error}");
        let error = <()>::from_response(Response::Jobs(Vec::new())).unwrap_err();
        assert!(error.to_string().contains("expected a `Done` answer, found Jobs([])"), "{error}");
    }

    /// Exits arrive typed from real processes, and read as they always did in messages.
    #[test]
    fn worker_exits_are_typed_from_real_processes() {
        let run = |script: &str| {
            let status = std::process::Command::new("sh").args(["-c", script]).status().unwrap();
            WorkerExit::of(status)
        };
        assert_eq!(run("exit 3"), WorkerExit::Code(3));
        assert_eq!(run("exit 3").code(), Some(3));
        assert_eq!(run("kill -9 $$"), WorkerExit::Signal(9));
        assert_eq!(run("kill -9 $$").code(), None);
        assert_eq!(WorkerExit::Code(3).to_string(), "worker process exited with code 3");
        assert_eq!(WorkerExit::Signal(9).to_string(), "worker process was killed by signal 9");
        assert_eq!(WorkerExit::Lost("node n2 died".into()).to_string(), "node n2 died");
    }
}
