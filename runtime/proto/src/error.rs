//! The runtime's error type: every failure a driver or actor can observe is a value of [`Error`].

use serde::{Deserialize, Serialize};

use crate::ids::{ActorId, NodeId, ObjectId};

/// What went wrong in a runtime call. Errors travel between processes, so they carry messages
/// rather than source errors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
pub enum Error {
    /// The actor's worker process died (and was not restarted for this call), or it was killed.
    #[error("actor {actor} died: {reason}")]
    ActorDied {
        /// The actor.
        actor: ActorId,
        /// Why: exit status, kill, failed constructor.
        reason: String,
    },
    /// A method or task panicked or returned an error; the actor lives on.
    #[error("{target} failed: {message}")]
    TaskFailed {
        /// The method or function that failed.
        target: String,
        /// The panic message or error text.
        message: String,
    },
    /// The worker process running a task died and no retries were left.
    #[error("worker running {target} died: {reason}")]
    WorkerDied {
        /// The function.
        target: String,
        /// The exit status.
        reason: String,
    },
    /// The object was freed before this `get`.
    #[error("object {0} was freed")]
    ObjectFreed(ObjectId),
    /// The object's owner is gone, so its value can no longer be obtained.
    #[error("object {id} is lost: {reason}")]
    ObjectLost {
        /// The object.
        id: ObjectId,
        /// Why it is lost.
        reason: String,
    },
    /// The call was cancelled before it completed.
    #[error("call was cancelled")]
    Cancelled,
    /// A `get` with a timeout ran out of time.
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// Bytes could not be encoded or decoded as the expected type.
    #[error("codec error: {0}")]
    Codec(String),
    /// A resource request can never be met by this cluster.
    #[error("infeasible: {0}")]
    Infeasible(String),
    /// A request was malformed (bad options, unknown names, reused names, ...).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A request named something its receiver does not know: never created, or already gone.
    /// Callers act on it (an already removed group needs no second removal).
    #[error("{0}")]
    NotFound(Missing),
    /// A named actor was created with a name a live actor already has (and without
    /// `get_if_exists`).
    #[error("an actor named `{name}` already exists in namespace `{namespace}`")]
    NameTaken {
        /// The name.
        name: String,
        /// Its namespace.
        namespace: String,
    },
    /// The placement group a waiter, actor or task needed was removed.
    #[error("placement group `{name}` was removed{when}")]
    GroupRemoved {
        /// The group's name.
        name: String,
        /// When, as seen by the one that failed (`" before it was created"`, or empty).
        when: String,
    },
    /// No actor has the given name in the given namespace.
    #[error("no actor named `{name}` in namespace `{namespace}`")]
    ActorNotFound {
        /// The name looked up.
        name: String,
        /// The namespace looked in.
        namespace: String,
    },
    /// Talking to another process failed.
    #[error("transport error: {0}")]
    Transport(String),
    /// The runtime is not initialised in this process, or was shut down.
    #[error("runtime not initialised: call rtrun::init() first")]
    NotInitialised,
    /// The node's object store refused an operation (full even after spilling, too large,
    /// object gone).
    #[error("object store: {0}")]
    ObjectStore(String),
    /// An operating-system call failed.
    #[error("system error: {0}")]
    System(String),
}

/// What a [`Error::NotFound`] request named.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
pub enum Missing {
    /// An actor, by id.
    #[error("no actor with id {0}")]
    Actor(ActorId),
    /// A placement group, by id.
    #[error("no placement group {0}: it was removed or never existed")]
    Group(rtrun_placement::GroupId),
    /// A placement group, by name.
    #[error("no placement group named `{0}`")]
    GroupName(String),
    /// A submitted job, by number.
    #[error("no job {0}")]
    Job(u64),
    /// A node, by id.
    #[error("no node {0}")]
    Node(NodeId),
}

/// Shorthand for results of runtime calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::System(e.to_string())
    }
}
