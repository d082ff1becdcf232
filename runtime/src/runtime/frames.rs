//! What arrives on this process's connections: calls, replies, requests and responses, each
//! frame's stored values counted for this process; and what a closed connection means (a lost
//! head ends a cluster process).

use std::sync::{Arc, OnceLock, Weak};

use super::{Ending, ProcessRole, ResponseCallback, Runtime};
use crate::error::Error;
use crate::head::Responder;
use crate::ids::WorkerId;
use crate::object::Value;
use crate::object::outcome_to_result;
use crate::protocol::{Frame, Outcome, OwnerRequest, Request, Response};
use crate::store::Hold;
use crate::transport::{Connection, FrameHandler};

pub(super) struct PendingRequest {
    pub(super) connection: u64,
    /// Behind a mutex only to make the entry `Sync`; it is taken exactly once.
    pub(super) callback: parking_lot::Mutex<Option<ResponseCallback>>,
    /// A request to a head that restarts: what to send again once reconnected.
    pub(super) resend: Option<crate::protocol::HeadRequest>,
}

impl PendingRequest {
    pub(super) fn answer(self, response: Response) {
        if let Some(callback) = self.callback.into_inner() {
            callback(response);
        }
    }
}

/// The endpoint's handler: bound before the runtime exists (the endpoint is one of its
/// parts), it serves the runtime once [`Handler::serve`] names it.
#[derive(Default)]
pub(super) struct Handler(OnceLock<Weak<Runtime>>);

impl Handler {
    pub(super) fn serve(&self, runtime: &Arc<Runtime>) {
        let _ = self.0.set(Arc::downgrade(runtime));
    }

    fn runtime(&self) -> Option<Arc<Runtime>> {
        self.0.get()?.upgrade()
    }
}

impl FrameHandler for Handler {
    fn on_frame(&self, conn: &Arc<Connection>, frame: Frame) {
        if let Some(runtime) = self.runtime() {
            runtime.on_frame(conn, frame);
        }
    }

    fn on_close(&self, conn: &Arc<Connection>, reason: &str) {
        if let Some(runtime) = self.runtime() {
            runtime.on_close(conn, reason);
        }
    }

    fn on_sent(&self, conn: &Connection, frame: &Frame) {
        if let Some(runtime) = self.runtime() {
            runtime.on_sent(conn, frame);
        }
    }

    fn handles_inline(&self, frame: &Frame) -> bool {
        match frame {
            // Completing an actor call's slot wakes its waiters; a task reply to the head
            // would run the scheduler, which may block, so those stay on the thread.
            Frame::Reply { call_id, .. } => {
                self.runtime().is_some_and(|runtime| runtime.calls.contains_key(call_id))
            }
            // A call to the actor this worker hosts only queues it for the actor's executor.
            Frame::Call(call) => {
                matches!(call.target, crate::protocol::CallTarget::Actor { .. })
                    && self.runtime().is_some_and(|runtime| runtime.hosted().is_some())
            }
            _ => false,
        }
    }
}

impl Runtime {
    fn on_frame(self: &Arc<Self>, conn: &Arc<Connection>, mut frame: Frame) {
        // Every stored value that arrives came with a count its sender added for this process,
        // at the store of the value's home node.
        frame.visit_stored_mut(&mut |value| {
            if value.hold.is_some() {
                return;
            }
            if self.is_foreign(value) {
                let home = value.home.clone().unwrap_or_default();
                value.hold = Some(Hold::adopt_remote(self, home, value.id));
            } else if let Some(store) = self.store() {
                value.hold = Some(Hold::adopt(store, value.id));
            }
        });
        match frame {
            Frame::Hello { address } => conn.set_peer(address),
            Frame::Call(call) => crate::worker::on_call(self, conn, call),
            Frame::Reply { call_id, outcome } => self.complete_call(call_id, outcome),
            Frame::TaskReply { call_id, outcome } => match self.head() {
                Some(head) => head.on_task_reply(call_id, outcome),
                None => tracing::debug!(
                    call = call_id,
                    "a task reply reached a process without the head"
                ),
            },
            Frame::Cancel { call_id } => {
                if let Some(hosted) = self.hosted() {
                    hosted.cancel(call_id);
                } else if let Some(tasks) = self.tasks() {
                    tasks.cancel(call_id);
                }
            }
            Frame::Request { req_id, body } => {
                self.on_request(Some(conn), Responder::remote(conn.clone(), req_id), body)
            }
            Frame::Response { req_id, body } => {
                if let Some((_, pending)) = self.requests.remove(&req_id) {
                    pending.answer(body);
                }
            }
        }
    }

    /// Where an actor call made by this process resumes: its reply completes the result's
    /// slot, waking whoever waits on the `ObjectRef` (a reply to a call already failed or
    /// cancelled is dropped).
    fn complete_call(self: &Arc<Self>, call_id: u64, outcome: Outcome) {
        if let Some((_, call)) = self.calls.remove(&call_id) {
            let seconds = call.started.elapsed().as_secs_f64();
            tracing::debug!(call = call_id, actor = %call.actor(), seconds, "call answered");
            call.latency.observe(seconds);
            call.slot.complete(outcome_to_result(outcome))
        }
    }

    /// Routes a request to the service of this process that answers it; `origin` is the
    /// connection it came on (None: from this process).
    pub(super) fn on_request(
        self: &Arc<Self>,
        origin: Option<&Arc<Connection>>,
        responder: Responder,
        body: Request,
    ) {
        match body {
            Request::Node(crate::protocol::NodeRequest::HeadRestarted { head }) => {
                responder.respond(Response::Done);
                self.on_head_restarted(&head);
            }
            Request::Head(request) => match self.head() {
                Some(head) => head.handle(origin, request, responder),
                None => responder.respond(Response::Error(Error::Invalid(format!(
                    "{} is not the control plane; cannot answer {request:?}",
                    self.worker_id
                )))),
            },
            Request::Node(request) => match (self.node_agent(), self.head()) {
                (Some(agent), _) => agent.handle(request, Box::new(move |r| responder.respond(r))),
                // The head serves its own node's logs.
                (None, Some(head)) => responder.respond(head.node_logs(&request)),
                (None, None) => responder.respond(Response::Error(Error::Invalid(format!(
                    "{} is not a node daemon; cannot answer {request:?}",
                    self.worker_id
                )))),
            },
            Request::Store { holder, op: crate::protocol::StoreOp::Pull { id, from } } => {
                // A transfer from another node: not on this connection's reader thread.
                let runtime = self.clone();
                std::thread::spawn(move || {
                    responder.respond(
                        match crate::cluster::pull_into_node(&runtime, id, &from, holder) {
                            Ok(()) => Response::Done,
                            Err(e) => Response::Error(e),
                        },
                    )
                });
            }
            Request::Store { holder, op } => match self.store() {
                Some(store) => responder.respond(store.handle_remote(self, holder, op)),
                None => responder.respond(Response::Error(Error::ObjectStore(
                    "this process has no object store".into(),
                ))),
            },
            Request::Owner(OwnerRequest::FetchObject { id }) => match self.objects.find_slot(id) {
                None => {
                    responder.respond(Response::Outcome(Outcome::Error(Error::ObjectFreed(id))))
                }
                Some(slot) => slot.on_done(move |result| {
                    responder.respond(Response::Outcome(match result {
                        Ok(Value::Inline(bytes)) => Outcome::Value(bytes.as_ref().clone()),
                        Ok(Value::Nested { bytes, refs }) => Outcome::Nested {
                            bytes: bytes.as_ref().clone(),
                            refs: refs.as_ref().clone(),
                        },
                        Ok(Value::Stored(stored)) => Outcome::Stored(stored.clone()),
                        Err(e) => Outcome::Error(e.clone()),
                    }))
                }),
            },
            Request::Owner(OwnerRequest::FreeObjects { ids }) => {
                for id in ids {
                    self.objects.free_owned(id);
                }
                responder.respond(Response::Done);
            }
        }
    }

    /// A frame went out on `conn`: add a count for the receiver of every stored value in it
    /// (the sender's own count is alive until the frame is dropped, after this).
    fn on_sent(&self, conn: &Connection, frame: &Frame) {
        frame.visit_stored(&mut |value| {
            let Some(peer) = conn.peer().as_deref().and_then(rtrun_proto::address::holder_of_address) else {
                tracing::warn!(object = %value.id, "a stored value was sent to a peer of unknown identity");
                return;
            };
            match (&value.home, self.store()) {
                (Some(home), _) if self.is_foreign(value) => {
                    self.notify_store_at(home, crate::protocol::StoreOp::Lend { id: value.id, to: peer })
                }
                (_, Some(store)) => store.lend(value.id, peer),
                (_, None) => {}
            }
        });
    }

    fn on_close(self: &Arc<Self>, conn: &Arc<Connection>, reason: &str) {
        let head_lost = self.head_connection().is_some_and(|h| h.id() == conn.id());
        // A head that restarts is waited for: its requests are held for it.
        let reconnects = head_lost && self.reconnects_to_head();
        // First, so that no caller that would see its request fail can exit with another code.
        // The head learns of worker deaths from the reaper (waitpid), not from closed sockets.
        if head_lost && !reconnects {
            self.on_head_lost(conn, reason);
        }
        let failed: Vec<u64> =
            self.requests.iter().filter(|r| r.connection == conn.id()).map(|r| *r.key()).collect();
        for req_id in failed {
            if let Some((_, mut pending)) = self.requests.remove(&req_id) {
                if let (true, Some(body)) = (reconnects, pending.resend.take())
                    && let Some(callback) = pending.callback.lock().take()
                {
                    self.parked.lock().push((body, callback));
                    continue;
                }
                pending.answer(Response::Error(Error::Transport(format!(
                    "connection to {} closed: {reason}",
                    conn.peer().unwrap_or_default()
                ))));
            }
        }
        if reconnects {
            self.on_head_lost(conn, reason);
        }
        self.submitters.on_connection_closed(self, conn);
        // A driver of a cluster went away: its job's actors go with it.
        if let Some(head) = self.head()
            && let Some(holder) =
                conn.peer().as_deref().and_then(rtrun_proto::address::holder_of_address)
        {
            head.on_driver_gone(WorkerId(holder.0));
        }
    }

    /// Whether this process reconnects to its head when it loses it (a member of a cluster
    /// whose head persists its state, not exiting).
    pub(super) fn reconnects_to_head(&self) -> bool {
        let expected = self.head_exit_expected.load(std::sync::atomic::Ordering::Acquire);
        !expected
            && !crate::cluster::exiting()
            && crate::cluster::member().is_some_and(|m| m.reconnect_window().is_some())
    }

    /// Sends the requests held while the head was away on the new connection to it.
    pub(crate) fn resend_parked(&self, conn: &Arc<Connection>) {
        let parked = std::mem::take(&mut *self.parked.lock());
        if !parked.is_empty() {
            tracing::info!(requests = parked.len(), "sending the requests held for the head again");
        }
        for (body, callback) in parked {
            self.send_on(conn, Request::Head(body), callback);
        }
    }

    /// Fails the requests held for a head that did not come back.
    pub(crate) fn fail_parked(&self, why: &str) {
        for (_, callback) in std::mem::take(&mut *self.parked.lock()) {
            callback(Response::Error(Error::Transport(format!("the cluster head is gone: {why}"))));
        }
    }

    /// The head at `head` says it restarted: the connection to it (a dead one, whose silence
    /// would be noticed only at its idle timeout) is closed now, and this process reconnects.
    fn on_head_restarted(self: &Arc<Self>, head: &str) {
        let Some(ours) = self.endpoint().head_address().cloned() else { return };
        let Some(conn) = self.head_connection() else { return };
        if ours != head {
            // It recovered this cluster's state at another address (another port, or another
            // --advertise): this process cannot follow it there.
            let joined = host_port(&ours);
            self.give_up_on_head(
                &joined,
                &format!(
                    "the cluster head restarted at {}, but this process joined it at {joined}: \
                     restart the head at {joined} (--port, --advertise), or join anew",
                    host_port(head),
                ),
            );
            return;
        }
        tracing::info!(%head, "the head restarted; reconnecting");
        conn.shutdown();
        self.on_close(&conn, "the head restarted");
    }

    /// Tells this process that the head is about to exit at its request (`rtrun stop`), so
    /// that the connection closing is not reported as a failure.
    pub(crate) fn expect_head_exit(&self) {
        self.head_exit_expected.store(true, std::sync::atomic::Ordering::Release);
    }

    /// The connection to the control plane closed. A process of a cluster cannot go on
    /// without it: its part in the session ends with [`Ending::HeadLost`] (its main exits
    /// with [`EXIT_HEAD_LOST`](super::EXIT_HEAD_LOST): schedulers, CI and Kubernetes read exit
    /// codes), a node daemon's after stopping its workers. A worker of an embedded session
    /// ends quietly: its driver leaving is how a session ends.
    pub(super) fn on_head_lost(&self, conn: &Connection, reason: &str) {
        let Some(role) = self.role() else { return };
        let expected = self.head_exit_expected.load(std::sync::atomic::Ordering::Acquire);
        if expected || crate::cluster::exiting() {
            if let ProcessRole::Worker(_) = role {
                self.end(Ending::Stopped);
            }
            return;
        }
        let head = host_port(&conn.peer().unwrap_or_default());
        if let ProcessRole::Worker(_) = role
            && crate::cluster::member().is_none()
        {
            return self.end(Ending::Stopped);
        }
        // A head with a state directory comes back: its members reconnect meanwhile.
        if !matches!(role, ProcessRole::ControlPlane { .. })
            && let Some(window) = crate::cluster::member().and_then(|m| m.reconnect_window())
            && let Some(runtime) = self.me.upgrade()
        {
            crate::cluster::reconnect::start(runtime, window, format!("{head}: {reason}"));
            return;
        }
        self.give_up_on_head(&head, reason);
    }

    /// This process lost the head for good (it has no state directory, or did not come back
    /// in time, or refused this process): it ends, a node daemon after stopping its workers.
    pub(crate) fn give_up_on_head(&self, head: &str, reason: &str) {
        let Some(role) = self.role() else { return };
        let message = match role {
            ProcessRole::Worker(_) if crate::cluster::member().is_none() => {
                return self.end(Ending::Stopped);
            }
            ProcessRole::ControlPlane { .. } => return,
            ProcessRole::Worker(_) => {
                format!(
                    "worker {}: lost the connection to the cluster head at {head}: {reason}; exiting",
                    self.worker_id
                )
            }
            ProcessRole::NodeDaemon { agent, .. } => {
                agent.stop();
                format!(
                    "rtrun join: lost the connection to the cluster head at {head}: {reason}; \
                     stopped this node's workers and exiting (restart `rtrun join` to rejoin)"
                )
            }
            ProcessRole::ClusterDriver { .. } => {
                format!("rtrun: lost the connection to the cluster head at {head}: {reason}")
            }
        };
        self.end(Ending::HeadLost(message));
    }
}

/// A cluster address as operators write it (`host:port`); any other address as it is.
fn host_port(address: &str) -> String {
    match crate::transport::Route::parse(address) {
        Ok(crate::transport::Route::Quic { addr, .. }) => addr.to_string(),
        _ => address.to_owned(),
    }
}
