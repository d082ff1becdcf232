//! Submitted jobs, the shell's side: the file work the core's decisions need — checking a
//! submission's files, laying out its working directory and starting its driver, reading its
//! log, removing its files. The core keeps each job's record (`rtrun_head_core`'s `jobs`).

use crate::error::{Error, Result};
use crate::protocol::JobInfo;
use crate::transport::Route;

use super::Head;
use super::spawn::{SUPERVISOR_NAME, SpawnRequest, supervised_exit};
use rtrun_head_core::JobStart;

impl Head {
    /// Checks what a submission needs from the head's disk before the core records it: a
    /// cluster head, the uploaded binary and, when given, the working-directory package.
    pub(super) fn check_submission(&self, binary: &str, working_dir: Option<&str>) -> Result<()> {
        let cluster = self
            .cluster
            .get()
            .ok_or_else(|| Error::Invalid("jobs are submitted to a cluster head".into()))?;
        if !cluster.binaries.path(binary).exists() {
            return Err(Error::Invalid(format!("job binary {binary} was not uploaded")));
        }
        if let Some(digest) = working_dir
            && !cluster.binaries.contains(digest)
        {
            return Err(Error::Invalid(format!(
                "the working directory package {digest} was not uploaded"
            )));
        }
        Ok(())
    }

    /// Starts a job the core recorded ([`Effect::StartJob`](rtrun_head_core::Effect)): lays
    /// out its working directory and starts its driver on the head's node. A job whose files
    /// cannot be laid out fails before its driver starts.
    pub(super) fn start_job(&self, start: Box<JobStart>) -> Result<JobInfo> {
        let JobStart { job, worker, binary, args, env, log, package, info, .. } = *start;
        let cluster = self
            .cluster
            .get()
            .cloned()
            .ok_or_else(|| Error::Invalid("jobs are submitted to a cluster head".into()))?;
        let mut env = env;
        let head = match Route::parse(&cluster.address)? {
            Route::Quic { addr, .. } => addr.to_string(),
            Route::Unix(_) => return Err(Error::Invalid("the head has no network address".into())),
        };
        env.push((crate::cluster::ADDRESS_ENV.into(), head));
        env.push((crate::cluster::JOB_ENV.into(), job.to_string()));
        env.extend(crate::cluster::node_env(self.local_node, &cluster.address));
        let package = package.map(|digest| cluster.binaries.path(&digest));
        let cwd = package.as_ref().map(|_| cluster.jobs_dir.join(format!("job-{job}")));
        if let Some(dir) = &cwd {
            env.push((crate::cluster::WORKING_DIR_ENV.into(), dir.display().to_string()));
        }
        if let (Some(dir), Some(package)) = (&cwd, &package) {
            crate::cluster::working_dir::unpack(package, dir)?;
        }
        // A head with a state directory starts drivers that outlive it (a restarted head
        // adopts them); otherwise a job's driver ends with its head.
        let persistent = self.state.lock().reconnect_window.is_some();
        let request = SpawnRequest {
            worker,
            env,
            binary: Some(cluster.binaries.path(&binary)),
            outlives_head: persistent.then(|| status_file(&log)),
            log: Some(log),
            job: Some(binary),
            args: Vec::new(),
            cwd,
        };
        self.spawner.spawn(request.with_args(args))?;
        Ok(info)
    }

    /// Takes up the driver of a submitted job that outlived the previous head (`pid`, under
    /// its supervising shell): a thread watches it (this process is not its parent, so it cannot
    /// wait for it) and reports its exit with the status its shell wrote.
    pub(super) fn adopt_job(
        &self,
        worker: crate::ids::WorkerId,
        pid: u32,
        log: std::path::PathBuf,
    ) {
        let head = self.weak.clone();
        let status = status_file(&log);
        let watching =
            std::thread::Builder::new().name(format!("rtrun-job-{}", worker.0)).spawn(move || {
                // A pid reused by another process is not the job's shell.
                let ours = std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                    cmdline.split(|b| *b == 0).any(|arg| arg == SUPERVISOR_NAME.as_bytes())
                });
                while ours && running(pid) {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                let exit = supervised_exit(&status).unwrap_or_else(|| {
                    crate::protocol::WorkerExit::Lost(
                        "its supervising shell ended without saying how the driver did".into(),
                    )
                });
                if let Some(head) = head.upgrade() {
                    head.on_worker_exit(worker, exit);
                }
            });
        if let Err(e) = watching {
            tracing::error!("cannot watch an adopted job's driver: {e}");
        }
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

/// Whether process `pid` runs (it exists and is not a zombie waiting for its new parent).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command name's closing parenthesis.
        stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()) != Some('Z')
    })
}

/// Where a job driver that outlives its head leaves its exit status: beside its log.
pub(super) fn status_file(log: &std::path::Path) -> std::path::PathBuf {
    log.with_extension("status")
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
