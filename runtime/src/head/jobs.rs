//! Submitted jobs, the shell's side: checking and laying out a submission (its binary and
//! working directory on disk), starting its driver, its log, stopping it. The core keeps each
//! job's record (its driver's pid and exit are events like any worker's).

use crate::error::{Error, Missing, Result};
use crate::ids::WorkerId;
use crate::protocol::{JobInfo, JobState};

use super::Head;
use super::core::JobEntry;
use super::spawn::SpawnRequest;

impl Head {
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
                    if state.core.members.jobs.values().any(|j| j.submission_id == name) {
                        return Err(Error::Invalid(format!(
                            "a job with submission id `{name}` exists already (`rtrun job \
                             status {name}`); choose another"
                        )));
                    }
                    name
                }
                None => format!("rtrunsubmit_{:016x}", crate::runtime::random_u64()),
            };
            let cluster = self
                .cluster
                .get()
                .cloned()
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
            let id = state.core.members.next_id();
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
            env.extend(crate::cluster::node_env(self.local_node, &cluster.address));
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
                package: working_dir.clone(),
            };
            let info = entry.info(id);
            state.core.members.jobs.insert(id, entry);
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
            if let Some(entry) = self.state.lock().core.members.jobs.get_mut(&id) {
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
            let entry =
                state.core.members.jobs.get(&job).ok_or(Error::NotFound(Missing::Job(job)))?;
            (entry.log.clone(), entry.info(job))
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
            let entry =
                state.core.members.jobs.get_mut(&job).ok_or(Error::NotFound(Missing::Job(job)))?;
            if entry.state != JobState::Running {
                return Ok(entry.info(job));
            }
            entry.stop_requested = true;
            (entry.pid, entry.info(job))
        };
        if let Some(pid) = pid {
            super::spawn::kill_process(pid);
        }
        Ok(info)
    }

    /// Removes an ended job's unpacked working directory and, when given, its package (the
    /// head's disk held every job's copy until `rtrun stop`, and after). Its log stays.
    pub(crate) fn remove_job_files(&self, job: u64, package: Option<String>) {
        let Some(cluster) = self.cluster.get() else { return };
        let dir = cluster.jobs_dir.join(format!("job-{job}"));
        if dir.exists()
            && let Err(e) = std::fs::remove_dir_all(&dir)
        {
            tracing::warn!(job, "cannot remove the job's directory {}: {e}", dir.display());
        }
        if let Some(digest) = package {
            remove_file(job, "package", &cluster.binaries.path(&digest));
        }
    }
}

/// Removes one of job `job`'s files (`what`: its package, its log), warning when it cannot (one
/// already gone, as a never-started job's log, is fine).
pub(super) fn remove_file(job: u64, what: &str, path: &std::path::Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(job, "cannot remove the job's {what} {}: {e}", path.display());
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
