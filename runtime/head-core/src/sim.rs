//! A deterministic simulator of the control plane (FoundationDB's simulation testing, quinn's
//! `Pair`): a [`World`] plays every process the core talks to — nodes that join and die,
//! drivers that connect and leave, worker processes that start, register, construct their
//! actor, run tasks, crash or die of the kills the core orders — and proptest draws thousands
//! of schedules of these events. Late and duplicate events are part of the schedule (an exit
//! of a worker whose node already died, a reply to a task that was cancelled).
//!
//! After every event the simulator checks the invariants below; at the end it stops
//! everything and checks that the cluster is whole again:
//! - **answers**: every request is answered at most once, and (at the end) exactly once;
//! - **resources**: every allocation belongs to exactly one actor or running task, every
//!   actor's and task's allocation exists, no node hands out more than it has, and at the end
//!   every node has all of its resources back;
//! - **actors**: no actor lives in two workers, an actor starting or alive has its one worker,
//!   a name maps to a live actor and a dead actor's name is free;
//! - **groups**: no pending group would fit now (pending groups are created as soon as they
//!   fit);
//! - **connections**: the core sends only on connections it was told about and has not
//!   forgotten.
//!
//! A failing schedule is shrunk by proptest and reproduces from its printed ops (and from the
//! seed file proptest writes).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use proptest::prelude::*;
use rtrun_placement::{
    CPU, GPU, GroupId, NodeResources, Quantity, ResourceSet, Strategy as GroupStrategy,
};

use super::{
    ActorState, ConnToken, DurableState, Effect, Event, HeadConfig, HeadCore, JobStart, Origin,
    ReplyToken,
};
use rtrun_proto::actor::{ActorOptions, ActorSpec};
use rtrun_proto::ids::{ActorId, ObjectId, WorkerId};
use rtrun_proto::placement_group::{BundleSchedule, PlacementGroupOptions};
use rtrun_proto::protocol::{Assignment, HeadRequest, JobState, Outcome, Response, WorkerExit};
use rtrun_proto::task::{TaskOptions, TaskSpec};

/// One step of a schedule. Selectors (`u8`) pick among what exists when the step runs, so
/// every drawn schedule is meaningful whatever happened before it.
#[derive(Clone, Debug)]
enum Op {
    JoinNode {
        cpus: u64,
        gpus: u32,
    },
    NodeDies(u8),
    DriverJoins,
    DriverLeaves(u8),
    CreateActor {
        by: u8,
        cpus: u8,
        gpus: u8,
        name: Option<u8>,
        restarts: i8,
        detached: bool,
        get_if_exists: bool,
        group: Option<(u8, Option<u8>)>,
    },
    KillActor {
        actor: u8,
        no_restart: bool,
    },
    WatchActor {
        actor: u8,
        after_current: bool,
    },
    ActorByName(u8),
    SubmitTask {
        by: u8,
        cpus: u8,
        retries: u8,
        group: Option<u8>,
    },
    CancelTask {
        task: u8,
        force: bool,
    },
    CreateGroup {
        bundles: Vec<(u8, u8)>,
        strategy: u8,
        by: u8,
    },
    RemoveGroup(u8),
    WaitGroup(u8),
    ProcessStarts(u8),
    ProcessRegisters(u8),
    ActorConstructed {
        process: u8,
        ok: bool,
    },
    ProcessCrashes {
        process: u8,
        how: u8,
    },
    KilledProcessExits(u8),
    TaskReplies {
        call: u8,
        ok: bool,
    },
    WatcherGoes(u8),
    Views,
    /// `rtrun job submit`; `fails`: its working directory cannot be laid out.
    SubmitJob {
        name: Option<u8>,
        package: bool,
        fails: bool,
    },
    StopJob(u8),
    JobLogs(u8),
    DeleteJob(u8),
    /// The key-value store: put, get or delete a key.
    Kv {
        op: u8,
        key: u8,
    },
    /// A group by id and by name.
    GetGroup(u8),
    NodeAlive(u8),
    StopCluster,
    /// The clock moves this many milliseconds on.
    Tick(u64),
    /// The head process is killed and restarted from its durable state; the nodes whose bit
    /// is set in `rejoin` (cycled) reconnect at once, the others later or never.
    HeadRestarts {
        rejoin: u8,
    },
    /// A node still awaited by a restarted head reconnects.
    LateRejoin(u8),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    prop_oneof![
        1 => (1u64..4, 0u32..3).prop_map(|(cpus, gpus)| Op::JoinNode { cpus, gpus }),
        1 => any::<u8>().prop_map(Op::NodeDies),
        1 => Just(Op::DriverJoins),
        1 => any::<u8>().prop_map(Op::DriverLeaves),
        4 => (
            any::<u8>(),
            0u8..3,
            0u8..2,
            proptest::option::of(0u8..3),
            -1i8..3,
            any::<bool>(),
            any::<bool>(),
            proptest::option::weighted(0.3, (any::<u8>(), proptest::option::of(0u8..3))),
        )
            .prop_map(|(by, cpus, gpus, name, restarts, detached, get_if_exists, group)| {
                Op::CreateActor { by, cpus, gpus, name, restarts, detached, get_if_exists, group }
            }),
        2 => (any::<u8>(), any::<bool>())
            .prop_map(|(actor, no_restart)| Op::KillActor { actor, no_restart }),
        2 => (any::<u8>(), any::<bool>())
            .prop_map(|(actor, after_current)| Op::WatchActor { actor, after_current }),
        1 => (0u8..3).prop_map(Op::ActorByName),
        4 => (any::<u8>(), 0u8..3, 0u8..3, proptest::option::weighted(0.3, any::<u8>()))
            .prop_map(|(by, cpus, retries, group)| Op::SubmitTask { by, cpus, retries, group }),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(task, force)| Op::CancelTask { task, force }),
        2 => (proptest::collection::vec((1u8..3, 0u8..2), 1..4), 0u8..4, any::<u8>())
            .prop_map(|(bundles, strategy, by)| Op::CreateGroup { bundles, strategy, by }),
        1 => any::<u8>().prop_map(Op::RemoveGroup),
        1 => any::<u8>().prop_map(Op::WaitGroup),
        5 => any::<u8>().prop_map(Op::ProcessStarts),
        5 => any::<u8>().prop_map(Op::ProcessRegisters),
        4 => (any::<u8>(), prop::bool::weighted(0.85))
            .prop_map(|(process, ok)| Op::ActorConstructed { process, ok }),
        1 => (any::<u8>(), 0u8..3).prop_map(|(process, how)| Op::ProcessCrashes { process, how }),
        3 => any::<u8>().prop_map(Op::KilledProcessExits),
        5 => (any::<u8>(), prop::bool::weighted(0.8))
            .prop_map(|(call, ok)| Op::TaskReplies { call, ok }),
        1 => any::<u8>().prop_map(Op::WatcherGoes),
        1 => Just(Op::Views),
        1 => (proptest::option::of(0u8..3), any::<bool>(), prop::bool::weighted(0.2))
            .prop_map(|(name, package, fails)| Op::SubmitJob { name, package, fails }),
        1 => any::<u8>().prop_map(Op::StopJob),
        1 => any::<u8>().prop_map(Op::JobLogs),
        1 => any::<u8>().prop_map(Op::DeleteJob),
        1 => (0u8..3, 0u8..3).prop_map(|(op, key)| Op::Kv { op, key }),
        1 => any::<u8>().prop_map(Op::GetGroup),
        1 => any::<u8>().prop_map(Op::NodeAlive),
        1 => prop::bool::weighted(0.05).prop_map(|_| Op::StopCluster),
        2 => (0u64..8_000).prop_map(Op::Tick),
        1 => any::<u8>().prop_map(|rejoin| Op::HeadRestarts { rejoin }),
        1 => any::<u8>().prop_map(Op::LateRejoin),
    ]
}

/// A process the core asked for, as the world runs it.
#[derive(Debug)]
struct Process {
    node: u64,
    pid: Option<u32>,
    conn: Option<ConnToken>,
    /// Its assignment, once registered: the actor and incarnation it constructs.
    actor: Option<(ActorId, u64)>,
    constructed: bool,
    /// The core ordered it killed: it exits when the world delivers the signal.
    killed: bool,
    /// A submitted job's driver (it joins as a driver; it never registers as a worker).
    job: bool,
}

/// What a pending request was.
#[derive(Debug)]
enum Asked {
    Watch,
    Other,
}

/// How long a restarted head waits for nodes and drivers in the simulation.
const RECONNECT_WINDOW_MS: u64 = 3_000;

/// Everything outside the core.
struct World {
    core: HeadCore,
    /// The durable state as the head's state directory holds it (every record replayed).
    durable: DurableState,
    /// Nodes a restarted head still waits for.
    awaiting: Vec<u64>,
    /// Head restarts played, actors kept alive across them, and nodes given up after them.
    restarts: usize,
    kept_across_restarts: usize,
    given_up: usize,
    /// Requests not answered yet.
    outstanding: BTreeMap<ReplyToken, Asked>,
    next_reply: u64,
    next_conn: u64,
    next_pid: u32,
    next_task: u64,
    processes: BTreeMap<WorkerId, Process>,
    /// Task calls in flight: call id → the worker it was sent to.
    calls: BTreeMap<u64, WorkerId>,
    /// Connections the core remembered and has not forgotten.
    conns: BTreeSet<ConnToken>,
    nodes: Vec<(String, u64)>,
    /// Nodes that ever joined (a dead node's name is free again: a restarted node rejoins).
    joined: usize,
    drivers: Vec<WorkerId>,
    actors: Vec<ActorId>,
    tasks: Vec<ObjectId>,
    groups: Vec<GroupId>,
    events: usize,
    /// The clock [`Op::Tick`] moves.
    clock_ms: u64,
    /// Submitted jobs, by number, and whether the next one's files cannot be laid out.
    jobs: Vec<u64>,
    job_layout_fails: bool,
    /// The key-value store as the world expects it.
    kv: BTreeMap<String, Vec<u8>>,
    /// The kinds of request sent.
    kinds: BTreeSet<&'static str>,
}

fn pick<T: Copy>(items: &[T], selector: u8) -> Option<T> {
    (!items.is_empty()).then(|| items[usize::from(selector) % items.len()])
}

fn resources(cpus: u8, gpus: u8) -> ResourceSet {
    let mut set = ResourceSet::new();
    set.set(CPU, Quantity::whole(u64::from(cpus)));
    if gpus > 0 {
        set.set(GPU, Quantity::whole(u64::from(gpus)));
    }
    set
}

fn sim_config() -> HeadConfig {
    let head_node = 0;
    HeadConfig {
        node: NodeResources::with_fake_gpus(
            rtrun_placement::NodeId::new(rtrun_proto::ids::NodeId(head_node).to_string()),
            2,
            1,
        ),
        max_task_workers: 3,
        noset_cuda_visible_devices: false,
        task_worker_idle_timeout: std::time::Duration::from_millis(5_000),
        workers_on_head: true,
    }
}

/// A fresh cluster head, as `rtrun head` makes one.
fn sim_head() -> HeadCore {
    let mut core = HeadCore::new("5151".into(), sim_config(), 0).expect("a valid node");
    core.enable_cluster(
        "quic://127.0.0.1:1/0/rtrun-5151-0".into(),
        "head".into(),
        "/sim/logs".into(),
    );
    core
}

/// The durable state as JSON, to compare two of them.
fn json(state: &DurableState) -> serde_json::Value {
    serde_json::to_value(state).expect("a durable state serialises")
}

impl World {
    fn new() -> World {
        let mut core = sim_head();
        let durable = core.journal_from_now();
        World {
            core,
            durable,
            awaiting: Vec::new(),
            restarts: 0,
            kept_across_restarts: 0,
            given_up: 0,
            outstanding: BTreeMap::new(),
            next_reply: 0,
            next_conn: 1,
            next_pid: 100,
            next_task: 1,
            clock_ms: 0,
            processes: BTreeMap::new(),
            calls: BTreeMap::new(),
            conns: BTreeSet::new(),
            nodes: Vec::new(),
            joined: 0,
            drivers: Vec::new(),
            actors: Vec::new(),
            tasks: Vec::new(),
            groups: Vec::new(),
            events: 0,
            jobs: Vec::new(),
            job_layout_fails: false,
            kv: BTreeMap::new(),
            kinds: BTreeSet::new(),
        }
    }

    /// Hands the core an event and plays its effects into the world.
    fn handle(&mut self, from: Origin, event: Event) -> Vec<(ReplyToken, Response)> {
        self.events += 1;
        let effects = self.core.handle(from, event);
        self.apply(effects)
    }

    /// A request from `from`; returns its answer when it came at once.
    fn request(&mut self, from: Origin, body: HeadRequest) -> Option<Response> {
        let reply = ReplyToken(self.next_reply);
        self.next_reply += 1;
        let asked = if matches!(body, HeadRequest::WaitActorAlive { .. }) {
            Asked::Watch
        } else {
            Asked::Other
        };
        self.outstanding.insert(reply, asked);
        self.kinds.insert(body.kind());
        let answers = self.handle(from, Event::Request { reply, body });
        answers.into_iter().find(|(token, _)| *token == reply).map(|(_, response)| response)
    }

    fn apply(&mut self, effects: Vec<Effect>) -> Vec<(ReplyToken, Response)> {
        let mut answers = Vec::new();
        for effect in effects {
            match effect {
                Effect::Respond(reply, response) => {
                    assert!(
                        self.outstanding.remove(&reply).is_some(),
                        "{reply:?} answered twice or never asked: {response:?}"
                    );
                    answers.push((reply, response));
                }
                Effect::Spawn { node, worker, .. } => {
                    let process = Process {
                        node,
                        pid: None,
                        conn: None,
                        actor: None,
                        constructed: false,
                        killed: false,
                        job: false,
                    };
                    assert!(
                        self.processes.insert(worker, process).is_none(),
                        "{worker} spawned twice"
                    );
                }
                Effect::Call { conn, call_id, .. } => {
                    assert!(self.conns.contains(&conn), "a call on unknown connection {conn:?}");
                    let worker = self
                        .processes
                        .iter()
                        .find(|(_, p)| p.conn == Some(conn))
                        .map(|(w, _)| *w)
                        .expect("a call goes to a registered worker");
                    assert!(
                        self.calls.insert(call_id, worker).is_none(),
                        "call id {call_id} reused"
                    );
                }
                Effect::Send(conn, _) => {
                    assert!(self.conns.contains(&conn), "a send on unknown connection {conn:?}")
                }
                Effect::Kill { node, pid } => {
                    if let Some(p) =
                        self.processes.values_mut().find(|p| p.node == node && p.pid == Some(pid))
                    {
                        p.killed = true;
                    }
                }
                Effect::Remember { conn, .. } => {
                    self.conns.insert(conn);
                }
                Effect::Forget(conn) => {
                    self.conns.remove(&conn);
                }
                Effect::StartJob(start) => {
                    let JobStart { reply, job, worker, info, .. } = *start;
                    assert!(self.outstanding.remove(&reply).is_some(), "{reply:?} answered twice");
                    assert_eq!(info.job, job);
                    if self.job_layout_fails {
                        // The shell reports the failure and answers the error.
                        self.core.job_failed_to_start(job, "no room for its files".into());
                        let error = rtrun_proto::error::Error::System("no room".into());
                        answers.push((reply, Response::Error(error)));
                    } else {
                        let process = Process {
                            node: self.core.members.head_node,
                            pid: None,
                            conn: None,
                            actor: None,
                            constructed: false,
                            killed: false,
                            job: true,
                        };
                        assert!(self.processes.insert(worker, process).is_none(), "job twice");
                        answers.push((reply, Response::Jobs(vec![info])));
                    }
                    self.jobs.push(job);
                }
                Effect::ReadJobLog { reply, info, .. } => {
                    assert!(self.outstanding.remove(&reply).is_some(), "{reply:?} answered twice");
                    answers.push((reply, Response::Logs { bytes: Vec::new(), job: *info }));
                }
                Effect::AdoptJob { job, worker, pid, .. } => {
                    let driver = self.processes.get(&worker);
                    assert!(
                        driver.is_some_and(|p| p.job && p.pid == Some(pid)),
                        "job {job} adopted without its driver {worker} (pid {pid}): {driver:?}"
                    );
                }
                Effect::StopNode { .. }
                | Effect::RemoveJobFiles { .. }
                | Effect::RemoveJobLog { .. }
                | Effect::StopCluster => {}
            }
        }
        answers
    }

    /// Where a request comes from: the embedded driver, a driver, or an actor's worker.
    fn origin(&self, selector: u8) -> Origin {
        let workers: Vec<WorkerId> = self
            .processes
            .iter()
            .filter(|(_, p)| p.actor.is_some() && p.conn.is_some())
            .map(|(w, _)| *w)
            .collect();
        let choices = 1 + self.drivers.len() + workers.len();
        let index = usize::from(selector) % choices;
        if index == 0 {
            return Origin::default();
        }
        if index <= self.drivers.len() {
            return Origin { conn: None, process: Some(self.drivers[index - 1]) };
        }
        let worker = workers[index - 1 - self.drivers.len()];
        Origin { conn: self.processes[&worker].conn, process: Some(worker) }
    }

    fn exits(&mut self, worker: WorkerId, status: WorkerExit) {
        if let Some(p) = self.processes.remove(&worker)
            && let Some(conn) = p.conn
        {
            self.conns.remove(&conn);
        }
        self.calls.retain(|_, w| *w != worker);
        if worker.0.is_multiple_of(2) {
            self.handle(Origin::default(), Event::WorkerExited { worker, status });
        } else {
            let answer =
                self.request(Origin::default(), HeadRequest::WorkerExited { worker, status });
            assert!(matches!(answer, Some(Response::Done)), "{answer:?}");
        }
    }

    fn run(&mut self, op: Op) {
        match op {
            Op::JoinNode { cpus, gpus } => {
                // Every other join reuses the name of a node that died, if one did.
                let name = (0..self.joined)
                    .map(|n| format!("node-{n}"))
                    .find(|name| self.joined % 2 == 1 && !self.nodes.iter().any(|(n, _)| n == name))
                    .unwrap_or_else(|| format!("node-{}", self.joined));
                self.joined += 1;
                let node = NodeResources::with_fake_gpus(
                    rtrun_placement::NodeId::new("joining"),
                    cpus,
                    gpus,
                );
                let endpoint = "127.0.0.1:9".parse().expect("an address");
                let mut effects = Vec::new();
                let (id, _) = self
                    .core
                    .join_node(name.clone(), &node, endpoint, &mut effects)
                    .expect("a node with a fresh name joins");
                self.events += 1;
                self.apply(effects);
                self.nodes.push((name, id));
            }
            Op::NodeDies(selector) => {
                let Some(index) = pick(&(0..self.nodes.len()).collect::<Vec<_>>(), selector) else {
                    return;
                };
                let (name, id) = self.nodes.remove(index);
                self.awaiting.retain(|n| *n != id);
                self.handle(
                    Origin::default(),
                    Event::NodeDead { name, reason: "no heartbeat".into() },
                );
                // Its processes are gone with it; the core has written them off already.
                let gone: Vec<WorkerId> =
                    self.processes.iter().filter(|(_, p)| p.node == id).map(|(w, _)| *w).collect();
                for worker in gone {
                    if let Some(conn) = self.processes.remove(&worker).and_then(|p| p.conn) {
                        self.conns.remove(&conn);
                    }
                    self.calls.retain(|_, w| *w != worker);
                    // A late report of the exit must change nothing.
                    self.handle(
                        Origin::default(),
                        Event::WorkerExited {
                            worker,
                            status: WorkerExit::Lost("its node died".into()),
                        },
                    );
                }
            }
            Op::DriverJoins => {
                let driver = self
                    .core
                    .join_driver(
                        Some("job".into()),
                        None,
                        Some("127.0.0.1:7".parse().expect("an address")),
                    )
                    .expect("a cluster head");
                self.drivers.push(driver);
            }
            Op::DriverLeaves(selector) => {
                let Some(driver) = pick(&self.drivers, selector) else { return };
                self.drivers.retain(|d| *d != driver);
                self.handle(Origin::default(), Event::DriverGone { driver });
            }
            Op::CreateActor { by, cpus, gpus, name, restarts, detached, get_if_exists, group } => {
                let placement = group.and_then(|(g, bundle)| {
                    Some(BundleSchedule {
                        group: pick(&self.groups, g)?,
                        bundle_index: bundle.map(usize::from),
                        capture_child_tasks: false,
                    })
                });
                let options = ActorOptions {
                    num_cpus: Some(f64::from(cpus)),
                    num_gpus: Some(f64::from(gpus)),
                    name: name.map(|n| format!("actor-{n}")),
                    max_restarts: i32::from(restarts),
                    detached,
                    get_if_exists,
                    placement,
                    ..Default::default()
                };
                let spec = ActorSpec { type_name: "Sim".into(), ctor_args: Vec::new(), options };
                let from = self.origin(by);
                if let Some(Response::Actor(info)) =
                    self.request(from, HeadRequest::CreateActor(Box::new(spec)))
                    && !self.actors.contains(&info.id)
                {
                    self.actors.push(info.id);
                }
            }
            Op::KillActor { actor, no_restart } => {
                let Some(actor) = pick(&self.actors, actor) else { return };
                self.request(Origin::default(), HeadRequest::KillActor { actor, no_restart });
            }
            Op::WatchActor { actor, after_current } => {
                let Some(actor) = pick(&self.actors, actor) else { return };
                let after = after_current
                    .then(|| self.core.actors.get(&actor).map(|a| a.incarnation))
                    .flatten();
                self.request(Origin::default(), HeadRequest::WaitActorAlive { actor, after });
            }
            Op::ActorByName(n) => {
                let response = self.request(
                    Origin::default(),
                    HeadRequest::GetActorByName {
                        name: format!("actor-{n}"),
                        namespace: "default".into(),
                    },
                );
                if let Some(Response::Actor(info)) = response {
                    let entry = &self.core.actors[&info.id];
                    assert!(
                        !matches!(entry.state, ActorState::Dead { .. }),
                        "a dead actor by name"
                    );
                }
            }
            Op::SubmitTask { by, cpus, retries, group } => {
                let placement = group.and_then(|g| {
                    Some(BundleSchedule {
                        group: pick(&self.groups, g)?,
                        bundle_index: None,
                        capture_child_tasks: false,
                    })
                });
                let task = ObjectId::new(7, self.next_task);
                self.next_task += 1;
                let options = TaskOptions {
                    num_cpus: f64::from(cpus),
                    max_retries: u32::from(retries),
                    placement,
                    ..Default::default()
                };
                let spec =
                    TaskSpec { task, function: "sim_task".into(), args: Vec::new(), options };
                let from = self.origin(by);
                self.request(from, HeadRequest::SubmitTask(Box::new(spec)));
                self.tasks.push(task);
            }
            Op::CancelTask { task, force } => {
                let Some(task) = pick(&self.tasks, task) else { return };
                self.request(Origin::default(), HeadRequest::CancelTask { task, force });
            }
            Op::CreateGroup { bundles, strategy, by } => {
                let strategy = [
                    GroupStrategy::Pack,
                    GroupStrategy::Spread,
                    GroupStrategy::StrictPack,
                    GroupStrategy::StrictSpread,
                ][usize::from(strategy) % 4];
                let options = PlacementGroupOptions {
                    bundles: bundles.iter().map(|&(c, g)| resources(c, g)).collect(),
                    strategy,
                    name: None,
                };
                let from = self.origin(by);
                if let Some(Response::PlacementGroup(state)) =
                    self.request(from, HeadRequest::CreatePlacementGroup(Box::new(options)))
                {
                    self.groups.push(state.id);
                }
            }
            Op::RemoveGroup(selector) => {
                let Some(group) = pick(&self.groups, selector) else { return };
                self.request(Origin::default(), HeadRequest::RemovePlacementGroup { group });
            }
            Op::WaitGroup(selector) => {
                let Some(group) = pick(&self.groups, selector) else { return };
                self.request(Origin::default(), HeadRequest::WaitPlacementGroup { group });
            }
            Op::ProcessStarts(selector) => {
                let waiting: Vec<WorkerId> = self
                    .processes
                    .iter()
                    .filter(|(_, p)| p.pid.is_none())
                    .map(|(w, _)| *w)
                    .collect();
                let Some(worker) = pick(&waiting, selector) else { return };
                let pid = self.next_pid;
                self.next_pid += 1;
                if let Some(p) = self.processes.get_mut(&worker) {
                    p.pid = Some(pid);
                }
                // A remote node's spawner reports by request, the head's own by event.
                if selector.is_multiple_of(2) {
                    self.handle(Origin::default(), Event::WorkerSpawned { worker, pid });
                } else {
                    let answer =
                        self.request(Origin::default(), HeadRequest::WorkerSpawned { worker, pid });
                    assert!(matches!(answer, Some(Response::Done)), "{answer:?}");
                }
            }
            Op::ProcessRegisters(selector) => {
                let started: Vec<WorkerId> = self
                    .processes
                    .iter()
                    .filter(|(_, p)| p.pid.is_some() && p.conn.is_none() && !p.job)
                    .map(|(w, _)| *w)
                    .collect();
                let Some(worker) = pick(&started, selector) else { return };
                let conn = ConnToken(self.next_conn);
                self.next_conn += 1;
                let pid = self.processes[&worker].pid.expect("started");
                let from = Origin { conn: Some(conn), process: Some(worker) };
                let address = format!("unix:@rtrun-5151-{}", worker.0);
                // Its connection is up before it registers: a task worker may be sent a task
                // before its registration is answered.
                if let Some(p) = self.processes.get_mut(&worker) {
                    p.conn = Some(conn);
                }
                let response =
                    self.request(from, HeadRequest::RegisterWorker { worker, address, pid });
                let Some(p) = self.processes.get_mut(&worker) else { return };
                match response {
                    Some(Response::Assignment(Assignment::Actor(start))) => {
                        p.actor = Some((start.actor, start.incarnation));
                    }
                    Some(Response::Assignment(Assignment::Tasks)) => {}
                    other => panic!("a spawned worker's registration answered {other:?}"),
                }
            }
            Op::ActorConstructed { process, ok } => {
                let ready: Vec<WorkerId> = self
                    .processes
                    .iter()
                    .filter(|(_, p)| p.actor.is_some() && !p.constructed)
                    .map(|(w, _)| *w)
                    .collect();
                let Some(worker) = pick(&ready, process) else { return };
                let p = self.processes.get_mut(&worker).expect("picked");
                p.constructed = true;
                let (actor, incarnation) = p.actor.expect("an actor's worker");
                let from = Origin { conn: p.conn, process: Some(worker) };
                let result = if ok { Ok(()) } else { Err("boom".into()) };
                self.request(from, HeadRequest::ActorStarted { actor, incarnation, result });
            }
            Op::ProcessCrashes { process, how } => {
                let live: Vec<WorkerId> = self.processes.keys().copied().collect();
                let Some(worker) = pick(&live, process) else { return };
                let status = match how {
                    0 => WorkerExit::Code(1),
                    1 => WorkerExit::Signal(11),
                    _ => WorkerExit::Lost("it could not be started".into()),
                };
                self.exits(worker, status);
            }
            Op::KilledProcessExits(selector) => {
                let killed: Vec<WorkerId> =
                    self.processes.iter().filter(|(_, p)| p.killed).map(|(w, _)| *w).collect();
                let Some(worker) = pick(&killed, selector) else { return };
                self.exits(worker, WorkerExit::Signal(9));
            }
            Op::TaskReplies { call, ok } => {
                let calls: Vec<u64> = self.calls.keys().copied().collect();
                let Some(call_id) = pick(&calls, call) else { return };
                self.calls.remove(&call_id);
                let outcome = if ok {
                    Outcome::Value(Vec::new())
                } else {
                    Outcome::Error(rtrun_proto::error::Error::TaskFailed {
                        target: "sim_task".into(),
                        message: "it raised".into(),
                    })
                };
                self.handle(Origin::default(), Event::TaskReply { call_id, outcome });
            }
            Op::WatcherGoes(selector) => {
                let watches: Vec<ReplyToken> = self
                    .outstanding
                    .iter()
                    .filter(|(_, asked)| matches!(asked, Asked::Watch))
                    .map(|(token, _)| *token)
                    .collect();
                let Some(reply) = pick(&watches, selector) else { return };
                self.outstanding.remove(&reply);
                self.handle(Origin::default(), Event::Abandoned(vec![reply]));
            }
            Op::Tick(ms) => {
                self.clock_ms += ms;
                self.handle(Origin::default(), Event::Tick { now_ms: self.clock_ms });
                self.drop_expired_nodes();
            }
            Op::HeadRestarts { rejoin } => self.restart_head(rejoin),
            Op::LateRejoin(selector) => {
                let Some(node) = pick(&self.awaiting, selector) else { return };
                self.rejoin(node);
            }
            Op::Views => {
                let info = self.request(Origin::default(), HeadRequest::ClusterInfo);
                assert!(matches!(info, Some(Response::ClusterInfo(_))), "{info:?}");
                self.request(Origin::default(), HeadRequest::ListActors);
                self.request(Origin::default(), HeadRequest::ListPlacementGroups);
                let tasks = self.request(Origin::default(), HeadRequest::ListTasks);
                let Some(Response::Tasks(table)) = tasks else { panic!("{tasks:?}") };
                let counts = table.by_function.values();
                let (queued, running, finished, failed) = counts.fold((0, 0, 0, 0), |t, c| {
                    (t.0 + c.queued, t.1 + c.running, t.2 + c.finished, t.3 + c.failed)
                });
                assert_eq!((finished, failed), (self.core.tasks_finished, self.core.tasks_failed));
                assert_eq!(queued as usize, self.core.task_queue.len());
                assert_eq!(running as usize, self.core.running_tasks.len());
                assert_eq!(table.live.len(), (queued + running) as usize);
                let workers = self.request(Origin::default(), HeadRequest::ListWorkers);
                let Some(Response::Workers(workers)) = workers else { panic!("{workers:?}") };
                assert_eq!(workers.len(), self.core.workers.len());
                self.request(Origin::default(), HeadRequest::ListJobs);
            }
            Op::SubmitJob { name, package, fails } => self.submit_job(name, package, fails),
            Op::StopJob(selector) => {
                let Some(job) = pick(&self.jobs, selector) else { return };
                let answer = self.request(Origin::default(), HeadRequest::StopJob { job });
                let Some(Response::Jobs(infos)) = answer else { panic!("{answer:?}") };
                // A running job's driver is killed (or will be, once it has started).
                let worker = WorkerId(job);
                if infos[0].state == JobState::Running
                    && let Some(p) = self.processes.get(&worker)
                {
                    assert!(p.pid.is_none() || p.killed, "stopped job {job}'s driver lives on");
                }
            }
            Op::JobLogs(selector) => {
                let Some(job) = pick(&self.jobs, selector) else { return };
                let answer =
                    self.request(Origin::default(), HeadRequest::JobLogs { job, offset: 0 });
                assert!(
                    matches!(&answer, Some(Response::Logs { job: info, .. }) if info.job == job),
                    "{answer:?}"
                );
            }
            Op::DeleteJob(selector) => {
                let Some(job) = pick(&self.jobs, selector) else { return };
                let running = self.processes.get(&WorkerId(job)).is_some_and(|p| p.job);
                let answer = self.request(Origin::default(), HeadRequest::DeleteJob { job });
                match answer {
                    Some(Response::Jobs(_)) => {
                        assert!(!running, "running job {job} was deleted");
                        self.jobs.retain(|j| *j != job);
                    }
                    Some(Response::Error(_)) => assert!(running, "ended job {job} was kept"),
                    other => panic!("{other:?}"),
                }
            }
            Op::Kv { op, key } => {
                let key = format!("k{key}");
                let answer = match op {
                    0 => {
                        let value = vec![op, self.events as u8];
                        self.kv.insert(key.clone(), value.clone());
                        self.request(Origin::default(), HeadRequest::KvPut { key, value })
                    }
                    1 => {
                        let answer = self
                            .request(Origin::default(), HeadRequest::KvGet { key: key.clone() });
                        let Some(Response::KvValue(value)) = &answer else { panic!("{answer:?}") };
                        assert_eq!(
                            value.as_deref().map(|v| &v[..]),
                            self.kv.get(&key).map(|v| &v[..])
                        );
                        answer
                    }
                    _ => {
                        let had = self.kv.remove(&key);
                        let answer = self.request(Origin::default(), HeadRequest::KvDelete { key });
                        let Some(Response::KvValue(value)) = &answer else { panic!("{answer:?}") };
                        assert_eq!(value.as_deref().map(|v| &v[..]), had.as_deref());
                        answer
                    }
                };
                assert!(answer.is_some(), "the key-value store answers at once");
            }
            Op::GetGroup(selector) => {
                let Some(group) = pick(&self.groups, selector) else { return };
                let answer =
                    self.request(Origin::default(), HeadRequest::GetPlacementGroup { group });
                let state = match answer {
                    Some(Response::PlacementGroup(state)) => state,
                    // A removed group is gone from the list too.
                    Some(Response::Error(_)) => {
                        let list =
                            self.request(Origin::default(), HeadRequest::ListPlacementGroups);
                        let Some(Response::PlacementGroups(list)) = list else {
                            panic!("{list:?}")
                        };
                        assert!(list.iter().all(|g| g.id != group), "{group} listed, not found");
                        return;
                    }
                    other => panic!("{other:?}"),
                };
                let by_name = self.request(
                    Origin::default(),
                    HeadRequest::GetPlacementGroupByName { name: state.name.clone() },
                );
                assert!(
                    matches!(&by_name, Some(Response::PlacementGroup(s)) if s.id == group),
                    "{by_name:?}"
                );
            }
            Op::NodeAlive(selector) => {
                let ids: Vec<u64> = self.nodes.iter().map(|(_, id)| *id).collect();
                let Some(node) = pick(&ids, selector) else { return };
                let answer = self.request(Origin::default(), HeadRequest::NodeAlive { node });
                assert!(matches!(answer, Some(Response::Done)), "live node {node}: {answer:?}");
            }
            Op::StopCluster => {
                let answer = self.request(Origin::default(), HeadRequest::StopCluster);
                assert!(matches!(answer, Some(Response::Done)), "{answer:?}");
            }
        }
    }

    /// The invariants that hold after every event.
    fn check(&self) {
        let core = &self.core;
        // Jobs: submission ids name one job; a job runs exactly while its driver lives.
        let mut names = BTreeSet::new();
        for (id, job) in &core.members.jobs {
            assert!(names.insert(&job.submission_id), "two jobs named {}", job.submission_id);
            let driver = self.processes.get(&WorkerId(*id)).filter(|p| p.job);
            assert_eq!(
                job.state == JobState::Running,
                driver.is_some(),
                "job {id} is {:?} with its driver {driver:?}",
                job.state
            );
        }
        check_core(core);
        // Connections: the core refers only to those it remembered.
        for (worker, entry) in &core.workers {
            if let Some(conn) = entry.conn {
                assert!(self.conns.contains(&conn), "worker {worker} on forgotten {conn:?}");
            }
        }
    }

    /// Appends what the core journaled to the durable state, which must then equal what the
    /// core holds (a replay of the state directory gives back the core's durable tables).
    fn persist(&mut self) {
        for record in self.core.take_records() {
            self.durable.apply(record);
        }
        let held = json(&self.core.durable_state());
        assert!(
            json(&self.durable) == held,
            "the journal missed a change: replayed {:#} vs held {held:#}",
            json(&self.durable)
        );
    }

    /// The head process is SIGKILLed and restarted on its state directory: requests in flight
    /// are lost, and so are the processes of the head's own node (its children); the nodes in
    /// `rejoin` reconnect at once with what they run, every registered worker re-registers and
    /// every driver reconnects. Actors alive on a node that rejoined keep their worker and
    /// incarnation; the key-value store is whole.
    fn restart_head(&mut self, rejoin: u8) {
        self.persist();
        self.restarts += 1;
        let head_node = self.core.members.head_node;
        let alive_before: BTreeMap<ActorId, (WorkerId, u64, u64)> = self
            .core
            .actors
            .iter()
            .filter_map(|(id, a)| match a.state {
                ActorState::Alive { worker, .. } => {
                    let node = self.core.workers.get(&worker)?.node;
                    Some((*id, (worker, a.incarnation, node)))
                }
                _ => None,
            })
            .collect();
        let mut core = sim_head();
        let effects = core
            .recover(self.durable.clone(), self.clock_ms, RECONNECT_WINDOW_MS)
            .expect("a head recovers what it persisted");
        self.durable = core.journal_from_now();
        self.core = core;
        self.outstanding.clear();
        self.conns.clear();
        self.calls.clear();
        // The head's own node's workers were its children; the submitted jobs' drivers it had
        // started outlive it (it starts them so), the ones it had not never start.
        self.processes.retain(|_, p| p.node != head_node || (p.job && p.pid.is_some()));
        for p in self.processes.values_mut() {
            p.conn = None;
        }
        self.apply(effects);
        self.awaiting = self.nodes.iter().map(|(_, id)| *id).collect();
        let now: Vec<u64> = self
            .awaiting
            .iter()
            .enumerate()
            .filter(|(i, _)| rejoin & (1 << (i % 8)) != 0)
            .map(|(_, id)| *id)
            .collect();
        for node in now {
            self.rejoin(node);
        }
        // Every process the new head does not know (a task worker) is refused and exits; the
        // others that had registered register again.
        let workers: Vec<WorkerId> = self.processes.keys().copied().collect();
        for worker in workers {
            if !self.core.workers.contains_key(&worker) {
                self.exits(worker, WorkerExit::Code(1));
                continue;
            }
            let Some(p) = self.processes.get(&worker) else { continue };
            if p.actor.is_none() {
                continue;
            }
            let pid = p.pid.expect("a registered worker has started");
            let conn = ConnToken(self.next_conn);
            self.next_conn += 1;
            if let Some(p) = self.processes.get_mut(&worker) {
                p.conn = Some(conn);
            }
            let from = Origin { conn: Some(conn), process: Some(worker) };
            let address = format!("unix:@rtrun-5151-{}", worker.0);
            let answer = self.request(from, HeadRequest::RegisterWorker { worker, address, pid });
            assert!(matches!(answer, Some(Response::Assignment(_))), "{worker}: {answer:?}");
        }
        for driver in self.drivers.clone() {
            self.core.rejoin_driver(driver).expect("a driver of the old head rejoins");
        }
        self.jobs.retain(|job| self.core.members.jobs.contains_key(job));
        for (actor, (worker, incarnation, node)) in alive_before {
            if node == head_node || self.awaiting.contains(&node) {
                continue;
            }
            let Some(entry) = self.core.actors.get(&actor) else { panic!("{actor} was lost") };
            let kept = matches!(entry.state, ActorState::Alive { worker: w, .. } if w == worker)
                && entry.incarnation == incarnation;
            let killed = self.processes.get(&worker).is_none_or(|p| p.killed);
            assert!(kept || killed, "{actor} on a rejoined node lost its worker {worker}");
            self.kept_across_restarts += usize::from(kept);
        }
        for (key, value) in &self.kv {
            assert_eq!(self.core.kv.get(key), Some(value), "{key} was lost in the restart");
        }
        assert_eq!(self.core.kv.len(), self.kv.len(), "keys appeared in the restart");
    }

    /// Node `node` reconnects to a restarted head, reporting the processes it runs.
    fn rejoin(&mut self, node: u64) {
        self.awaiting.retain(|n| *n != node);
        let Some((name, _)) = self.nodes.iter().find(|(_, id)| *id == node).cloned() else {
            return;
        };
        let running: Vec<(WorkerId, Option<u32>)> = self
            .processes
            .iter()
            .filter(|(_, p)| p.node == node)
            .map(|(w, p)| (*w, p.pid))
            .collect();
        let mut effects = Vec::new();
        self.core
            .rejoin_node(node, &name, &running, &mut effects)
            .expect("an awaited node rejoins");
        self.events += 1;
        self.apply(effects);
    }

    /// Drops the nodes a restarted head gave up on (they did not reconnect in time) and their
    /// processes, reporting their exits late.
    fn drop_expired_nodes(&mut self) {
        let dead: Vec<(String, u64)> = self
            .nodes
            .iter()
            .filter(|(_, id)| self.core.members.nodes.get(id).is_some_and(|n| n.dead.is_some()))
            .cloned()
            .collect();
        for (name, id) in dead {
            self.given_up += 1;
            self.nodes.retain(|(_, n)| *n != id);
            self.awaiting.retain(|n| *n != id);
            let gone: Vec<WorkerId> =
                self.processes.iter().filter(|(_, p)| p.node == id).map(|(w, _)| *w).collect();
            for worker in gone {
                self.exits(worker, WorkerExit::Lost(format!("{name} was given up")));
            }
            let mut effects = Vec::new();
            let refused = self.core.rejoin_node(id, &name, &[], &mut effects);
            assert!(refused.is_err() && effects.is_empty(), "a node given up rejoined");
        }
    }

    /// Submits a job, named `job-<name>` when `name` is given; a name in use is refused.
    fn submit_job(&mut self, name: Option<u8>, package: bool, fails: bool) {
        let submission_id = name.map(|n| format!("job-{n}"));
        let taken = submission_id
            .as_ref()
            .is_some_and(|id| self.core.members.jobs.values().any(|j| &j.submission_id == id));
        self.job_layout_fails = fails;
        let answer = self.request(
            Origin::default(),
            HeadRequest::SubmitJob {
                binary: "sim-job".into(),
                args: vec!["--steps".into(), "3".into()],
                env: vec![("SIM".into(), "1".into())],
                submission_id: submission_id.clone(),
                working_dir: package.then(|| "d1g3st".into()),
            },
        );
        self.job_layout_fails = false;
        match answer {
            Some(Response::Jobs(infos)) => {
                assert!(!taken && !fails, "{submission_id:?} was accepted");
                let info = &infos[0];
                assert_eq!(info.state, JobState::Running);
                assert_eq!(info.log, format!("/sim/logs/job-{}.log", info.job));
                if let Some(id) = submission_id {
                    assert_eq!(info.submission_id, id);
                }
            }
            Some(Response::Error(e)) => assert!(taken || fails, "refused: {e}"),
            other => panic!("{other:?}"),
        }
    }

    /// Stops everything and lets every process end; then the cluster must be whole again and
    /// every request answered.
    fn wind_down(&mut self) {
        for driver in std::mem::take(&mut self.drivers) {
            self.handle(Origin::default(), Event::DriverGone { driver });
        }
        for task in self.tasks.clone() {
            self.request(Origin::default(), HeadRequest::CancelTask { task, force: true });
        }
        for actor in self.actors.clone() {
            self.request(Origin::default(), HeadRequest::KillActor { actor, no_restart: true });
        }
        for group in self.groups.clone() {
            self.request(Origin::default(), HeadRequest::RemovePlacementGroup { group });
        }
        self.check();
        // Every process starts, registers and ends (killed ones as ordered; the rest are idle
        // task workers, stopped by the shutdown).
        for _ in 0..10_000 {
            let Some((&worker, p)) = self.processes.iter().next() else { break };
            if p.pid.is_none() {
                self.run(Op::ProcessStarts(0));
            } else {
                self.exits(worker, WorkerExit::Signal(9));
            }
            self.check();
        }
        assert!(self.processes.is_empty(), "processes left: {:?}", self.processes);
        assert!(self.outstanding.is_empty(), "requests never answered: {:?}", self.outstanding);
        assert!(self.core.cluster.allocations().next().is_none(), "allocations left");
        for node in self.core.cluster.nodes() {
            assert_eq!(node.available(), node.total(), "{} did not get everything back", node.id());
        }
        assert!(self.core.names.is_empty(), "names left: {:?}", self.core.names);
        assert!(self.core.task_queue.is_empty() && self.core.running_tasks.is_empty());
    }
}

/// The invariants of the core alone (resources, actors, names, groups, indexes): what
/// [`World::check`] checks besides the world's processes, jobs and connections.
fn check_core(core: &HeadCore) {
    // Resources: each allocation has exactly one holder, and each holder's allocation
    // exists.
    let mut holders: HashMap<rtrun_placement::AllocationId, String> = HashMap::new();
    for (id, actor) in &core.actors {
        if let Some(allocation) = &actor.allocation {
            assert!(
                holders.insert(allocation.id, format!("actor {id}")).is_none(),
                "allocation {} held twice",
                allocation.id
            );
            assert!(
                !matches!(actor.state, ActorState::Dead { .. }),
                "dead actor {id} holds {}",
                allocation.id
            );
        }
    }
    for (call, run) in &core.running_tasks {
        if let Some(other) = holders.insert(run.allocation, format!("task call {call}")) {
            panic!("allocation {} held by {other} and task call {call}", run.allocation);
        }
    }
    let live: BTreeSet<_> = core.cluster.allocations().map(|a| a.id).collect();
    let held: BTreeSet<_> = holders.keys().copied().collect();
    assert_eq!(live, held, "allocations without a holder, or holders without one");
    for node in core.cluster.nodes() {
        assert!(
            node.total().first_shortfall(node.available()).is_none(),
            "{} hands out more than it has: {:?} of {:?}",
            node.id(),
            node.available(),
            node.total()
        );
    }
    // Actors: one worker each, names only for the living.
    let mut hosts: HashMap<ActorId, WorkerId> = HashMap::new();
    for (worker, entry) in &core.workers {
        if let super::WorkerRole::Actor { actor, .. } = entry.role
            && let Some(other) = hosts.insert(actor, *worker)
        {
            panic!("actor {actor} lives in workers {other} and {worker}");
        }
    }
    for (id, actor) in &core.actors {
        if let ActorState::Starting { worker } | ActorState::Alive { worker, .. } = actor.state {
            let entry = core.workers.get(&worker).expect("a starting or alive actor's worker");
            assert!(
                matches!(entry.role, super::WorkerRole::Actor { actor: a, incarnation }
                        if a == *id && incarnation == actor.incarnation),
                "actor {id}'s worker {worker} hosts something else"
            );
        }
    }
    for ((namespace, name), id) in &core.names {
        let actor = &core.actors[id];
        assert!(
            !matches!(actor.state, ActorState::Dead { .. }),
            "dead actor {id} keeps {namespace}/{name}"
        );
    }
    // Groups: none pending that would fit now; the core's indexes agree.
    if let Err(e) = core.verify_indexes() {
        panic!("{e}");
    }
    let mut cluster = core.cluster.clone();
    assert!(cluster.schedule_pending().is_empty(), "a pending group fits but waits");
}

fn simulate(ops: Vec<Op>) {
    let mut world = World::new();
    for op in ops {
        world.run(op);
        world.persist();
        world.check();
    }
    world.wind_down();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    /// Random schedules of joins, deaths, requests, process lifecycles and replies keep every
    /// invariant, and winding down returns every resource and answers every request.
    #[test]
    fn control_plane_keeps_its_invariants(ops in proptest::collection::vec(op(), 1..80)) {
        simulate(ops);
    }
}

/// What the schedules reached, so that a change which makes them vacuous (every op a no-op)
/// fails instead of passing.
#[derive(Debug, Default)]
struct Reached {
    alive_actors: usize,
    restarted_actors: usize,
    dead_actors: usize,
    tasks_answered: u64,
    tasks_failed: u64,
    placed_groups: usize,
    pending_groups: usize,
    dead_nodes: usize,
    restarts: usize,
    given_up: usize,
    events: usize,
    kinds: BTreeSet<&'static str>,
}

impl World {
    fn observe(&self, reached: &mut Reached) {
        let core = &self.core;
        for actor in core.actors.values() {
            match actor.state {
                ActorState::Alive { .. } => reached.alive_actors += 1,
                ActorState::Dead { .. } => reached.dead_actors += 1,
                _ => {}
            }
            reached.restarted_actors += usize::from(actor.incarnation > 0);
        }
        reached.tasks_answered = reached.tasks_answered.max(core.tasks_finished);
        reached.tasks_failed = reached.tasks_failed.max(core.tasks_failed);
        reached.placed_groups +=
            core.cluster.groups().filter(|g| g.2 == rtrun_placement::GroupStatus::Placed).count();
        reached.pending_groups += core.pending_groups.len();
        reached.dead_nodes += core.members.nodes.values().filter(|n| n.dead.is_some()).count();
    }
}

#[test]
fn the_schedules_reach_every_kind_of_state() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let schedules = proptest::collection::vec(op(), 1..80);
    let mut reached = Reached::default();
    for _ in 0..300 {
        let ops = schedules.new_tree(&mut runner).expect("a schedule").current();
        let mut world = World::new();
        for op in ops {
            world.run(op);
            world.observe(&mut reached);
        }
        reached.events += world.events;
        reached.restarts += world.restarts;
        reached.given_up += world.given_up;
        world.wind_down();
        reached.kinds.extend(&world.kinds);
    }
    let never: Vec<&str> =
        HeadRequest::KINDS.into_iter().filter(|kind| !reached.kinds.contains(kind)).collect();
    assert!(never.is_empty(), "no schedule sent {never:?}");
    for (what, count) in [
        ("alive actors", reached.alive_actors),
        ("restarted actors", reached.restarted_actors),
        ("dead actors", reached.dead_actors),
        ("placed groups", reached.placed_groups),
        ("pending groups", reached.pending_groups),
        ("dead nodes", reached.dead_nodes),
        ("answered tasks", reached.tasks_answered as usize),
        ("failed tasks", reached.tasks_failed as usize),
        ("head restarts", reached.restarts),
        ("nodes given up after a head restart", reached.given_up),
    ] {
        assert!(count > 0, "no schedule reached {what}: {reached:?}");
    }
}

#[test]
fn an_actor_restarts_then_dies_and_frees_its_name() {
    let mut world = World::new();
    world.run(Op::CreateActor {
        by: 0,
        cpus: 1,
        gpus: 0,
        name: Some(1),
        restarts: 1,
        detached: false,
        get_if_exists: false,
        group: None,
    });
    for _ in 0..2 {
        world.run(Op::ProcessStarts(0));
        world.run(Op::ProcessRegisters(0));
        world.run(Op::ActorConstructed { process: 0, ok: true });
        world.check();
        world.run(Op::ProcessCrashes { process: 0, how: 1 });
        world.check();
    }
    let actor = world.actors[0];
    assert!(matches!(world.core.actors[&actor].state, ActorState::Dead { .. }));
    assert!(world.core.names.is_empty());
    world.wind_down();
}

#[test]
fn a_worker_that_dies_on_another_node_says_which() {
    let mut world = World::new();
    // The head offers 2 CPUs, so an actor of 3 goes to the node that joins with 3.
    world.run(Op::JoinNode { cpus: 3, gpus: 0 });
    world.run(Op::CreateActor {
        by: 0,
        cpus: 3,
        gpus: 0,
        name: None,
        restarts: 0,
        detached: false,
        get_if_exists: false,
        group: None,
    });
    world.run(Op::ProcessStarts(0));
    world.run(Op::ProcessRegisters(0));
    world.run(Op::ActorConstructed { process: 0, ok: true });
    world.run(Op::ProcessCrashes { process: 0, how: 1 });
    world.check();
    let actor = world.actors[0];
    let ActorState::Dead { reason } = &world.core.actors[&actor].state else {
        panic!("the actor should be dead");
    };
    assert!(reason.contains("signal 11") && reason.contains(" on node-2 (node-0)"), "{reason}");
    world.wind_down();
}

/// Checks the core's invariants every `stride` decisions and at the end of every phase.
struct Invariants {
    stride: usize,
    decisions: usize,
    checks: usize,
}

impl crate::scale::Probe for Invariants {
    fn after(&mut self, _phase: crate::scale::Phase, core: &HeadCore) {
        self.decisions += 1;
        if self.decisions.is_multiple_of(self.stride) {
            check_core(core);
            self.checks += 1;
        }
    }
    fn phase_done(&mut self, _phase: crate::scale::Phase, core: &HeadCore) {
        check_core(core);
        self.checks += 1;
    }
}

/// Ray's RL scheduling shapes at 2,000 nodes (issue 44): every group is placed, every actor
/// comes alive in its bundle, the actors of the 10 nodes that die restart on the spare nodes,
/// and the invariants hold throughout.
#[test]
fn two_thousand_nodes_keep_the_invariants_in_every_shape() {
    use crate::scale::{Layout, Scale, Shape};
    for layout in [
        Layout::GroupPerNode,
        Layout::GroupPerRack { rack: 32 },
        Layout::PlainActors { actors: 40_000 },
    ] {
        let shape = Shape::ray_benchmark(2_000, layout, 10);
        let mut scale = Scale::new(shape);
        let mut probe = Invariants { stride: 2_000, decisions: 0, checks: 0 };
        let reached = scale.run(&mut probe);
        assert_eq!(reached.groups_placed, shape.groups(), "{layout:?}");
        assert_eq!(reached.actors_alive, shape.actors(), "{layout:?}");
        assert_eq!(reached.actors_not_restarted, 0, "{layout:?}: {reached:?}");
        assert!(reached.actors_restarted > 0, "{layout:?}: no actor was on a dying node");
        // A dying node's 4 actors restart; in a rack, so do the other 31 nodes' (a group that
        // lost a bundle is placed again as a whole; the 10 deaths hit 10 racks).
        let restarted = match layout {
            Layout::GroupPerNode => Some(10 * shape.actors_per_node),
            Layout::GroupPerRack { rack } => Some(10 * rack * shape.actors_per_node),
            Layout::PlainActors { .. } => None,
        };
        if let Some(restarted) = restarted {
            assert_eq!(reached.actors_restarted, restarted, "{layout:?}");
        }
        assert!(probe.checks > 20, "{layout:?}: only {} checks", probe.checks);
        // Every node but the dead is in the placement state, and the resources balance.
        let core = scale.core();
        assert_eq!(core.cluster.nodes().len(), 1 + 2_000 - 10);
        let held: u64 = core.cluster.allocations().map(|a| a.resources.get(GPU).raw()).sum();
        let expected = match layout {
            Layout::PlainActors { .. } => 0,
            _ => shape.actors() as u64 * 2 * Quantity::SCALE,
        };
        assert_eq!(held, expected, "{layout:?}: GPUs held by actors");
    }
}

/// A head killed and restarted on its durable state: the actor on the node that rejoins keeps
/// its worker and incarnation (its state lives on), the named detached actor on the head's own
/// node restarts, the key-value store is whole; the node that never reconnects is given up
/// when the window closes and its actor is placed anew.
#[test]
fn a_restarted_head_keeps_what_rejoins_and_gives_up_what_does_not() {
    let mut world = World::new();
    // The head offers 2 CPUs: actors of 3 go to the nodes, which offer 3 each.
    world.run(Op::JoinNode { cpus: 3, gpus: 0 });
    world.run(Op::JoinNode { cpus: 3, gpus: 0 });
    world.run(Op::DriverJoins);
    let actor = |cpus, name, detached| Op::CreateActor {
        by: 1,
        cpus,
        gpus: 0,
        name,
        restarts: 1,
        detached,
        get_if_exists: false,
        group: None,
    };
    world.run(actor(3, None, false));
    world.run(actor(3, None, false));
    world.run(actor(1, Some(0), true));
    for _ in 0..3 {
        world.run(Op::ProcessStarts(0));
        world.run(Op::ProcessRegisters(0));
        world.run(Op::ActorConstructed { process: 0, ok: true });
    }
    world.run(Op::Kv { op: 0, key: 1 });
    world.persist();
    world.check();
    let [on_first, on_second, named] = [0, 1, 2].map(|i| world.actors[i]);
    let before = |world: &World, actor| match world.core.actors[&actor].state {
        ActorState::Alive { worker, .. } => (worker, world.core.workers[&worker].node),
        ref other => panic!("{actor} is {other:?}"),
    };
    let (first_worker, first_node) = before(&world, on_first);
    let (_, second_node) = before(&world, on_second);
    assert_ne!(first_node, second_node);
    assert_eq!(before(&world, named).1, 0, "the small actor runs on the head's node");
    // Only the first node reconnects at once (its index is bit 0).
    let first_index = world.nodes.iter().position(|(_, id)| *id == first_node).unwrap();
    world.run(Op::HeadRestarts { rejoin: 1 << first_index });
    world.persist();
    world.check();
    assert!(matches!(world.core.actors[&on_first].state,
        ActorState::Alive { worker, .. } if worker == first_worker));
    assert_eq!(world.core.actors[&on_first].incarnation, 0);
    assert_eq!(world.kept_across_restarts, 1);
    // The named actor's worker ended with the head: it restarts under the same name.
    assert!(matches!(world.core.actors[&named].state, ActorState::Starting { .. }));
    assert_eq!(world.core.actors[&named].incarnation, 1);
    assert!(world.core.names.values().any(|id| *id == named));
    world.run(Op::Kv { op: 1, key: 1 });
    // The window closes: the second node is given up, its actor waits to be placed anew.
    world.run(Op::Tick(RECONNECT_WINDOW_MS));
    world.persist();
    world.check();
    assert_eq!(world.given_up, 1);
    assert!(world.core.members.nodes[&second_node].dead.is_some());
    assert!(matches!(world.core.actors[&on_second].state, ActorState::Pending));
    assert_eq!(world.core.actors[&on_second].incarnation, 1);
    world.wind_down();
}
