//! Identifiers of the runtime's entities: sessions, workers, actors, calls.
//!
//! Ids are plain integers made without coordination where possible (a process prefix plus a
//! counter) so that hot paths never ask the control plane for one.

use std::fmt;

use serde::{Deserialize, Serialize};

pub use rtrun_object_store::ObjectId;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }
    };
}

id_type!(
    /// A worker process (or the driver, which is worker 0 of its session).
    WorkerId,
    "worker-"
);
id_type!(
    /// An actor; stable across restarts of the actor's worker process.
    ActorId,
    "actor-"
);
id_type!(
    /// A node of the cluster.
    NodeId,
    "node-"
);

/// The driver's worker id: the driver process is the first member of its session.
pub const DRIVER_WORKER_ID: WorkerId = WorkerId(0);
