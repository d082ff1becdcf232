//! The command-line client of a cluster (`rtrun status`, `list`, `logs`, `submit`, `stop`): a
//! process that joins as a driver without a binary and asks the control plane.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::placement_group::PlacementGroupState;
use crate::protocol::{ActorSummary, ClusterInfo, JobInfo, NodeMemory, Request, Response, StoreOp};
use crate::runtime::{Config, Runtime};

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

    fn call(&self, request: Request) -> Result<Response> {
        self.runtime.head_call(request)
    }

    /// Nodes, resources and counts.
    pub fn status(&self) -> Result<ClusterInfo> {
        match self.call(Request::ClusterInfo)? {
            Response::ClusterInfo(info) => Ok(info),
            other => Err(unexpected(other)),
        }
    }

    /// Every actor.
    pub fn actors(&self) -> Result<Vec<ActorSummary>> {
        match self.call(Request::ListActors)? {
            Response::Actors(actors) => Ok(actors),
            other => Err(unexpected(other)),
        }
    }

    /// Every live placement group.
    pub fn placement_groups(&self) -> Result<Vec<PlacementGroupState>> {
        match self.call(Request::ListPlacementGroups)? {
            Response::PlacementGroups(groups) => Ok(groups),
            other => Err(unexpected(other)),
        }
    }

    /// Every submitted job.
    pub fn jobs(&self) -> Result<Vec<JobInfo>> {
        match self.call(Request::ListJobs)? {
            Response::Jobs(jobs) => Ok(jobs),
            other => Err(unexpected(other)),
        }
    }

    /// The object store of every live node.
    pub fn objects(&self) -> Result<Vec<NodeMemory>> {
        let info = self.status()?;
        let mut nodes = Vec::new();
        for node in info.nodes.iter().filter(|n| n.alive) {
            let conn = self.runtime.endpoint()?.connect(&node.address)?;
            let holder = crate::store::holder_of(self.runtime.worker_id);
            match self.runtime.call_on(&conn, Request::Store { holder, op: StoreOp::Stats })? {
                Response::StoreStats(memory) => nodes.push(*memory),
                other => return Err(unexpected(other)),
            }
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
        super::upload_binary(member, binary, &digest)?;
        single_job(self.call(Request::SubmitJob {
            binary: digest,
            args,
            env,
            submission_id,
            working_dir,
        })?)
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
        single_job(self.call(Request::StopJob { job })?)
    }

    /// A job's output from `offset`, and its state.
    pub fn job_logs(&self, job: u64, offset: u64) -> Result<(Vec<u8>, JobInfo)> {
        match self.call(Request::JobLogs { job, offset })? {
            Response::Logs { bytes, job } => Ok((bytes, job)),
            other => Err(unexpected(other)),
        }
    }

    /// Removes the placement group named `name` (its actors and tasks are stopped, its
    /// resources freed), whoever created it.
    pub fn remove_placement_group(&self, name: &str) -> Result<PlacementGroupState> {
        let group = match self.call(Request::GetPlacementGroupByName { name: name.to_owned() })? {
            Response::PlacementGroup(group) => *group,
            other => return Err(unexpected(other)),
        };
        self.call(Request::RemovePlacementGroup { group: group.id })?;
        Ok(group)
    }

    /// Stops every node and the head.
    pub fn stop(&self) -> Result<()> {
        // The head's connection closing after this is the expected end, not a lost head.
        self.runtime.expect_head_exit();
        self.call(Request::StopCluster).map(|_| ())
    }
}

fn single_job(response: Response) -> Result<JobInfo> {
    match response {
        Response::Jobs(mut jobs) if jobs.len() == 1 => Ok(jobs.remove(0)),
        other => Err(unexpected(other)),
    }
}

fn unexpected(response: Response) -> Error {
    Error::Transport(format!("unexpected answer from the head: {response:?}"))
}
