//! The control plane's decisions without I/O (quinn-proto's shape): [`HeadCore`] takes an
//! [`Event`] — a request with a reply token, a worker that started or exited, a task's reply,
//! a node or driver that joined or left — and returns the [`Effect`]s to carry out: answers by
//! token, processes to spawn or kill, frames to send on a connection by token. It holds no
//! connection, closure, clock, file or lock, so every scheduling rule can be driven by a test
//! (see `sim.rs`, the deterministic simulator); the shell (`rtrun`'s `head` module) owns the
//! lock, the connections, the responders, the spawner and the files, and executes the
//! effects. The crate depends on the wire types (`rtrun-proto`), the placement state machine
//! and the `tracing` facade only.
//!
//! Ids come from the core: actors, workers, drivers, nodes, jobs and the call ids of the tasks it
//! dispatches (answered by `Frame::TaskReply`, so they share no id space with a process's own
//! actor calls).

mod actors;
mod durable;
mod groups;
mod jobs;
mod members;
pub mod scale;
#[cfg(test)]
mod sim;
mod tasks;
mod views;
mod workers;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use rtrun_placement::{
    Allocation, AllocationId, ClusterState, GroupId, NodeResources, ResourceSet,
};

use rtrun_proto::actor::ActorSpec;
use rtrun_proto::error::{Error, Missing, Result};
use rtrun_proto::ids::{ActorId, NodeId, WorkerId};
use rtrun_proto::protocol::{
    Address, Frame, HeadRequest, JobInfo, JobState, Outcome, Response, TaskCounts, WorkerExit,
};
use rtrun_proto::task::TaskSpec;

pub use durable::{DurableState, Record, STATE_VERSION};
pub use jobs::JobStart;
pub(crate) use members::Members;

/// The token of a request that waits for its answer: the core answers it exactly once, with
/// [`Effect::Respond`]. The shell numbers requests and keeps what each answer goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplyToken(pub u64);

/// A connection the core may send frames on (a worker's), by the shell's connection id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnToken(pub u64);

/// Where a request came from.
#[derive(Clone, Copy, Debug, Default)]
pub struct Origin {
    /// Its connection (`None`: the embedded driver's own process).
    pub conn: Option<ConnToken>,
    /// The process at the other end, as its address names it (a worker or a driver); the
    /// shell reads it for the requests that create something, whose lineage it decides.
    pub process: Option<WorkerId>,
}

/// What happens to the control plane.
#[derive(Debug)]
pub enum Event {
    /// A control-plane request (actors, tasks, placement groups, the key-value store, views),
    /// answered once with [`Effect::Respond`] to `reply`.
    Request { reply: ReplyToken, body: HeadRequest },
    /// A worker's (or a submitted job driver's) process started.
    WorkerSpawned { worker: WorkerId, pid: u32 },
    /// A worker's (or a submitted job driver's) process ended.
    WorkerExited { worker: WorkerId, status: WorkerExit },
    /// A task worker answered the task call `call_id`.
    TaskReply { call_id: u64, outcome: Outcome },
    /// A node stopped answering heartbeats (or its daemon went): everything on it is lost.
    NodeDead { name: String, reason: String },
    /// A driver disconnected: its non-detached actors and its placement groups end.
    DriverGone { driver: WorkerId },
    /// The answers to these requests can no longer be delivered (their connections closed):
    /// whatever keeps them waiting (actor watches) stops keeping them.
    Abandoned(Vec<ReplyToken>),
    /// The control plane stops: every worker of its own node is killed, nothing is started
    /// any more.
    Shutdown,
    /// The clock (milliseconds since the control plane started, never decreasing): task workers
    /// idle for `task_worker_idle_timeout` end.
    Tick { now_ms: u64 },
}

/// What the shell carries out, in order, once the core has decided.
#[derive(Debug)]
pub enum Effect {
    /// Answer a request.
    Respond(ReplyToken, Response),
    /// Start a worker process on a node.
    Spawn { node: u64, worker: WorkerId, env: Vec<(String, String)>, job: Option<String> },
    /// Run a task: register `call_id` as the core's call (its reply comes back as
    /// [`Event::TaskReply`]) and send `frame` on the worker's connection.
    Call { conn: ConnToken, call_id: u64, frame: Frame },
    /// Send a frame on a worker's connection.
    Send(ConnToken, Frame),
    /// Kill a process on a node.
    Kill { node: u64, pid: u32 },
    /// Calls to `address` may reuse the connection it registered on.
    Remember { address: Address, conn: ConnToken },
    /// The core keeps no reference to this connection any more.
    Forget(ConnToken),
    /// Tell a node declared dead to stop its workers and exit, in case it is only paused or
    /// cut off and would otherwise live on as a zombie.
    StopNode { address: Address, reason: String },
    /// A job ended: remove its unpacked working directory (its log stays) and, when no running
    /// job uses it, its working-directory package.
    RemoveJobFiles { job: u64, package: Option<String> },
    /// A deleted job's log file.
    RemoveJobLog { job: u64, log: std::path::PathBuf },
    /// Start a submitted job (see [`JobStart`]); boxed, as it is rare and large (every
    /// effect moves as the largest one).
    StartJob(Box<JobStart>),
    /// Answer `reply` with job `info` and its log from `offset` (read from `log`).
    ReadJobLog { reply: ReplyToken, log: std::path::PathBuf, offset: u64, info: Box<JobInfo> },
    /// The cluster stops: its nodes, then this control plane's process (the request is
    /// answered first).
    StopCluster,
    /// A recovered head takes up a submitted job's driver that outlived the head before it
    /// (process `pid` on the head's node, logging into `log`): its exit is reported as
    /// [`Event::WorkerExited`] of `worker`.
    AdoptJob { job: u64, worker: WorkerId, pid: u32, log: std::path::PathBuf },
}

/// Control-plane settings.
#[derive(Debug, Clone)]
pub struct HeadConfig {
    /// The node's resources and GPUs.
    pub node: NodeResources,
    /// At most this many task workers exist at once.
    pub max_task_workers: usize,
    /// Whether workers keep the driver's `CUDA_VISIBLE_DEVICES` instead of their assignment.
    pub noset_cuda_visible_devices: bool,
    /// A task worker idle for this long ends (a finished detached run's, an idle job's): a
    /// pooled worker holds its job's environment, memory and a process slot.
    pub task_worker_idle_timeout: std::time::Duration,
    /// Whether actors and tasks may be placed on the head's own node. A head that persists its
    /// state places none there: its node's processes end with the head's, the joined nodes'
    /// live through a restart.
    pub workers_on_head: bool,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
enum WorkerRole {
    Actor { actor: ActorId, incarnation: u64 },
    Tasks { running: Option<u64> },
}

/// Which driver's job a worker, actor or task belongs to.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
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
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
enum GroupOwner {
    /// The driver whose job created it: removed when that driver goes.
    Driver(WorkerId),
    /// The actor that created it: removed when that actor's incarnation ends.
    Actor(ActorId),
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct WorkerEntry {
    /// The node it runs on.
    node: u64,
    lineage: Lineage,
    pid: Option<u32>,
    address: Option<Address>,
    /// The connection it registered on (none until it has; a restarted head has none).
    #[serde(skip)]
    conn: Option<ConnToken>,
    role: WorkerRole,
    /// Killed before its pid was known: kill it as soon as it is.
    kill_requested: bool,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
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

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
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
    /// Who waits for it to be alive (after an incarnation, if given).
    #[serde(skip)]
    waiters: Vec<(Option<u64>, ReplyToken)>,
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
    reply: ReplyToken,
    attempts: u32,
}

/// What makes tasks place alike: their demand and their bundle, if any.
type ClassKey = (ResourceSet, Option<rtrun_proto::placement_group::BundleSchedule>);

struct RunningTask {
    task: QueuedTask,
    worker: WorkerId,
    allocation: AllocationId,
}

/// The control plane's state and rules.
pub struct HeadCore {
    session: String,
    config: HeadConfig,
    /// Nodes, placement groups and every allocation.
    cluster: ClusterState,
    /// Groups waiting for resources.
    pending_groups: BTreeSet<GroupId>,
    /// Who waits for which group to be created.
    group_waiters: HashMap<GroupId, Vec<ReplyToken>>,
    /// How many unnamed groups were created (for their generated names).
    unnamed_groups: u64,
    /// Who created each group (groups the embedded driver creates are absent): they are
    /// removed when that driver goes or that actor's incarnation ends.
    group_owners: HashMap<GroupId, GroupOwner>,
    /// The same, by owner.
    owned_groups: HashMap<GroupOwner, BTreeSet<GroupId>>,
    /// The actors each actor created (whatever became of them), in creation order.
    children: HashMap<ActorId, Vec<ActorId>>,
    /// The actor holding each actor allocation.
    holders: HashMap<AllocationId, ActorId>,
    /// Actors whose incarnation ended since the last reschedule: what they owned ends next.
    ended_owners: Vec<ActorId>,
    next_actor: u64,
    /// The next task call id.
    next_call: u64,
    /// The workers on each node.
    workers_on: HashMap<u64, BTreeSet<WorkerId>>,
    workers: HashMap<WorkerId, WorkerEntry>,
    /// Boxed: the table doubles as it grows, and moving 40,000 inline entries of a few hundred
    /// bytes stalled one decision for ~20 ms (the scale harness's maximum).
    actors: HashMap<ActorId, Box<ActorEntry>>,
    names: HashMap<(String, String), ActorId>,
    /// The key-value store (`rtrun::kv`).
    kv: HashMap<String, Vec<u8>>,
    pending_actors: VecDeque<ActorId>,
    task_queue: VecDeque<QueuedTask>,
    /// Scheduling classes by key, numbered as they first appear.
    classes: HashMap<ClassKey, u64>,
    /// Idle task workers, each with when it became idle (by [`HeadCore::clock_ms`]).
    idle_task_workers: Vec<(WorkerId, u64)>,
    /// The last [`Event::Tick`]'s clock.
    clock_ms: u64,
    starting_task_workers: usize,
    running_tasks: HashMap<u64, RunningTask>,
    /// Tasks answered since the head started: with a value, with an error.
    tasks_finished: u64,
    tasks_failed: u64,
    /// Answered tasks by function: finished, failed.
    task_totals: BTreeMap<String, TaskCounts>,
    shutting_down: bool,
    /// Nodes, drivers and jobs of a cluster (the embedded session has only its own node).
    pub(crate) members: Members,
    /// Which durable entries changed since the shell last took its records.
    journal: durable::Journal,
    /// The nodes and drivers a recovered head waits for.
    awaiting: durable::Awaiting,
}

impl HeadCore {
    /// A control plane for `session` whose own node is `head_node`, holding `config.node`.
    pub fn new(session: String, config: HeadConfig, head_node: u64) -> Result<HeadCore> {
        let mut cluster = ClusterState::new();
        if config.workers_on_head {
            cluster
                .add_node(config.node.clone())
                .map_err(|e| Error::Invalid(format!("node resources: {e}")))?;
        }
        Ok(HeadCore {
            session,
            config,
            cluster,
            pending_groups: BTreeSet::new(),
            group_waiters: HashMap::new(),
            unnamed_groups: 0,
            group_owners: HashMap::new(),
            owned_groups: HashMap::new(),
            children: HashMap::new(),
            holders: HashMap::new(),
            workers_on: HashMap::new(),
            ended_owners: Vec::new(),
            next_actor: 1,
            next_call: 1,
            workers: HashMap::new(),
            actors: HashMap::new(),
            names: HashMap::new(),
            kv: HashMap::new(),
            pending_actors: VecDeque::new(),
            task_queue: VecDeque::new(),
            classes: HashMap::new(),
            idle_task_workers: Vec::new(),
            clock_ms: 0,
            starting_task_workers: 0,
            running_tasks: HashMap::new(),
            tasks_finished: 0,
            tasks_failed: 0,
            task_totals: BTreeMap::new(),
            shutting_down: false,
            members: Members::new(head_node),
            journal: durable::Journal::default(),
            awaiting: durable::Awaiting::default(),
        })
    }

    /// Decides what `event`, coming from `from`, changes and what must happen because of it.
    pub fn handle(&mut self, from: Origin, event: Event) -> Vec<Effect> {
        let mut effects = Vec::new();
        match event {
            Event::Request { reply, body } => self.request(from, reply, body, &mut effects),
            Event::WorkerSpawned { worker, pid } => self.worker_spawned(worker, pid, &mut effects),
            Event::WorkerExited { worker, status } => {
                self.process_exited(worker, status, &mut effects)
            }
            Event::TaskReply { call_id, outcome } => {
                self.task_reply(call_id, outcome, &mut effects)
            }
            Event::NodeDead { name, reason } => self.node_dead(&name, &reason, &mut effects),
            Event::DriverGone { driver } => self.driver_gone(driver, &mut effects),
            Event::Abandoned(replies) => {
                for actor in self.actors.values_mut() {
                    actor.waiters.retain(|(_, reply)| !replies.contains(reply));
                }
            }
            Event::Tick { now_ms } => self.tick(now_ms, &mut effects),
            Event::Shutdown => {
                self.shutting_down = true;
                // Other nodes' workers are their daemons' to stop (`StopNode`).
                let head_node = self.members.head_node;
                for w in self.workers.values().filter(|w| w.node == head_node) {
                    if let Some(pid) = w.pid {
                        effects.push(Effect::Kill { node: w.node, pid });
                    }
                }
                // Submitted jobs' drivers too (those of a head with a state directory would
                // outlive it).
                for job in self.members.jobs.values() {
                    if let (JobState::Running, Some(pid)) = (&job.state, job.pid) {
                        effects.push(Effect::Kill { node: head_node, pid });
                    }
                }
            }
        }
        // The arrangement of a group's bundles is greedy, so a group can come to fit after an
        // allocation (not only a release) moved what the greedy choice sees: pending groups
        // are tried after every event (found by the simulator: a group that fitted waited
        // for the next release).
        if !self.pending_groups.is_empty() && !self.shutting_down {
            self.reschedule(&mut effects);
        }
        effects
    }

    /// Checks that the core's indexes agree with what they index — workers by node, actors
    /// by allocation, children and groups by owner, and the placement state's own — naming
    /// the first disagreement (the simulator checks it after every event).
    pub fn verify_indexes(&self) -> std::result::Result<(), String> {
        self.cluster.verify_indexes()?;
        let mut workers_on: HashMap<u64, BTreeSet<WorkerId>> = HashMap::new();
        for (worker, entry) in &self.workers {
            workers_on.entry(entry.node).or_default().insert(*worker);
        }
        if workers_on != self.workers_on {
            return Err("stale index: the workers on each node".into());
        }
        let holders: HashMap<AllocationId, ActorId> = self
            .actors
            .iter()
            .filter_map(|(id, actor)| actor.allocation.as_ref().map(|a| (a.id, *id)))
            .collect();
        if holders != self.holders {
            return Err("stale index: the actor holding each allocation".into());
        }
        let mut owned: HashMap<GroupOwner, BTreeSet<GroupId>> = HashMap::new();
        for (group, owner) in &self.group_owners {
            owned.entry(*owner).or_default().insert(*group);
        }
        if owned != self.owned_groups {
            return Err("stale index: the groups of each owner".into());
        }
        for (id, actor) in &self.actors {
            if let Some(owner) = actor.lineage.owner
                && !self.children.get(&owner).is_some_and(|c| c.contains(id))
            {
                return Err(format!("stale index: actor {id} is missing from {owner}'s children"));
            }
        }
        Ok(())
    }

    /// Whether every worker of the head's own node has been reaped (after
    /// [`Event::Shutdown`]).
    pub fn no_local_workers(&self) -> bool {
        self.workers.values().all(|w| w.node != self.members.head_node)
    }

    /// The type of the actor `worker` hosts, if any (for its output lines' prefix).
    pub fn actor_type_of(&self, worker: WorkerId) -> Option<&str> {
        self.actors.values().find_map(|actor| match actor.state {
            ActorState::Starting { worker: w } | ActorState::Alive { worker: w, .. }
                if w == worker =>
            {
                Some(actor.spec.type_name.as_str())
            }
            _ => None,
        })
    }

    fn request(
        &mut self,
        from: Origin,
        reply: ReplyToken,
        body: HeadRequest,
        effects: &mut Vec<Effect>,
    ) {
        let response = match body {
            HeadRequest::RegisterWorker { worker, address, pid } => {
                match self.register_worker(from, worker, address, pid, effects) {
                    Ok(assignment) => Response::Assignment(assignment),
                    Err(e) => Response::Error(e),
                }
            }
            HeadRequest::ActorStarted { actor, incarnation, result } => {
                self.actor_started(actor, incarnation, result, effects);
                Response::Done
            }
            HeadRequest::CreateActor(spec) => {
                let lineage = self.lineage_of(from);
                match self.create_actor(*spec, lineage, effects) {
                    Ok(info) => Response::Actor(info),
                    Err(e) => Response::Error(e),
                }
            }
            HeadRequest::GetActorByName { name, namespace } => self.actor_by_name(name, namespace),
            HeadRequest::WaitActorAlive { actor, after } => {
                match self.wait_actor_alive(actor, after, reply) {
                    Some(response) => response,
                    None => return,
                }
            }
            HeadRequest::KillActor { actor, no_restart } => {
                match self.kill_actor(actor, no_restart, effects) {
                    Ok(()) => Response::Done,
                    Err(e) => Response::Error(e),
                }
            }
            HeadRequest::SubmitTask(spec) => {
                let lineage = self.lineage_of(from);
                match self.submit_task(*spec, lineage, reply, effects) {
                    Ok(()) => return,
                    Err(e) => Response::Error(e),
                }
            }
            HeadRequest::CancelTask { task, force } => {
                self.cancel_task(task, force, effects);
                Response::Done
            }
            HeadRequest::ClusterInfo => Response::ClusterInfo(self.cluster_info()),
            HeadRequest::ListActors => Response::Actors(self.actor_summaries()),
            HeadRequest::ListTasks => Response::Tasks(self.task_table()),
            HeadRequest::ListWorkers => Response::Workers(self.worker_summaries()),
            HeadRequest::ListJobs => Response::Jobs(self.members.job_infos()),
            HeadRequest::DeleteJob { job } => self.delete_job(job, effects),
            HeadRequest::SubmitJob { binary, args, env, submission_id, working_dir } => {
                let submission = jobs::Submission { binary, args, env, submission_id, working_dir };
                match self.submit_job(submission, reply, effects) {
                    Ok(()) => return,
                    Err(e) => Response::Error(e),
                }
            }
            HeadRequest::StopJob { job } => match self.stop_job(job, effects) {
                Ok(info) => Response::Jobs(vec![info]),
                Err(e) => Response::Error(e),
            },
            HeadRequest::JobLogs { job, offset } => {
                match self.job_logs(job, offset, reply, effects) {
                    Ok(()) => return,
                    Err(e) => Response::Error(e),
                }
            }
            // Reports from the spawners (a node's, or the shell's for the head's own node).
            HeadRequest::WorkerSpawned { worker, pid } => {
                self.worker_spawned(worker, pid, effects);
                Response::Done
            }
            HeadRequest::WorkerExited { worker, status } => {
                self.process_exited(worker, status, effects);
                Response::Done
            }
            HeadRequest::StopCluster => {
                effects.push(Effect::Respond(reply, Response::Done));
                effects.push(Effect::StopCluster);
                return;
            }
            HeadRequest::NodeAlive { node } => match self.members.nodes.get(&node) {
                Some(entry) => match &entry.dead {
                    None => Response::Done,
                    Some(reason) => Response::Error(Error::Transport(reason.clone())),
                },
                None => Response::Error(Error::NotFound(Missing::Node(NodeId(node)))),
            },
            HeadRequest::CreatePlacementGroup(options) => match self.create_group(*options) {
                Ok(state) => {
                    let lineage = self.lineage_of(from);
                    let owner = match (lineage.owner, lineage.driver) {
                        (Some(actor), _) => Some(GroupOwner::Actor(actor)),
                        (None, Some(driver)) => Some(GroupOwner::Driver(driver)),
                        (None, None) => None,
                    };
                    self.journal.group(state.id);
                    if let Some(owner) = owner {
                        self.group_owners.insert(state.id, owner);
                        self.owned_groups.entry(owner).or_default().insert(state.id);
                    }
                    Response::PlacementGroup(Box::new(state))
                }
                Err(e) => Response::Error(e),
            },
            HeadRequest::WaitPlacementGroup { group } => {
                self.wait_group(group, reply, effects);
                return;
            }
            HeadRequest::RemovePlacementGroup { group } => {
                match self.remove_group(group, effects) {
                    Ok(()) => Response::Done,
                    Err(e) => Response::Error(e),
                }
            }
            HeadRequest::GetPlacementGroup { group } => match self.group_state(group) {
                Some(state) => Response::PlacementGroup(Box::new(state)),
                None => Response::Error(Error::Invalid(format!(
                    "no placement group {group}: it was removed or never existed"
                ))),
            },
            HeadRequest::GetPlacementGroupByName { name } => match self.group_by_name(&name) {
                Ok(state) => Response::PlacementGroup(Box::new(state)),
                Err(e) => Response::Error(e),
            },
            HeadRequest::ListPlacementGroups => Response::PlacementGroups(self.list_groups()),
            HeadRequest::KvPut { key, value } => {
                self.journal.kv(&key);
                self.kv.insert(key, value);
                Response::Done
            }
            HeadRequest::KvGet { key } => Response::KvValue(
                self.kv.get(&key).cloned().map(rtrun_proto::protocol::ByteBuf::from),
            ),
            HeadRequest::KvDelete { key } => {
                self.journal.kv(&key);
                Response::KvValue(self.kv.remove(&key).map(rtrun_proto::protocol::ByteBuf::from))
            }
        };
        effects.push(Effect::Respond(reply, response));
    }

    /// A worker's or a job driver's process ended.
    fn process_exited(&mut self, worker: WorkerId, status: WorkerExit, effects: &mut Vec<Effect>) {
        match self.members.job_exited(worker, &status) {
            // A submitted job's driver was reaped: the driver is gone now, so its actors and
            // groups go at once rather than when its connection times out.
            Some((driver, files)) => {
                // A job's driver has the job's number as its id.
                self.journal.job(worker.0);
                if let Some(driver) = driver {
                    self.driver_gone(driver, effects);
                }
                effects.push(files);
            }
            None => {
                let status = self.exit_reason(worker, &status);
                self.worker_exited(worker, status, effects);
                self.reschedule(effects);
            }
        }
    }

    /// Returns an allocation's resources to its node or bundle. The caller reschedules.
    fn release(&mut self, allocation: AllocationId) {
        if let Err(e) = self.cluster.release(allocation) {
            // Only a group removal releases allocations behind our back, and it clears the
            // owner's record first; anything else is a bookkeeping bug worth seeing.
            tracing::warn!(%allocation, "could not release an allocation: {e}");
        }
    }
}

/// Removes `item` from `key`'s set, and the set when it empties (the core's per-key indexes).
fn remove_member<K, V>(map: &mut HashMap<K, BTreeSet<V>>, key: &K, item: &V)
where
    K: std::hash::Hash + Eq,
    V: Ord,
{
    if let Some(set) = map.get_mut(key) {
        set.remove(item);
        if set.is_empty() {
            map.remove(key);
        }
    }
}

fn resources_of(
    num_cpus: f64,
    num_gpus: f64,
    custom: &std::collections::BTreeMap<String, f64>,
) -> Result<ResourceSet> {
    use rtrun_placement::{CPU, GPU};
    let mut pairs: Vec<(&str, f64)> = vec![(CPU, num_cpus), (GPU, num_gpus)];
    pairs.extend(custom.iter().map(|(k, v)| (k.as_str(), *v)));
    ResourceSet::from_floats(pairs).map_err(|e| Error::Invalid(format!("resource request: {e}")))
}

fn shortfall_message(what: &str, demand: &ResourceSet, total: &ResourceSet) -> Option<String> {
    total.first_shortfall(demand).map(|(name, needed, have)| {
        format!("{what} needs {name}: {needed}, the cluster has {have} in total")
    })
}

/// Every effect moves as the largest one (into the list, out of it, into the shell's action),
/// on every request: a rare, large one goes in a box so that the common ones stay cheap.
#[test]
fn effects_stay_as_small_as_the_frame_they_may_carry() {
    let frame = std::mem::size_of::<Frame>();
    let effect = std::mem::size_of::<Effect>();
    assert!(effect <= frame + 32, "an Effect is {effect} bytes, a Frame {frame}: box a variant");
}
