//! Requests this process sends: to the control plane (in process when it holds it, else on its
//! head connection) and to its node, blocking or with a callback, and the control-plane calls
//! behind the public API (actors, tasks, listings).

use std::sync::Arc;

use super::frames::PendingRequest;
use super::{ResponseCallback, Runtime};
use crate::actor::{ActorInfo, ActorSpec};
use crate::error::{Error, Result};
use crate::head::Responder;
use crate::ids::{ActorId, ObjectId};
use crate::object::{ObjectRef, Slot};
use crate::object::{failed_ref, outcome_to_result};
use crate::protocol::{
    Address, Ask, ClusterInfo, Frame, ObjectLocator, Reply, Request, Response, ask,
};
use crate::task::TaskSpec;
use crate::transport::Connection;

/// Where a request goes.
#[derive(Clone, Copy)]
pub(crate) enum To<'a> {
    /// The control plane: answered in this process when it holds it, else sent on its head
    /// connection.
    Head,
    /// This process's node (its store, its logs): on the node daemon's connection in a cluster
    /// worker, on the head's in a worker of an embedded session (its driver holds the node);
    /// in the process that holds the node (an embedded driver, a head, a node daemon) it is
    /// answered here.
    Node,
    /// The process at the other end of this connection (an object's owner, another node).
    Peer(&'a Arc<Connection>),
}

impl To<'_> {
    fn name(self) -> &'static str {
        match self {
            To::Head => "the control plane",
            To::Node => "the node",
            To::Peer(_) => "the peer",
        }
    }
}

impl Runtime {
    /// Sends `request` to `to` and blocks for its answer, typed by the request (see [`Ask`]).
    /// Never call this from a connection's reader thread.
    pub(crate) fn ask<A: Ask>(self: &Arc<Self>, to: To<'_>, request: A) -> Result<A::Reply> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send(to, request, move |answer| {
            let _ = tx.send(answer);
        });
        let answer =
            rx.recv().unwrap_or_else(|_| Err(Error::Transport(format!("{} went away", to.name()))));
        // A request that failed because the head's connection closed (before its reader
        // thread got to say so) ends the process the same way.
        if matches!(to, To::Head)
            && let Err(e) = &answer
            && let Some(conn) = self.head_connection().filter(|c| c.is_closed())
        {
            self.on_head_lost(&conn, &e.to_string());
        }
        answer
    }

    /// Sends `request` to `to`; `then` gets its answer, typed by the request (an error when
    /// the connection closes first).
    pub(crate) fn send<A: Ask>(
        self: &Arc<Self>,
        to: To<'_>,
        request: A,
        then: impl FnOnce(Result<A::Reply>) + Send + 'static,
    ) {
        let callback: ResponseCallback =
            Box::new(move |response| then(<A::Reply as Reply>::from_response(response)));
        let request = request.into();
        match to {
            To::Head => match (self.head(), request) {
                (Some(head), Request::Head(body)) => {
                    head.handle(None, body, Responder::local(callback))
                }
                (None, request @ Request::Head(_)) => match self.head_connection() {
                    Some(conn) => self.send_on(&conn, request, callback),
                    None => callback(Response::Error(Error::NotInitialised)),
                },
                (_, other) => callback(Response::Error(Error::Invalid(format!(
                    "not a request for the control plane: {other:?}"
                )))),
            },
            To::Node => {
                let node = self.worker().map(|w| w.node.clone().unwrap_or_else(|| w.head.get()));
                match node {
                    Some(conn) => self.send_on(&conn, request, callback),
                    None => self.on_request(None, Responder::local(callback), request),
                }
            }
            To::Peer(conn) => self.send_on(conn, request, callback),
        }
    }

    /// Sends a request on `conn`; `callback` gets the response (an error response when `conn`
    /// closes first). [`Runtime::send`] types it; this is the frame underneath.
    pub(crate) fn send_on(
        &self,
        conn: &Arc<Connection>,
        body: Request,
        callback: ResponseCallback,
    ) {
        let req_id = self.next_id();
        // A request to a head that restarts is kept to be sent again after a reconnect.
        let resend = match &body {
            Request::Head(request) if self.reconnects_to_head() => Some(request.clone()),
            _ => None,
        };
        self.requests.insert(
            req_id,
            PendingRequest {
                connection: conn.id(),
                callback: parking_lot::Mutex::new(Some(callback)),
                resend,
            },
        );
        if let Err(e) = conn.send(&Frame::Request { req_id, body })
            && let Some((_, mut pending)) = self.requests.remove(&req_id)
        {
            // The head's connection is down: held until this process has reconnected.
            let head = self.head_connection().is_some_and(|h| h.id() == conn.id());
            if head
                && let Some(body) = pending.resend.take()
                && let Some(callback) = pending.callback.lock().take()
            {
                self.parked.lock().push((body, callback));
                self.on_head_lost(conn, &e.to_string());
                // A reconnect that finished meanwhile sent what was held before this was.
                if let Some(current) = self.head_connection()
                    && current.id() != conn.id()
                    && !current.is_closed()
                {
                    self.resend_parked(&current);
                }
                return;
            }
            pending.answer(Response::Error(e));
        }
    }

    /// Fetches an object's value from its owner into `slot`.
    pub(crate) fn fetch_object(self: &Arc<Self>, id: ObjectId, owner: &Address, slot: Arc<Slot>) {
        let conn = match self.endpoint().connect(owner) {
            Ok(conn) => conn,
            Err(e) => {
                slot.complete(Err(Error::ObjectLost {
                    id,
                    reason: format!("its owner {owner} is unreachable: {e}"),
                }));
                return;
            }
        };
        self.send(To::Peer(&conn), ask::FetchObject { id }, move |outcome| {
            let result = outcome.and_then(outcome_to_result).map_err(|e| match e {
                Error::Transport(reason) => Error::ObjectLost { id, reason },
                e => e,
            });
            slot.complete(result);
        });
    }

    /// Frees an object, here if we own it, else at its owner.
    pub(crate) fn free_object(self: &Arc<Self>, locator: &ObjectLocator) {
        if &locator.owner == self.address() {
            self.objects.free_owned(locator.id);
        } else if let Ok(conn) = self.endpoint().connect(&locator.owner) {
            self.send(To::Peer(&conn), ask::FreeObjects { ids: vec![locator.id] }, |_| {});
        }
    }

    pub(crate) fn create_actor(self: &Arc<Self>, mut spec: ActorSpec) -> Result<ActorInfo> {
        if crate::registry::actor_type(&spec.type_name).is_none() {
            return Err(Error::Invalid(format!(
                "actor type {} is not compiled into this binary",
                spec.type_name
            )));
        }
        if spec.options.namespace.is_none() && spec.options.name.is_some() {
            spec.options.namespace = Some(self.namespace.clone());
        }
        self.ask(To::Head, ask::CreateActor { spec: Box::new(spec) })
    }

    pub(crate) fn get_actor_by_name(
        self: &Arc<Self>,
        name: &str,
        namespace: Option<&str>,
    ) -> Result<ActorInfo> {
        let namespace = namespace.unwrap_or(&self.namespace).to_owned();
        self.ask(To::Head, ask::GetActorByName { name: name.to_owned(), namespace })
    }

    /// Every actor the control plane knows, dead ones included.
    pub(crate) fn list_actors(self: &Arc<Self>) -> Result<Vec<crate::protocol::ActorSummary>> {
        self.ask(To::Head, ask::ListActors)
    }

    /// Every live placement group.
    pub(crate) fn list_placement_groups(
        self: &Arc<Self>,
    ) -> Result<Vec<crate::placement_group::PlacementGroupState>> {
        self.ask(To::Head, ask::ListPlacementGroups)
    }

    /// Every submitted job.
    pub(crate) fn list_jobs(self: &Arc<Self>) -> Result<Vec<crate::protocol::JobInfo>> {
        self.ask(To::Head, ask::ListJobs)
    }

    /// Whether this process holds the control plane (a cluster head or an embedded driver).
    pub(crate) fn holds_control_plane(&self) -> bool {
        self.head().is_some()
    }

    /// The object store's snapshot when this process is a node (its store lives here).
    pub(crate) fn node_store_stats(&self) -> Result<Option<rtrun_object_store::StoreStats>> {
        let Ok(client) = self.store_client() else { return Ok(None) };
        Ok(client.node_store().map(|store| store.stats()))
    }

    /// The namespace names default to.
    pub(crate) fn namespace(&self) -> &str {
        &self.namespace
    }

    pub(crate) fn kill_actor(self: &Arc<Self>, actor: ActorId, no_restart: bool) -> Result<()> {
        self.ask(To::Head, ask::KillActor { actor, no_restart })
    }

    /// Submits a task; its result arrives as the head's response.
    pub(crate) fn submit_task<T>(
        self: &Arc<Self>,
        function: String,
        args: Vec<crate::protocol::Arg>,
        options: crate::task::TaskOptions,
    ) -> ObjectRef<T> {
        if crate::registry::task(&function).is_none() {
            return failed_ref(Error::Invalid(format!(
                "remote function {function} is not compiled into this binary"
            )));
        }
        let id = self.new_object_id();
        let spec = TaskSpec { task: id, function, args, options };
        let slot = Arc::new(Slot::default());
        let object = self.objects.create_owned(self, id, slot.clone());
        self.send(To::Head, ask::SubmitTask { spec: Box::new(spec) }, move |outcome| {
            slot.complete(outcome.and_then(outcome_to_result))
        });
        ObjectRef::from_local(object)
    }

    /// A summary of the cluster's resources and workers.
    pub fn cluster_info(self: &Arc<Self>) -> Result<ClusterInfo> {
        self.ask(To::Head, ask::ClusterInfo)
    }
}
