//! Cluster membership as the control plane keeps it: nodes (the head's own and those that
//! joined), drivers and their job binaries, submitted jobs, and what happens when a node dies.
//! An embedded session has only its own node and none of the rest.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rtrun_placement::NodeResources;

use crate::cluster::binaries::BinaryCache;
use crate::error::{Error, Result};
use crate::ids::{NodeId, WorkerId};
use crate::protocol::{Address, JobInfo, JobState, NodeInfo, Request, Response, WorkerExit};

use super::spawn::SpawnRequest;
use super::{ActorState, Effect, GroupOwner, Head, HeadState, WorkerRole};

/// A node as the head knows it.
pub(super) struct NodeEntry {
    /// The name its certificate carries (unique among live nodes).
    pub(super) name: String,
    /// Its daemon's address (the head's own address for the head node).
    pub(super) address: Address,
    /// Its id in the placement state.
    pub(super) placement: rtrun_placement::NodeId,
    /// Resources it registered with.
    pub(super) resources: NodeResources,
    /// `None` while alive; why it died otherwise.
    pub(super) dead: Option<String>,
}

/// A submitted job: a driver process the head runs on its own node.
pub(super) struct JobEntry {
    pub(super) worker: WorkerId,
    pub(super) binary: String,
    pub(super) args: Vec<String>,
    pub(super) log: PathBuf,
    pub(super) state: JobState,
    pub(super) submission_id: String,
    /// The environment given at submission, which every worker of the job gets too.
    pub(super) env: Vec<(String, String)>,
    /// The driver's process, once started.
    pub(super) pid: Option<u32>,
    /// The driver's id once it has joined (its workers' lineage names it).
    pub(super) driver: Option<WorkerId>,
    /// `rtrun job stop` asked for it.
    pub(super) stop_requested: bool,
}

/// What a cluster head needs besides the embedded control plane.
pub(crate) struct ClusterHead {
    /// The head process's own address (every worker's control-plane address).
    pub(crate) address: Address,
    /// Where job binaries live, by digest.
    pub(crate) binaries: Arc<BinaryCache>,
    /// Where job and worker logs of the head node go.
    pub(crate) log_dir: PathBuf,
    /// Where submitted jobs' working directories are unpacked, one per job.
    pub(crate) jobs_dir: PathBuf,
}

/// Nodes, drivers and jobs.
pub(super) struct Members {
    /// The head's own node.
    pub(super) head_node: u64,
    /// The control plane's address as workers reach it (cluster only).
    pub(super) head_address: Option<Address>,
    pub(super) cluster: Option<Arc<ClusterHead>>,
    /// Ids of workers, drivers and nodes come from one counter, so none collide.
    next: u64,
    pub(super) nodes: BTreeMap<u64, NodeEntry>,
    by_placement: HashMap<rtrun_placement::NodeId, u64>,
    /// Connected drivers and the job binary each runs.
    pub(super) drivers: HashMap<WorkerId, Option<String>>,
    pub(super) jobs: BTreeMap<u64, JobEntry>,
}

impl Members {
    pub(super) fn new(head_node: u64) -> Members {
        Members {
            head_node,
            head_address: None,
            cluster: None,
            next: head_node.max(1) + 1,
            nodes: BTreeMap::new(),
            by_placement: HashMap::new(),
            drivers: HashMap::new(),
            jobs: BTreeMap::new(),
        }
    }

    /// Records the head's own node (called once at start).
    pub(super) fn add_head_node(&mut self, name: String, address: Address, node: &NodeResources) {
        self.by_placement.insert(node.id().clone(), self.head_node);
        self.nodes.insert(
            self.head_node,
            NodeEntry {
                name,
                address,
                placement: node.id().clone(),
                resources: node.clone(),
                dead: None,
            },
        );
    }

    /// A fresh id for a worker, driver or node.
    pub(super) fn next_id(&mut self) -> u64 {
        let id = self.next;
        self.next += 1;
        id
    }

    /// The node id of a placement node.
    pub(super) fn node_of(&self, placement: &rtrun_placement::NodeId) -> u64 {
        self.by_placement.get(placement).copied().unwrap_or(self.head_node)
    }

    /// What to spawn for `worker` on `node`: on the head's own node in a cluster, the job's
    /// binary from the head's cache, a log file and the cluster environment; elsewhere the node
    /// daemon resolves the binary from `job`.
    pub(super) fn spawn_request(
        &self,
        node: u64,
        worker: WorkerId,
        env: Vec<(String, String)>,
        job: Option<&str>,
    ) -> SpawnRequest {
        let local = node == self.head_node;
        let cluster = self.cluster.as_ref();
        let binary = match (local, cluster, job) {
            (true, Some(cluster), Some(digest)) => Some(cluster.binaries.path(digest)),
            _ => None,
        };
        let log = match (local, cluster) {
            (true, Some(cluster)) => Some(cluster.log_dir.join(format!("worker-{}.log", worker.0))),
            _ => None,
        };
        let mut env = env;
        if local && let Some(cluster) = cluster {
            env.extend(crate::cluster::node_env(self.head_node, &cluster.address));
        }
        SpawnRequest {
            worker,
            env,
            binary,
            log,
            job: job.map(str::to_owned),
            args: Vec::new(),
            cwd: None,
        }
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
}

pub(super) fn floats(set: &rtrun_placement::ResourceSet) -> BTreeMap<String, f64> {
    set.iter().map(|(k, q)| (k.to_owned(), q.as_f64())).collect()
}

/// How a process asks to join (the net-level registration, see `crate::cluster`).
pub(crate) enum JoinAs {
    /// A node daemon with its resources, reachable at `endpoint`.
    Node { name: String, resources: NodeResources, endpoint: std::net::SocketAddr },
    /// A driver running `binary` (its digest; `None` for command-line clients), the driver of
    /// submitted job `job` if that is set.
    Driver { binary: Option<String>, job: Option<u64> },
}

/// What a joining process learns.
pub(crate) struct Joined {
    pub(crate) session: String,
    pub(crate) worker: WorkerId,
    pub(crate) node: u64,
    pub(crate) head: Address,
}

impl Head {
    /// Makes this control plane a cluster head (called once, before anything joins).
    pub(crate) fn enable_cluster(&self, cluster: Arc<ClusterHead>, node_name: String) {
        let mut state = self.state.lock();
        state.members.head_address = Some(cluster.address.clone());
        let node = state.config.node.clone();
        state.members.add_head_node(node_name, cluster.address.clone(), &node);
        state.members.cluster = Some(cluster);
    }

    /// Registers a node, driver or client.
    pub(crate) fn join(&self, session: &str, as_: JoinAs) -> Result<Joined> {
        let mut effects = Vec::new();
        let joined = {
            let mut state = self.state.lock();
            let head =
                state.members.head_address.clone().ok_or_else(|| {
                    Error::Invalid("this control plane does not accept nodes".into())
                })?;
            let id = state.members.next_id();
            match as_ {
                JoinAs::Node { name, resources, endpoint } => {
                    if let Some((other, _)) =
                        state.members.nodes.iter().find(|(_, n)| n.name == name && n.dead.is_none())
                    {
                        return Err(Error::Invalid(format!(
                            "a live node named `{name}` is already in the cluster ({})",
                            NodeId(*other)
                        )));
                    }
                    let placement = rtrun_placement::NodeId::new(NodeId(id).to_string());
                    let resources = NodeResources::new(
                        placement.clone(),
                        resources.total().clone(),
                        resources.gpus().slots().iter().map(|s| s.gpu.clone()).collect(),
                    )
                    .map_err(|e| Error::Invalid(format!("node `{name}` resources: {e}")))?;
                    state
                        .cluster
                        .add_node(resources.clone())
                        .map_err(|e| Error::Invalid(format!("node `{name}`: {e}")))?;
                    let worker = WorkerId(state.members.next_id());
                    let address = crate::transport::Route::quic(
                        endpoint,
                        id,
                        &crate::runtime::socket_name(session, worker),
                    );
                    state.members.by_placement.insert(placement.clone(), id);
                    state
                        .members
                        .nodes
                        .insert(id, NodeEntry { name, address, placement, resources, dead: None });
                    tracing::info!(node = %NodeId(id), "node joined");
                    // Whatever waited for resources may fit now.
                    state.reschedule(self, &mut effects);
                    Joined { session: session.to_owned(), worker, node: id, head }
                }
                JoinAs::Driver { binary, job } => {
                    let worker = WorkerId(id);
                    state.members.drivers.insert(worker, binary);
                    if let Some(entry) = job.and_then(|job| state.members.jobs.get_mut(&job))
                        && entry.driver.is_none()
                    {
                        entry.driver = Some(worker);
                    }
                    Joined { session: session.to_owned(), worker, node: id, head }
                }
            }
        };
        self.apply(effects);
        Ok(joined)
    }

    /// A node stopped sending heartbeats (or its daemon went away): everything on it is lost.
    pub(crate) fn on_node_dead(&self, name: &str, reason: &str) {
        let mut effects = Vec::new();
        let (address, reason) = {
            let mut state = self.state.lock();
            let Some(id) = state
                .members
                .nodes
                .iter()
                .find(|(_, n)| n.name == name && n.dead.is_none())
                .map(|(id, _)| *id)
            else {
                return;
            };
            if id == state.members.head_node {
                return;
            }
            let reason = format!("node {} ({name}) died: {reason}", NodeId(id));
            state.node_died(self, id, reason.clone(), &mut effects);
            let address = state.members.nodes.get(&id).map(|n| n.address.clone());
            (address, reason)
        };
        self.apply(effects);
        // A node that is only paused or cut off would otherwise live on as a zombie: tell it,
        // so that it stops its workers and exits when (if) it hears this. On a thread: this
        // runs on the heartbeat monitor's task, and a connection may have to be opened.
        if let (Some(address), Some(runtime)) = (address, self.runtime()) {
            std::thread::spawn(move || {
                match runtime.endpoint().and_then(|e| e.connect(&address)) {
                    Ok(conn) => runtime.request_on(
                        &conn,
                        Request::StopNode { declared_dead: Some(reason) },
                        Box::new(|_| {}),
                    ),
                    Err(e) => tracing::debug!("cannot tell the dead node at {address}: {e}"),
                }
            });
        }
    }

    /// A driver disconnected: its actors (but detached ones), queued tasks and placement groups
    /// go with it (as in Ray, where a job's non-detached actors and placement groups die with
    /// its driver).
    pub(crate) fn on_driver_gone(&self, driver: WorkerId) {
        let mut effects = Vec::new();
        {
            let mut state = self.state.lock();
            if state.members.drivers.remove(&driver).is_none() {
                return;
            }
            let actors: Vec<_> = state
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
                let _ = state.kill_actor(actor, true, &mut effects);
            }
            state.remove_groups_of(self, GroupOwner::Driver(driver), &mut effects);
        }
        self.apply(effects);
    }

    pub(super) fn spawn_remote(&self, node: u64, request: SpawnRequest) {
        let worker = request.worker;
        let sent = self.node_request(
            node,
            Request::SpawnWorker { worker, env: request.env, job: request.job },
            Some(Box::new(move |head: &Head, response: Response| {
                if let Response::Error(e) = response {
                    let why = WorkerExit::Lost(format!("its node could not start it: {e}"));
                    head.on_worker_exit(worker, why);
                }
            })),
        );
        if let Err(e) = sent {
            self.on_worker_exit(worker, WorkerExit::Lost(format!("its node is unreachable: {e}")));
        }
    }

    pub(super) fn send_to_node(&self, node: u64, request: Request) {
        if node == self.local_node {
            // Requests the head addresses to its own node are handled here.
            if let Request::WorkerExited { worker, status } = request {
                self.on_worker_exit(worker, status);
            }
            return;
        }
        if let Err(e) = self.node_request(node, request, None) {
            tracing::debug!(node = %NodeId(node), "request to a node failed: {e}");
        }
    }

    /// Sends a request to a node's daemon.
    #[allow(clippy::type_complexity)]
    fn node_request(
        &self,
        node: u64,
        request: Request,
        on_answer: Option<Box<dyn FnOnce(&Head, Response) + Send>>,
    ) -> Result<()> {
        let runtime = self.runtime().ok_or(Error::NotInitialised)?;
        let address = {
            let state = self.state.lock();
            let entry = state
                .members
                .nodes
                .get(&node)
                .ok_or_else(|| Error::Invalid(format!("no node {}", NodeId(node))))?;
            if let Some(reason) = &entry.dead {
                return Err(Error::Transport(reason.clone()));
            }
            entry.address.clone()
        };
        let conn = runtime.endpoint()?.connect(&address)?;
        let head = self.weak.clone();
        runtime.request_on(
            &conn,
            request,
            Box::new(move |response| {
                if let (Some(on_answer), Some(head)) = (on_answer, head.upgrade()) {
                    on_answer(&head, response);
                }
            }),
        );
        Ok(())
    }

    /// The live nodes other than the head's own.
    fn live_remote_nodes(&self) -> Vec<u64> {
        let state = self.state.lock();
        state
            .members
            .nodes
            .iter()
            .filter(|(id, n)| **id != self.local_node && n.dead.is_none())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Every node's daemon releases the store references of an exited process.
    pub(super) fn broadcast_exit(&self, worker: WorkerId) {
        let nodes = self.live_remote_nodes();
        for node in nodes {
            self.send_to_node(node, Request::ProcessExited { worker });
        }
    }

    /// Runs a submitted job's driver on the head's node.
    pub(crate) fn submit_job(
        &self,
        binary: String,
        args: Vec<String>,
        env: Vec<(String, String)>,
        submission_id: Option<String>,
        working_dir: Option<String>,
    ) -> Result<JobInfo> {
        let (id, request, info, package) = {
            let mut state = self.state.lock();
            let submission_id = match submission_id {
                Some(name) => {
                    check_submission_id(&name)?;
                    if state.members.jobs.values().any(|j| j.submission_id == name) {
                        return Err(Error::Invalid(format!(
                            "a job with submission id `{name}` exists already (`rtrun job \
                             status {name}`); choose another"
                        )));
                    }
                    name
                }
                None => format!("rtrunsubmit_{:016x}", crate::runtime::random_u64()),
            };
            let cluster = state
                .members
                .cluster
                .clone()
                .ok_or_else(|| Error::Invalid("jobs are submitted to a cluster head".into()))?;
            let path = cluster.binaries.path(&binary);
            if !path.exists() {
                return Err(Error::Invalid(format!("job binary {binary} was not uploaded")));
            }
            if let Some(digest) = &working_dir
                && !cluster.binaries.contains(digest)
            {
                return Err(Error::Invalid(format!(
                    "the working directory package {digest} was not uploaded"
                )));
            }
            let id = state.members.next_id();
            let worker = WorkerId(id);
            let log = cluster.log_dir.join(format!("job-{id}.log"));
            let job_env = env.clone();
            let mut env = env;
            let head = match crate::transport::Route::parse(&cluster.address)? {
                crate::transport::Route::Quic { addr, .. } => addr.to_string(),
                crate::transport::Route::Unix(_) => {
                    return Err(Error::Invalid("the head has no network address".into()));
                }
            };
            env.push((crate::cluster::ADDRESS_ENV.into(), head));
            env.push((crate::cluster::JOB_ENV.into(), id.to_string()));
            env.extend(crate::cluster::node_env(state.members.head_node, &cluster.address));
            let package = working_dir.as_ref().map(|digest| cluster.binaries.path(digest));
            let cwd = package.as_ref().map(|_| cluster.jobs_dir.join(format!("job-{id}")));
            if let Some(dir) = &cwd {
                env.push((crate::cluster::WORKING_DIR_ENV.into(), dir.display().to_string()));
            }
            let entry = JobEntry {
                worker,
                binary: binary.clone(),
                args: args.clone(),
                log: log.clone(),
                state: JobState::Running,
                submission_id,
                env: job_env,
                pid: None,
                driver: None,
                stop_requested: false,
            };
            let info = job_info(id, &entry);
            state.members.jobs.insert(id, entry);
            let request = SpawnRequest {
                worker,
                env,
                binary: Some(path),
                log: Some(log),
                job: Some(binary),
                args: Vec::new(),
                cwd,
            };
            (id, request.with_args(args), info, package)
        };
        // Unpacked outside the lock (it may take a while); a job whose files cannot be laid
        // out fails before its driver starts.
        if let (Some(dir), Some(package)) = (&request.cwd, &package)
            && let Err(e) = crate::cluster::working_dir::unpack(package, dir)
        {
            if let Some(entry) = self.state.lock().members.jobs.get_mut(&id) {
                entry.state = JobState::Failed { reason: e.to_string() };
            }
            return Err(e);
        }
        self.spawner.spawn(request)?;
        Ok(info)
    }

    /// A job's log from `offset`, and its state.
    pub(crate) fn job_logs(&self, job: u64, offset: u64, max: u64) -> Result<(Vec<u8>, JobInfo)> {
        let (log, info) = {
            let state = self.state.lock();
            let entry = state
                .members
                .jobs
                .get(&job)
                .ok_or_else(|| Error::Invalid(format!("no job {job}")))?;
            (entry.log.clone(), job_info(job, entry))
        };
        let bytes = read_from(&log, offset, max)?;
        Ok((bytes, info))
    }

    /// Stops job `job`: kills its driver (now, or as soon as it has started), whose leaving
    /// takes its workers and placement groups; the job ends `Stopped`. A job that has ended
    /// is left as it is.
    pub(crate) fn stop_job(&self, job: u64) -> Result<JobInfo> {
        let (pid, info) = {
            let mut state = self.state.lock();
            let entry = state
                .members
                .jobs
                .get_mut(&job)
                .ok_or_else(|| Error::Invalid(format!("no job {job}")))?;
            if entry.state != JobState::Running {
                return Ok(job_info(job, entry));
            }
            entry.stop_requested = true;
            (entry.pid, job_info(job, entry))
        };
        if let Some(pid) = pid {
            super::spawn::kill_process(pid);
        }
        Ok(info)
    }

    /// Records a job driver's process id (false when `worker` is not a job); kills it at
    /// once when the job was stopped before it started.
    pub(super) fn job_spawned(&self, worker: WorkerId, pid: u32) -> bool {
        let stop = {
            let mut state = self.state.lock();
            let Some(entry) = state.members.jobs.values_mut().find(|j| j.worker == worker) else {
                return false;
            };
            entry.pid = Some(pid);
            entry.stop_requested
        };
        if stop {
            super::spawn::kill_process(pid);
        }
        true
    }

    /// Every job.
    pub(crate) fn jobs(&self) -> Vec<JobInfo> {
        let state = self.state.lock();
        state.members.jobs.iter().map(|(id, entry)| job_info(*id, entry)).collect()
    }

    /// Records a job driver's exit (false when `worker` is not a job). Its process has been
    /// reaped, so the driver is gone now: its actors and groups go at once rather than when
    /// its connection times out (a killed or stopped driver cannot close it).
    pub(super) fn job_exited(&self, worker: WorkerId, status: &WorkerExit) -> bool {
        let driver = {
            let mut state = self.state.lock();
            let Some(entry) = state.members.jobs.values_mut().find(|j| j.worker == worker) else {
                return false;
            };
            entry.state = match status {
                _ if entry.stop_requested => JobState::Stopped,
                WorkerExit::Code(code) => JobState::Exited { code: *code },
                other => JobState::Failed { reason: other.to_string() },
            };
            entry.driver
        };
        if let Some(driver) = driver {
            self.on_driver_gone(driver);
        }
        true
    }

    /// Stops every live node daemon (they kill their workers) and waits, up to `timeout`, for
    /// each to acknowledge, then stops this head's workers.
    pub(crate) fn stop_cluster(&self, timeout: Duration) {
        let nodes = self.live_remote_nodes();
        let (acks, acked) = std::sync::mpsc::channel();
        let mut waiting = 0;
        for node in nodes {
            let ack = acks.clone();
            let on_answer = Box::new(move |_: &Head, _: Response| {
                let _ = ack.send(node);
            });
            match self.node_request(
                node,
                Request::StopNode { declared_dead: None },
                Some(on_answer),
            ) {
                Ok(()) => waiting += 1,
                Err(e) => tracing::warn!(node = %NodeId(node), "cannot stop node: {e}"),
            }
        }
        let deadline = std::time::Instant::now() + timeout;
        while waiting > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match acked.recv_timeout(left) {
                Ok(_) => waiting -= 1,
                Err(_) => {
                    tracing::warn!("{waiting} node(s) did not acknowledge the stop in {timeout:?}");
                    break;
                }
            }
        }
        self.shutdown();
    }
}

fn job_info(id: u64, entry: &JobEntry) -> JobInfo {
    JobInfo {
        job: id,
        binary: entry.binary.clone(),
        args: entry.args.clone(),
        state: entry.state.clone(),
        log: entry.log.display().to_string(),
        submission_id: entry.submission_id.clone(),
    }
}

/// A submission id names a job on the command line beside its number: letters, digits, `-`,
/// `_` and `.`, at most 128, not all digits.
fn check_submission_id(name: &str) -> Result<()> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 128 || !name.chars().all(allowed) {
        return Err(Error::Invalid(format!(
            "submission id `{name}`: expected 1 to 128 letters, digits, `-`, `_` or `.`"
        )));
    }
    if name.chars().all(|c| c.is_ascii_digit()) {
        return Err(Error::Invalid(format!(
            "submission id `{name}`: expected a name that is not a number (job numbers are \
             names already)"
        )));
    }
    Ok(())
}

/// Up to `max` bytes of a file from `offset` (nothing when it does not exist yet).
pub(crate) fn read_from(path: &std::path::Path, offset: u64, max: u64) -> Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::System(format!("cannot read {}: {e}", path.display()))),
    };
    file.seek(SeekFrom::Start(offset))
        .map_err(|e| Error::System(format!("cannot read {}: {e}", path.display())))?;
    let mut bytes = Vec::new();
    file.take(max)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::System(format!("cannot read {}: {e}", path.display())))?;
    Ok(bytes)
}

impl HeadState {
    /// Removes a dead node: its workers are gone (actors restart elsewhere or die), its
    /// placement groups are placed anew, its objects are lost.
    fn node_died(&mut self, head: &Head, id: u64, reason: String, effects: &mut Vec<Effect>) {
        tracing::warn!("{reason}");
        let Some(entry) = self.members.nodes.get_mut(&id) else { return };
        entry.dead = Some(reason.clone());
        let placement = entry.placement.clone();
        let lost = match self.cluster.remove_node(&placement) {
            Ok(lost) => lost,
            Err(e) => {
                tracing::warn!("removing {placement} from placement: {e}");
                return;
            }
        };
        let lost_ids: std::collections::HashSet<_> =
            lost.lost_allocations.iter().map(|a| a.id).collect();
        // Actors whose allocation went with the node start anew (elsewhere) when restarts remain.
        for actor in self.actors.values_mut() {
            if actor.allocation.as_ref().is_some_and(|a| lost_ids.contains(&a.id)) {
                actor.allocation = None;
            }
        }
        for group in &lost.requeued_groups {
            self.pending_groups.insert(*group);
        }
        let workers: Vec<WorkerId> =
            self.workers.iter().filter(|(_, w)| w.node == id).map(|(w, _)| *w).collect();
        for worker in workers {
            self.on_worker_exit(worker, reason.clone(), effects);
        }
        // Running tasks whose allocation was in a requeued group on another node lose it too.
        let running: Vec<u64> = self
            .running_tasks
            .iter()
            .filter(|(_, r)| lost_ids.contains(&r.allocation))
            .map(|(call, _)| *call)
            .collect();
        for call in running {
            if let Some(run) = self.running_tasks.remove(&call) {
                if let Some(w) = self.workers.get_mut(&run.worker) {
                    w.role = WorkerRole::Tasks { running: None };
                    if let Some(pid) = w.pid {
                        effects.push(Effect::Kill(w.node, pid));
                    }
                }
                let error = Error::WorkerDied {
                    target: run.task.spec.function.clone(),
                    reason: reason.clone(),
                };
                self.answer_task(
                    run.task.responder,
                    crate::protocol::Outcome::Error(error),
                    effects,
                );
            }
        }
        // Actors still alive elsewhere whose allocation was in a requeued group are stopped and
        // restart with the group.
        let displaced: Vec<(u64, u32)> = self
            .actors
            .values()
            .filter(|a| a.allocation.is_none())
            .filter_map(|a| match a.state {
                ActorState::Alive { worker, .. } | ActorState::Starting { worker } => {
                    self.workers.get(&worker).and_then(|w| w.pid.map(|pid| (w.node, pid)))
                }
                _ => None,
            })
            .collect();
        for (node, pid) in displaced {
            effects.push(Effect::Kill(node, pid));
        }
        self.reschedule(head, effects);
    }
}
