//! An actor's membership of an actor group, as its spec carries it.

use serde::{Deserialize, Serialize};

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
    /// Port of rank 0's collective endpoint; 0 when rank 0 picks it and publishes its
    /// address under `rendezvous_key`.
    pub master_port: u16,
    /// The key of the head's key-value store (`rtrun::kv`) where rank 0 publishes the
    /// address it listens on, for a group whose master port is not known in advance (every
    /// `rtrun::ActorGroup`: rank 0 may land on any node).
    pub rendezvous_key: Option<String>,
}
