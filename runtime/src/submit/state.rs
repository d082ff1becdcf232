//! What a process keeps of its actor calls: each call in flight or queued, and one submitter
//! per actor it calls with the state of its connection. How calls move through them is in the
//! parent module.

use std::collections::VecDeque;
use std::sync::Arc;

use dashmap::DashMap;
use parking_lot::Mutex;

use crate::error::Error;
use crate::ids::ActorId;
use crate::object::table::Slot;
use crate::protocol::CallFrame;
use crate::transport::Connection;
use rtrun_proto::actor::ActorInfo;

/// An actor call made by this process, in flight or queued (`Runtime::calls`; the head's task
/// calls are the core's `running_tasks`, answered by `Frame::TaskReply`).
pub(crate) struct ActorCall {
    pub(crate) slot: Arc<Slot>,
    pub(super) actor: ActorId,
    /// Kept while the call may still be (re)sent.
    pub(super) frame: Option<CallFrame>,
    pub(super) retries_left: i32,
    pub(super) connection: Option<u64>,
    /// When it was submitted, and the latency histogram of its actor's type (observed when the
    /// reply arrives).
    pub(crate) started: std::time::Instant,
    pub(crate) latency: prometheus_client::metrics::histogram::Histogram,
}

pub(super) enum State {
    /// Waiting to learn where the actor lives; calls queue in order. `lost` holds calls that
    /// were in flight on a dead worker and cannot be retried: they fail once the head says what
    /// happened (its reason — a kill, a removed placement group — is the error they get).
    Resolving { queue: VecDeque<u64>, lost: Vec<u64>, known_incarnation: Option<u64>, asked: bool },
    /// Calls go straight to the actor's worker.
    Connected { conn: Arc<Connection>, incarnation: u64 },
    /// Every call fails with this error.
    Dead(Error),
}

/// Calls to one actor.
pub(crate) struct Submitter {
    pub(super) info: ActorInfo,
    pub(super) state: Mutex<State>,
    /// `rtrun_actor_call_seconds` of this actor's type, resolved once.
    pub(super) latency: prometheus_client::metrics::histogram::Histogram,
}

/// This process's submitters, by actor.
#[derive(Default)]
pub(crate) struct Submitters {
    pub(super) by_actor: DashMap<ActorId, Arc<Submitter>>,
}
