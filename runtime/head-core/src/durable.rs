//! The durable state: what a cluster head persists so that a head restarted on the same state
//! directory recovers its cluster (Ray's GCS fault tolerance). It is the core's tables that
//! outlive a process — nodes, actor workers, actors, placement groups, submitted jobs, drivers,
//! the key-value store — plus high-water marks of the ids handed out. Queued and running
//! tasks, watches and connections are not durable: their requesters resubmit them.
//!
//! The core records which entries each event changed ([`Journal`]); [`HeadCore::take_records`]
//! turns them into [`Record`]s (an entry written, or removed), which the shell appends to its
//! log before it carries out the event's effects. A snapshot is the same records for every
//! entry ([`DurableState::records`]); replaying a snapshot and the log after it into a
//! [`DurableState`] gives back what [`HeadCore::durable_state`] shows (the simulator checks
//! this after every event). [`HeadCore::recover`] rebuilds a fresh core from it: the nodes,
//! groups and allocations exactly where they were, each remote node and driver given a window
//! to reconnect ([`HeadCore::rejoin_node`], [`HeadCore::rejoin_driver`]), after which it is
//! declared dead or gone.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use rtrun_placement::{BundleTable, GroupId, PlacementGroupRequest};
use rtrun_proto::error::{Error, Result};
use rtrun_proto::ids::{ActorId, NodeId, WorkerId};
use rtrun_proto::protocol::{ByteBuf, JobState};

use super::{ActorEntry, ActorState, Effect, GroupOwner, HeadCore, WorkerEntry, WorkerRole};
use crate::members::{JobEntry, NodeEntry};

/// The layout of the records; a state directory written with a newer one is refused.
pub const STATE_VERSION: u32 = 1;

/// Ids are reserved this many at a time: a [`Marks`] record is written only when a counter
/// reaches its mark, and a recovered core counts on from the marks, so no id handed out before
/// a restart (a task worker still running on a node) is handed out again.
const ID_STRIDE: u64 = 4096;

/// One change to the durable state: an entry written, or removed (`None`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record(Change);

#[derive(Clone, Debug, Serialize, Deserialize)]
enum Change {
    Marks(Marks),
    Node(u64, Option<NodeEntry>),
    Worker(WorkerId, Option<WorkerEntry>),
    Actor(ActorId, Option<Box<ActorEntry>>),
    Group(GroupId, Option<GroupRecord>),
    Job(u64, Option<JobEntry>),
    /// A connected driver: the job binary it runs and its address.
    Driver(WorkerId, Option<DriverRecord>),
    Kv(String, Option<ByteBuf>),
}

/// Every counter's next value is below its mark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Marks {
    ids: u64,
    actors: u64,
    groups: u64,
    unnamed_groups: u64,
    allocations: u64,
    calls: u64,
}

impl Marks {
    /// Raises every mark its counter reached to that counter plus [`ID_STRIDE`]; whether any
    /// moved.
    fn cover(&mut self, counters: Marks) -> bool {
        let mut moved = false;
        for (mark, counter) in [
            (&mut self.ids, counters.ids),
            (&mut self.actors, counters.actors),
            (&mut self.groups, counters.groups),
            (&mut self.unnamed_groups, counters.unnamed_groups),
            (&mut self.allocations, counters.allocations),
            (&mut self.calls, counters.calls),
        ] {
            if counter >= *mark {
                *mark = counter + ID_STRIDE;
                moved = true;
            }
        }
        moved
    }
}

/// A placement group as persisted: its request, where it is placed (`None`: pending) and who
/// owns it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct GroupRecord {
    request: PlacementGroupRequest,
    table: Option<BundleTable>,
    owner: Option<GroupOwner>,
}

/// A connected driver as persisted.
type DriverRecord = (Option<String>, Option<rtrun_proto::protocol::Address>);

/// Everything a head persists, as a replay of its records leaves it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DurableState {
    marks: Marks,
    nodes: BTreeMap<u64, NodeEntry>,
    workers: BTreeMap<WorkerId, WorkerEntry>,
    actors: BTreeMap<ActorId, Box<ActorEntry>>,
    groups: BTreeMap<GroupId, GroupRecord>,
    jobs: BTreeMap<u64, JobEntry>,
    drivers: BTreeMap<WorkerId, DriverRecord>,
    kv: BTreeMap<String, ByteBuf>,
}

fn set<K: Ord, V>(map: &mut BTreeMap<K, V>, key: K, value: Option<V>) {
    match value {
        Some(value) => map.insert(key, value),
        None => map.remove(&key),
    };
}

impl DurableState {
    /// Applies one record.
    pub fn apply(&mut self, record: Record) {
        match record.0 {
            Change::Marks(marks) => self.marks = marks,
            Change::Node(id, entry) => set(&mut self.nodes, id, entry),
            Change::Worker(id, entry) => set(&mut self.workers, id, entry),
            Change::Actor(id, entry) => set(&mut self.actors, id, entry),
            Change::Group(id, entry) => set(&mut self.groups, id, entry),
            Change::Job(id, entry) => set(&mut self.jobs, id, entry),
            Change::Driver(id, entry) => set(&mut self.drivers, id, entry),
            Change::Kv(key, value) => set(&mut self.kv, key, value),
        }
    }

    /// The records that rebuild this state from nothing (a snapshot).
    pub fn records(&self) -> Vec<Record> {
        let mut changes = vec![Change::Marks(self.marks)];
        changes.extend(self.nodes.iter().map(|(k, v)| Change::Node(*k, Some(v.clone()))));
        changes.extend(self.workers.iter().map(|(k, v)| Change::Worker(*k, Some(v.clone()))));
        changes.extend(self.actors.iter().map(|(k, v)| Change::Actor(*k, Some(v.clone()))));
        changes.extend(self.groups.iter().map(|(k, v)| Change::Group(*k, Some(v.clone()))));
        changes.extend(self.jobs.iter().map(|(k, v)| Change::Job(*k, Some(v.clone()))));
        changes.extend(self.drivers.iter().map(|(k, v)| Change::Driver(*k, Some(v.clone()))));
        changes.extend(self.kv.iter().map(|(k, v)| Change::Kv(k.clone(), Some(v.clone()))));
        changes.into_iter().map(Record).collect()
    }

    /// What it holds, for the head's log line: `3 nodes, 12 actors, ...`.
    pub fn summary(&self) -> String {
        let live_nodes = self.nodes.values().filter(|n| n.dead.is_none()).count();
        let live_actors =
            self.actors.values().filter(|a| !matches!(a.state, ActorState::Dead { .. })).count();
        format!(
            "{live_nodes} nodes, {live_actors} live actors, {} placement groups, {} jobs, {} \
             drivers, {} keys",
            self.groups.len(),
            self.jobs.len(),
            self.drivers.len(),
            self.kv.len()
        )
    }
}

/// Which durable entries changed since the records were last taken (only while journaling).
#[derive(Default)]
pub(crate) struct Journal {
    on: bool,
    marks: Marks,
    nodes: BTreeSet<u64>,
    workers: BTreeSet<WorkerId>,
    actors: BTreeSet<ActorId>,
    groups: BTreeSet<GroupId>,
    jobs: BTreeSet<u64>,
    drivers: BTreeSet<WorkerId>,
    kv: BTreeSet<String>,
}

impl Journal {
    pub(crate) fn node(&mut self, id: u64) {
        if self.on {
            self.nodes.insert(id);
        }
    }

    pub(crate) fn worker(&mut self, id: WorkerId) {
        if self.on {
            self.workers.insert(id);
        }
    }

    pub(crate) fn actor(&mut self, id: ActorId) {
        if self.on {
            self.actors.insert(id);
        }
    }

    pub(crate) fn group(&mut self, id: GroupId) {
        if self.on {
            self.groups.insert(id);
        }
    }

    pub(crate) fn job(&mut self, id: u64) {
        if self.on {
            self.jobs.insert(id);
        }
    }

    pub(crate) fn driver(&mut self, id: WorkerId) {
        if self.on {
            self.drivers.insert(id);
        }
    }

    pub(crate) fn kv(&mut self, key: &str) {
        if self.on {
            self.kv.insert(key.to_owned());
        }
    }
}

/// Nodes and drivers a recovered head waits for, each with its deadline on the core's clock.
#[derive(Default)]
pub(crate) struct Awaiting {
    pub(crate) nodes: BTreeMap<u64, u64>,
    pub(crate) drivers: BTreeMap<WorkerId, u64>,
}

impl HeadCore {
    fn counters(&self) -> Marks {
        let (groups, allocations) = self.cluster.next_ids();
        Marks {
            ids: self.members.next,
            actors: self.next_actor,
            groups,
            unnamed_groups: self.unnamed_groups,
            allocations,
            calls: self.next_call,
        }
    }

    /// Starts journaling: from now on [`HeadCore::take_records`] returns what each event
    /// changed. Returns the whole durable state now (the first snapshot).
    pub fn journal_from_now(&mut self) -> DurableState {
        self.journal = Journal { on: true, ..Journal::default() };
        let counters = self.counters();
        self.journal.marks.cover(counters);
        self.durable_state()
    }

    /// The records of what changed since they were last taken, in the order to apply them
    /// (empty unless journaling). The shell appends them to its log before it carries out the
    /// effects of the events that made them.
    pub fn take_records(&mut self) -> Vec<Record> {
        if !self.journal.on {
            return Vec::new();
        }
        let mut records = Vec::new();
        let counters = self.counters();
        if self.journal.marks.cover(counters) {
            records.push(Record(Change::Marks(self.journal.marks)));
        }
        let head = self.members.head_node;
        for id in std::mem::take(&mut self.journal.nodes) {
            if id != head {
                records.push(Record(Change::Node(id, self.members.nodes.get(&id).cloned())));
            }
        }
        for id in std::mem::take(&mut self.journal.workers) {
            let entry = match self.workers.get(&id) {
                // Task workers are not durable: a recovered head does not know them, and a
                // node that reports one is told to kill it.
                Some(entry) if matches!(entry.role, WorkerRole::Tasks { .. }) => continue,
                entry => entry.cloned(),
            };
            records.push(Record(Change::Worker(id, entry)));
        }
        for id in std::mem::take(&mut self.journal.actors) {
            records.push(Record(Change::Actor(id, self.actors.get(&id).map(|a| durable_actor(a)))));
        }
        for id in std::mem::take(&mut self.journal.groups) {
            records.push(Record(Change::Group(id, self.group_record(id))));
        }
        for id in std::mem::take(&mut self.journal.jobs) {
            records.push(Record(Change::Job(id, self.members.jobs.get(&id).cloned())));
        }
        for id in std::mem::take(&mut self.journal.drivers) {
            records.push(Record(Change::Driver(id, self.driver_record(id))));
        }
        for key in std::mem::take(&mut self.journal.kv) {
            let value = self.kv.get(&key).cloned().map(ByteBuf::from);
            records.push(Record(Change::Kv(key, value)));
        }
        records
    }

    fn driver_record(&self, id: WorkerId) -> Option<DriverRecord> {
        let binary = self.members.drivers.get(&id)?.clone();
        Some((binary, self.members.driver_addresses.get(&id).cloned()))
    }

    fn group_record(&self, id: GroupId) -> Option<GroupRecord> {
        let (request, _) = self.cluster.group(id)?;
        Some(GroupRecord {
            request: request.clone(),
            table: self.cluster.bundle_table(id).cloned(),
            owner: self.group_owners.get(&id).copied(),
        })
    }

    /// The durable state as the core holds it now (what replaying every record gives).
    pub fn durable_state(&self) -> DurableState {
        let head = self.members.head_node;
        DurableState {
            marks: self.journal.marks,
            nodes: self
                .members
                .nodes
                .iter()
                .filter(|(id, _)| **id != head)
                .map(|(id, n)| (*id, n.clone()))
                .collect(),
            workers: self
                .workers
                .iter()
                .filter(|(_, w)| matches!(w.role, WorkerRole::Actor { .. }))
                .map(|(id, w)| (*id, w.clone()))
                .collect(),
            actors: self.actors.iter().map(|(id, a)| (*id, durable_actor(a))).collect(),
            groups: self
                .cluster
                .groups()
                .filter_map(|(id, _, _)| Some((id, self.group_record(id)?)))
                .collect(),
            jobs: self.members.jobs.iter().map(|(id, j)| (*id, j.clone())).collect(),
            drivers: self
                .members
                .drivers
                .keys()
                .filter_map(|id| Some((*id, self.driver_record(*id)?)))
                .collect(),
            kv: self.kv.iter().map(|(k, v)| (k.clone(), ByteBuf::from(v.clone()))).collect(),
        }
    }

    /// Rebuilds this fresh core (just made a cluster head, nothing joined) from `state`: nodes,
    /// placement groups and allocations where they were, actors in the states they were in,
    /// jobs, drivers and keys. Each remote node and driver has until `now_ms + window_ms` to
    /// reconnect; the head's own node restarted with this process, so its workers are gone
    /// (their actors restart or die), while the submitted jobs' drivers outlived it and are
    /// adopted ([`Effect::AdoptJob`]). Returns what to do about that.
    pub fn recover(
        &mut self,
        state: DurableState,
        now_ms: u64,
        window_ms: u64,
    ) -> Result<Vec<Effect>> {
        if !self.actors.is_empty() || self.members.nodes.len() > 1 || self.journal.on {
            return Err(Error::Invalid("only a fresh head recovers a durable state".into()));
        }
        let corrupt =
            |what: String| Error::Invalid(format!("the durable state is corrupt: {what}"));
        let head = self.members.head_node;
        self.clock_ms = self.clock_ms.max(now_ms);
        let deadline = self.clock_ms.saturating_add(window_ms);
        let marks = state.marks;
        self.members.next = self.members.next.max(marks.ids);
        self.next_actor = self.next_actor.max(marks.actors);
        self.unnamed_groups = self.unnamed_groups.max(marks.unnamed_groups);
        self.next_call = self.next_call.max(marks.calls);
        self.cluster.advance_ids(marks.groups, marks.allocations);
        for (id, node) in state.nodes {
            if id == head {
                continue;
            }
            if node.dead.is_none() {
                let resources = node.resources.clone();
                self.cluster.add_node(resources).map_err(|e| corrupt(format!("node {id}: {e}")))?;
                self.awaiting.nodes.insert(id, deadline);
            }
            self.members.restore_node(id, node);
        }
        for (id, group) in state.groups {
            let pending = group.table.is_none();
            self.cluster
                .restore_group(id, group.request, group.table)
                .map_err(|e| corrupt(e.to_string()))?;
            if pending {
                self.pending_groups.insert(id);
            }
            if let Some(owner) = group.owner {
                self.group_owners.insert(id, owner);
                self.owned_groups.entry(owner).or_default().insert(id);
            }
        }
        for (id, actor) in state.actors {
            if let Some(allocation) = &actor.allocation {
                self.cluster
                    .restore_allocation(allocation.clone())
                    .map_err(|e| corrupt(format!("actor {id}: {e}")))?;
                self.holders.insert(allocation.id, id);
            }
            let live = !matches!(actor.state, ActorState::Dead { .. });
            if let (true, Some(name)) = (live, &actor.spec.options.name) {
                let namespace =
                    actor.spec.options.namespace.clone().unwrap_or_else(|| "default".into());
                self.names.insert((namespace, name.clone()), id);
            }
            if let Some(owner) = actor.lineage.owner {
                self.children.entry(owner).or_default().push(id);
            }
            if matches!(actor.state, ActorState::Pending) {
                self.pending_actors.push_back(id);
            }
            self.actors.insert(id, actor);
        }
        for (id, worker) in state.workers {
            self.workers_on.entry(worker.node).or_default().insert(id);
            self.workers.insert(id, worker);
        }
        self.kv = state.kv.into_iter().map(|(k, v)| (k, v.into_vec())).collect();
        for (id, (binary, address)) in state.drivers {
            self.members.drivers.insert(id, binary);
            if let Some(address) = address {
                self.members.driver_addresses.insert(id, address);
            }
            self.awaiting.drivers.insert(id, deadline);
        }
        self.members.jobs = state.jobs;
        let mut effects = Vec::new();
        // The head's own node restarted with this process: what ran on it ended with the old
        // one (its workers and the drivers of submitted jobs are its children).
        let reason = "the head restarted (the processes of its own node end with it)";
        let lost: Vec<WorkerId> =
            self.workers_on.get(&head).into_iter().flatten().copied().collect();
        for worker in lost {
            self.worker_exited(worker, reason.to_owned(), &mut effects);
        }
        // A running job's driver outlived the old head (a head with a state directory starts
        // them so): it is taken up. One the old head had not started yet never will be.
        let running: Vec<u64> = self
            .members
            .jobs
            .iter()
            .filter(|(_, j)| j.state == JobState::Running)
            .map(|(id, _)| *id)
            .collect();
        for job in running {
            let Some(entry) = self.members.jobs.get_mut(&job) else { continue };
            if let Some(pid) = entry.pid {
                let (worker, log) = (entry.worker, entry.log.clone());
                effects.push(Effect::AdoptJob { job, worker, pid, log });
                continue;
            }
            entry.state = JobState::Failed {
                reason: "its driver had not started when the head restarted".into(),
            };
            self.journal.job(job);
            if let Some(driver) = entry.driver {
                self.awaiting.drivers.remove(&driver);
                self.driver_gone(driver, &mut effects);
            }
        }
        self.reschedule(&mut effects);
        tracing::info!(
            nodes = self.awaiting.nodes.len(),
            drivers = self.awaiting.drivers.len(),
            "recovered the durable state; waiting for nodes and drivers to reconnect"
        );
        Ok(effects)
    }

    /// Node `id` named `name` reconnected to a recovered head (or after its connection was
    /// lost), reporting the workers it runs (with their pids, once started). Known workers it
    /// no longer runs have exited; workers the head does not know (task workers, whose tasks
    /// were lost) are killed. Refused, naming why, when the head declared the node dead or
    /// never knew it: the node must stop its workers and join anew.
    pub fn rejoin_node(
        &mut self,
        id: u64,
        name: &str,
        workers: &[(WorkerId, Option<u32>)],
        effects: &mut Vec<Effect>,
    ) -> Result<()> {
        let stale = |why: String| {
            Error::Invalid(format!(
                "node {} ({name}) cannot rejoin: {why}; stop its workers and join as a new node",
                NodeId(id)
            ))
        };
        let entry = self
            .members
            .nodes
            .get(&id)
            .filter(|_| id != self.members.head_node)
            .ok_or_else(|| stale("this head does not know it".into()))?;
        if let Some(reason) = &entry.dead {
            return Err(stale(format!(
                "it was declared dead ({reason}) and its actors were restarted elsewhere"
            )));
        }
        if entry.name != name {
            return Err(stale(format!("that id belongs to node `{}`", entry.name)));
        }
        self.awaiting.nodes.remove(&id);
        let known: BTreeSet<WorkerId> =
            self.workers_on.get(&id).into_iter().flatten().copied().collect();
        let reported: BTreeMap<WorkerId, Option<u32>> = workers.iter().copied().collect();
        for worker in known.difference(&reported.keys().copied().collect()) {
            self.worker_exited(*worker, "it was gone when its node rejoined".into(), effects);
        }
        for (worker, pid) in &reported {
            match self.workers.get_mut(worker) {
                None => {
                    if let Some(pid) = pid {
                        effects.push(Effect::Kill { node: id, pid: *pid });
                    }
                }
                Some(entry) => {
                    if entry.pid.is_none()
                        && let Some(pid) = pid
                    {
                        entry.pid = Some(*pid);
                        self.journal.worker(*worker);
                        if entry.kill_requested {
                            effects.push(Effect::Kill { node: id, pid: *pid });
                        }
                    }
                }
            }
        }
        tracing::info!(node = %NodeId(id), %name, "node rejoined");
        self.reschedule(effects);
        Ok(())
    }

    /// Driver `driver` reconnected to a recovered head: its actors and groups live on. Refused
    /// when the head counted it gone (its actors and groups ended).
    pub fn rejoin_driver(&mut self, driver: WorkerId) -> Result<()> {
        if !self.members.drivers.contains_key(&driver) {
            return Err(Error::Invalid(format!(
                "driver {driver} cannot rejoin: the head counted it gone and ended its actors \
                 and placement groups"
            )));
        }
        self.awaiting.drivers.remove(&driver);
        Ok(())
    }

    /// The addresses of what a recovered head waits for — the nodes' daemons, their
    /// registered workers and the drivers — to tell them it restarted (so they reconnect at once, rather than
    /// when their dead connections to the old head time out).
    pub fn reconnect_targets(&self) -> Vec<rtrun_proto::protocol::Address> {
        let mut targets = Vec::new();
        for node in self.awaiting.nodes.keys() {
            if let Some(entry) = self.members.nodes.get(node) {
                targets.push(entry.address.clone());
            }
            for worker in self.workers_on.get(node).into_iter().flatten() {
                if let Some(address) = self.workers.get(worker).and_then(|w| w.address.clone()) {
                    targets.push(address);
                }
            }
        }
        for driver in self.awaiting.drivers.keys() {
            if let Some(address) = self.members.driver_addresses.get(driver) {
                targets.push(address.clone());
            }
        }
        targets
    }

    /// Whether a recovered head still waits for nodes or drivers to reconnect.
    pub fn awaiting_reconnects(&self) -> bool {
        !self.awaiting.nodes.is_empty() || !self.awaiting.drivers.is_empty()
    }

    /// Declares the nodes and drivers that did not reconnect by their deadline dead or gone.
    pub(crate) fn expire_awaiting(&mut self, effects: &mut Vec<Effect>) {
        let now = self.clock_ms;
        let nodes: Vec<u64> =
            self.awaiting.nodes.iter().filter(|(_, d)| **d <= now).map(|(n, _)| *n).collect();
        for node in nodes {
            self.awaiting.nodes.remove(&node);
            let Some(name) = self.members.nodes.get(&node).map(|n| n.name.clone()) else {
                continue;
            };
            self.node_dead(&name, "it did not reconnect after the head restarted", effects);
        }
        let drivers: Vec<WorkerId> =
            self.awaiting.drivers.iter().filter(|(_, d)| **d <= now).map(|(w, _)| *w).collect();
        for driver in drivers {
            self.awaiting.drivers.remove(&driver);
            tracing::warn!(%driver, "driver did not reconnect after the head restarted");
            self.driver_gone(driver, effects);
        }
    }
}

/// An actor's entry as persisted (without who waits for it).
fn durable_actor(actor: &ActorEntry) -> Box<ActorEntry> {
    Box::new(ActorEntry { waiters: Vec::new(), ..actor.clone() })
}
