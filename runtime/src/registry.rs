//! Link-time registries of the actor types and remote functions compiled into this binary.
//!
//! A worker process is the driver's own executable, so it finds every `#[rtrun::actor]` type
//! and `#[rtrun::remote]` function by name in these slices; `linkme` builds them at link time,
//! so they are complete before `main` runs (no life-before-main registration).

use std::sync::Arc;

use crate::error::Result;
use crate::object::ObjectBytes;
use crate::worker::HostedActor;

/// Constructs an actor from its encoded arguments and `max_concurrency`, ready to host.
pub type HostFn = fn(Vec<ObjectBytes>, Option<usize>) -> Result<Arc<dyn HostedActor>>;

/// A registered actor type.
pub struct ActorTypeEntry {
    /// `Actor::TYPE_NAME`.
    pub type_name: &'static str,
    /// Constructs the actor and wraps it for hosting.
    pub host: HostFn,
}

/// A registered remote function.
pub struct TaskEntry {
    /// Module path and function name.
    pub name: &'static str,
    /// Decodes the arguments, runs the function, encodes its result.
    pub run: fn(Vec<ObjectBytes>) -> Result<Vec<u8>>,
}

/// Every actor type in the binary.
#[linkme::distributed_slice]
pub static ACTOR_TYPES: [ActorTypeEntry];

/// Every remote function in the binary.
#[linkme::distributed_slice]
pub static TASKS: [TaskEntry];

/// Finds an actor type by name.
pub fn actor_type(name: &str) -> Option<&'static ActorTypeEntry> {
    ACTOR_TYPES.iter().find(|e| e.type_name == name)
}

/// Finds a remote function by name.
pub fn task(name: &str) -> Option<&'static TaskEntry> {
    TASKS.iter().find(|e| e.name == name)
}
