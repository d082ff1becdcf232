//! The head core at cluster scale: the shapes of Ray's 2026 RL scheduling benchmark played
//! against [`HeadCore::handle`] with no I/O — thousands of simulated nodes join, a driver
//! creates placement groups (one per node, or one per rack with a bundle per node) and actors
//! in their bundles, or plain actors anywhere; every worker the core spawns starts, registers
//! and constructs its actor; then nodes die mid-scenario and their actors restart elsewhere.
//!
//! [`Scale::run`] calls a [`Probe`] around every decision (a call of the core), so the caller
//! measures what it wants — `examples/head_scale.rs` times each decision and counts memory,
//! the simulator's test checks its invariants — while this module keeps no clock.

use std::collections::VecDeque;

use rtrun_placement::{CPU, GPU, GroupId, NodeResources, Quantity, ResourceSet, Strategy};
use rtrun_proto::actor::{ActorOptions, ActorSpec};
use rtrun_proto::ids::{ActorId, WorkerId};
use rtrun_proto::placement_group::{BundleSchedule, PlacementGroupOptions};
use rtrun_proto::protocol::{Assignment, HeadRequest, Response, WorkerExit};

use crate::{ConnToken, Effect, Event, HeadConfig, HeadCore, Origin, ReplyToken};

/// How the driver lays its actors out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One group per node with a single whole-node bundle ("pg-per-node"); the actors of a node
    /// share its bundle.
    GroupPerNode,
    /// One `STRICT_SPREAD` group per rack of `rack` nodes, a whole-node bundle per node
    /// ("pg-per-rack").
    GroupPerRack {
        /// Nodes per rack.
        rack: usize,
    },
    /// No groups: this many actors of one CPU each, placed anywhere.
    PlainActors {
        /// How many.
        actors: usize,
    },
}

/// A cluster and what runs on it.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Simulated nodes besides the head's own (which offers nothing).
    pub nodes: usize,
    /// CPUs of each node.
    pub cpus_per_node: u64,
    /// GPUs of each node.
    pub gpus_per_node: u32,
    /// How actors are laid out.
    pub layout: Layout,
    /// Actors per node in the group layouts, each a equal share of its node's bundle.
    pub actors_per_node: usize,
    /// Nodes that die once every actor is alive (one in `nodes / deaths`, spread out). As many
    /// nodes are left spare (the layouts cover `nodes - deaths`), so every actor can restart.
    pub deaths: usize,
}

impl Shape {
    /// Ray's benchmark node: 8 GPUs and 96 CPUs, 4 actors per node.
    pub fn ray_benchmark(nodes: usize, layout: Layout, deaths: usize) -> Shape {
        Shape { nodes, cpus_per_node: 96, gpus_per_node: 8, layout, actors_per_node: 4, deaths }
    }

    /// The nodes the groups cover: all but as many as die.
    pub fn covered(&self) -> usize {
        self.nodes.saturating_sub(self.deaths)
    }

    /// How many actors the driver creates.
    pub fn actors(&self) -> usize {
        match self.layout {
            Layout::PlainActors { actors } => actors,
            _ => self.covered() * self.actors_per_node,
        }
    }

    /// How many groups the driver creates.
    pub fn groups(&self) -> usize {
        match self.layout {
            Layout::GroupPerNode => self.covered(),
            Layout::GroupPerRack { rack } => self.covered().div_ceil(rack.max(1)),
            Layout::PlainActors { .. } => 0,
        }
    }
}

/// What a decision was part of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// A node joins.
    Join,
    /// The driver creates a placement group.
    CreateGroup,
    /// The driver creates an actor (the core places it and spawns its worker, or queues it).
    CreateActor,
    /// An actor's worker started, registered or constructed its actor.
    StartActor,
    /// A node died (the event, and the late reports of its workers' exits).
    NodeDeath,
    /// An actor restarted after its node died: its new worker starts.
    Restart,
}

impl Phase {
    /// Every phase, in scenario order.
    pub const ALL: [Phase; 6] = [
        Phase::Join,
        Phase::CreateGroup,
        Phase::CreateActor,
        Phase::StartActor,
        Phase::NodeDeath,
        Phase::Restart,
    ];
}

/// Called around every decision of the core.
pub trait Probe {
    /// Just before the core decides.
    fn before(&mut self, _phase: Phase) {}
    /// Just after; `core` is the state the decision left.
    fn after(&mut self, _phase: Phase, _core: &HeadCore) {}
    /// A phase of the scenario ended (`core` as it left it).
    fn phase_done(&mut self, _phase: Phase, _core: &HeadCore) {}
}

/// What the scenario reached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reached {
    /// Groups created and placed.
    pub groups_placed: usize,
    /// Actors alive once every worker started.
    pub actors_alive: usize,
    /// Actors alive again after the node deaths (on other nodes).
    pub actors_restarted: usize,
    /// Actors that could not restart (no room left for them), dead or pending.
    pub actors_not_restarted: usize,
    /// Calls of the core.
    pub decisions: usize,
}

/// The scenario, with the core it drives and the processes it plays.
pub struct Scale {
    shape: Shape,
    core: HeadCore,
    driver: WorkerId,
    /// Node names and ids, in joining order.
    nodes: Vec<(String, u64)>,
    /// Workers the core asked for and the node each runs on, not started yet.
    to_start: VecDeque<(WorkerId, u64)>,
    /// Started workers by node and pid, and those the core ordered killed (which exit).
    pids: std::collections::HashMap<(u64, u32), WorkerId>,
    killed: Vec<WorkerId>,
    /// Every actor the driver created.
    actors: Vec<ActorId>,
    next_reply: u64,
    next_conn: u64,
    next_pid: u32,
    decisions: usize,
}

impl Scale {
    /// A head whose own node offers nothing, and a driver connected to it.
    pub fn new(shape: Shape) -> Scale {
        let head_node = 0;
        let config = HeadConfig {
            node: NodeResources::with_fake_gpus(
                rtrun_placement::NodeId::new(rtrun_proto::ids::NodeId(head_node).to_string()),
                0,
                0,
            ),
            max_task_workers: 0,
            noset_cuda_visible_devices: false,
            task_worker_idle_timeout: std::time::Duration::from_secs(60),
            workers_on_head: true,
        };
        // Invariant: a node of no resources is valid (the error is only for malformed sets).
        let mut core = match HeadCore::new("scale".into(), config, head_node) {
            Ok(core) => core,
            Err(e) => unreachable!("an empty head node is valid: {e}"),
        };
        core.enable_cluster("quic://127.0.0.1:1/0/rtrun-scale-0".into(), "head".into(), "/".into());
        let driver = match core.join_driver(Some("scale".into()), None, None) {
            Ok(driver) => driver,
            Err(e) => unreachable!("a cluster head takes drivers: {e}"),
        };
        Scale {
            shape,
            core,
            driver,
            nodes: Vec::new(),
            to_start: VecDeque::new(),
            pids: std::collections::HashMap::new(),
            killed: Vec::new(),
            actors: Vec::new(),
            next_reply: 0,
            next_conn: 1,
            next_pid: 1_000,
            decisions: 0,
        }
    }

    /// The core.
    pub fn core(&self) -> &HeadCore {
        &self.core
    }

    /// Plays the whole scenario; panics where the core answers what the scenario cannot go on
    /// from (a group that does not fit an empty cluster, an actor refused).
    pub fn run(&mut self, probe: &mut dyn Probe) -> Reached {
        let shape = self.shape;
        let mut reached = Reached::default();
        for n in 0..shape.nodes {
            self.join(n, probe);
        }
        probe.phase_done(Phase::Join, &self.core);
        let groups = self.create_groups(probe);
        reached.groups_placed = groups.len();
        probe.phase_done(Phase::CreateGroup, &self.core);
        self.create_actors(&groups, probe);
        probe.phase_done(Phase::CreateActor, &self.core);
        self.start_workers(Phase::StartActor, probe);
        probe.phase_done(Phase::StartActor, &self.core);
        reached.actors_alive = self.alive_actors().len();
        let before: Vec<(ActorId, u64)> = self.incarnations();
        self.kill_nodes(probe);
        probe.phase_done(Phase::NodeDeath, &self.core);
        self.start_workers(Phase::Restart, probe);
        probe.phase_done(Phase::Restart, &self.core);
        let alive = self.alive_actors();
        for (actor, incarnation) in before {
            let now = self.core.actors.get(&actor).map(|a| a.incarnation);
            if now.is_some_and(|now| now > incarnation) {
                if alive.contains(&actor) {
                    reached.actors_restarted += 1;
                } else {
                    reached.actors_not_restarted += 1;
                }
            } else if !alive.contains(&actor) {
                reached.actors_not_restarted += 1;
            }
        }
        reached.decisions = self.decisions;
        reached
    }

    fn decide(
        &mut self,
        phase: Phase,
        from: Origin,
        event: Event,
        probe: &mut dyn Probe,
    ) -> Vec<Effect> {
        probe.before(phase);
        let effects = self.core.handle(from, event);
        probe.after(phase, &self.core);
        self.decisions += 1;
        effects
    }

    /// A request; returns its answer (every request of the scenario is answered at once) and
    /// queues the workers the core spawned.
    fn request(
        &mut self,
        phase: Phase,
        from: Origin,
        body: HeadRequest,
        probe: &mut dyn Probe,
    ) -> Response {
        let reply = ReplyToken(self.next_reply);
        self.next_reply += 1;
        let effects = self.decide(phase, from, Event::Request { reply, body }, probe);
        self.play(effects).into_iter().find(|(token, _)| *token == reply).map_or_else(
            || panic!("{phase:?}: request {reply:?} was not answered at once"),
            |(_, response)| response,
        )
    }

    /// Carries out the effects the scenario cares about: spawned workers queue to start.
    fn play(&mut self, effects: Vec<Effect>) -> Vec<(ReplyToken, Response)> {
        let mut answers = Vec::new();
        for effect in effects {
            match effect {
                Effect::Respond(reply, response) => answers.push((reply, response)),
                Effect::Spawn { node, worker, .. } => self.to_start.push_back((worker, node)),
                Effect::Kill { node, pid } => {
                    if let Some(worker) = self.pids.remove(&(node, pid)) {
                        self.killed.push(worker);
                    }
                }
                _ => {}
            }
        }
        answers
    }

    fn join(&mut self, n: usize, probe: &mut dyn Probe) {
        let name = format!("node-{n}");
        let resources = NodeResources::with_fake_gpus(
            rtrun_placement::NodeId::new("joining"),
            self.shape.cpus_per_node,
            self.shape.gpus_per_node,
        );
        // A distinct port per node, as distinct daemons would have.
        let port = 10_000 + (n % 50_000) as u16;
        let endpoint = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let mut effects = Vec::new();
        probe.before(Phase::Join);
        let joined = self.core.join_node(name.clone(), &resources, endpoint, &mut effects);
        probe.after(Phase::Join, &self.core);
        self.decisions += 1;
        let (id, _) = joined.unwrap_or_else(|e| panic!("node {name} could not join: {e}"));
        self.play(effects);
        self.nodes.push((name, id));
    }

    fn whole_node(&self) -> ResourceSet {
        resources(self.shape.cpus_per_node, u64::from(self.shape.gpus_per_node))
    }

    fn create_groups(&mut self, probe: &mut dyn Probe) -> Vec<GroupId> {
        let (count, bundles, strategy) = match self.shape.layout {
            Layout::GroupPerNode => (self.shape.groups(), 1, Strategy::Pack),
            Layout::GroupPerRack { rack } => (self.shape.groups(), rack, Strategy::StrictSpread),
            Layout::PlainActors { .. } => return Vec::new(),
        };
        let from = Origin { conn: None, process: Some(self.driver) };
        let mut groups = Vec::with_capacity(count);
        for g in 0..count {
            // The last rack holds what is left.
            let size = bundles.min(self.shape.covered() - g * bundles);
            let options = PlacementGroupOptions {
                bundles: vec![self.whole_node(); size],
                strategy,
                name: Some(format!("group-{g}")),
            };
            let body = HeadRequest::CreatePlacementGroup(Box::new(options));
            match self.request(Phase::CreateGroup, from, body, probe) {
                Response::PlacementGroup(state) => groups.push(state.id),
                other => panic!("group {g} was not created: {other:?}"),
            }
        }
        groups
    }

    fn create_actors(&mut self, groups: &[GroupId], probe: &mut dyn Probe) {
        let shape = self.shape;
        let per_node = shape.actors_per_node.max(1) as u64;
        let share =
            resources(shape.cpus_per_node / per_node, u64::from(shape.gpus_per_node) / per_node);
        let mut plan: Vec<(ResourceSet, Option<BundleSchedule>)> = Vec::new();
        match shape.layout {
            Layout::PlainActors { actors } => plan.resize(actors, (resources(1, 0), None)),
            Layout::GroupPerNode => {
                for &group in groups {
                    let bundle =
                        BundleSchedule { group, bundle_index: Some(0), capture_child_tasks: false };
                    plan.extend((0..per_node).map(|_| (share.clone(), Some(bundle))));
                }
            }
            Layout::GroupPerRack { rack } => {
                for (g, &group) in groups.iter().enumerate() {
                    let size = rack.min(shape.covered() - g * rack);
                    for index in 0..size {
                        let bundle = BundleSchedule {
                            group,
                            bundle_index: Some(index),
                            capture_child_tasks: false,
                        };
                        plan.extend((0..per_node).map(|_| (share.clone(), Some(bundle))));
                    }
                }
            }
        }
        let from = Origin { conn: None, process: Some(self.driver) };
        for (a, (demand, placement)) in plan.into_iter().enumerate() {
            let options = ActorOptions {
                num_cpus: Some(demand.get(CPU).as_f64()),
                num_gpus: Some(demand.get(GPU).as_f64()),
                // One restart: an actor of a node that dies starts again elsewhere.
                max_restarts: 1,
                placement,
                ..Default::default()
            };
            let spec = ActorSpec { type_name: "Rollout".into(), ctor_args: Vec::new(), options };
            match self.request(
                Phase::CreateActor,
                from,
                HeadRequest::CreateActor(Box::new(spec)),
                probe,
            ) {
                Response::Actor(info) => self.actors.push(info.id),
                other => panic!("actor {a} was not created: {other:?}"),
            }
        }
    }

    /// Every queued worker starts, registers and constructs its actor.
    fn start_workers(&mut self, phase: Phase, probe: &mut dyn Probe) {
        while let Some((worker, node)) = self.to_start.pop_front() {
            let pid = self.next_pid;
            self.next_pid = self.next_pid.wrapping_add(1);
            let effects =
                self.decide(phase, Origin::default(), Event::WorkerSpawned { worker, pid }, probe);
            self.pids.insert((node, pid), worker);
            self.play(effects);
            let conn = ConnToken(self.next_conn);
            self.next_conn += 1;
            let from = Origin { conn: Some(conn), process: Some(worker) };
            let address = format!("quic://127.0.0.1:{}/{node}/rtrun-scale-{}", 10_000, worker.0);
            let body = HeadRequest::RegisterWorker { worker, address, pid };
            let Response::Assignment(Assignment::Actor(start)) =
                self.request(phase, from, body, probe)
            else {
                panic!("worker {worker} on node {node} got no actor to start");
            };
            let body = HeadRequest::ActorStarted {
                actor: start.actor,
                incarnation: start.incarnation,
                result: Ok(()),
            };
            let answer = self.request(phase, from, body, probe);
            assert!(
                matches!(answer, Response::Done),
                "actor {} did not start: {answer:?}",
                start.actor
            );
        }
    }

    /// `deaths` nodes die, spread over the cluster; the exits of their workers are reported
    /// late, as their daemons' would be.
    fn kill_nodes(&mut self, probe: &mut dyn Probe) {
        let deaths = self.shape.deaths.min(self.nodes.len());
        if deaths == 0 {
            return;
        }
        let stride = self.nodes.len() / deaths;
        let dying: Vec<(String, u64)> =
            (0..deaths).map(|d| self.nodes[d * stride].clone()).collect();
        let dead: Vec<u64> = dying.iter().map(|(_, id)| *id).collect();
        for (name, id) in dying {
            let on_node: Vec<WorkerId> =
                self.core.workers_on.get(&id).into_iter().flatten().copied().collect();
            let event = Event::NodeDead { name, reason: "no heartbeat".into() };
            let effects = self.decide(Phase::NodeDeath, Origin::default(), event, probe);
            self.play(effects);
            self.pids.retain(|(node, _), _| *node != id);
            for worker in on_node {
                let status = WorkerExit::Lost("its node died".into());
                let effects = self.decide(
                    Phase::NodeDeath,
                    Origin::default(),
                    Event::WorkerExited { worker, status },
                    probe,
                );
                self.play(effects);
            }
        }
        // Actors of a group that lost a node were stopped on the others (the group is placed
        // again as a whole): their workers exit as ordered.
        while !self.killed.is_empty() {
            for worker in std::mem::take(&mut self.killed) {
                let event = Event::WorkerExited { worker, status: WorkerExit::Signal(9) };
                let effects = self.decide(Phase::NodeDeath, Origin::default(), event, probe);
                self.play(effects);
            }
        }
        // Workers spawned on a node that died before they started never start.
        self.to_start.retain(|(_, node)| !dead.contains(node));
    }

    fn alive_actors(&self) -> std::collections::HashSet<ActorId> {
        self.actors
            .iter()
            .copied()
            .filter(|id| {
                self.core
                    .actors
                    .get(id)
                    .is_some_and(|a| matches!(a.state, crate::ActorState::Alive { .. }))
            })
            .collect()
    }

    fn incarnations(&self) -> Vec<(ActorId, u64)> {
        self.actors
            .iter()
            .filter_map(|id| self.core.actors.get(id).map(|a| (*id, a.incarnation)))
            .collect()
    }
}

fn resources(cpus: u64, gpus: u64) -> ResourceSet {
    let mut set = ResourceSet::new();
    set.set(CPU, Quantity::whole(cpus));
    if gpus > 0 {
        set.set(GPU, Quantity::whole(gpus));
    }
    set
}
