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
    Address, ClusterInfo, Frame, HeadRequest, ObjectLocator, Outcome, OwnerRequest, Reply, Request,
    Response,
};
use crate::task::TaskSpec;
use crate::transport::Connection;

impl Runtime {
    /// Sends a request to the control plane; `callback` gets the response (or an error response
    /// when the head connection closes first).
    pub(crate) fn head_request(self: &Arc<Self>, body: HeadRequest, callback: ResponseCallback) {
        if let Some(head) = self.head() {
            head.handle(None, body, Responder::local(callback));
            return;
        }
        match self.head_connection() {
            Some(conn) => self.request_on(conn, Request::Head(body), callback),
            None => callback(Response::Error(Error::NotInitialised)),
        }
    }

    /// Sends a request to this process's node (its store, its logs): on the node daemon's
    /// connection in a cluster worker, on the head's in a worker of an embedded session (its
    /// driver holds the node); in the process that holds the node (an embedded driver, a
    /// head, a node daemon) it is answered here.
    pub(crate) fn node_request(
        self: &Arc<Self>,
        body: impl Into<Request>,
        callback: ResponseCallback,
    ) {
        let body = body.into();
        match self.worker().map(|worker| worker.node.as_ref().unwrap_or(&worker.head)) {
            Some(conn) => self.request_on(conn, body, callback),
            None => self.on_request(None, Responder::local(callback), body),
        }
    }

    /// Like [`Runtime::node_request`], blocking for the answer.
    pub(crate) fn node_call(self: &Arc<Self>, body: impl Into<Request>) -> Result<Response> {
        wait_response("the node", |callback| self.node_request(body, callback))
    }

    /// Sends a request to the control plane and blocks for the response. Never call this from a
    /// connection's reader thread.
    pub(crate) fn head_call(self: &Arc<Self>, body: HeadRequest) -> Result<Response> {
        let result =
            wait_response("the control plane", |callback| self.head_request(body, callback));
        // A request that failed because the head's connection closed (before its reader
        // thread got to say so) ends the process the same way.
        if let Err(e) = &result
            && let Some(conn) = self.head_connection().filter(|c| c.is_closed())
        {
            self.on_head_lost(conn, &e.to_string());
        }
        result
    }

    /// Sends a request to the control plane and blocks for its typed answer (see [`Reply`]).
    pub(crate) fn call<R: Reply>(self: &Arc<Self>, body: HeadRequest) -> Result<R> {
        self.head_call(body).and_then(R::from_response)
    }

    /// Sends a request on `conn` and blocks for the response.
    pub(crate) fn call_on(
        &self,
        conn: &Arc<Connection>,
        body: impl Into<Request>,
    ) -> Result<Response> {
        wait_response("the peer", |callback| self.request_on(conn, body.into(), callback))
    }

    /// Sends a request on `conn` and blocks for its typed answer (see [`Reply`]).
    pub(crate) fn ask_on<R: Reply>(
        &self,
        conn: &Arc<Connection>,
        body: impl Into<Request>,
    ) -> Result<R> {
        self.call_on(conn, body).and_then(R::from_response)
    }

    /// Sends a request to this process's node and blocks for its typed answer.
    pub(crate) fn node_ask<R: Reply>(self: &Arc<Self>, body: impl Into<Request>) -> Result<R> {
        self.node_call(body).and_then(R::from_response)
    }

    /// Sends a request on `conn`.
    pub(crate) fn request_on(
        &self,
        conn: &Arc<Connection>,
        body: Request,
        callback: ResponseCallback,
    ) {
        let req_id = self.next_id();
        self.requests.insert(
            req_id,
            PendingRequest {
                connection: conn.id(),
                callback: parking_lot::Mutex::new(Some(callback)),
            },
        );
        if let Err(e) = conn.send(&Frame::Request { req_id, body })
            && let Some((_, pending)) = self.requests.remove(&req_id)
        {
            pending.answer(Response::Error(e));
        }
    }

    /// Fetches an object's value from its owner into `slot`.
    pub(crate) fn fetch_object(&self, id: ObjectId, owner: &Address, slot: Arc<Slot>) {
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
        self.request_on(
            &conn,
            Request::Owner(OwnerRequest::FetchObject { id }),
            Box::new(move |response| {
                let result = Outcome::from_response(response).and_then(outcome_to_result);
                let result = result.map_err(|e| match e {
                    Error::Transport(reason) => Error::ObjectLost { id, reason },
                    e => e,
                });
                slot.complete(result);
            }),
        );
    }

    /// Frees an object, here if we own it, else at its owner.
    pub(crate) fn free_object(&self, locator: &ObjectLocator) {
        if &locator.owner == self.address() {
            self.objects.free_owned(locator.id);
        } else if let Ok(conn) = self.endpoint().connect(&locator.owner) {
            self.request_on(
                &conn,
                Request::Owner(OwnerRequest::FreeObjects { ids: vec![locator.id] }),
                Box::new(|_| {}),
            );
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
        self.call(HeadRequest::CreateActor(Box::new(spec)))
    }

    pub(crate) fn get_actor_by_name(
        self: &Arc<Self>,
        name: &str,
        namespace: Option<&str>,
    ) -> Result<ActorInfo> {
        let namespace = namespace.unwrap_or(&self.namespace).to_owned();
        self.call(HeadRequest::GetActorByName { name: name.to_owned(), namespace })
    }

    /// Every actor the control plane knows, dead ones included.
    pub(crate) fn list_actors(self: &Arc<Self>) -> Result<Vec<crate::protocol::ActorSummary>> {
        self.call(HeadRequest::ListActors)
    }

    /// Every live placement group.
    pub(crate) fn list_placement_groups(
        self: &Arc<Self>,
    ) -> Result<Vec<crate::placement_group::PlacementGroupState>> {
        self.call(HeadRequest::ListPlacementGroups)
    }

    /// Every submitted job.
    pub(crate) fn list_jobs(self: &Arc<Self>) -> Result<Vec<crate::protocol::JobInfo>> {
        self.call(HeadRequest::ListJobs)
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
        self.call(HeadRequest::KillActor { actor, no_restart })
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
        self.head_request(
            HeadRequest::SubmitTask(Box::new(spec)),
            Box::new(move |response| {
                slot.complete(Outcome::from_response(response).and_then(outcome_to_result))
            }),
        );
        ObjectRef::from_local(object)
    }

    /// A summary of the cluster's resources and workers.
    pub fn cluster_info(self: &Arc<Self>) -> Result<ClusterInfo> {
        self.call(HeadRequest::ClusterInfo)
    }
}

/// Sends a request through `send` and blocks for its response; an error response is an `Err`.
fn wait_response(who: &str, send: impl FnOnce(ResponseCallback)) -> Result<Response> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    send(Box::new(move |response| {
        let _ = tx.send(response);
    }));
    match rx.recv() {
        Ok(Response::Error(e)) => Err(e),
        Ok(response) => Ok(response),
        Err(_) => Err(Error::Transport(format!("{who} went away"))),
    }
}
