//! The control plane of a session (Ray's GCS plus raylet): the shell around the sans-I/O
//! [`rtrun_head_core::HeadCore`], which decides everything — the actor directory with names
//! and restarts, resources and placement groups, the task queue and pool of task workers, nodes,
//! drivers and jobs. The shell owns what the core must not: the lock, the connections and the
//! answers' destinations (the core names them by token), the spawner, and the effects' I/O.
//!
//! Every event goes through [`Head::event`]: under the lock the core decides and the tokens of
//! its effects are resolved; the effects are carried out after the lock is released, so no
//! callback or send ever runs with the lock held.

pub(crate) mod config;
mod jobs;
mod nodes;
pub(crate) mod spawn;
pub(crate) mod state_dir;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::Result;
use crate::ids::WorkerId;
use crate::protocol::{
    Address, Frame, HeadRequest, JobInfo, NodeRequest, Outcome, Response, WorkerExit,
};
use crate::runtime::Runtime;
use crate::transport::Connection;

pub(crate) use config::head_config;
pub use config::{
    DEFAULT_TASK_WORKER_IDLE_TIMEOUT, NOSET_CUDA_VISIBLE_DEVICES_ENV, TASK_WORKER_IDLE_TIMEOUT_ENV,
};
pub(crate) use nodes::{ClusterHead, JoinAs, Joined, Persistence};
pub(crate) use rtrun_head_core::HeadConfig;
use rtrun_head_core::{ConnToken, Effect, Event, HeadCore, JobStart, Origin, ReplyToken};
pub(crate) use spawn::{SpawnEvents, Spawner, kill_process};

/// Watches that wait before the first sweep of closed ones (see `Shared::sweep_at`).
const MIN_WATCH_SWEEP: usize = 64;

/// How long `rtrun stop` waits for the node daemons to acknowledge before the head exits.
const STOP_ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// Answers a request: locally (a callback in this process) or on a connection.
pub(crate) struct Responder {
    answer: Box<dyn FnOnce(Response) + Send>,
    /// The connection the answer goes to (none for a local callback).
    conn: Option<Arc<Connection>>,
}

impl Responder {
    pub(crate) fn local(callback: Box<dyn FnOnce(Response) + Send>) -> Responder {
        Responder { answer: callback, conn: None }
    }

    pub(crate) fn remote(conn: Arc<Connection>, req_id: u64) -> Responder {
        let to = conn.clone();
        let answer = Box::new(move |body| {
            if let Err(e) = to.send(&Frame::Response { req_id, body }) {
                tracing::debug!("could not deliver a response: {e}");
            }
        });
        Responder { answer, conn: Some(conn) }
    }

    pub(crate) fn respond(self, response: Response) {
        (self.answer)(response)
    }

    /// Whether nobody can hear the answer any more (its connection closed).
    fn abandoned(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.is_closed())
    }
}

/// The core and what its tokens stand for, under one lock.
struct Shared {
    core: HeadCore,
    /// Where each pending answer goes.
    replies: HashMap<ReplyToken, Responder>,
    /// The pending actor watches (kept by the core until their actor is alive or dead).
    watches: HashSet<ReplyToken>,
    /// How many watches may wait before the closed ones are swept (doubling, so the sweeps
    /// cost O(1) per watch however many wait).
    sweep_at: usize,
    next_reply: u64,
    /// The connections the core refers to (workers' registrations).
    conns: HashMap<ConnToken, Arc<Connection>>,
    /// Where the durable state goes (`rtrun head --state-dir`).
    state_dir: Option<state_dir::StateDir>,
    /// How long nodes and drivers reconnect to this head after losing it (with a state
    /// directory only: a head without one comes back knowing nobody).
    reconnect_window: Option<Duration>,
}

/// An effect with its tokens resolved, carried out after the lock is released.
enum Action {
    Respond(Responder, Response),
    Spawn {
        node: u64,
        worker: WorkerId,
        env: Vec<(String, String)>,
        job: Option<String>,
    },
    Call(Arc<Connection>, u64, Frame),
    Send(Arc<Connection>, Frame),
    Kill(u64, u32),
    Remember(Address, Arc<Connection>),
    StopNode(Address, String),
    RemoveJobFiles(u64, Option<String>),
    RemoveJobLog(u64, std::path::PathBuf),
    StartJob(Option<Responder>, Box<JobStart>),
    ReadJobLog(Option<Responder>, std::path::PathBuf, u64, Box<JobInfo>),
    StopCluster,
    /// The state directory could not be written: the head ends rather than act on changes it
    /// could not persist.
    PersistFailed(String),
    AdoptJob {
        worker: WorkerId,
        pid: u32,
        log: std::path::PathBuf,
    },
}

impl Shared {
    /// Resolves the core's tokens: answers leave `replies`, connections are looked up (the one
    /// a request came on is kept once the core remembers it).
    fn resolve(&mut self, effects: Vec<Effect>, origin: Option<&Arc<Connection>>) -> Vec<Action> {
        // Write-ahead: what the effects act on is on disk before any of them is carried out.
        if let Err(e) = self.persist() {
            return vec![Action::PersistFailed(e.to_string())];
        }
        let mut actions = Vec::with_capacity(effects.len());
        for effect in effects {
            match effect {
                Effect::Respond(reply, response) => {
                    self.watches.remove(&reply);
                    // An abandoned watch has no responder any more: nobody hears its answer.
                    if let Some(responder) = self.replies.remove(&reply) {
                        actions.push(Action::Respond(responder, response));
                    }
                }
                Effect::Spawn { node, worker, env, job } => {
                    actions.push(Action::Spawn { node, worker, env, job })
                }
                Effect::Call { conn, call_id, frame } => match self.conns.get(&conn) {
                    Some(c) => actions.push(Action::Call(c.clone(), call_id, frame)),
                    None => tracing::warn!(?conn, "the core called on a connection it forgot"),
                },
                Effect::Send(conn, frame) => match self.conns.get(&conn) {
                    Some(c) => actions.push(Action::Send(c.clone(), frame)),
                    None => tracing::warn!(?conn, "the core sent on a connection it forgot"),
                },
                Effect::Kill { node, pid } => actions.push(Action::Kill(node, pid)),
                Effect::Remember { address, conn } => {
                    let known = self
                        .conns
                        .get(&conn)
                        .cloned()
                        .or_else(|| origin.filter(|c| ConnToken(c.id()) == conn).cloned());
                    if let Some(c) = known {
                        self.conns.insert(conn, c.clone());
                        actions.push(Action::Remember(address, c));
                    }
                }
                Effect::Forget(conn) => {
                    self.conns.remove(&conn);
                }
                Effect::StopNode { address, reason } => {
                    actions.push(Action::StopNode(address, reason))
                }
                Effect::RemoveJobFiles { job, package } => {
                    actions.push(Action::RemoveJobFiles(job, package))
                }
                Effect::RemoveJobLog { job, log } => actions.push(Action::RemoveJobLog(job, log)),
                Effect::StartJob(start) => {
                    actions.push(Action::StartJob(self.replies.remove(&start.reply), start));
                }
                Effect::ReadJobLog { reply, log, offset, info } => {
                    actions.push(Action::ReadJobLog(self.replies.remove(&reply), log, offset, info))
                }
                Effect::StopCluster => actions.push(Action::StopCluster),
                Effect::AdoptJob { worker, pid, log, .. } => {
                    actions.push(Action::AdoptJob { worker, pid, log })
                }
            }
        }
        actions
    }

    /// Appends what the core changed to the state directory (and starts a new generation when
    /// the log has outgrown its snapshot).
    fn persist(&mut self) -> Result<()> {
        let Some(state_dir) = self.state_dir.as_mut() else { return Ok(()) };
        state_dir.append(&self.core.take_records())?;
        if state_dir.needs_compaction() {
            state_dir.compact(&self.core.durable_state())?;
        }
        Ok(())
    }

    /// Forgets the watches whose connections closed, telling the core, once enough wait.
    fn sweep_abandoned_watches(&mut self) -> Vec<Effect> {
        if self.watches.len() < self.sweep_at {
            return Vec::new();
        }
        let abandoned: Vec<ReplyToken> = self
            .watches
            .iter()
            .filter(|reply| self.replies.get(reply).is_none_or(Responder::abandoned))
            .copied()
            .collect();
        for reply in &abandoned {
            self.watches.remove(reply);
            self.replies.remove(reply);
        }
        self.sweep_at = (2 * self.watches.len()).max(MIN_WATCH_SWEEP);
        if abandoned.is_empty() {
            return Vec::new();
        }
        self.core.handle(Origin::default(), Event::Abandoned(abandoned))
    }
}

impl SpawnEvents for Head {
    fn on_spawned(&self, worker: WorkerId, pid: u32) {
        Head::on_spawned(self, worker, pid)
    }

    fn on_worker_exit(&self, worker: WorkerId, status: WorkerExit) {
        Head::on_worker_exit(self, worker, status)
    }

    fn runtime(&self) -> Option<Arc<Runtime>> {
        self.runtime.upgrade()
    }

    fn echoes_output(&self) -> bool {
        // An embedded session's workers print on its driver's terminal; a cluster head's go
        // to log files (served to `rtrun logs` and streamed to their drivers).
        self.cluster.get().is_none()
    }

    fn worker_label(&self, worker: WorkerId) -> Option<String> {
        let state = self.state.lock();
        let type_name = state.core.actor_type_of(worker)?;
        Some(rtrun_proto::actor::short_type(type_name).to_owned())
    }
}

/// The control plane.
pub(crate) struct Head {
    runtime: Weak<Runtime>,
    state: Mutex<Shared>,
    spawner: Spawner,
    /// The head's own node.
    local_node: u64,
    /// Set once when this control plane is a cluster head.
    cluster: OnceLock<Arc<ClusterHead>>,
    weak: Weak<Head>,
}

impl Head {
    pub(crate) fn start(runtime: &Arc<Runtime>, config: HeadConfig) -> Result<Arc<Head>> {
        let core = HeadCore::new(runtime.session.clone(), config, runtime.node_id.0)?;
        let (spawner, inbox) = Spawner::channel();
        let head = Arc::new_cyclic(|weak| Head {
            weak: weak.clone(),
            runtime: Arc::downgrade(runtime),
            state: Mutex::new(Shared {
                core,
                replies: HashMap::new(),
                watches: HashSet::new(),
                sweep_at: MIN_WATCH_SWEEP,
                next_reply: 0,
                conns: HashMap::new(),
                state_dir: None,
                reconnect_window: None,
            }),
            spawner,
            local_node: runtime.node_id.0,
            cluster: OnceLock::new(),
        });
        inbox.run(Arc::downgrade(&head))?;
        head.start_clock()?;
        Ok(head)
    }

    /// Gives the core its clock ([`Event::Tick`]) once a second, while the head lives.
    fn start_clock(&self) -> Result<()> {
        let weak = self.weak.clone();
        let started = std::time::Instant::now();
        std::thread::Builder::new()
            .name("rtrun-head-clock".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                    let Some(head) = weak.upgrade() else { return };
                    let now_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                    head.event(Event::Tick { now_ms });
                }
            })
            .map(drop)
            .map_err(|e| crate::error::Error::System(format!("cannot start the head's clock: {e}")))
    }

    /// Handles a control-plane request; `origin` is the connection it came on (None: local).
    pub(crate) fn handle(
        &self,
        origin: Option<&Arc<Connection>>,
        body: HeadRequest,
        responder: Responder,
    ) {
        // The peer is looked up (a lock and a copy) only when the span is enabled.
        let from = || origin.and_then(|c| c.peer()).unwrap_or_else(|| "local".to_owned());
        let _span =
            tracing::debug_span!("head_request", kind = body.kind(), from = from()).entered();
        // What the shell does before the core decides: a submission's files are checked (and
        // an unnamed one named at random), an exited process's store references dropped.
        let body = match body {
            HeadRequest::SubmitJob { binary, args, env, submission_id, working_dir } => {
                if let Err(e) = self.check_submission(&binary, working_dir.as_deref()) {
                    return responder.respond(Response::Error(e));
                }
                let submission_id = submission_id
                    .or_else(|| Some(format!("rtrunsubmit_{:016x}", crate::runtime::random_u64())));
                HeadRequest::SubmitJob { binary, args, env, submission_id, working_dir }
            }
            HeadRequest::WorkerExited { worker, status } => {
                self.before_exit(worker);
                HeadRequest::WorkerExited { worker, status }
            }
            body => body,
        };
        // Only what a request creates needs to know its creator (its job and owner).
        let creates = matches!(
            body,
            HeadRequest::CreateActor(_)
                | HeadRequest::SubmitTask(_)
                | HeadRequest::CreatePlacementGroup(_)
        );
        let from = Origin {
            conn: origin.map(|c| ConnToken(c.id())),
            process: origin
                .filter(|_| creates)
                .and_then(|c| c.peer())
                .and_then(|peer| rtrun_proto::address::holder_of_address(&peer))
                .map(|holder| WorkerId(holder.0)),
        };
        let watch = matches!(body, HeadRequest::WaitActorAlive { .. });
        let actions = {
            let mut state = self.state.lock();
            let mut effects = if watch { state.sweep_abandoned_watches() } else { Vec::new() };
            let reply = ReplyToken(state.next_reply);
            state.next_reply += 1;
            state.replies.insert(reply, responder);
            if watch {
                state.watches.insert(reply);
            }
            effects.extend(state.core.handle(from, Event::Request { reply, body }));
            state.resolve(effects, origin)
        };
        self.execute(actions);
    }

    /// Hands an event that came from no connection to the core and carries out its effects.
    fn event(&self, event: Event) {
        let actions = {
            let mut state = self.state.lock();
            let effects = state.core.handle(Origin::default(), event);
            state.resolve(effects, None)
        };
        self.execute(actions);
    }

    fn execute(&self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Respond(responder, response) => responder.respond(response),
                Action::Spawn { node, worker, env, job } => {
                    let request = self.spawn_request(node, worker, env, job);
                    if node == self.local_node {
                        if let Err(e) = self.spawner.spawn(request) {
                            tracing::error!("{e}");
                        }
                    } else {
                        self.spawn_remote(node, request);
                    }
                }
                Action::Call(conn, call_id, frame) => {
                    // Its answer comes back as a `TaskReply` (`Head::on_task_reply`).
                    if let Err(e) = conn.send(&frame) {
                        tracing::debug!(
                            call = call_id,
                            "a task call failed to send (the reaper handles its exit): {e}"
                        );
                    }
                }
                Action::Send(conn, frame) => {
                    if let Err(e) = conn.send(&frame) {
                        tracing::debug!(
                            "send to a worker failed (the reaper handles its exit): {e}"
                        );
                    }
                }
                Action::Kill(node, pid) if node == self.local_node => kill_process(pid),
                Action::Kill(node, pid) => {
                    self.send_to_node(node, NodeRequest::KillProcess { pid })
                }
                Action::Remember(address, conn) => {
                    if let Some(endpoint) = self.runtime().map(|r| r.endpoint().clone()) {
                        endpoint.remember(address, conn);
                    }
                }
                Action::StopNode(address, reason) => self.stop_dead_node(address, reason),
                Action::RemoveJobFiles(job, package) => self.remove_job_files(job, package),
                Action::RemoveJobLog(job, log) => jobs::remove_file(job, "log", &log),
                Action::StartJob(responder, start) => {
                    let job = start.job;
                    let response = match self.start_job(start) {
                        Ok(info) => Response::Jobs(vec![info]),
                        Err(e) => {
                            self.state.lock().core.job_failed_to_start(job, e.to_string());
                            Response::Error(e)
                        }
                    };
                    if let Some(responder) = responder {
                        responder.respond(response);
                    }
                }
                Action::ReadJobLog(responder, log, offset, info) => {
                    let response = match jobs::read_from(&log, offset, 1 << 20) {
                        Ok(bytes) => Response::Logs { bytes, job: *info },
                        Err(e) => Response::Error(e),
                    };
                    if let Some(responder) = responder {
                        responder.respond(response);
                    }
                }
                Action::AdoptJob { worker, pid, log } => self.adopt_job(worker, pid, log),
                Action::PersistFailed(message) => {
                    tracing::error!("{message}");
                    if let Some(runtime) = self.runtime() {
                        runtime.end(crate::runtime::Ending::HeadLost(format!(
                            "rtrun head: cannot write its state directory ({message}); exiting \
                             rather than act on what it could not persist (restart it on the \
                             same --state-dir once this is fixed: its nodes reconnect)"
                        )));
                    }
                    return;
                }
                Action::StopCluster => {
                    if let Some(head) = self.weak.upgrade() {
                        std::thread::spawn(move || {
                            // Let the answer go out first.
                            std::thread::sleep(Duration::from_millis(200));
                            head.stop_cluster(STOP_ACK_TIMEOUT);
                            // `rtrun head`'s main exits once it hears this.
                            if let Some(runtime) = head.runtime() {
                                runtime.end(crate::runtime::Ending::Stopped);
                            }
                        });
                    }
                }
            }
        }
    }

    pub(crate) fn on_spawned(&self, worker: WorkerId, pid: u32) {
        self.event(Event::WorkerSpawned { worker, pid });
    }

    pub(crate) fn on_worker_exit(&self, worker: WorkerId, status: WorkerExit) {
        self.before_exit(worker);
        self.event(Event::WorkerExited { worker, status });
    }

    /// The object store drops an exited process's references and pins (every node's).
    fn before_exit(&self, worker: WorkerId) {
        if let Some(runtime) = self.runtime() {
            runtime.on_process_exit(worker);
        }
        self.broadcast_exit(worker);
    }

    pub(crate) fn on_task_reply(&self, call_id: u64, outcome: Outcome) {
        self.event(Event::TaskReply { call_id, outcome });
    }

    /// Kills every worker of this node and waits (bounded) until they are reaped.
    pub(crate) fn shutdown(&self) {
        self.event(Event::Shutdown);
        Runtime::poll_until(Duration::from_secs(10), || self.state.lock().core.no_local_workers());
    }

    pub(crate) fn runtime(&self) -> Option<Arc<Runtime>> {
        self.runtime.upgrade()
    }
}
