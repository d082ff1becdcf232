//! The cluster side of the control plane's shell: nodes and drivers joining, a node declared
//! dead or a driver gone (decided by the core), requests to node daemons (spawning workers,
//! killing processes, dropping an exited process's store references) and stopping the
//! cluster.

use std::sync::Arc;
use std::time::Duration;

use rtrun_placement::NodeResources;

use super::spawn::SpawnRequest;
use super::{Event, Head};
use crate::cluster::binaries::BinaryCache;
use crate::error::{Error, Result};
use crate::ids::{NodeId, WorkerId};
use crate::protocol::{Address, NodeRequest, Request, Response, WorkerExit, ask};
use crate::runtime::To;

/// What a cluster head needs besides the embedded control plane.
pub(crate) struct ClusterHead {
    /// The head process's own address (every worker's control-plane address).
    pub(crate) address: Address,
    /// Where job binaries live, by digest.
    pub(crate) binaries: Arc<BinaryCache>,
    /// Where job and worker logs of the head node go.
    pub(crate) log_dir: std::path::PathBuf,
    /// Where submitted jobs' working directories are unpacked, one per job.
    pub(crate) jobs_dir: std::path::PathBuf,
}

/// How a process asks to join (the net-level registration, see `crate::cluster`).
pub(crate) enum JoinAs {
    /// A node daemon with its resources, reachable at `endpoint`.
    Node { name: String, resources: NodeResources, endpoint: std::net::SocketAddr },
    /// A driver running `binary` (its digest; `None` for command-line clients), the driver of
    /// submitted job `job` if that is set.
    Driver { binary: Option<String>, job: Option<u64>, endpoint: std::net::SocketAddr },
    /// A driver that had joined the head before it restarted, as `worker`.
    ResumedDriver { worker: WorkerId },
}

/// How a head with a state directory starts: its directory (locked), what it held, and how
/// long its nodes and drivers have to reconnect.
pub(crate) struct Persistence {
    pub(crate) dir: std::path::PathBuf,
    pub(crate) lock: super::state_dir::DirLock,
    pub(crate) meta: super::state_dir::Meta,
    pub(crate) recovered: Option<rtrun_head_core::DurableState>,
    pub(crate) reconnect_window: Duration,
}

/// What a joining process learns.
pub(crate) struct Joined {
    pub(crate) session: String,
    pub(crate) worker: WorkerId,
    pub(crate) node: u64,
    pub(crate) head: Address,
    /// How long a member reconnects after losing the head (a head with a state directory).
    pub(crate) reconnect_window: Option<Duration>,
}

impl Head {
    /// Makes this control plane a cluster head (called once, before anything joins).
    pub(crate) fn enable_cluster(&self, cluster: Arc<ClusterHead>, node_name: String) {
        let (address, log_dir) = (cluster.address.clone(), cluster.log_dir.clone());
        if self.cluster.set(cluster).is_err() {
            tracing::warn!("the control plane was made a cluster head twice; the first stays");
            return;
        }
        self.state.lock().core.enable_cluster(address, node_name, log_dir);
    }

    /// Registers a node, driver or client.
    pub(crate) fn join(&self, session: &str, as_: JoinAs) -> Result<Joined> {
        let (joined, actions) = {
            let mut state = self.state.lock();
            let head = state.core.head_address()?;
            let mut effects = Vec::new();
            let (node, worker) = match as_ {
                JoinAs::Node { name, resources, endpoint } => {
                    state.core.join_node(name, &resources, endpoint, &mut effects)?
                }
                JoinAs::Driver { binary, job, endpoint } => {
                    let worker = state.core.join_driver(binary, job, Some(endpoint))?;
                    (worker.0, worker)
                }
                JoinAs::ResumedDriver { worker } => {
                    state.core.rejoin_driver(worker)?;
                    (worker.0, worker)
                }
            };
            let reconnect_window = state.reconnect_window;
            let joined =
                Joined { session: session.to_owned(), worker, node, head, reconnect_window };
            (joined, state.resolve(effects, None))
        };
        self.execute(actions);
        Ok(joined)
    }

    /// Starts persisting to a state directory (called once, after [`Head::enable_cluster`] and
    /// before anything joins): a head that finds a state there recovers it first, and waits
    /// for its nodes and drivers to reconnect.
    pub(crate) fn enable_persistence(&self, persistence: Persistence) -> Result<()> {
        let window = persistence.reconnect_window;
        let (actions, targets) = {
            let mut state = self.state.lock();
            let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
            let effects = match persistence.recovered {
                Some(durable) => state.core.recover(durable, 0, window_ms)?,
                None => Vec::new(),
            };
            let snapshot = state.core.journal_from_now();
            let dir = &persistence.dir;
            let started = super::state_dir::StateDir::start(
                persistence.lock,
                dir,
                persistence.meta,
                &snapshot,
            )?;
            state.state_dir = Some(started);
            state.reconnect_window = Some(window);
            let targets = state.core.reconnect_targets();
            (state.resolve(effects, None), targets)
        };
        self.execute(actions);
        self.announce_restart(targets);
        Ok(())
    }

    /// Tells each of `targets` (the recovered cluster's node daemons and workers) that this
    /// head restarted, each from its own thread (a dead node's handshake must not hold up the
    /// others).
    fn announce_restart(&self, targets: Vec<Address>) {
        let Some(runtime) = self.runtime() else { return };
        let head = runtime.address().clone();
        for target in targets {
            let (runtime, head) = (runtime.clone(), head.clone());
            std::thread::spawn(move || match runtime.endpoint().connect(&target) {
                Ok(conn) => runtime.send(
                    To::Peer(&conn),
                    Request::Node(NodeRequest::HeadRestarted { head }),
                    |_: Result<Response>| {},
                ),
                Err(e) => tracing::debug!(%target, "cannot tell it the head restarted: {e}"),
            });
        }
    }

    /// Node `node` (named `name`) reconnects after the head restarted, running `workers`.
    pub(crate) fn rejoin_node(
        &self,
        node: u64,
        name: &str,
        workers: &[(WorkerId, Option<u32>)],
    ) -> Result<(Address, Option<Duration>)> {
        let (answer, actions) = {
            let mut state = self.state.lock();
            let head = state.core.head_address()?;
            let mut effects = Vec::new();
            state.core.rejoin_node(node, name, workers, &mut effects)?;
            ((head, state.reconnect_window), state.resolve(effects, None))
        };
        self.execute(actions);
        Ok(answer)
    }

    /// A node stopped sending heartbeats (or its daemon went away): everything on it is lost.
    pub(crate) fn on_node_dead(&self, name: &str, reason: &str) {
        self.event(Event::NodeDead { name: name.to_owned(), reason: reason.to_owned() });
    }

    /// Tells a node declared dead to stop. On a thread: this runs on the heartbeat monitor's
    /// task, and a connection may have to be opened.
    pub(super) fn stop_dead_node(&self, address: Address, reason: String) {
        let Some(runtime) = self.runtime() else { return };
        std::thread::spawn(move || match runtime.endpoint().connect(&address) {
            Ok(conn) => {
                runtime.send(To::Peer(&conn), ask::StopNode { declared_dead: Some(reason) }, |_| {})
            }
            Err(e) => tracing::debug!("cannot tell the dead node at {address}: {e}"),
        });
    }

    /// A driver disconnected: its actors (but detached ones), queued tasks and placement groups
    /// go with it.
    pub(crate) fn on_driver_gone(&self, driver: WorkerId) {
        self.event(Event::DriverGone { driver });
    }

    /// What to spawn for `worker` on `node`: on the head's own node in a cluster, the job's
    /// binary from the head's cache, a log file and the cluster environment; elsewhere the node
    /// daemon resolves the binary from `job`.
    pub(super) fn spawn_request(
        &self,
        node: u64,
        worker: WorkerId,
        env: Vec<(String, String)>,
        job: Option<String>,
    ) -> SpawnRequest {
        let local = node == self.local_node;
        let cluster = self.cluster.get();
        let binary = match (local, cluster, &job) {
            (true, Some(cluster), Some(digest)) => Some(cluster.binaries.path(digest)),
            _ => None,
        };
        let log = match (local, cluster) {
            (true, Some(cluster)) => Some(cluster.log_dir.join(format!("worker-{}.log", worker.0))),
            _ => None,
        };
        let mut env = env;
        if local && let Some(cluster) = cluster {
            env.extend(crate::cluster::node_env(self.local_node, &cluster.address));
        }
        SpawnRequest {
            worker,
            env,
            binary,
            log,
            job,
            args: Vec::new(),
            cwd: None,
            outlives_head: None,
        }
    }

    pub(super) fn spawn_remote(&self, node: u64, request: SpawnRequest) {
        let worker = request.worker;
        let sent = self.node_request(
            node,
            NodeRequest::SpawnWorker { worker, env: request.env, job: request.job },
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

    /// Answers a request about the logs of the head's own node.
    pub(crate) fn node_logs(&self, request: &NodeRequest) -> Response {
        let dir = self.cluster.get().map(|c| c.log_dir.clone());
        match (dir, request) {
            (Some(dir), _) => crate::logs::answer(&dir, request),
            (None, NodeRequest::ListLogs) => Response::LogFiles(Vec::new()),
            (None, NodeRequest::ReadLog { .. }) => Response::Error(Error::Invalid(
                "an embedded session keeps no log files (its workers print on the driver's \
                 terminal)"
                    .into(),
            )),
            (None, other) => Response::Error(Error::Invalid(format!(
                "the control plane is not a node daemon; it cannot answer {other:?}"
            ))),
        }
    }

    /// Sends a request to a remote node's daemon, without waiting for its answer (the head's
    /// own node has no daemon: its callers act on it directly).
    pub(super) fn send_to_node(&self, node: u64, request: NodeRequest) {
        debug_assert_ne!(node, self.local_node, "the head's own node has no daemon");
        if let Err(e) = self.node_request(node, request, None) {
            tracing::debug!(node = %NodeId(node), "request to a node failed: {e}");
        }
    }

    /// Sends a request to a node's daemon.
    #[allow(clippy::type_complexity)]
    fn node_request(
        &self,
        node: u64,
        request: NodeRequest,
        on_answer: Option<Box<dyn FnOnce(&Head, Response) + Send>>,
    ) -> Result<()> {
        let runtime = self.runtime().ok_or(Error::NotInitialised)?;
        let address = { self.state.lock().core.live_node_address(node)? };
        let conn = runtime.endpoint().connect(&address)?;
        let head = self.weak.clone();
        runtime.send(To::Peer(&conn), Request::Node(request), move |answer| {
            if let (Some(on_answer), Some(head)) = (on_answer, head.upgrade()) {
                on_answer(&head, answer.unwrap_or_else(Response::Error));
            }
        });
        Ok(())
    }

    /// Every node's daemon releases the store references of an exited process.
    pub(super) fn broadcast_exit(&self, worker: WorkerId) {
        let nodes = self.state.lock().core.live_remote_nodes();
        for node in nodes {
            self.send_to_node(node, NodeRequest::ProcessExited { worker });
        }
    }

    /// Stops every live node daemon (they kill their workers) and waits, up to `timeout`, for
    /// each to acknowledge, then stops this head's workers.
    pub(crate) fn stop_cluster(&self, timeout: Duration) {
        let nodes = self.state.lock().core.live_remote_nodes();
        let (acks, acked) = std::sync::mpsc::channel();
        let mut waiting = 0;
        for node in nodes {
            let ack = acks.clone();
            let on_answer = Box::new(move |_: &Head, _: Response| {
                let _ = ack.send(node);
            });
            match self.node_request(
                node,
                NodeRequest::StopNode { declared_dead: None },
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
