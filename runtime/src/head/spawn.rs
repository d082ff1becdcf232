//! Spawning and reaping worker processes.
//!
//! Workers are this executable re-run with a worker environment. They are started from one
//! long-lived thread because Linux delivers the parent-death signal when the *thread* that
//! forked a child exits; with that thread living as long as the process, every worker gets
//! SIGKILL exactly when the driver process dies — also when the driver itself is SIGKILLed.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Weak};

use crate::error::{Error, Result};
use crate::ids::WorkerId;
use crate::protocol::WorkerExit;
use crate::runtime::Runtime;

/// Who learns of the spawner's children: the head (embedded session, head node) or a node
/// daemon (which reports to the head).
pub(crate) trait SpawnEvents: Send + Sync + 'static {
    /// The worker's process started.
    fn on_spawned(&self, worker: WorkerId, pid: u32);
    /// The worker's process exited (or could not start).
    fn on_worker_exit(&self, worker: WorkerId, status: WorkerExit);
    /// The runtime whose node store the children inherit.
    fn runtime(&self) -> Option<Arc<Runtime>>;
    /// Whether workers without a log file print on this process's stdout/stderr, each line
    /// prefixed with [`SpawnEvents::worker_label`] (an embedded session's driver); else they
    /// inherit them.
    fn echoes_output(&self) -> bool {
        false
    }
    /// What a worker's output lines are prefixed with: its actor's type, once it hosts one.
    fn worker_label(&self, _worker: WorkerId) -> Option<String> {
        None
    }
}

/// A worker to start.
pub(crate) struct SpawnRequest {
    pub(crate) worker: WorkerId,
    pub(crate) env: Vec<(String, String)>,
    /// The executable to run (a job's binary from the node's cache); `None`: this process's own
    /// executable with its arguments (an embedded session's driver).
    pub(crate) binary: Option<std::path::PathBuf>,
    /// Where the child's stdout and stderr go (inherited when `None`).
    pub(crate) log: Option<std::path::PathBuf>,
    /// The job binary's digest (what a node daemon must run).
    pub(crate) job: Option<String>,
    /// Arguments for `binary` (a submitted job's driver; workers need none).
    pub(crate) args: Vec<String>,
    /// The directory it starts in (a submitted job's working directory; else inherited).
    pub(crate) cwd: Option<std::path::PathBuf>,
    /// A submitted job's driver that must outlive this process (a head with a state
    /// directory): started under a supervising shell in its own session, without the
    /// parent-death signal, its output appended straight to its log (no pipe through this
    /// process), and its exit code written to this file (see [`SUPERVISOR`]).
    pub(crate) outlives_head: Option<std::path::PathBuf>,
}

/// The supervising shell of a job driver that outlives its head: runs the driver, writes its
/// exit status (`$?`: the code, or 128 + the signal) to `$RTRUN_JOB_STATUS` by an atomic
/// rename, and exits with it. Its `$0` names it in `ps` and `/proc/PID/cmdline`.
const SUPERVISOR: &str = r#""$@"; code=$?; printf '%s
' "$code" > "$RTRUN_JOB_STATUS.tmp" && mv -f "$RTRUN_JOB_STATUS.tmp" "$RTRUN_JOB_STATUS"; exit "$code""#;

/// The supervisor's `$0`.
pub(crate) const SUPERVISOR_NAME: &str = "rtrun-job-supervisor";

/// Where a supervised job's status file says how it ended: `None` while it has not.
pub(crate) fn supervised_exit(status_file: &std::path::Path) -> Option<WorkerExit> {
    let text = std::fs::read_to_string(status_file).ok()?;
    let code: i32 = text.trim().parse().ok()?;
    Some(match code {
        129..=192 => WorkerExit::Signal(code - 128),
        code => WorkerExit::Code(code),
    })
}

impl SpawnRequest {
    /// With arguments for the binary.
    pub(crate) fn with_args(mut self, args: Vec<String>) -> SpawnRequest {
        self.args = args;
        self
    }
}

/// Sends spawn requests to the spawner thread.
pub(crate) struct Spawner {
    requests: crossbeam_channel::Sender<SpawnRequest>,
}

impl Spawner {
    /// A spawner and the inbox its thread will serve.
    pub(crate) fn channel() -> (Spawner, SpawnerInbox) {
        let (tx, rx) = crossbeam_channel::unbounded::<SpawnRequest>();
        (Spawner { requests: tx }, SpawnerInbox { requests: rx })
    }

    /// Queues a worker to start.
    pub(crate) fn spawn(&self, request: SpawnRequest) -> Result<()> {
        self.requests
            .send(request)
            .map_err(|_| Error::System("the spawner thread has stopped".into()))
    }
}

/// The running executable's image, as the kernel links it for every process.
const SELF_EXE: &str = "/proc/self/exe";

/// The receiving side of a [`Spawner`].
pub(crate) struct SpawnerInbox {
    requests: crossbeam_channel::Receiver<SpawnRequest>,
}

impl SpawnerInbox {
    /// Starts the spawner thread; it reports spawns and exits to `head`.
    pub(crate) fn run<H: SpawnEvents>(self, head: Weak<H>) -> Result<()> {
        let exe = std::env::current_exe()
            .map_err(|e| Error::System(format!("cannot find this executable: {e}")))?;
        // Workers exec `/proc/self/exe`, which the forked child resolves to the inode this
        // process runs from: a driver binary rebuilt or deleted during the run (cargo replaces
        // the file) still starts workers from the code the driver runs. `argv[0]` stays the path.
        let image = std::path::PathBuf::from(SELF_EXE);
        let image = if image.exists() { image } else { exe.clone() };
        let args: Vec<_> = std::env::args_os().skip(1).collect();
        let rotation = crate::logs::Rotation::from_env();
        std::thread::Builder::new()
            .name("rtrun-spawner".into())
            .spawn(move || {
                let parent = std::process::id();
                for request in self.requests {
                    let Some(head) = head.upgrade() else { return };
                    if let Some(status) = &request.outlives_head {
                        spawn_supervised(&head, &request, status);
                        continue;
                    }
                    let mut command = match &request.binary {
                        Some(binary) => {
                            let mut command = Command::new(binary);
                            command.args(&request.args);
                            command
                        }
                        None => {
                            let mut command = Command::new(&image);
                            command.arg0(&exe).args(&args);
                            command
                        }
                    };
                    command.envs(request.env.iter().cloned()).stdin(Stdio::null());
                    if let Some(dir) = &request.cwd {
                        command.current_dir(dir);
                    }
                    // Output goes through pipes to a rotating log file or, in an embedded
                    // session, to this process's terminal with a prefix.
                    let sinks = output_sinks(&head, &request, rotation);
                    let readers = match &sinks {
                        Some(_) => match (std::io::pipe(), std::io::pipe()) {
                            (Ok((out_r, out_w)), Ok((err_r, err_w))) => {
                                command.stdout(out_w).stderr(err_w);
                                Some((out_r, err_r))
                            }
                            (Err(e), _) | (_, Err(e)) => {
                                tracing::warn!("no pipes for worker output: {e}");
                                None
                            }
                        },
                        None => None,
                    };
                    // The node's object arena: the worker inherits its fd (close-on-exec is
                    // cleared in the child only) and learns of it from the environment.
                    let arena = head.runtime().and_then(|runtime| runtime.store_inheritance());
                    if let Some((_, env)) = &arena {
                        command.envs(env.iter().cloned());
                    }
                    let arena_fd = arena.map(|(fd, _)| fd);
                    // SAFETY: the closure runs in the forked child before exec and only makes
                    // async-signal-safe calls (prctl, getppid, fcntl, _exit).
                    unsafe {
                        command.pre_exec(move || {
                            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                                return Err(std::io::Error::last_os_error());
                            }
                            if let Some(fd) = arena_fd {
                                let flags = libc::fcntl(fd, libc::F_GETFD);
                                if flags < 0
                                    || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0
                                {
                                    return Err(std::io::Error::last_os_error());
                                }
                            }
                            // The parent may have died between fork and prctl.
                            if libc::getppid() != parent as libc::pid_t {
                                libc::_exit(1);
                            }
                            Ok(())
                        });
                    }
                    let spawned = command.spawn();
                    // The pipes' write ends live in `command`: closed here, so that the
                    // readers see the end of output when the child exits.
                    drop(command);
                    if let (Ok(child), Some((out, err)), Some((out_sink, err_sink))) =
                        (&spawned, readers, sinks)
                    {
                        let pid = child.id();
                        let label = |sink| with_pid(sink, pid);
                        let name = |kind| format!("rtrun-{kind}-{}", request.worker.0);
                        crate::logs::pump(name("out"), out, label(out_sink));
                        crate::logs::pump(name("err"), err, label(err_sink));
                    }
                    match spawned {
                        Ok(child) => {
                            head.on_spawned(request.worker, child.id());
                            start_reaper(&head, request.worker, child);
                        }
                        Err(e) => {
                            let why = WorkerExit::Lost(format!("failed to start: {e}"));
                            head.on_worker_exit(request.worker, why)
                        }
                    }
                }
            })
            .map_err(|e| Error::System(format!("cannot start the spawner thread: {e}")))?;
        Ok(())
    }
}

/// Starts a job driver that outlives this process under [`SUPERVISOR`] (see
/// [`SpawnRequest::outlives_head`]) and reaps it while this process lives.
fn spawn_supervised<H: SpawnEvents>(
    head: &Arc<H>,
    request: &SpawnRequest,
    status: &std::path::Path,
) {
    let started = (|| -> std::io::Result<std::process::Child> {
        let binary = request.binary.as_ref().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "a job driver has a binary")
        })?;
        let _ = std::fs::remove_file(status);
        let mut command = Command::new("/bin/sh");
        command.arg("-c").arg(SUPERVISOR).arg(SUPERVISOR_NAME).arg(binary).args(&request.args);
        command.envs(request.env.iter().cloned()).env("RTRUN_JOB_STATUS", status);
        command.stdin(Stdio::null());
        if let Some(dir) = &request.cwd {
            command.current_dir(dir);
        }
        if let Some(log) = &request.log {
            let file = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
            command.stdout(file.try_clone()?).stderr(file);
        }
        // SAFETY: the closure runs in the forked child before exec and only calls setsid,
        // which is async-signal-safe.
        unsafe {
            command.pre_exec(|| {
                // Its own session and process group: a signal to the head's group (a
                // terminal's ^C) does not reach it, and `rtrun job stop` kills the group.
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        command.spawn()
    })();
    match started {
        Ok(child) => {
            head.on_spawned(request.worker, child.id());
            start_reaper(head, request.worker, child);
        }
        Err(e) => {
            head.on_worker_exit(request.worker, WorkerExit::Lost(format!("failed to start: {e}")))
        }
    }
}

/// Where a spawned worker's stdout and stderr go: its log file (rotating) when it has one, this
/// process's stdout/stderr when the head echoes output, else nowhere special (inherited).
fn output_sinks<H: SpawnEvents>(
    head: &Arc<H>,
    request: &SpawnRequest,
    rotation: crate::logs::Rotation,
) -> Option<(PendingSink, PendingSink)> {
    if let Some(path) = &request.log {
        return match crate::logs::RotatingLog::open(path, rotation) {
            Ok(log) => {
                let log = Arc::new(parking_lot::Mutex::new(log));
                Some((PendingSink::File(log.clone()), PendingSink::File(log)))
            }
            Err(e) => {
                tracing::warn!("{e}");
                None
            }
        };
    }
    if !head.echoes_output() {
        return None;
    }
    let weak = Arc::downgrade(head);
    let worker = request.worker;
    // A worker hosts at most one actor: once known, its type is not looked up again.
    let known = std::sync::OnceLock::new();
    let label: Arc<dyn Fn() -> Option<String> + Send + Sync> = Arc::new(move || {
        if let Some(label) = known.get() {
            return Some(String::clone(label));
        }
        let label = weak.upgrade().and_then(|head| head.worker_label(worker))?;
        Some(known.get_or_init(|| label).clone())
    });
    Some((
        PendingSink::Echo { stderr: false, label: label.clone() },
        PendingSink::Echo { stderr: true, label },
    ))
}

/// A sink before the child's pid is known.
enum PendingSink {
    File(Arc<parking_lot::Mutex<crate::logs::RotatingLog>>),
    Echo { stderr: bool, label: Arc<dyn Fn() -> Option<String> + Send + Sync> },
}

/// The sink, with the pid in echoed prefixes (`Counter pid=42`, or `pid=42` before the worker
/// hosts an actor).
fn with_pid(sink: PendingSink, pid: u32) -> crate::logs::Sink {
    match sink {
        PendingSink::File(log) => crate::logs::Sink::File(log),
        PendingSink::Echo { stderr, label } => crate::logs::Sink::Echo {
            stderr,
            label: Arc::new(move || match label() {
                Some(actor) => format!("{actor} pid={pid}"),
                None => format!("pid={pid}"),
            }),
        },
    }
}

/// Waits for `child` on its own thread and reports its exit.
fn start_reaper<H: SpawnEvents>(head: &Arc<H>, worker: WorkerId, mut child: std::process::Child) {
    let head = std::sync::Arc::downgrade(head);
    let spawned =
        std::thread::Builder::new().name(format!("rtrun-reap-{}", worker.0)).spawn(move || {
            let status = match child.wait() {
                Ok(status) => WorkerExit::of(status),
                Err(e) => WorkerExit::Lost(format!("could not be waited for: {e}")),
            };
            if let Some(head) = head.upgrade() {
                head.on_worker_exit(worker, status);
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start a reaper thread: {e}");
    }
}

/// Sends SIGKILL to a process, and to its process group when it leads one (a supervised job
/// driver's shell leads its session: the driver goes with it).
pub(crate) fn kill_process(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return };
    // SAFETY: kill(2) has no memory-safety preconditions; a stale pid at worst signals nothing
    // (the reaper has not yet waited for it, so it cannot have been reused). A worker leads no
    // group, so the group kill finds none for it.
    unsafe {
        libc::kill(-pid, libc::SIGKILL);
        libc::kill(pid, libc::SIGKILL);
    }
}
