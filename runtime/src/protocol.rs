//! The messages processes exchange. Only [`crate::transport`] knows how they are framed and
//! encoded; everything else builds and matches these types.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::ids::{ActorId, ObjectId, WorkerId};

/// An endpoint address: an abstract Unix socket name on this node (`unix:@name`).
pub type Address = String;

/// One frame on a connection.
#[derive(Debug, Serialize, Deserialize)]
pub enum Frame {
    /// Run a method or a task.
    Call(CallFrame),
    /// The outcome of a call, sent back on the connection the call came in on.
    Reply {
        /// The call's id, chosen by the caller.
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

/// Requests to the head, to an object's owner, or from the head to a worker.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// A freshly started worker announces itself; answered with its assignment.
    RegisterWorker {
        /// Given to it at spawn.
        worker: WorkerId,
        /// Its listening endpoint.
        address: Address,
        /// Its process id.
        pid: u32,
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
    /// One placement group's state.
    PlacementGroup(Box<crate::placement_group::PlacementGroupState>),
    /// Every live placement group's state, oldest first.
    PlacementGroups(Vec<crate::placement_group::PlacementGroupState>),
    /// The request failed.
    Error(Error),
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
}
