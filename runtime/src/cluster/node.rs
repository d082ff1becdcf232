//! A node daemon's agent: starts the workers the head places on this node (from the job's
//! binary, fetched from the head by digest and cached), reports their starts and exits to the
//! head, kills them when told, and releases the store references of processes that exited
//! anywhere in the cluster.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::head::spawn::{SpawnEvents, SpawnRequest, Spawner, kill_process};
use crate::ids::WorkerId;
use crate::protocol::{Ask, NodeRequest, Response, WorkerExit, ask};
use crate::runtime::Ending;
use crate::runtime::{Runtime, To};

use super::binaries::BinaryCache;
use super::{NetReply, NetRequest};

/// Where a node keeps job binaries and worker logs.
pub(crate) struct NodeAgentConfig {
    pub(crate) binaries: Arc<BinaryCache>,
    pub(crate) log_dir: PathBuf,
}

/// The node daemon's worker supervision.
pub(crate) struct NodeAgent {
    runtime: Weak<Runtime>,
    spawner: Spawner,
    config: NodeAgentConfig,
    /// Live children: worker → pid.
    children: Mutex<HashMap<WorkerId, Option<u32>>>,
    /// Serializes binary fetches (one download per digest).
    fetching: Mutex<()>,
}

impl NodeAgent {
    pub(crate) fn start(runtime: &Arc<Runtime>, config: NodeAgentConfig) -> Result<Arc<NodeAgent>> {
        let (spawner, inbox) = Spawner::channel();
        let agent = Arc::new(NodeAgent {
            runtime: Arc::downgrade(runtime),
            spawner,
            config,
            children: Mutex::new(HashMap::new()),
            fetching: Mutex::new(()),
        });
        inbox.run(Arc::downgrade(&agent))?;
        Ok(agent)
    }

    /// Handles a request from the head; `respond` gets the answer.
    pub(crate) fn handle(
        self: &Arc<Self>,
        body: NodeRequest,
        respond: Box<dyn FnOnce(Response) + Send>,
    ) {
        match body {
            NodeRequest::SpawnWorker { worker, env, job } => {
                // Fetching a binary may take a while: not on the connection's reader thread.
                let agent = self.clone();
                std::thread::spawn(move || {
                    respond(match agent.spawn(worker, env, job) {
                        Ok(()) => Response::Done,
                        Err(e) => Response::Error(e),
                    })
                });
            }
            NodeRequest::KillProcess { pid } => {
                let ours = self.children.lock().values().any(|p| *p == Some(pid));
                if ours {
                    kill_process(pid);
                }
                respond(Response::Done)
            }
            NodeRequest::ProcessExited { worker } => {
                if let Some(runtime) = self.runtime.upgrade() {
                    runtime.on_process_exit(worker);
                }
                respond(Response::Done)
            }
            NodeRequest::StopNode { declared_dead: None } => {
                respond(Response::Done);
                self.stop();
                // `rtrun join`'s main exits; the answer reaches the head (which waits for it)
                // as the exit closes this process's connections gracefully (`close_on_exit`).
                self.end(Ending::Stopped);
            }
            NodeRequest::StopNode { declared_dead: Some(reason) } => {
                respond(Response::Done);
                self.stop();
                // The head gave this node up (it was paused or cut off past the heartbeat
                // timeout) and has already restarted its actors elsewhere: rejoining under the
                // old id could run them twice, so the node exits and a restarted `rtrun join`
                // joins as a new node.
                self.end(Ending::HeadLost(format!(
                    "rtrun join: the head declared this node dead ({reason}); stopped its \
                     workers and exiting (restart `rtrun join` to rejoin as a new node)"
                )));
            }
            request @ (NodeRequest::ReadLog { .. } | NodeRequest::ListLogs) => {
                respond(crate::logs::answer(&self.config.log_dir, &request))
            }
            // Answered before it reaches the agent (`Runtime::on_request`).
            NodeRequest::HeadRestarted { .. } => respond(Response::Done),
        }
    }

    fn spawn(
        &self,
        worker: WorkerId,
        env: Vec<(String, String)>,
        job: Option<String>,
    ) -> Result<()> {
        let runtime = self.runtime.upgrade().ok_or(Error::NotInitialised)?;
        let digest = job.ok_or_else(|| {
            Error::Invalid("a node daemon runs job binaries only; this worker has none".into())
        })?;
        let binary = self.binary(&digest)?;
        let mut env = env;
        env.extend(super::node_env(runtime.node_id.0, runtime.address()));
        self.children.lock().insert(worker, None);
        self.spawner.spawn(SpawnRequest {
            worker,
            env,
            binary: Some(binary),
            log: Some(self.config.log_dir.join(format!("worker-{}.log", worker.0))),
            job: Some(digest),
            args: Vec::new(),
            cwd: None,
            outlives_head: None,
        })
    }

    /// The path of a job binary, fetched from the head when not cached.
    fn binary(&self, digest: &str) -> Result<PathBuf> {
        let _one_at_a_time = self.fetching.lock();
        if self.config.binaries.contains(digest) {
            return Ok(self.config.binaries.path(digest));
        }
        let member = super::member().ok_or(Error::NotInitialised)?;
        let (reply, parts) = super::control_request(
            member,
            NetRequest::FetchBinary { digest: digest.to_owned() },
            Vec::new(),
        )?;
        match (reply, parts.first()) {
            (NetReply::Done, Some(bytes)) => self.config.binaries.insert(digest, bytes),
            _ => Err(Error::Transport(format!("the head sent no binary {digest}"))),
        }
    }

    /// The workers this node runs, with their pids once started (what it reports when it
    /// rejoins a restarted head).
    pub(crate) fn children(&self) -> Vec<(WorkerId, Option<u32>)> {
        self.children.lock().iter().map(|(w, p)| (*w, *p)).collect()
    }

    /// Kills every child.
    pub(crate) fn stop(&self) {
        let pids: Vec<u32> = self.children.lock().values().flatten().copied().collect();
        for pid in pids {
            kill_process(pid);
        }
    }

    fn end(&self, ending: Ending) {
        if let Some(runtime) = self.runtime.upgrade() {
            runtime.end(ending);
        }
    }

    fn report(&self, request: impl Ask) {
        if let Some(runtime) = self.runtime.upgrade() {
            runtime.send(To::Head, request, |_| {});
        }
    }
}

impl SpawnEvents for NodeAgent {
    fn on_spawned(&self, worker: WorkerId, pid: u32) {
        self.children.lock().insert(worker, Some(pid));
        self.report(ask::WorkerSpawned { worker, pid });
    }

    fn on_worker_exit(&self, worker: WorkerId, status: WorkerExit) {
        self.children.lock().remove(&worker);
        if let Some(runtime) = self.runtime.upgrade() {
            runtime.on_process_exit(worker);
        }
        self.report(ask::WorkerExited { worker, status });
    }

    fn runtime(&self) -> Option<Arc<Runtime>> {
        self.runtime.upgrade()
    }
}
