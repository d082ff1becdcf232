//! The runtime context: who and where the current process is (Ray's `get_runtime_context`).

use serde::{Deserialize, Serialize};

use crate::ids::{ActorId, NodeId, WorkerId};

/// Membership of an actor in an actor group: rank, world size, and the master address and port
/// the group's collective back-end rendezvous on (OpenRLHF's `MASTER_ADDR`/`MASTER_PORT`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMembership {
    /// The group's name.
    pub group: String,
    /// This member's rank, 0-based.
    pub rank: usize,
    /// The number of members.
    pub world_size: usize,
    /// Address of rank 0's collective endpoint.
    pub master_addr: String,
    /// Port of rank 0's collective endpoint.
    pub master_port: u16,
}

/// What the current process is.
#[derive(Debug, Clone)]
pub struct RuntimeContext {
    /// The node it runs on.
    pub node_id: NodeId,
    /// Its worker id (the driver is worker 0).
    pub worker_id: WorkerId,
    /// The actor it hosts, if any.
    pub actor_id: Option<ActorId>,
    /// Which start of the actor this is (0 for the first).
    pub incarnation: u64,
    /// The actor's name, if it has one.
    pub actor_name: Option<String>,
    /// Actor group membership, if any.
    pub group: Option<GroupMembership>,
    /// The session this process belongs to.
    pub session: String,
}

/// The current process's context.
pub fn context() -> crate::Result<RuntimeContext> {
    Ok(crate::runtime::current()?.context())
}
