//! The command-line client of a cluster (`rtrun status`, `list`, `logs`, `submit`, `stop`): a
//! process that joins as a driver without a binary and asks the control plane.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::actor::ActorInfo;
use crate::error::{Error, Result};
use crate::placement_group::PlacementGroupState;
use crate::protocol::{
    ActorSummary, Ask, ClusterInfo, JobInfo, JobOutput, LogChunk, NodeInfo, NodeMemory, ask,
};
use crate::runtime::{Config, Runtime, To};
pub(crate) use rtrun_proto::actor::short_type;

/// The file in the credentials directory where `rtrun head` records its address.
pub const HEAD_ADDRESS_FILE: &str = "head_address";

/// A connection to a cluster's control plane.
pub struct Client {
    runtime: Arc<Runtime>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Client({})", self.runtime.address())
    }
}

/// The head address to use: the flag, else `RTRUN_ADDRESS`, else the one `rtrun head` recorded
/// in the credentials directory.
pub fn resolve_address(flag: Option<&str>, credentials_dir: &Path) -> Result<String> {
    if let Some(address) = flag {
        return Ok(address.to_owned());
    }
    if let Ok(address) = std::env::var(super::ADDRESS_ENV)
        && !address.trim().is_empty()
    {
        return Ok(address);
    }
    let file = credentials_dir.join(HEAD_ADDRESS_FILE);
    std::fs::read_to_string(&file).map(|s| s.trim().to_owned()).map_err(|_| {
        Error::Invalid(format!(
            "no cluster address: pass --address, set {}, or run on the head's host (no {})",
            super::ADDRESS_ENV,
            file.display()
        ))
    })
}

impl Client {
    /// Connects to the head at `address` with the credentials in `credentials_dir` (or a token).
    /// `connect_timeout` bounds the wait for the head (default: see
    /// [`Config::connect_timeout`]).
    pub fn connect(
        address: &str,
        token: Option<String>,
        credentials_dir: PathBuf,
        connect_timeout: Option<std::time::Duration>,
    ) -> Result<Client> {
        let config = Config {
            token,
            credentials_dir: Some(credentials_dir),
            connect_timeout,
            ..Config::default()
        };
        let runtime = super::start_driver(&config, address, false)?;
        Ok(Client { runtime })
    }

    /// Nodes, resources and counts.
    pub fn status(&self) -> Result<ClusterInfo> {
        self.runtime.cluster_info()
    }

    /// Every actor.
    pub fn actors(&self) -> Result<Vec<ActorSummary>> {
        self.runtime.list_actors()
    }

    /// Kills the live actor named `name` in `namespace` (without restarting it, unless
    /// `restart`).
    pub fn kill_actor(&self, name: &str, namespace: &str, restart: bool) -> Result<ActorInfo> {
        let info = self.runtime.get_actor_by_name(name, Some(namespace))?;
        self.runtime.kill_actor(info.id, !restart)?;
        Ok(info)
    }

    /// Every live placement group.
    pub fn placement_groups(&self) -> Result<Vec<PlacementGroupState>> {
        self.runtime.list_placement_groups()
    }

    /// Every submitted job.
    pub fn jobs(&self) -> Result<Vec<JobInfo>> {
        self.runtime.list_jobs()
    }

    /// Any control-plane request, answered with the payload type its reply carries (the
    /// listings `rtrun list tasks|workers` show).
    pub fn ask<A: Ask>(&self, request: A) -> Result<A::Reply> {
        self.runtime.ask(To::Head, request)
    }

    /// Forgets ended job `job`: its record and its log (a running job is refused).
    pub fn delete_job(&self, job: u64) -> Result<JobInfo> {
        single_job(self.runtime.ask(To::Head, ask::DeleteJob { job })?)
    }

    /// The object store of every live node.
    pub fn objects(&self) -> Result<Vec<NodeMemory>> {
        let info = self.status()?;
        let mut nodes = Vec::new();
        for node in info.nodes.iter().filter(|n| n.alive) {
            let conn = self.runtime.endpoint().connect(&node.address)?;
            let holder = rtrun_proto::address::holder_of(self.runtime.worker_id);
            let memory = self.runtime.ask(To::Peer(&conn), ask::NodeStoreStats { holder })?;
            nodes.push(*memory);
        }
        Ok(nodes)
    }

    /// Uploads `binary` (unless the head has it) and runs it with `args` on the head's node,
    /// with `env` for the driver and every worker of the job, named `submission_id` (default:
    /// a generated name), in a copy of `working_dir` (packed and uploaded unless the head has
    /// the same files already; see [`super::working_dir`]).
    pub fn submit(
        &self,
        binary: &Path,
        args: Vec<String>,
        env: Vec<(String, String)>,
        submission_id: Option<String>,
        working_dir: Option<&Path>,
    ) -> Result<JobInfo> {
        let member = super::member().ok_or(Error::NotInitialised)?;
        let working_dir = match working_dir {
            Some(dir) => {
                let package = super::working_dir::pack(dir)?;
                let digest = super::binaries::digest_of(&package);
                super::upload_bytes(member, &digest, || Ok(package))?;
                Some(digest)
            }
            None => None,
        };
        let digest = super::binaries::digest_file(binary)?;
        super::member::upload_binary(member, binary, &digest)?;
        single_job(self.runtime.ask(
            To::Head,
            ask::SubmitJob { binary: digest, args, env, submission_id, working_dir },
        )?)
    }

    /// The job named `name`: its number or its submission id.
    pub fn job(&self, name: &str) -> Result<JobInfo> {
        let jobs = self.jobs()?;
        let number = name.parse::<u64>().ok();
        jobs.into_iter()
            .find(|j| Some(j.job) == number || j.submission_id == name)
            .ok_or_else(|| Error::Invalid(format!("no job `{name}` (see `rtrun job list`)")))
    }

    /// Stops job `job` (its driver, its workers on every node, its placement groups).
    pub fn stop_job(&self, job: u64) -> Result<JobInfo> {
        single_job(self.runtime.ask(To::Head, ask::StopJob { job })?)
    }

    /// A job's output from `offset`, and its state.
    pub fn job_logs(&self, job: u64, offset: u64) -> Result<(Vec<u8>, JobInfo)> {
        let JobOutput { bytes, job } = self.runtime.ask(To::Head, ask::JobLogs { job, offset })?;
        Ok((bytes, job))
    }

    /// Removes the placement group named `name` (its actors and tasks are stopped, its
    /// resources freed), whoever created it.
    pub fn remove_placement_group(&self, name: &str) -> Result<PlacementGroupState> {
        let group =
            self.runtime.ask(To::Head, ask::GetPlacementGroupByName { name: name.to_owned() })?;
        self.runtime.ask(To::Head, ask::RemovePlacementGroup { group: group.id })?;
        Ok(*group)
    }

    /// Up to 1 MiB of the log `file` on `node` from `offset`, and the file's inode (see
    /// [`LogCursor`], which follows a log through its rotations).
    pub fn read_log(&self, node: &NodeInfo, file: &str, offset: u64) -> Result<(Vec<u8>, u64)> {
        let conn = self.runtime.endpoint().connect(&node.address)?;
        let request = ask::ReadLog { file: file.to_owned(), offset };
        let LogChunk { bytes, inode, .. } = self.runtime.ask(To::Peer(&conn), request)?;
        Ok((bytes, inode))
    }

    /// The log files on `node` with their sizes.
    pub fn list_logs(&self, node: &NodeInfo) -> Result<Vec<(String, u64)>> {
        let conn = self.runtime.endpoint().connect(&node.address)?;
        self.runtime.ask(To::Peer(&conn), ask::ListLogs)
    }

    /// Stops every node and the head.
    pub fn stop(&self) -> Result<()> {
        // The head's connection closing after this is the expected end, not a lost head.
        self.runtime.expect_head_exit();
        self.runtime.ask(To::Head, ask::StopCluster)
    }
}

/// The one job a job request is answered with.
fn single_job(mut jobs: Vec<JobInfo>) -> Result<JobInfo> {
    match jobs.len() {
        1 => Ok(jobs.remove(0)),
        n => Err(Error::Transport(format!("expected one job in the head's answer, found {n}"))),
    }
}

/// A reader of one log on one node that loses nothing to rotation (while the log is rotated
/// at most as many times between two reads as it keeps backups): it remembers the inode it
/// reads, finds that file among the rotated copies when the name has moved on, finishes it,
/// reads any newer copies, then the current file.
#[derive(Debug)]
pub struct LogCursor {
    file: String,
    inode: Option<u64>,
    offset: u64,
}

impl LogCursor {
    /// A cursor at the start of `file`'s history (its oldest rotated copy).
    pub fn new(file: &str) -> LogCursor {
        LogCursor { file: file.to_owned(), inode: None, offset: 0 }
    }

    /// Everything written to the log since the last call.
    pub fn read_new(&mut self, client: &Client, node: &NodeInfo) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let (bytes, inode) = client.read_log(node, &self.file, self.offset)?;
        if self.inode == Some(inode) {
            out.extend_from_slice(&bytes);
            self.offset += bytes.len() as u64;
            self.drain(client, node, &self.file.clone(), &mut out)?;
            return Ok(out);
        }
        // First read, or the name was rotated since: the older copies come first.
        let backups: Vec<u32> = {
            let prefix = format!("{}.", self.file);
            let mut ks: Vec<u32> = client
                .list_logs(node)?
                .into_iter()
                .filter_map(|(name, _)| name.strip_prefix(&prefix)?.parse().ok())
                .collect();
            ks.sort_unstable_by(|a, b| b.cmp(a));
            ks
        };
        let mut found = self.inode.is_none();
        for k in backups {
            let name = format!("{}.{k}", self.file);
            if found {
                self.offset = 0;
                self.drain(client, node, &name, &mut out)?;
            } else if let Ok((_, inode)) = client.read_log(node, &name, u64::MAX)
                && Some(inode) == self.inode
            {
                found = true;
                self.drain(client, node, &name, &mut out)?;
            }
        }
        if !found {
            out.extend_from_slice(b"[rtrun: lines lost to log rotation]\n");
        }
        self.offset = 0;
        let (bytes, inode) = client.read_log(node, &self.file, 0)?;
        self.inode = Some(inode);
        out.extend_from_slice(&bytes);
        self.offset = bytes.len() as u64;
        self.drain(client, node, &self.file.clone(), &mut out)?;
        Ok(out)
    }

    /// Reads `name` from the cursor's offset to its end.
    fn drain(
        &mut self,
        client: &Client,
        node: &NodeInfo,
        name: &str,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        loop {
            let (bytes, _) = client.read_log(node, name, self.offset)?;
            if bytes.is_empty() {
                return Ok(());
            }
            self.offset += bytes.len() as u64;
            out.extend_from_slice(&bytes);
        }
    }
}

/// Set to `0` to keep a cluster driver's actors' output off its terminal (Ray's
/// `log_to_driver=False`).
pub const LOG_TO_DRIVER_ENV: &str = "RTRUN_LOG_TO_DRIVER";

/// How often a driver looks for new output of its actors.
const LOG_POLL: std::time::Duration = std::time::Duration::from_millis(300);

/// Prints the output of this cluster driver's actors, wherever they run, on its stderr, each
/// line prefixed `(ActorType pid=…, node=…)` as Ray does: a thread reads the actors' worker
/// logs from their nodes (each from where it left off; a restarted actor's new worker from
/// its start).
pub(crate) fn stream_actor_output(runtime: Arc<Runtime>) {
    if std::env::var(LOG_TO_DRIVER_ENV).is_ok_and(|v| v.trim() == "0") {
        return;
    }
    let me = runtime.worker_id;
    let client = Client { runtime };
    let (flushes, requests) = std::sync::mpsc::channel::<std::sync::mpsc::Sender<()>>();
    let _ = FLUSH.set(flushes);
    super::member::flush_at_exit(flush_actor_output);
    let spawned = std::thread::Builder::new().name("rtrun-log-stream".into()).spawn(move || {
        let mut streams: std::collections::HashMap<(u64, u64), LogStream> = Default::default();
        let mut nodes: Vec<NodeInfo> = Vec::new();
        let mut flushed: Option<std::sync::mpsc::Sender<()>> = None;
        loop {
            if let Some(ack) = flushed.take() {
                let _ = ack.send(());
            }
            match requests.recv_timeout(LOG_POLL) {
                Ok(ack) => flushed = Some(ack),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
            }
            let Ok(actors) = client.actors() else { continue };
            for actor in actors.iter().filter(|a| a.driver == Some(me)) {
                let (Some(worker), Some(node)) = (actor.worker, actor.log_node) else { continue };
                if !nodes.iter().any(|n| n.node == node) {
                    match client.status() {
                        Ok(info) => nodes = info.nodes,
                        Err(_) => continue,
                    }
                }
                let Some(info) = nodes.iter().find(|n| n.node == node) else { continue };
                let stream = streams
                    .entry((node.0, worker.0))
                    .or_insert_with(|| LogStream::new(&format!("worker-{}.log", worker.0)));
                if stream.done || !info.alive {
                    continue;
                }
                if let Some(pid) = actor.pid {
                    stream.pid = Some(pid);
                }
                let label = format!(
                    "{} pid={}, node={}",
                    short_type(&actor.type_name),
                    stream.pid.map_or("?".to_owned(), |p| p.to_string()),
                    info.name
                );
                if let Ok(bytes) = stream.cursor.read_new(&client, info) {
                    use std::io::Write;
                    let _ =
                        std::io::stderr().lock().write_all(&stream.lines.prefix(&label, &bytes));
                }
                // A dead actor's log is complete once read to its end.
                stream.done = actor.state.starts_with("DEAD");
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!("cannot stream actor output to the driver: {e}");
    }
}

/// Asks the streaming thread for one more round, now.
static FLUSH: std::sync::OnceLock<std::sync::mpsc::Sender<std::sync::mpsc::Sender<()>>> =
    std::sync::OnceLock::new();

/// At a cluster driver's exit: prints what its actors wrote since the last round (waiting at
/// most `timeout`), so that their last lines are not lost with the driver.
fn flush_actor_output(timeout: std::time::Duration) {
    let Some(requests) = FLUSH.get() else { return };
    let (ack, done) = std::sync::mpsc::channel();
    if requests.send(ack).is_ok() {
        let _ = done.recv_timeout(timeout);
    }
}

/// Where the driver is in one worker's log.
struct LogStream {
    cursor: LogCursor,
    pid: Option<u32>,
    lines: LinePrefixer,
    done: bool,
}

impl LogStream {
    fn new(file: &str) -> LogStream {
        LogStream {
            cursor: LogCursor::new(file),
            pid: None,
            lines: Default::default(),
            done: false,
        }
    }
}

/// Prefixes whole lines of a byte stream read in chunks: a line cut by a chunk's end waits for
/// the rest.
#[derive(Debug, Default)]
pub struct LinePrefixer {
    /// A line not yet ended.
    partial: Vec<u8>,
}

impl LinePrefixer {
    /// The complete lines of what came so far plus `bytes`, each as `(label) line`.
    pub fn prefix(&mut self, label: &str, bytes: &[u8]) -> Vec<u8> {
        self.partial.extend_from_slice(bytes);
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else { return Vec::new() };
        let mut out = Vec::with_capacity(end + 64);
        for line in self.partial[..end].split(|b| *b == b'\n') {
            out.extend_from_slice(format!("({label}) ").as_bytes());
            out.extend_from_slice(line);
            out.push(b'\n');
        }
        self.partial.drain(..=end);
        out
    }
}
