//! Submitted jobs as the core keeps them: a submission checked and recorded, stopped, its log
//! asked for, deleted. The shell does the file work these decide: it checks a submission's
//! files before the core sees it, and carries out [`Effect::StartJob`] (lays out the working
//! directory, starts the driver) and [`Effect::ReadJobLog`].

use super::{Effect, HeadCore, ReplyToken};
use rtrun_proto::error::{Error, Missing, Result};
use rtrun_proto::ids::WorkerId;
use rtrun_proto::protocol::{JobInfo, JobState, Response};

use crate::members::JobEntry;

/// Start submitted job `job`: lay out its working directory (`package`, when given), start its
/// driver `worker` running `binary` with `args` and `env` (and the cluster's own variables),
/// logging into `log`; then answer `reply` with `info`, or with the error and
/// [`HeadCore::job_failed_to_start`].
#[derive(Debug)]
pub struct JobStart {
    pub reply: ReplyToken,
    pub job: u64,
    pub worker: WorkerId,
    pub binary: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub log: std::path::PathBuf,
    pub package: Option<String>,
    pub info: JobInfo,
}

/// What `rtrun job submit` asks for.
#[derive(Debug)]
pub(super) struct Submission {
    pub(super) binary: String,
    pub(super) args: Vec<String>,
    pub(super) env: Vec<(String, String)>,
    pub(super) submission_id: Option<String>,
    pub(super) working_dir: Option<String>,
}

impl HeadCore {
    /// Records a submitted job and asks the shell to start its driver, which answers `reply`.
    pub(super) fn submit_job(
        &mut self,
        submission: Submission,
        reply: ReplyToken,
        effects: &mut Vec<Effect>,
    ) -> Result<()> {
        let Some(log_dir) = self.members.job_log_dir.clone() else {
            return Err(Error::Invalid("jobs are submitted to a cluster head".into()));
        };
        // The shell names a job without a submission id at random (a restarted head reuses
        // numbers); one from elsewhere (the simulator) is named by its number.
        if let Some(name) = &submission.submission_id {
            check_submission_id(name)?;
            if self.members.jobs.values().any(|j| &j.submission_id == name) {
                return Err(Error::Invalid(format!(
                    "a job with submission id `{name}` exists already (`rtrun job \
                         status {name}`); choose another"
                )));
            }
        }
        let id = self.members.next_id();
        let submission_id =
            submission.submission_id.unwrap_or_else(|| format!("rtrunsubmit_{id:016x}"));
        let entry = JobEntry {
            worker: WorkerId(id),
            binary: submission.binary,
            args: submission.args,
            log: log_dir.join(format!("job-{id}.log")),
            state: JobState::Running,
            submission_id,
            env: submission.env,
            pid: None,
            driver: None,
            stop_requested: false,
            package: submission.working_dir,
        };
        effects.push(Effect::StartJob(Box::new(JobStart {
            reply,
            job: id,
            worker: entry.worker,
            binary: entry.binary.clone(),
            args: entry.args.clone(),
            env: entry.env.clone(),
            log: entry.log.clone(),
            package: entry.package.clone(),
            info: entry.info(id),
        })));
        self.journal.job(id);
        self.members.jobs.insert(id, entry);
        Ok(())
    }

    /// The shell could not start job `job` (its files could not be laid out).
    pub fn job_failed_to_start(&mut self, job: u64, reason: String) {
        self.journal.job(job);
        if let Some(entry) = self.members.jobs.get_mut(&job) {
            entry.state = JobState::Failed { reason };
        }
    }

    /// Stops job `job`: kills its driver (now, or as soon as it has started), whose leaving
    /// takes its workers and placement groups; the job ends `Stopped`. A job that has ended is
    /// left as it is.
    pub(super) fn stop_job(&mut self, job: u64, effects: &mut Vec<Effect>) -> Result<JobInfo> {
        let head_node = self.members.head_node;
        let entry = self.members.jobs.get_mut(&job).ok_or(Error::NotFound(Missing::Job(job)))?;
        if entry.state == JobState::Running {
            self.journal.job(job);
            entry.stop_requested = true;
            if let Some(pid) = entry.pid {
                effects.push(Effect::Kill { node: head_node, pid });
            }
        }
        Ok(entry.info(job))
    }

    /// Asks the shell for job `job`'s log from `offset`, answered to `reply` with its state.
    pub(super) fn job_logs(
        &self,
        job: u64,
        offset: u64,
        reply: ReplyToken,
        effects: &mut Vec<Effect>,
    ) -> Result<()> {
        let entry = self.members.jobs.get(&job).ok_or(Error::NotFound(Missing::Job(job)))?;
        let (log, info) = (entry.log.clone(), entry.info(job));
        effects.push(Effect::ReadJobLog { reply, log, offset, info: Box::new(info) });
        Ok(())
    }

    /// Forgets ended job `job` and asks the shell to remove its log.
    pub(super) fn delete_job(&mut self, job: u64, effects: &mut Vec<Effect>) -> Response {
        match self.members.delete_job(job) {
            Ok((info, log)) => {
                self.journal.job(job);
                effects.push(Effect::RemoveJobLog { job, log });
                Response::Jobs(vec![info])
            }
            Err(e) => Response::Error(e),
        }
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
