//! The control plane of an embedded session (Ray's GCS plus raylet, in the driver process):
//! the actor directory with names and restarts, the node's resources and placement groups (as a
//! placement [`ClusterState`], see `groups.rs`), the task queue and pool of task workers, and
//! supervision of every worker process.
//!
//! All decisions are made under one lock on [`HeadState`]; what must happen afterwards
//! (answers, process spawns, sends) is collected as [`Effect`]s and carried out after the lock
//! is released, so no callback ever runs with the lock held.

mod groups;
mod nodes;
mod spawn;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use rtrun_placement::{
    Allocation, AllocationId, CPU, ClusterState, GPU, GroupId, NodeResources, ResourceSet,
};

use crate::actor::{ActorInfo, ActorSpec};
use crate::error::{Error, Result};
use crate::ids::{ActorId, NodeId, ObjectId, WorkerId};
use crate::protocol::{
    ActorStart, Address, Assignment, CallFrame, CallTarget, ClusterInfo, Frame, Outcome, Request,
    Response, WorkerExit,
};
use crate::runtime::{Config, Runtime};
use crate::submit::PendingCall;
use crate::task::TaskSpec;
use crate::transport::Connection;
use crate::worker::WorkerSpec;

pub(crate) use nodes::{ClusterHead, JoinAs};
pub(crate) use spawn::{SpawnEvents, SpawnRequest, Spawner, kill_process};

/// How long `rtrun stop` waits for the node daemons to acknowledge before the head exits.
const STOP_ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// The environment variable that stops the runtime from setting `CUDA_VISIBLE_DEVICES` (and
/// `CUDA_DEVICE_ORDER`) for workers given GPUs (Ray's
/// `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`). Set it in the driver's environment for every
/// worker, or in one actor's `ActorOptions::env` for that actor; any non-empty value other than
/// `0` counts.
pub const NOSET_CUDA_VISIBLE_DEVICES_ENV: &str = "RTRUN_NOSET_CUDA_VISIBLE_DEVICES";

fn opt_out(value: Option<&str>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0")
}

/// Control-plane settings.
#[derive(Debug, Clone)]
pub(crate) struct HeadConfig {
    /// The node's resources and GPUs.
    pub(crate) node: NodeResources,
    /// At most this many task workers exist at once.
    pub(crate) max_task_workers: usize,
    /// Whether workers keep the driver's `CUDA_VISIBLE_DEVICES` instead of their assignment.
    pub(crate) noset_cuda_visible_devices: bool,
}

/// A node's resources from the runtime's settings: CPUs, custom resources and GPUs (detected,
/// limited by `CUDA_VISIBLE_DEVICES`, or fake ones from `num_gpus`), under placement id `id`.
pub(crate) fn node_resources(config: &Config, id: &str) -> Result<NodeResources> {
    Ok(HeadConfig::node_of(config, id)?.0)
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
        self.state.lock().members.cluster.is_none()
    }

    fn worker_label(&self, worker: WorkerId) -> Option<String> {
        let state = self.state.lock();
        state.actors.values().find_map(|actor| match actor.state {
            ActorState::Starting { worker: w } | ActorState::Alive { worker: w, .. }
                if w == worker =>
            {
                Some(crate::cluster::client::short_type(&actor.spec.type_name).to_owned())
            }
            _ => None,
        })
    }
}

impl HeadConfig {
    pub(crate) fn from_runtime_config(config: &Config) -> Result<HeadConfig> {
        let id = crate::ids::NodeId(0).to_string();
        let (node, cpus) = HeadConfig::node_of(config, &id)?;
        let max_task_workers = (cpus.ceil() as usize).max(1) + 2;
        let noset = opt_out(std::env::var(NOSET_CUDA_VISIBLE_DEVICES_ENV).ok().as_deref());
        Ok(HeadConfig { node, max_task_workers, noset_cuda_visible_devices: noset })
    }

    fn node_of(config: &Config, id: &str) -> Result<(NodeResources, f64)> {
        let cpus = config.num_cpus.unwrap_or_else(|| {
            std::thread::available_parallelism().map(|n| n.get() as f64).unwrap_or(1.0)
        });
        let mut pairs: Vec<(&str, f64)> = vec![(CPU, cpus)];
        for (name, amount) in &config.resources {
            if name == GPU {
                return Err(Error::Invalid(
                    "node resources: expected GPUs in `num_gpus`, found `GPU` in `resources`"
                        .into(),
                ));
            }
            pairs.push((name.as_str(), *amount));
        }
        let resources = ResourceSet::from_floats(pairs)
            .map_err(|e| Error::Invalid(format!("node resources: {e}")))?;
        let id = rtrun_placement::NodeId::new(id);
        let (detected, source) = crate::gpus::detect_gpus();
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let gpus =
            crate::gpus::node_gpus(id.as_str(), detected, visible.as_deref(), config.num_gpus)?;
        tracing::debug!(gpus = gpus.len(), ?source, "node GPUs");
        let node = NodeResources::new(id, resources, gpus)
            .map_err(|e| Error::Invalid(format!("node resources: {e}")))?;
        Ok((node, cpus))
    }
}

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

/// Work to do once the state lock is released.
enum Effect {
    Respond(Responder, Response),
    /// Start a worker on a node (the head's own node spawns it, another node's daemon is asked).
    Spawn(u64, SpawnRequest),
    Send(Arc<Connection>, Frame),
    /// Kill a process on a node.
    Kill(u64, u32),
}

enum WorkerRole {
    Actor { actor: ActorId, incarnation: u64 },
    Tasks { running: Option<u64> },
}

/// Which driver's job a worker, actor or task belongs to.
#[derive(Clone, Debug, Default)]
struct Lineage {
    /// The job binary (`None`: the embedded driver's own executable).
    job: Option<String>,
    /// The driver (`None`: the embedded driver, which outlives everything).
    driver: Option<WorkerId>,
    /// Created detached, or by a detached actor: outlives its driver.
    detached: bool,
    /// The actor whose worker created it (Ray's owner): an actor not itself created detached
    /// ends with its owner's incarnation, and so does a placement group.
    owner: Option<ActorId>,
}

/// Who a placement group ends with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GroupOwner {
    /// The driver whose job created it: removed when that driver goes.
    Driver(WorkerId),
    /// The actor that created it: removed when that actor's incarnation ends.
    Actor(ActorId),
}

struct WorkerEntry {
    /// The node it runs on.
    node: u64,
    lineage: Lineage,
    pid: Option<u32>,
    address: Option<Address>,
    conn: Option<Arc<Connection>>,
    role: WorkerRole,
    /// Killed before its pid was known: kill it as soon as it is.
    kill_requested: bool,
}

enum ActorState {
    /// Waiting for resources.
    Pending,
    /// A worker is starting it.
    Starting { worker: WorkerId },
    /// Serving calls.
    Alive { worker: WorkerId, address: Address },
    /// Gone for good.
    Dead { reason: String },
}

struct ActorEntry {
    /// The job that created it (it dies with that job's driver).
    lineage: Lineage,
    spec: ActorSpec,
    demand: ResourceSet,
    state: ActorState,
    incarnation: u64,
    restarts_left: i32,
    killed: bool,
    /// What the actor holds while it is starting or alive (kept across restarts).
    allocation: Option<Allocation>,
    /// Why the actor must die when its worker exits (a failed constructor).
    death_reason: Option<String>,
    waiters: Vec<(Option<u64>, Responder)>,
    /// Its latest worker and that worker's node (whose log holds its output, also once dead).
    last_worker: Option<(WorkerId, u64)>,
}

struct QueuedTask {
    spec: TaskSpec,
    lineage: Lineage,
    demand: ResourceSet,
    /// Its scheduling class (Ray's term): tasks of one class (demand and placement) place
    /// alike, so a pass over the queue places each class that has to wait only once.
    class: u64,
    responder: Responder,
    attempts: u32,
}

/// What makes tasks place alike: their demand and their bundle, if any.
type ClassKey = (ResourceSet, Option<crate::placement_group::BundleSchedule>);

struct RunningTask {
    task: QueuedTask,
    worker: WorkerId,
    allocation: AllocationId,
}

struct HeadState {
    session: String,
    config: HeadConfig,
    /// Nodes, placement groups and every allocation.
    cluster: ClusterState,
    /// Groups waiting for resources.
    pending_groups: BTreeSet<GroupId>,
    /// Who waits for which group to be created.
    group_waiters: HashMap<GroupId, Vec<Responder>>,
    /// How many unnamed groups were created (for their generated names).
    unnamed_groups: u64,
    /// Who created each group (groups the embedded driver creates are absent): they are
    /// removed when that driver goes or that actor's incarnation ends.
    group_owners: HashMap<GroupId, GroupOwner>,
    /// Actors whose incarnation ended since the last reschedule: what they owned ends next.
    ended_owners: Vec<ActorId>,
    next_actor: u64,
    workers: HashMap<WorkerId, WorkerEntry>,
    actors: HashMap<ActorId, ActorEntry>,
    names: HashMap<(String, String), ActorId>,
    /// The key-value store ([`crate::kv`]).
    kv: HashMap<String, Vec<u8>>,
    pending_actors: VecDeque<ActorId>,
    task_queue: VecDeque<QueuedTask>,
    /// Scheduling classes by key, numbered as they first appear.
    classes: HashMap<ClassKey, u64>,
    idle_task_workers: Vec<WorkerId>,
    starting_task_workers: usize,
    running_tasks: HashMap<u64, RunningTask>,
    /// Tasks answered since the head started: with a value, with an error.
    tasks_finished: u64,
    tasks_failed: u64,
    shutting_down: bool,
    /// Nodes, drivers and jobs of a cluster (the embedded session has only its own node).
    members: nodes::Members,
}

/// The control plane.
pub(crate) struct Head {
    runtime: Weak<Runtime>,
    state: Mutex<HeadState>,
    spawner: Spawner,
    /// The head's own node.
    local_node: u64,
    weak: Weak<Head>,
}

impl Head {
    pub(crate) fn start(runtime: &Arc<Runtime>, config: HeadConfig) -> Result<Arc<Head>> {
        let mut cluster = ClusterState::new();
        cluster
            .add_node(config.node.clone())
            .map_err(|e| Error::Invalid(format!("node resources: {e}")))?;
        let (spawner, inbox) = Spawner::channel();
        let head = Arc::new_cyclic(|weak| Head {
            weak: weak.clone(),
            runtime: Arc::downgrade(runtime),
            state: Mutex::new(HeadState {
                session: runtime.session.clone(),
                config,
                cluster,
                pending_groups: BTreeSet::new(),
                group_waiters: HashMap::new(),
                unnamed_groups: 0,
                group_owners: HashMap::new(),
                ended_owners: Vec::new(),
                next_actor: 1,
                workers: HashMap::new(),
                actors: HashMap::new(),
                names: HashMap::new(),
                kv: HashMap::new(),
                pending_actors: VecDeque::new(),
                task_queue: VecDeque::new(),
                classes: HashMap::new(),
                idle_task_workers: Vec::new(),
                starting_task_workers: 0,
                running_tasks: HashMap::new(),
                tasks_finished: 0,
                tasks_failed: 0,
                shutting_down: false,
                members: nodes::Members::new(runtime.node_id.0),
            }),
            spawner,
            local_node: runtime.node_id.0,
        });
        inbox.run(Arc::downgrade(&head))?;
        Ok(head)
    }

    /// Handles a control-plane request; `origin` is the connection it came on (None: local).
    pub(crate) fn handle(
        &self,
        origin: Option<&Arc<Connection>>,
        body: Request,
        responder: Responder,
    ) {
        // Requests about jobs and node daemons' children, answered outside the state lock.
        let body = match body {
            Request::WorkerSpawned { worker, pid } => {
                self.on_spawned(worker, pid);
                return responder.respond(Response::Done);
            }
            Request::WorkerExited { worker, status } => {
                self.on_worker_exit(worker, status);
                return responder.respond(Response::Done);
            }
            Request::SubmitJob { binary, args, env, submission_id, working_dir } => {
                return responder.respond(
                    match self.submit_job(binary, args, env, submission_id, working_dir) {
                        Ok(info) => Response::Jobs(vec![info]),
                        Err(e) => Response::Error(e),
                    },
                );
            }
            Request::StopJob { job } => {
                return responder.respond(match self.stop_job(job) {
                    Ok(info) => Response::Jobs(vec![info]),
                    Err(e) => Response::Error(e),
                });
            }
            request @ (Request::ReadLog { .. } | Request::ListLogs) => {
                let dir = self.state.lock().members.cluster.as_ref().map(|c| c.log_dir.clone());
                return responder.respond(match (dir, &request) {
                    (Some(dir), _) => crate::logs::answer(&dir, &request),
                    (None, Request::ListLogs) => Response::LogFiles(Vec::new()),
                    (None, _) => Response::Error(Error::Invalid(
                        "an embedded session keeps no log files (its workers print on the \
                         driver's terminal)"
                            .into(),
                    )),
                });
            }
            Request::JobLogs { job, offset } => {
                return responder.respond(match self.job_logs(job, offset, 1 << 20) {
                    Ok((bytes, info)) => Response::Logs { bytes, job: info },
                    Err(e) => Response::Error(e),
                });
            }
            Request::ListJobs => return responder.respond(Response::Jobs(self.jobs())),
            Request::StopCluster => {
                responder.respond(Response::Done);
                if let Some(weak) = self.weak.upgrade() {
                    std::thread::spawn(move || {
                        // Let the answer go out first.
                        std::thread::sleep(Duration::from_millis(200));
                        weak.stop_cluster(STOP_ACK_TIMEOUT);
                        std::process::exit(0);
                    });
                }
                return;
            }
            body => body,
        };
        let mut effects = Vec::new();
        {
            let mut state = self.state.lock();
            state.handle(self, origin, body, responder, &mut effects);
        }
        self.apply(effects);
    }

    fn apply(&self, effects: Vec<Effect>) {
        for effect in effects {
            match effect {
                Effect::Respond(responder, response) => responder.respond(response),
                Effect::Spawn(node, request) if node == self.local_node => {
                    if let Err(e) = self.spawner.spawn(request) {
                        tracing::error!("{e}");
                    }
                }
                Effect::Spawn(node, request) => self.spawn_remote(node, request),
                Effect::Send(conn, frame) => {
                    if let Err(e) = conn.send(&frame) {
                        tracing::debug!(
                            "send to a worker failed (the reaper handles its exit): {e}"
                        );
                    }
                }
                Effect::Kill(node, pid) if node == self.local_node => kill_process(pid),
                Effect::Kill(node, pid) => self.send_to_node(node, Request::KillProcess { pid }),
            }
        }
    }

    pub(crate) fn on_spawned(&self, worker: WorkerId, pid: u32) {
        if self.job_spawned(worker, pid) {
            return;
        }
        let kill = {
            let mut state = self.state.lock();
            let shutting_down = state.shutting_down;
            match state.workers.get_mut(&worker) {
                Some(entry) => {
                    entry.pid = Some(pid);
                    entry.kill_requested || shutting_down
                }
                None => false,
            }
        };
        if kill {
            kill_process(pid);
        }
    }

    pub(crate) fn on_worker_exit(&self, worker: WorkerId, status: WorkerExit) {
        // The object store drops the exited process's references and pins (every node's).
        if let Some(runtime) = self.runtime() {
            runtime.on_process_exit(worker);
        }
        self.broadcast_exit(worker);
        if self.job_exited(worker, &status) {
            return;
        }
        let mut effects = Vec::new();
        {
            let mut state = self.state.lock();
            state.on_worker_exit(worker, status.to_string(), &mut effects);
            state.reschedule(self, &mut effects);
        }
        self.apply(effects);
    }

    pub(crate) fn on_task_reply(&self, call_id: u64, outcome: Outcome) {
        let mut effects = Vec::new();
        {
            let mut state = self.state.lock();
            if let Some(running) = state.running_tasks.remove(&call_id) {
                state.release(running.allocation);
                if let Some(entry) = state.workers.get_mut(&running.worker) {
                    entry.role = WorkerRole::Tasks { running: None };
                    state.idle_task_workers.push(running.worker);
                }
                state.answer_task(running.task.responder, outcome, &mut effects);
                state.reschedule(self, &mut effects);
            }
        }
        self.apply(effects);
    }

    /// Kills every worker and waits (bounded) until they are reaped.
    pub(crate) fn shutdown(&self) {
        let pids: Vec<u32> = {
            let mut state = self.state.lock();
            state.shutting_down = true;
            state.workers.values().filter_map(|w| w.pid).collect()
        };
        for pid in pids {
            kill_process(pid);
        }
        Runtime::poll_until(Duration::from_secs(10), || self.state.lock().workers.is_empty());
    }

    pub(crate) fn runtime(&self) -> Option<Arc<Runtime>> {
        self.runtime.upgrade()
    }
}

fn resources_of(
    num_cpus: f64,
    num_gpus: f64,
    custom: &std::collections::BTreeMap<String, f64>,
) -> Result<ResourceSet> {
    let mut pairs: Vec<(&str, f64)> = vec![(CPU, num_cpus), (GPU, num_gpus)];
    pairs.extend(custom.iter().map(|(k, v)| (k.as_str(), *v)));
    ResourceSet::from_floats(pairs).map_err(|e| Error::Invalid(format!("resource request: {e}")))
}

fn shortfall_message(what: &str, demand: &ResourceSet, total: &ResourceSet) -> Option<String> {
    total.first_shortfall(demand).map(|(name, needed, have)| {
        format!("{what} needs {name}: {needed}, the cluster has {have} in total")
    })
}

fn info_of(id: ActorId, spec: &ActorSpec) -> ActorInfo {
    ActorInfo {
        id,
        type_name: spec.type_name.clone(),
        max_task_retries: spec.options.max_task_retries,
    }
}

impl HeadState {
    fn handle(
        &mut self,
        head: &Head,
        origin: Option<&Arc<Connection>>,
        body: Request,
        responder: Responder,
        effects: &mut Vec<Effect>,
    ) {
        let response = match body {
            Request::RegisterWorker { worker, address, pid } => {
                match self.register_worker(head, origin, worker, address, pid, effects) {
                    Ok(assignment) => Response::Assignment(assignment),
                    Err(e) => Response::Error(e),
                }
            }
            Request::ActorStarted { actor, incarnation, result } => {
                self.actor_started(actor, incarnation, result, effects);
                Response::Done
            }
            Request::CreateActor(spec) => {
                let lineage = self.lineage_of(origin);
                match self.create_actor(*spec, lineage, effects) {
                    Ok(info) => Response::Actor(info),
                    Err(e) => Response::Error(e),
                }
            }
            Request::GetActorByName { name, namespace } => {
                let found = self
                    .names
                    .get(&(namespace.clone(), name.clone()))
                    .and_then(|id| self.actors.get(id).map(|entry| (*id, entry)));
                match found {
                    Some((id, entry)) if !matches!(entry.state, ActorState::Dead { .. }) => {
                        Response::Actor(info_of(id, &entry.spec))
                    }
                    _ => Response::Error(Error::ActorNotFound { name, namespace }),
                }
            }
            Request::WaitActorAlive { actor, after } => match self.actors.get_mut(&actor) {
                None => Response::Error(Error::Invalid(format!("no actor with id {actor}"))),
                Some(entry) => match &entry.state {
                    ActorState::Alive { address, .. }
                        if after.is_none_or(|a| entry.incarnation > a) =>
                    {
                        Response::ActorAlive {
                            address: address.clone(),
                            incarnation: entry.incarnation,
                        }
                    }
                    ActorState::Dead { reason } => {
                        Response::Error(Error::ActorDied { actor, reason: reason.clone() })
                    }
                    _ => {
                        // Callers watch the actors they call (below); a watcher that went
                        // away stops being kept.
                        entry.waiters.retain(|(_, r)| !r.abandoned());
                        entry.waiters.push((after, responder));
                        return;
                    }
                },
            },
            Request::KillActor { actor, no_restart } => {
                match self.kill_actor(actor, no_restart, effects) {
                    Ok(()) => Response::Done,
                    Err(e) => Response::Error(e),
                }
            }
            Request::SubmitTask(spec) => match self.validate_task(&spec) {
                Ok(demand) => {
                    let key = (demand.clone(), spec.options.placement);
                    let next = self.classes.len() as u64;
                    let class = *self.classes.entry(key).or_insert(next);
                    self.task_queue.push_back(QueuedTask {
                        lineage: self.lineage_of(origin),
                        class,
                        spec: *spec,
                        demand,
                        responder,
                        attempts: 0,
                    });
                    self.dispatch_tasks(head, effects);
                    return;
                }
                Err(e) => Response::Error(e),
            },
            Request::CancelTask { task, force } => {
                self.cancel_task(task, force, effects);
                Response::Done
            }
            Request::ClusterInfo => Response::ClusterInfo(self.cluster_info(head.local_node)),
            Request::ListActors => Response::Actors(self.actor_summaries()),
            Request::NodeAlive { node } => match self.members.nodes.get(&node) {
                Some(entry) => match &entry.dead {
                    None => Response::Done,
                    Some(reason) => Response::Error(Error::Transport(reason.clone())),
                },
                None => Response::Error(Error::Invalid(format!("no node {}", NodeId(node)))),
            },
            Request::CreatePlacementGroup(options) => match self.create_group(*options) {
                Ok(state) => {
                    let lineage = self.lineage_of(origin);
                    let owner = match (lineage.owner, lineage.driver) {
                        (Some(actor), _) => Some(GroupOwner::Actor(actor)),
                        (None, Some(driver)) => Some(GroupOwner::Driver(driver)),
                        (None, None) => None,
                    };
                    if let Some(owner) = owner {
                        self.group_owners.insert(state.id, owner);
                    }
                    Response::PlacementGroup(Box::new(state))
                }
                Err(e) => Response::Error(e),
            },
            Request::WaitPlacementGroup { group } => {
                self.wait_group(group, responder, effects);
                return;
            }
            Request::RemovePlacementGroup { group } => {
                match self.remove_group(head, group, effects) {
                    Ok(()) => Response::Done,
                    Err(e) => Response::Error(e),
                }
            }
            Request::GetPlacementGroup { group } => match self.group_state(group) {
                Some(state) => Response::PlacementGroup(Box::new(state)),
                None => Response::Error(Error::Invalid(format!(
                    "no placement group {group}: it was removed or never existed"
                ))),
            },
            Request::GetPlacementGroupByName { name } => match self.group_by_name(&name) {
                Ok(state) => Response::PlacementGroup(Box::new(state)),
                Err(e) => Response::Error(e),
            },
            Request::ListPlacementGroups => Response::PlacementGroups(self.list_groups()),
            Request::KvPut { key, value } => {
                self.kv.insert(key, value);
                Response::Done
            }
            Request::KvGet { key } => {
                Response::KvValue(self.kv.get(&key).cloned().map(serde_bytes::ByteBuf::from))
            }
            Request::KvDelete { key } => {
                Response::KvValue(self.kv.remove(&key).map(serde_bytes::ByteBuf::from))
            }
            other => {
                Response::Error(Error::Invalid(format!("not a control-plane request: {other:?}")))
            }
        };
        effects.push(Effect::Respond(responder, response));
    }

    fn worker_env(
        &self,
        worker: WorkerId,
        extra: &std::collections::BTreeMap<String, String>,
    ) -> Vec<(String, String)> {
        let spec = WorkerSpec {
            session: self.session.clone(),
            worker,
            head_address: self.members.head_address.clone().unwrap_or_else(|| {
                crate::runtime::worker_address(&self.session, crate::ids::DRIVER_WORKER_ID)
            }),
            namespace: "default".into(),
        };
        let mut env: Vec<(String, String)> =
            extra.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        env.push(spec.to_env());
        env
    }

    fn new_worker(
        &mut self,
        role: WorkerRole,
        node: u64,
        lineage: Lineage,
        extra_env: &std::collections::BTreeMap<String, String>,
        effects: &mut Vec<Effect>,
    ) -> WorkerId {
        let worker = WorkerId(self.members.next_id());
        let job = lineage.job.clone();
        // A submitted job's environment reaches its workers; the actor's own settings win.
        let mut env: Vec<(String, String)> = lineage
            .driver
            .and_then(|driver| self.members.jobs.values().find(|j| j.driver == Some(driver)))
            .map(|j| j.env.clone())
            .unwrap_or_default();
        env.extend(self.worker_env(worker, extra_env));
        self.workers.insert(
            worker,
            WorkerEntry {
                node,
                lineage,
                pid: None,
                address: None,
                conn: None,
                role,
                kill_requested: false,
            },
        );
        let request = self.members.spawn_request(node, worker, env, job.as_deref());
        effects.push(Effect::Spawn(node, request));
        worker
    }

    fn register_worker(
        &mut self,
        head: &Head,
        origin: Option<&Arc<Connection>>,
        worker: WorkerId,
        address: Address,
        pid: u32,
        effects: &mut Vec<Effect>,
    ) -> Result<Assignment> {
        let conn =
            origin.ok_or_else(|| Error::Invalid("workers register over a connection".into()))?;
        let entry = self
            .workers
            .get_mut(&worker)
            .ok_or_else(|| Error::Invalid(format!("unknown worker {worker} (pid {pid})")))?;
        entry.conn = Some(conn.clone());
        entry.address = Some(address.clone());
        entry.pid.get_or_insert(pid);
        if let Some(endpoint) = head.runtime().and_then(|r| r.endpoint().ok().cloned()) {
            endpoint.remember(address, conn.clone());
        }
        match entry.role {
            WorkerRole::Actor { actor, incarnation } => {
                let actor_entry = self
                    .actors
                    .get(&actor)
                    .ok_or_else(|| Error::Invalid(format!("worker {worker} has no actor")))?;
                Ok(Assignment::Actor(Box::new(ActorStart {
                    actor,
                    incarnation,
                    type_name: actor_entry.spec.type_name.clone(),
                    ctor_args: actor_entry.spec.ctor_args.clone(),
                    max_concurrency: actor_entry.spec.options.max_concurrency,
                    group: actor_entry.spec.options.group.clone(),
                    name: actor_entry.spec.options.name.clone(),
                    allocation: actor_entry.allocation.clone(),
                    capture_group: actor_entry
                        .spec
                        .options
                        .placement
                        .filter(|schedule| schedule.capture_child_tasks)
                        .map(|schedule| schedule.group),
                })))
            }
            WorkerRole::Tasks { .. } => {
                self.starting_task_workers = self.starting_task_workers.saturating_sub(1);
                self.idle_task_workers.push(worker);
                self.dispatch_tasks(head, effects);
                Ok(Assignment::Tasks)
            }
        }
    }

    fn actor_started(
        &mut self,
        actor: ActorId,
        incarnation: u64,
        result: std::result::Result<(), String>,
        effects: &mut Vec<Effect>,
    ) {
        let Some(entry) = self.actors.get_mut(&actor) else { return };
        let ActorState::Starting { worker } = entry.state else { return };
        if entry.incarnation != incarnation {
            return;
        }
        match result {
            Ok(()) => {
                let Some(address) = self.workers.get(&worker).and_then(|w| w.address.clone())
                else {
                    return;
                };
                entry.state = ActorState::Alive { worker, address: address.clone() };
                let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut entry.waiters)
                    .into_iter()
                    .partition(|(after, _)| after.is_none_or(|a| incarnation > a));
                entry.waiters = waiting;
                for (_, responder) in ready {
                    effects.push(Effect::Respond(
                        responder,
                        Response::ActorAlive { address: address.clone(), incarnation },
                    ));
                }
            }
            Err(message) => {
                // A constructor that fails is not retried (as in Ray): the actor is dead.
                entry.killed = true;
                entry.death_reason = Some(format!("its constructor failed: {message}"));
                if let Some(w) = self.workers.get(&worker)
                    && let Some(pid) = w.pid
                {
                    effects.push(Effect::Kill(w.node, pid));
                }
            }
        }
    }

    /// The job of the process a request came from.
    fn lineage_of(&self, origin: Option<&Arc<Connection>>) -> Lineage {
        let Some(worker) = origin
            .and_then(|conn| conn.peer())
            .and_then(|peer| crate::store::holder_of_address(&peer))
            .map(|holder| WorkerId(holder.0))
        else {
            return Lineage::default();
        };
        if let Some(job) = self.members.drivers.get(&worker) {
            return Lineage {
                job: job.clone(),
                driver: Some(worker),
                detached: false,
                owner: None,
            };
        }
        let Some(entry) = self.workers.get(&worker) else { return Lineage::default() };
        let mut lineage = entry.lineage.clone();
        // What an actor's worker creates is owned by that actor; a task worker's by nobody.
        lineage.owner = match entry.role {
            WorkerRole::Actor { actor, .. } => Some(actor),
            WorkerRole::Tasks { .. } => None,
        };
        lineage
    }

    fn create_actor(
        &mut self,
        spec: ActorSpec,
        lineage: Lineage,
        effects: &mut Vec<Effect>,
    ) -> Result<ActorInfo> {
        let options = &spec.options;
        let demand = resources_of(
            options.num_cpus.unwrap_or(0.0),
            options.num_gpus.unwrap_or(0.0),
            &options.resources,
        )?;
        self.check_placeable(
            &format!("actor {}", spec.type_name),
            &demand,
            options.placement.as_ref(),
        )?;
        let name_key = match &options.name {
            Some(name) => {
                let key =
                    (options.namespace.clone().unwrap_or_else(|| "default".into()), name.clone());
                let live = self.names.get(&key).and_then(|&id| Some((id, self.actors.get(&id)?)));
                if let Some((id, existing)) = live {
                    if !options.get_if_exists {
                        return Err(Error::Invalid(format!(
                            "an actor named `{}` already exists in namespace `{}`",
                            key.1, key.0
                        )));
                    }
                    if existing.spec.type_name != spec.type_name {
                        return Err(Error::Invalid(format!(
                            "get_if_exists: the actor named `{}` in namespace `{}` has type {}, \
                             asked for {}",
                            key.1, key.0, existing.spec.type_name, spec.type_name
                        )));
                    }
                    return Ok(info_of(id, &existing.spec));
                }
                Some(key)
            }
            None if options.get_if_exists => {
                return Err(Error::Invalid(format!(
                    "actor {}: get_if_exists needs a name",
                    spec.type_name
                )));
            }
            None => None,
        };
        let mut lineage = lineage;
        lineage.detached |= options.detached;
        let id = ActorId(self.next_actor);
        self.next_actor += 1;
        if let Some(key) = name_key {
            self.names.insert(key, id);
        }
        let info = info_of(id, &spec);
        self.actors.insert(
            id,
            ActorEntry {
                lineage,
                restarts_left: spec.options.max_restarts,
                spec,
                demand,
                state: ActorState::Pending,
                incarnation: 0,
                killed: false,
                allocation: None,
                death_reason: None,
                waiters: Vec::new(),
                last_worker: None,
            },
        );
        self.pending_actors.push_back(id);
        self.schedule_pending_actors(effects);
        Ok(info)
    }

    /// Starts pending actors whose resources are now available, in creation order.
    fn schedule_pending_actors(&mut self, effects: &mut Vec<Effect>) {
        let mut still_pending = VecDeque::new();
        while let Some(id) = self.pending_actors.pop_front() {
            let Some(entry) = self.actors.get(&id) else { continue };
            if !matches!(entry.state, ActorState::Pending) {
                continue;
            }
            let demand = entry.demand.clone();
            let placement = entry.spec.options.placement;
            let allocation = match self.place_demand(&demand, placement.as_ref()) {
                Ok(allocation) => allocation,
                Err(e) if groups::is_waiting(&e) => {
                    still_pending.push_back(id);
                    continue;
                }
                Err(e) => {
                    self.finish_actor(id, format!("it cannot be placed: {e}"), effects);
                    continue;
                }
            };
            let Some(entry) = self.actors.get_mut(&id) else {
                self.release(allocation.id);
                continue;
            };
            let node = self.members.node_of(&allocation.node);
            entry.allocation = Some(allocation);
            let incarnation = entry.incarnation;
            let lineage = entry.lineage.clone();
            let env = self.actor_env(id);
            let role = WorkerRole::Actor { actor: id, incarnation };
            let worker = self.new_worker(role, node, lineage, &env, effects);
            if let Some(entry) = self.actors.get_mut(&id) {
                entry.state = ActorState::Starting { worker };
                entry.last_worker = Some((worker, node));
            }
        }
        self.pending_actors = still_pending;
    }

    fn kill_actor(
        &mut self,
        actor: ActorId,
        no_restart: bool,
        effects: &mut Vec<Effect>,
    ) -> Result<()> {
        let entry = self
            .actors
            .get_mut(&actor)
            .ok_or_else(|| Error::Invalid(format!("no actor with id {actor}")))?;
        if no_restart {
            entry.killed = true;
            entry.death_reason = Some("it was killed".into());
        }
        let worker = match entry.state {
            ActorState::Starting { worker } | ActorState::Alive { worker, .. } => worker,
            ActorState::Pending => {
                if no_restart {
                    self.finish_actor(actor, "it was killed before it started".into(), effects);
                }
                return Ok(());
            }
            ActorState::Dead { .. } => return Ok(()),
        };
        if let Some(w) = self.workers.get_mut(&worker) {
            match w.pid {
                Some(pid) => effects.push(Effect::Kill(w.node, pid)),
                None => w.kill_requested = true,
            }
        }
        Ok(())
    }

    /// Returns an allocation's resources to its node or bundle. The caller reschedules.
    fn release(&mut self, allocation: AllocationId) {
        if let Err(e) = self.cluster.release(allocation) {
            // Only a group removal releases allocations behind our back, and it clears the
            // owner's record first; anything else is a bookkeeping bug worth seeing.
            tracing::warn!(%allocation, "could not release an allocation: {e}");
        }
    }

    /// The environment of an actor's worker: its `env` option, plus `CUDA_VISIBLE_DEVICES` and
    /// `CUDA_DEVICE_ORDER` for the GPUs it was given unless opted out.
    fn actor_env(&self, actor: ActorId) -> BTreeMap<String, String> {
        let Some(entry) = self.actors.get(&actor) else { return BTreeMap::new() };
        let mut env = entry.spec.options.env.clone();
        let opted_out = self.config.noset_cuda_visible_devices
            || opt_out(env.get(NOSET_CUDA_VISIBLE_DEVICES_ENV).map(String::as_str));
        if let Some(allocation) = &entry.allocation
            && !allocation.gpus.is_empty()
            && !opted_out
        {
            env.insert("CUDA_VISIBLE_DEVICES".into(), allocation.cuda_visible_devices());
            env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        }
        env
    }

    /// Marks an actor dead for good: frees its resources and name, fails its waiters.
    fn finish_actor(&mut self, actor: ActorId, reason: String, effects: &mut Vec<Effect>) {
        let Some(entry) = self.actors.get_mut(&actor) else { return };
        if let Some(allocation) = entry.allocation.take() {
            self.release(allocation.id);
        }
        let Some(entry) = self.actors.get_mut(&actor) else { return };
        entry.state = ActorState::Dead { reason: reason.clone() };
        for (_, responder) in std::mem::take(&mut entry.waiters) {
            effects.push(Effect::Respond(
                responder,
                Response::Error(Error::ActorDied { actor, reason: reason.clone() }),
            ));
        }
        if let Some(name) = entry.spec.options.name.clone() {
            let namespace =
                entry.spec.options.namespace.clone().unwrap_or_else(|| "default".into());
            self.names.remove(&(namespace, name));
        }
    }

    fn on_worker_exit(&mut self, worker: WorkerId, status: String, effects: &mut Vec<Effect>) {
        let Some(entry) = self.workers.remove(&worker) else { return };
        if self.shutting_down {
            return;
        }
        match entry.role {
            WorkerRole::Actor { actor, incarnation } => {
                let Some(actor_entry) = self.actors.get_mut(&actor) else { return };
                if actor_entry.incarnation != incarnation {
                    return;
                }
                self.ended_owners.push(actor);
                let Some(actor_entry) = self.actors.get_mut(&actor) else { return };
                let restart = !actor_entry.killed && actor_entry.restarts_left != 0;
                if restart {
                    if actor_entry.restarts_left > 0 {
                        actor_entry.restarts_left -= 1;
                    }
                    actor_entry.incarnation += 1;
                    tracing::info!(%actor, %status, incarnation = actor_entry.incarnation, "restarting actor");
                    let incarnation = actor_entry.incarnation;
                    let lineage = actor_entry.lineage.clone();
                    match actor_entry.allocation.as_ref().map(|a| a.node.clone()) {
                        Some(placed) => {
                            let node = self.members.node_of(&placed);
                            let env = self.actor_env(actor);
                            let role = WorkerRole::Actor { actor, incarnation };
                            let new_worker = self.new_worker(role, node, lineage, &env, effects);
                            if let Some(actor_entry) = self.actors.get_mut(&actor) {
                                actor_entry.state = ActorState::Starting { worker: new_worker };
                                actor_entry.last_worker = Some((new_worker, node));
                            }
                        }
                        // Its node died: it is placed anew.
                        None => {
                            actor_entry.state = ActorState::Pending;
                            self.pending_actors.push_back(actor);
                        }
                    }
                } else {
                    let reason = actor_entry.death_reason.clone().unwrap_or(status);
                    self.finish_actor(actor, reason, effects);
                }
            }
            WorkerRole::Tasks { running } => {
                self.idle_task_workers.retain(|w| *w != worker);
                if entry.conn.is_none() {
                    self.starting_task_workers = self.starting_task_workers.saturating_sub(1);
                }
                if let Some(call_id) = running
                    && let Some(run) = self.running_tasks.remove(&call_id)
                {
                    {
                        self.release(run.allocation);
                        let mut task = run.task;
                        if task.attempts < task.spec.options.max_retries {
                            task.attempts += 1;
                            self.task_queue.push_front(task);
                        } else {
                            let target = task.spec.function.clone();
                            self.answer_task(
                                task.responder,
                                Outcome::Error(Error::WorkerDied { target, reason: status }),
                                effects,
                            );
                        }
                    }
                }
            }
        }
    }

    fn validate_task(&self, spec: &TaskSpec) -> Result<ResourceSet> {
        let demand =
            resources_of(spec.options.num_cpus, spec.options.num_gpus, &spec.options.resources)?;
        self.check_placeable(
            &format!("task {}", spec.function),
            &demand,
            spec.options.placement.as_ref(),
        )?;
        Ok(demand)
    }

    /// Starts queued tasks that fit, on idle task workers of the node and job each task is
    /// placed on, spawning workers there as needed.
    fn dispatch_tasks(&mut self, head: &Head, effects: &mut Vec<Effect>) {
        if self.shutting_down {
            return;
        }
        let mut wanted: Vec<(u64, Lineage)> = Vec::new();
        let task_workers =
            self.workers.values().filter(|w| matches!(w.role, WorkerRole::Tasks { .. })).count();
        // Tasks that find no idle worker are placed only to learn which node wants a worker;
        // past what could still be started (and started already), the rest of the queue waits
        // untouched, so a long queue costs nothing per reply.
        let startable =
            self.config.max_task_workers.saturating_sub(task_workers) + self.starting_task_workers;
        // Demands that had to wait in this pass: the same demand later in the queue waits too
        // (resources only get scarcer within a pass: an allocation made here is either kept
        // or released at once), so it is not placed again. Without this, idle workers and a
        // full node (more task workers than CPUs) made every reply scan the whole queue
        // through the placement code: 1,000 queued tasks ran at 3k/s.
        let mut waiting: Vec<u64> = Vec::new();
        let mut index = 0;
        while index < self.task_queue.len() {
            if self.idle_task_workers.is_empty() && wanted.len() >= startable {
                break;
            }
            let queued = &self.task_queue[index];
            let placement = queued.spec.options.placement;
            let class = queued.class;
            if waiting.contains(&class) {
                index += 1;
                continue;
            }
            let demand = queued.demand.clone();
            let allocation = match self.place_demand(&demand, placement.as_ref()) {
                Ok(allocation) => allocation,
                Err(e) if groups::is_waiting(&e) => {
                    waiting.push(class);
                    index += 1;
                    continue;
                }
                Err(e) => {
                    if let Some(task) = self.task_queue.remove(index) {
                        let error = Error::Infeasible(format!(
                            "task {} cannot be placed: {e}",
                            task.spec.function
                        ));
                        self.answer_task(task.responder, Outcome::Error(error), effects);
                    }
                    continue;
                }
            };
            let node = self.members.node_of(&allocation.node);
            let lineage = self.task_queue[index].lineage.clone();
            let idle = self.idle_task_workers.iter().rposition(|w| {
                self.workers.get(w).is_some_and(|entry| {
                    entry.node == node && entry.lineage.job == lineage.job && entry.conn.is_some()
                })
            });
            let Some(position) = idle else {
                self.release(allocation.id);
                wanted.push((node, lineage));
                index += 1;
                continue;
            };
            let worker = self.idle_task_workers.remove(position);
            let Some(conn) = self.workers.get(&worker).and_then(|w| w.conn.clone()) else {
                self.release(allocation.id);
                continue;
            };
            let Some(task) = self.task_queue.remove(index) else {
                self.release(allocation.id);
                break;
            };
            let Some(runtime) = head.runtime() else {
                self.release(allocation.id);
                return;
            };
            let call_id = runtime.next_id();
            runtime.calls.insert(call_id, PendingCall::HeadTask);
            if let Some(entry) = self.workers.get_mut(&worker) {
                entry.role = WorkerRole::Tasks { running: Some(call_id) };
            }
            let frame = Frame::Call(CallFrame {
                call_id,
                target: CallTarget::Task { function: task.spec.function.clone() },
                args: task.spec.args.clone(),
            });
            self.running_tasks
                .insert(call_id, RunningTask { task, worker, allocation: allocation.id });
            effects.push(Effect::Send(conn, frame));
        }
        let mut task_workers = task_workers;
        let mut asked: Vec<(u64, Option<String>, usize)> = Vec::new();
        for (node, lineage) in wanted {
            let key = (node, lineage.job.clone());
            let asked_now = match asked.iter_mut().find(|(n, j, _)| (*n, j.clone()) == key) {
                Some(entry) => {
                    entry.2 += 1;
                    entry.2
                }
                None => {
                    asked.push((node, lineage.job.clone(), 1));
                    1
                }
            };
            let starting = self
                .workers
                .values()
                .filter(|w| {
                    matches!(w.role, WorkerRole::Tasks { .. })
                        && w.conn.is_none()
                        && w.node == node
                        && w.lineage.job == lineage.job
                })
                .count();
            if asked_now <= starting || task_workers >= self.config.max_task_workers {
                continue;
            }
            task_workers += 1;
            self.starting_task_workers += 1;
            let role = WorkerRole::Tasks { running: None };
            self.new_worker(role, node, lineage, &Default::default(), effects);
        }
    }

    fn cancel_task(&mut self, task: ObjectId, force: bool, effects: &mut Vec<Effect>) {
        if let Some(index) = self.task_queue.iter().position(|t| t.spec.task == task) {
            if let Some(queued) = self.task_queue.remove(index) {
                self.answer_task(queued.responder, Outcome::Error(Error::Cancelled), effects);
            }
            return;
        }
        let Some((call_id, worker)) = self
            .running_tasks
            .iter()
            .find(|(_, r)| r.task.spec.task == task)
            .map(|(call_id, r)| (*call_id, r.worker))
        else {
            return;
        };
        if force {
            if let Some(mut run) = self.running_tasks.remove(&call_id) {
                self.release(run.allocation);
                run.task.spec.options.max_retries = 0;
                self.answer_task(run.task.responder, Outcome::Error(Error::Cancelled), effects);
            }
            if let Some(w) = self.workers.get_mut(&worker) {
                w.role = WorkerRole::Tasks { running: None };
                if let Some(pid) = w.pid {
                    effects.push(Effect::Kill(w.node, pid));
                }
            }
        } else if let Some(conn) = self.workers.get(&worker).and_then(|w| w.conn.clone()) {
            effects.push(Effect::Send(conn, Frame::Cancel { call_id }));
        }
    }

    /// Answers a submitted task (its value or its error), counting it for metrics.
    fn answer_task(&mut self, responder: Responder, outcome: Outcome, effects: &mut Vec<Effect>) {
        match outcome {
            Outcome::Error(_) => self.tasks_failed += 1,
            _ => self.tasks_finished += 1,
        }
        effects.push(Effect::Respond(responder, Response::Outcome(outcome)));
    }

    /// The cluster's resources, workers, nodes and tasks; `local` is the head's own node, listed
    /// even in an embedded session (which has no member nodes).
    fn cluster_info(&self, local: u64) -> ClusterInfo {
        let mut total: BTreeMap<String, f64> = BTreeMap::new();
        let mut available: BTreeMap<String, f64> = BTreeMap::new();
        for node in self.cluster.nodes() {
            for (name, amount) in nodes::floats(node.total()) {
                *total.entry(name).or_default() += amount;
            }
            for (name, amount) in nodes::floats(node.available()) {
                *available.entry(name).or_default() += amount;
            }
        }
        let mut node_infos = self.members.info();
        if !node_infos.iter().any(|n| n.node.0 == local) {
            let id = crate::ids::NodeId(local);
            if let Some(node) = self.cluster.node(&rtrun_placement::NodeId::new(id.to_string())) {
                node_infos.insert(
                    0,
                    crate::protocol::NodeInfo {
                        node: id,
                        name: "embedded".into(),
                        alive: true,
                        total: nodes::floats(node.total()),
                        ..Default::default()
                    },
                );
            }
        }
        for info in &mut node_infos {
            let placement = rtrun_placement::NodeId::new(info.node.to_string());
            if let Some(node) = self.cluster.node(&placement) {
                info.available = nodes::floats(node.available());
            }
        }
        ClusterInfo {
            total,
            available,
            workers: self.workers.len(),
            alive_actors: self
                .actors
                .values()
                .filter(|a| matches!(a.state, ActorState::Alive { .. }))
                .count(),
            worker_pids: self.workers.values().filter_map(|w| w.pid).collect(),
            nodes: node_infos,
            tasks: crate::protocol::TaskCounts {
                queued: self.task_queue.len() as u64,
                running: self.running_tasks.len() as u64,
                finished: self.tasks_finished,
                failed: self.tasks_failed,
            },
        }
    }

    fn actor_summaries(&self) -> Vec<crate::protocol::ActorSummary> {
        let mut actors: Vec<_> = self
            .actors
            .iter()
            .map(|(id, entry)| {
                let worker = match entry.state {
                    ActorState::Starting { worker } | ActorState::Alive { worker, .. } => {
                        Some(worker)
                    }
                    _ => None,
                };
                let node =
                    worker.and_then(|w| self.workers.get(&w)).map(|w| crate::ids::NodeId(w.node));
                crate::protocol::ActorSummary {
                    actor: *id,
                    type_name: entry.spec.type_name.clone(),
                    name: entry.spec.options.name.clone(),
                    state: match &entry.state {
                        ActorState::Pending => "PENDING".into(),
                        ActorState::Starting { .. } => "STARTING".into(),
                        ActorState::Alive { .. } => "ALIVE".into(),
                        ActorState::Dead { reason } => format!("DEAD ({reason})"),
                    },
                    node,
                    pid: worker.and_then(|w| self.workers.get(&w)).and_then(|w| w.pid),
                    restarts: entry.incarnation,
                    worker: entry.last_worker.map(|(worker, _)| worker),
                    log_node: entry.last_worker.map(|(_, node)| crate::ids::NodeId(node)),
                    driver: entry.lineage.driver,
                    namespace: entry.spec.options.name.as_ref().map(|_| {
                        entry.spec.options.namespace.clone().unwrap_or_else(|| "default".into())
                    }),
                    detached: entry.lineage.detached,
                }
            })
            .collect();
        actors.sort_by_key(|a| a.actor.0);
        actors
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtrun_placement::Quantity;

    #[test]
    fn node_config_takes_gpus_from_num_gpus_only() {
        let config = Config { num_cpus: Some(4.0), num_gpus: Some(3.0), ..Default::default() };
        let head = HeadConfig::from_runtime_config(&config).unwrap();
        assert_eq!(head.node.total().get(GPU), Quantity::whole(3));
        assert_eq!(head.node.gpus().slots().len(), 3);
        let config = Config { num_gpus: Some(2.5), ..Default::default() };
        let err = HeadConfig::from_runtime_config(&config).unwrap_err();
        assert!(err.to_string().contains("whole non-negative number of GPUs"), "{err}");
        let config = Config {
            resources: [("GPU".to_owned(), 2.0)].into_iter().collect(),
            ..Default::default()
        };
        let err = HeadConfig::from_runtime_config(&config).unwrap_err();
        assert!(err.to_string().contains("expected GPUs in `num_gpus`"), "{err}");
    }

    #[test]
    fn opt_out_values() {
        assert!(opt_out(Some("1")));
        assert!(opt_out(Some("true")));
        assert!(!opt_out(Some("0")));
        assert!(!opt_out(Some("")));
        assert!(!opt_out(None));
    }
}
