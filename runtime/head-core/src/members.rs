//! Cluster membership as the control plane keeps it: nodes (the head's own and those that
//! joined), drivers and their job binaries, submitted jobs' records, and what happens when a
//! node dies or a driver leaves. An embedded session has only its own node and none of the
//! rest.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

use rtrun_placement::NodeResources;

use super::{ActorState, Effect, GroupOwner, HeadCore};
use rtrun_proto::error::{Error, Result};
use rtrun_proto::ids::{NodeId, WorkerId};
use rtrun_proto::protocol::{Address, JobInfo, JobState, NodeInfo, WorkerExit};

/// A node as the head knows it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct NodeEntry {
    /// The name its certificate carries (unique among live nodes).
    pub(crate) name: String,
    /// Its daemon's address (the head's own address for the head node).
    pub(crate) address: Address,
    /// Its id in the placement state.
    placement: rtrun_placement::NodeId,
    /// Resources it registered with.
    pub(crate) resources: NodeResources,
    /// `None` while alive; why it died otherwise.
    pub(crate) dead: Option<String>,
}

/// A submitted job: a driver process the head runs on its own node.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct JobEntry {
    pub(crate) worker: WorkerId,
    pub(crate) binary: String,
    pub(crate) args: Vec<String>,
    pub(crate) log: PathBuf,
    pub(crate) state: JobState,
    pub(crate) submission_id: String,
    /// The environment given at submission, which every worker of the job gets too.
    pub(crate) env: Vec<(String, String)>,
    /// The driver's process, once started.
    pub(crate) pid: Option<u32>,
    /// The driver's id once it has joined (its workers' lineage names it).
    pub(crate) driver: Option<WorkerId>,
    /// `rtrun job stop` asked for it.
    pub(crate) stop_requested: bool,
    /// The digest of its working-directory package, unpacked into its own directory.
    pub(crate) package: Option<String>,
}

impl JobEntry {
    /// What `rtrun job` shows of job `id`.
    pub(crate) fn info(&self, id: u64) -> JobInfo {
        JobInfo {
            job: id,
            binary: self.binary.clone(),
            args: self.args.clone(),
            state: self.state.clone(),
            log: self.log.display().to_string(),
            submission_id: self.submission_id.clone(),
        }
    }
}

/// Nodes, drivers and jobs.
pub(crate) struct Members {
    /// The head's own node.
    pub(crate) head_node: u64,
    /// The control plane's address as workers reach it (cluster only).
    pub(crate) head_address: Option<Address>,
    /// Where submitted jobs' logs go (cluster only).
    pub(crate) job_log_dir: Option<PathBuf>,
    /// Ids of workers, drivers and nodes come from one counter, so none collide.
    pub(crate) next: u64,
    pub(crate) nodes: BTreeMap<u64, NodeEntry>,
    by_placement: HashMap<rtrun_placement::NodeId, u64>,
    /// Live nodes by name (a dead node's name is free for a node that rejoins).
    live_by_name: HashMap<String, u64>,
    /// Connected drivers and the job binary each runs.
    pub(crate) drivers: HashMap<WorkerId, Option<String>>,
    /// Drivers' addresses (a restarted head tells them it is back).
    pub(crate) driver_addresses: HashMap<WorkerId, Address>,
    pub(crate) jobs: BTreeMap<u64, JobEntry>,
}

impl Members {
    pub(super) fn new(head_node: u64) -> Members {
        Members {
            head_node,
            head_address: None,
            job_log_dir: None,
            next: head_node.max(1) + 1,
            nodes: BTreeMap::new(),
            by_placement: HashMap::new(),
            live_by_name: HashMap::new(),
            drivers: HashMap::new(),
            driver_addresses: HashMap::new(),
            jobs: BTreeMap::new(),
        }
    }

    /// A fresh id for a worker, driver, job or node.
    pub(crate) fn next_id(&mut self) -> u64 {
        let id = self.next;
        self.next += 1;
        id
    }

    /// Records node `id` as restored from the durable state, a live one indexed by name and
    /// placement id.
    pub(crate) fn restore_node(&mut self, id: u64, node: NodeEntry) {
        if node.dead.is_none() {
            self.by_placement.insert(node.placement.clone(), id);
            self.live_by_name.insert(node.name.clone(), id);
        }
        self.nodes.insert(id, node);
    }

    /// The node id of a placement node.
    pub(super) fn node_of(&self, placement: &rtrun_placement::NodeId) -> u64 {
        self.by_placement.get(placement).copied().unwrap_or(self.head_node)
    }

    /// The live nodes other than the head's own.
    pub(crate) fn live_remote_nodes(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .filter(|(id, n)| **id != self.head_node && n.dead.is_none())
            .map(|(id, _)| *id)
            .collect()
    }

    pub(super) fn info(&self) -> Vec<NodeInfo> {
        self.nodes
            .iter()
            .map(|(id, node)| NodeInfo {
                node: NodeId(*id),
                name: node.name.clone(),
                address: node.address.clone(),
                alive: node.dead.is_none(),
                death_reason: node.dead.clone(),
                total: floats(node.resources.total()),
                available: BTreeMap::new(),
            })
            .collect()
    }

    /// Every job, by number.
    pub(super) fn job_infos(&self) -> Vec<JobInfo> {
        self.jobs.iter().map(|(id, entry)| entry.info(*id)).collect()
    }

    /// Forgets ended job `job`; returns its last state and its log to remove. A running job is
    /// refused (its driver would run on unlisted).
    pub(super) fn delete_job(&mut self, job: u64) -> Result<(JobInfo, PathBuf)> {
        let entry =
            self.jobs.get(&job).ok_or(Error::NotFound(rtrun_proto::error::Missing::Job(job)))?;
        if entry.state == JobState::Running {
            return Err(Error::Invalid(format!(
                "job {job} ({}) is running; stop it first (`rtrun job stop {job}`)",
                entry.submission_id
            )));
        }
        let info = entry.info(job);
        let log = entry.log.clone();
        self.jobs.remove(&job);
        Ok((info, log))
    }

    /// Records a job driver's process id; `None` when `worker` is not a job, else whether to
    /// kill it at once (the job was stopped before it started).
    pub(super) fn job_spawned(&mut self, worker: WorkerId, pid: u32) -> Option<bool> {
        let entry = self.jobs.values_mut().find(|j| j.worker == worker)?;
        entry.pid = Some(pid);
        Some(entry.stop_requested)
    }

    /// Records a job driver's exit; `None` when `worker` is not a job, else the driver it had
    /// joined as (which is gone now) and the job's files to remove.
    pub(super) fn job_exited(
        &mut self,
        worker: WorkerId,
        status: &WorkerExit,
    ) -> Option<(Option<WorkerId>, Effect)> {
        let (&job, entry) = self.jobs.iter_mut().find(|(_, j)| j.worker == worker)?;
        entry.state = match status {
            _ if entry.stop_requested => JobState::Stopped,
            WorkerExit::Code(code) => JobState::Exited { code: *code },
            other => JobState::Failed { reason: other.to_string() },
        };
        let (driver, package) = (entry.driver, entry.package.clone());
        // A package another running job was made from stays for it.
        let package = package.filter(|digest| {
            !self.jobs.values().any(|j| {
                j.state == JobState::Running && j.package.as_deref() == Some(digest.as_str())
            })
        });
        Some((driver, Effect::RemoveJobFiles { job, package }))
    }
}

pub(crate) fn floats(set: &rtrun_placement::ResourceSet) -> BTreeMap<String, f64> {
    set.iter().map(|(k, q)| (k.to_owned(), q.as_f64())).collect()
}

impl HeadCore {
    /// Makes this control plane a cluster head reachable at `address` whose own node is named
    /// `node_name` and whose jobs log into `job_log_dir` (called once, before anything joins).
    pub fn enable_cluster(&mut self, address: Address, node_name: String, job_log_dir: PathBuf) {
        self.members.head_address = Some(address.clone());
        self.members.job_log_dir = Some(job_log_dir);
        let node = self.config.node.clone();
        let head_node = self.members.head_node;
        self.members.by_placement.insert(node.id().clone(), head_node);
        self.members.live_by_name.insert(node_name.clone(), head_node);
        self.members.nodes.insert(
            head_node,
            NodeEntry {
                name: node_name,
                address,
                placement: node.id().clone(),
                resources: node,
                dead: None,
            },
        );
    }

    /// The live nodes other than the head's own.
    pub fn live_remote_nodes(&self) -> Vec<u64> {
        self.members.live_remote_nodes()
    }

    /// The daemon address of live node `node`; an error naming why it died, or that it is
    /// unknown.
    pub fn live_node_address(&self, node: u64) -> Result<Address> {
        let entry = self
            .members
            .nodes
            .get(&node)
            .ok_or(Error::NotFound(rtrun_proto::error::Missing::Node(NodeId(node))))?;
        match &entry.dead {
            Some(reason) => Err(Error::Transport(reason.clone())),
            None => Ok(entry.address.clone()),
        }
    }

    /// The head's address for a joining process; an error when this is not a cluster head.
    pub fn head_address(&self) -> Result<Address> {
        self.members
            .head_address
            .clone()
            .ok_or_else(|| Error::Invalid("this control plane does not accept nodes".into()))
    }

    /// Adds a node named `name` holding `resources` whose daemon listens at `endpoint`: its id
    /// and its daemon's worker id. Whatever waited for resources may fit now.
    pub fn join_node(
        &mut self,
        name: String,
        resources: &NodeResources,
        endpoint: std::net::SocketAddr,
        effects: &mut Vec<Effect>,
    ) -> Result<(u64, WorkerId)> {
        self.head_address()?;
        if let Some(other) = self.members.live_by_name.get(&name) {
            return Err(Error::Invalid(format!(
                "a live node named `{name}` is already in the cluster ({})",
                NodeId(*other)
            )));
        }
        let id = self.members.next_id();
        let placement = rtrun_placement::NodeId::new(NodeId(id).to_string());
        let resources = NodeResources::new(
            placement.clone(),
            resources.total().clone(),
            resources.gpus().slots().iter().map(|s| s.gpu.clone()).collect(),
        )
        .map_err(|e| Error::Invalid(format!("node `{name}` resources: {e}")))?;
        self.cluster
            .add_node(resources.clone())
            .map_err(|e| Error::Invalid(format!("node `{name}`: {e}")))?;
        let worker = WorkerId(self.members.next_id());
        let address = rtrun_proto::address::Route::quic(
            endpoint,
            id,
            &rtrun_proto::address::socket_name(&self.session, worker),
        );
        self.members.by_placement.insert(placement.clone(), id);
        self.members.live_by_name.insert(name.clone(), id);
        self.journal.node(id);
        self.members
            .nodes
            .insert(id, NodeEntry { name, address, placement, resources, dead: None });
        tracing::info!(node = %NodeId(id), "node joined");
        self.reschedule(effects);
        Ok((id, worker))
    }

    /// Registers a driver running `binary` (the driver of submitted job `job` if given) whose
    /// endpoint is `endpoint`, if it has one.
    pub fn join_driver(
        &mut self,
        binary: Option<String>,
        job: Option<u64>,
        endpoint: Option<std::net::SocketAddr>,
    ) -> Result<WorkerId> {
        self.head_address()?;
        let worker = WorkerId(self.members.next_id());
        self.members.drivers.insert(worker, binary);
        if let Some(endpoint) = endpoint {
            let name = rtrun_proto::address::socket_name(&self.session, worker);
            let address = rtrun_proto::address::Route::quic(endpoint, worker.0, &name);
            self.members.driver_addresses.insert(worker, address);
        }
        self.journal.driver(worker);
        if let Some(job) = job
            && let Some(entry) = self.members.jobs.get_mut(&job)
            && entry.driver.is_none()
        {
            entry.driver = Some(worker);
            self.journal.job(job);
        }
        Ok(worker)
    }

    /// A driver disconnected: its actors (but detached ones), queued tasks and placement groups
    /// go with it (as in Ray, where a job's non-detached actors and placement groups die with
    /// its driver).
    pub(super) fn driver_gone(&mut self, driver: WorkerId, effects: &mut Vec<Effect>) {
        if self.members.drivers.remove(&driver).is_none() {
            return;
        }
        self.journal.driver(driver);
        self.awaiting.drivers.remove(&driver);
        self.members.driver_addresses.remove(&driver);
        let actors: Vec<_> = self
            .actors
            .iter()
            .filter(|(_, a)| {
                a.lineage.driver == Some(driver)
                    && !a.lineage.detached
                    && !matches!(a.state, ActorState::Dead { .. })
            })
            .map(|(id, _)| *id)
            .collect();
        for actor in actors {
            let _ = self.kill_actor(actor, true, effects);
        }
        self.end_tasks_of(driver, effects);
        self.remove_groups_of(GroupOwner::Driver(driver), effects);
    }

    /// The node named `name` stopped answering: it is removed (see [`HeadCore::node_died`])
    /// and told to stop, in case it is only paused or cut off and would live on as a zombie.
    pub(super) fn node_dead(&mut self, name: &str, reason: &str, effects: &mut Vec<Effect>) {
        let Some(id) = self.members.live_by_name.get(name).copied() else {
            return;
        };
        if id == self.members.head_node {
            return;
        }
        let reason = format!("node {} ({name}) died: {reason}", NodeId(id));
        self.node_died(id, reason.clone(), effects);
        if let Some(node) = self.members.nodes.get(&id) {
            effects.push(Effect::StopNode { address: node.address.clone(), reason });
        }
    }

    /// Removes a dead node: its workers are gone (actors restart elsewhere or die), its
    /// placement groups are placed anew, its objects are lost.
    fn node_died(&mut self, id: u64, reason: String, effects: &mut Vec<Effect>) {
        tracing::warn!("{reason}");
        let Some(entry) = self.members.nodes.get_mut(&id) else { return };
        self.journal.node(id);
        self.awaiting.nodes.remove(&id);
        entry.dead = Some(reason.clone());
        if self.members.live_by_name.get(&entry.name) == Some(&id) {
            self.members.live_by_name.remove(&entry.name);
        }
        let placement = entry.placement.clone();
        let lost = match self.cluster.remove_node(&placement) {
            Ok(lost) => lost,
            Err(e) => {
                tracing::warn!("removing {placement} from placement: {e}");
                return;
            }
        };
        let lost_ids: HashSet<_> = lost.lost_allocations.iter().map(|a| a.id).collect();
        // Actors whose allocation went with the node start anew (elsewhere) when restarts remain.
        let mut lost_holders = Vec::new();
        for allocation in &lost_ids {
            if let Some(actor) = self.holders.remove(allocation) {
                self.journal.actor(actor);
                if let Some(entry) = self.actors.get_mut(&actor) {
                    entry.allocation = None;
                }
                lost_holders.push(actor);
            }
        }
        for group in &lost.requeued_groups {
            self.journal.group(*group);
            self.pending_groups.insert(*group);
        }
        let workers: Vec<WorkerId> =
            self.workers_on.get(&id).into_iter().flatten().copied().collect();
        for worker in workers {
            self.worker_exited(worker, reason.clone(), effects);
        }
        // Running tasks whose allocation was in a requeued group on another node lose it too.
        self.fail_running_tasks(|allocation| lost_ids.contains(&allocation), &reason, effects);
        // Actors still alive elsewhere whose allocation was in a requeued group are stopped and
        // restart with the group.
        lost_holders.sort_unstable();
        let displaced: Vec<(u64, u32)> = lost_holders
            .iter()
            .filter_map(|actor| self.actors.get(actor))
            .filter(|a| a.allocation.is_none())
            .filter_map(|a| match a.state {
                ActorState::Alive { worker, .. } | ActorState::Starting { worker } => {
                    self.workers.get(&worker).and_then(|w| w.pid.map(|pid| (w.node, pid)))
                }
                _ => None,
            })
            .collect();
        for (node, pid) in displaced {
            effects.push(Effect::Kill { node, pid });
        }
        self.reschedule(effects);
    }
}
