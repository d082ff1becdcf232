//! A value in a node's object store, as frames carry it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::ids::ObjectId;

/// The process-local reference that keeps a stored value alive: the runtime makes one when a
/// value is created or arrives in a frame (its store's reference count, dropped with the last
/// clone). The wire carries no hold; each process attaches its own at the edge.
pub type Hold = Arc<dyn std::any::Any + Send + Sync>;

/// A value in the node's object store, with one reference count of this process on it (absent
/// only while the value is on the wire).
#[derive(Clone, Serialize, Deserialize)]
pub struct StoredValue {
    /// The object in the store (not the id of the `ObjectRef` whose value it is).
    pub id: ObjectId,
    /// Its size in bytes.
    pub size: u64,
    /// The node daemon whose store holds it, in a cluster (`None`: this node's store).
    #[serde(default)]
    pub home: Option<crate::address::Address>,
    #[serde(skip)]
    pub hold: Option<Hold>,
}

impl std::fmt::Debug for StoredValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoredValue({}, {} bytes)", self.id, self.size)
    }
}
