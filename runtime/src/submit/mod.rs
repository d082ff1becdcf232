//! Caller-side actor calls: one submitter per actor this process calls. It queues calls until
//! the actor is alive, sends them in submission order straight to the actor's worker, and on
//! the worker's death retries or fails the calls in flight and waits for the actor's restart.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::actor::ActorInfo;
use crate::error::{Error, Result};
use crate::ids::ActorId;
use crate::object::{ObjectRef, Slot};
use crate::protocol::{AliveAt, Arg, CallFrame, CallTarget, Frame, ask};
use crate::runtime::{Runtime, To};
use crate::transport::Connection;

pub(crate) mod state;

pub(crate) use state::{ActorCall, Submitters};
use state::{State, Submitter};

impl ActorCall {
    /// The actor called.
    pub(crate) fn actor(&self) -> ActorId {
        self.actor
    }
}

impl Runtime {
    /// Submits a call of `method` on the actor described by `info`.
    pub(crate) fn submit_actor_call<R>(
        self: &Arc<Self>,
        info: &ActorInfo,
        method: u16,
        args: Vec<Result<Arg>>,
    ) -> ObjectRef<R> {
        let args = match args.into_iter().collect::<Result<Vec<_>>>() {
            Ok(args) => args,
            Err(e) => return crate::object::failed_ref(e),
        };
        let call_id = self.next_id();
        // The result's id carries the call id, so `cancel` can find the call from the ref.
        let id = self.object_id_for(call_id);
        let slot = Arc::new(Slot::default());
        let object = self.objects.create_owned(self, id, slot.clone());
        let frame =
            CallFrame { call_id, target: CallTarget::Actor { actor: info.id, method }, args };
        let submitter = self.submitters.get_or_create(info);
        let _span = tracing::debug_span!(
            "actor_call",
            worker = %self.worker_id,
            actor = %info.id,
            type_name = %info.type_name,
            method,
            call = call_id
        )
        .entered();
        self.calls.insert(
            call_id,
            ActorCall {
                slot,
                actor: info.id,
                frame: Some(frame),
                retries_left: info.max_task_retries,
                connection: None,
                started: std::time::Instant::now(),
                latency: submitter.latency.clone(),
            },
        );
        submitter.submit(self, call_id);
        ObjectRef::from_local(object)
    }

    /// Cancels a call made by this process or a task it submitted.
    pub(crate) fn cancel(self: &Arc<Self>, id: crate::ids::ObjectId, force: bool) -> Result<()> {
        let call_id = id.0 as u64;
        if self.owns_object_id(id) {
            let queued_or_sent = self.calls.get(&call_id).map(|call| call.connection);
            match queued_or_sent {
                Some(None) => {
                    fail_call(self, call_id, Error::Cancelled);
                    return Ok(());
                }
                Some(Some(connection)) => {
                    let conn =
                        self.submitters.by_actor.iter().find_map(|s| match &*s.state.lock() {
                            State::Connected { conn, .. } if conn.id() == connection => {
                                Some(conn.clone())
                            }
                            _ => None,
                        });
                    if let Some(conn) = conn {
                        conn.send(&Frame::Cancel { call_id })?;
                    }
                    return Ok(());
                }
                None => {}
            }
        }
        self.send(To::Head, ask::CancelTask { task: id, force }, |_| {});
        Ok(())
    }
}

impl Submitters {
    fn get_or_create(&self, info: &ActorInfo) -> Arc<Submitter> {
        if let Some(s) = self.by_actor.get(&info.id) {
            return s.clone();
        }
        self.by_actor
            .entry(info.id)
            .or_insert_with(|| {
                Arc::new(Submitter {
                    latency: crate::metrics::actor_call_histogram(&info.type_name),
                    info: info.clone(),
                    state: Mutex::new(State::Resolving {
                        queue: VecDeque::new(),
                        lost: Vec::new(),
                        known_incarnation: None,
                        asked: false,
                    }),
                })
            })
            .clone()
    }

    /// Handles the death of a connection: every actor reached through it is re-resolved.
    pub(crate) fn on_connection_closed(&self, runtime: &Arc<Runtime>, conn: &Arc<Connection>) {
        let affected: Vec<Arc<Submitter>> = self
            .by_actor
            .iter()
            .filter(|s| matches!(&*s.state.lock(), State::Connected { conn: c, .. } if c.id() == conn.id()))
            .map(|s| s.clone())
            .collect();
        for submitter in affected {
            submitter.on_disconnect(runtime, conn.id());
        }
    }
}

impl Submitter {
    fn submit(self: &Arc<Self>, runtime: &Arc<Runtime>, call_id: u64) {
        let mut state = self.state.lock();
        match &mut *state {
            State::Connected { conn, .. } => {
                let conn = conn.clone();
                if !send_call(runtime, &conn, call_id) {
                    // The connection broke under us; the close handler re-resolves and requeues.
                    drop(state);
                    self.on_disconnect(runtime, conn.id());
                }
            }
            State::Resolving { queue, asked, known_incarnation, .. } => {
                queue.push_back(call_id);
                if !*asked {
                    *asked = true;
                    let after = *known_incarnation;
                    drop(state);
                    self.ask_where(runtime, after);
                }
            }
            State::Dead(error) => {
                let error = error.clone();
                drop(state);
                fail_call(runtime, call_id, error);
            }
        }
    }

    /// Asks the head where the actor lives (answered when it is alive in a newer incarnation
    /// than `after`, or dead).
    fn ask_where(self: &Arc<Self>, runtime: &Arc<Runtime>, after: Option<u64>) {
        let this = self.clone();
        let rt = runtime.clone();
        let request = ask::WaitActorAlive { actor: self.info.id, after };
        runtime.send(To::Head, request, move |answer| match answer {
            Ok(AliveAt { address, incarnation }) => {
                match rt.endpoint().connect(&address) {
                    Ok(conn) => {
                        let connection = conn.id();
                        this.on_alive(&rt, conn, incarnation);
                        // Not under the state lock: an answer at once would take it.
                        this.watch(&rt, connection, incarnation);
                    }
                    Err(e) => this.on_dead(
                        &rt,
                        Error::ActorDied {
                            actor: this.info.id,
                            reason: format!("cannot reach its worker at {address}: {e}"),
                        },
                    ),
                }
            }
            Err(e) => this.on_dead(&rt, e),
        });
    }

    fn on_alive(self: &Arc<Self>, runtime: &Arc<Runtime>, conn: Arc<Connection>, incarnation: u64) {
        let mut state = self.state.lock();
        let (queue, lost) = match &mut *state {
            State::Resolving { queue, lost, .. } => (std::mem::take(queue), std::mem::take(lost)),
            _ => return,
        };
        *state = State::Connected { conn: conn.clone(), incarnation };
        // The actor lives on in a newer incarnation: the lost calls died with the old one.
        for call_id in lost {
            fail_call(runtime, call_id, self.lost_in_flight());
        }
        for call_id in queue {
            if !send_call(runtime, &conn, call_id) {
                drop(state);
                self.on_disconnect(runtime, conn.id());
                return;
            }
        }
    }

    /// Asks the head to say when this incarnation ends (the actor restarted or died): the
    /// head learns of a dead worker or node (heartbeats) well before this process's connection
    /// to it times out (QUIC's idle timeout), so calls in flight fail or retry that much sooner.
    fn watch(self: &Arc<Self>, runtime: &Arc<Runtime>, connection: u64, incarnation: u64) {
        let this = self.clone();
        let rt = runtime.clone();
        let request = ask::WaitActorAlive { actor: self.info.id, after: Some(incarnation) };
        runtime.send(To::Head, request, move |_| this.on_disconnect(&rt, connection));
    }

    /// The error of a call lost with a worker when the actor itself lives on (restarted).
    fn lost_in_flight(&self) -> Error {
        Error::ActorDied {
            actor: self.info.id,
            reason: "its worker process died while the call was in flight".into(),
        }
    }

    fn on_dead(self: &Arc<Self>, runtime: &Arc<Runtime>, error: Error) {
        let (queue, lost) = {
            let mut state = self.state.lock();
            let (queue, lost) = match &mut *state {
                State::Resolving { queue, lost, .. } => {
                    (std::mem::take(queue), std::mem::take(lost))
                }
                _ => (VecDeque::new(), Vec::new()),
            };
            *state = State::Dead(error.clone());
            (queue, lost)
        };
        for call_id in lost.into_iter().chain(queue) {
            fail_call(runtime, call_id, error.clone());
        }
    }

    /// The actor's worker went away: retry or fail the calls in flight, then re-resolve.
    fn on_disconnect(self: &Arc<Self>, runtime: &Arc<Runtime>, connection: u64) {
        let mut state = self.state.lock();
        let incarnation = match &*state {
            State::Connected { conn, incarnation } if conn.id() == connection => *incarnation,
            _ => return,
        };
        let mut in_flight: Vec<u64> = runtime
            .calls
            .iter()
            .filter(|c| c.actor == self.info.id && c.connection == Some(connection))
            .map(|c| *c.key())
            .collect();
        in_flight.sort_unstable();
        let mut queue = VecDeque::new();
        let mut lost = Vec::new();
        for call_id in in_flight {
            let retry = match runtime.calls.get_mut(&call_id) {
                Some(mut call) if call.retries_left != 0 && call.frame.is_some() => {
                    if call.retries_left > 0 {
                        call.retries_left -= 1;
                    }
                    call.connection = None;
                    true
                }
                Some(_) => false,
                None => continue,
            };
            if retry {
                tracing::info!(
                    call = call_id,
                    actor = %self.info.id,
                    "the actor's worker died with the call in flight; it is retried"
                );
                queue.push_back(call_id);
            } else {
                lost.push(call_id);
            }
        }
        *state =
            State::Resolving { queue, lost, known_incarnation: Some(incarnation), asked: true };
        drop(state);
        self.ask_where(runtime, Some(incarnation));
    }
}

/// Sends a queued call; false when the connection is broken.
fn send_call(runtime: &Runtime, conn: &Arc<Connection>, call_id: u64) -> bool {
    let (frame, actor) = match runtime.calls.get_mut(&call_id) {
        Some(mut call) => {
            call.connection = Some(conn.id());
            let frame = if call.retries_left != 0 { call.frame.clone() } else { call.frame.take() };
            (frame, call.actor)
        }
        None => return true,
    };
    let Some(frame) = frame else { return true };
    // A queued call is sent when its actor comes alive, outside the `actor_call` span: the
    // line names the call, the actor and this caller itself.
    tracing::debug!(
        call = call_id,
        %actor,
        caller = %runtime.worker_id,
        to = conn.peer().as_deref().unwrap_or("-"),
        "call sent"
    );
    conn.send(&Frame::Call(frame)).is_ok()
}

fn fail_call(runtime: &Runtime, call_id: u64, error: Error) {
    if let Some((_, call)) = runtime.calls.remove(&call_id) {
        tracing::debug!(call = call_id, actor = %call.actor, "call failed: {error}");
        call.slot.complete(Err(error));
    }
}
