//! `reward.kind: python`: reward functions written in Python with OpenRLHF's signature,
//! `reward_func(queries, prompts, labels)` (`queries` are prompt + response texts), scored batch
//! by batch in long-lived Python processes. Each process belongs to an rtrun actor
//! ([`PythonRewardWorker`], `reward.parallel_tasks` of them), which starts it with the
//! interpreter `reward.python` and talks to it over its stdin and stdout, one JSON object per
//! line (the script is `python/reward_worker.py`, built in). The runtime itself runs no Python.
//!
//! An exception in the function comes back with its traceback, which names the file and line;
//! a process that dies or a batch that takes longer than `reward.timeout_s` is an error naming
//! the file, never a hang.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::reward::{RewardAnswer, RewardQuery};

/// The worker script.
const WORKER: &str = include_str!("python/reward_worker.py");

/// How a worker starts its Python process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PythonRewardConfig {
    /// The interpreter (`reward.python`).
    pub python: String,
    /// The file defining the function (`reward.path`).
    pub path: PathBuf,
    /// The function's name (`reward.function`).
    pub function: String,
    /// Seconds a batch (and the start) may take (`reward.timeout_s`).
    pub timeout_s: f64,
}

/// A running Python process and its answer lines.
struct Process {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

/// The answer the worker script writes for a batch: `rewards` (with `scores` and
/// `extra_logs` when the function gave them), `error`, or at the start `ready`.
#[derive(Debug, Deserialize)]
struct Reply {
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    ready: Option<bool>,
    #[serde(flatten)]
    rest: serde_json::Value,
}

/// An actor owning one Python reward process.
pub struct PythonRewardWorker {
    config: PythonRewardConfig,
    process: Mutex<Process>,
}

#[rtrun::actor(pub)]
impl PythonRewardWorker {
    /// Starts the Python process and waits until the function has loaded.
    pub fn new(config: PythonRewardConfig) -> Result<Self, String> {
        let mut child = Command::new(&config.python)
            .arg("-c")
            .arg(WORKER)
            .arg(&config.path)
            .arg(&config.function)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                format!(
                    "reward.python: cannot start `{}` for {}: {e}",
                    config.python,
                    config.path.display()
                )
            })?;
        let (stdin, stdout) = match (child.stdin.take(), child.stdout.take()) {
            (Some(stdin), Some(stdout)) => (stdin, stdout),
            _ => return Err("reward.python: the process has no stdin or stdout".into()),
        };
        let (send, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        let worker =
            PythonRewardWorker { config, process: Mutex::new(Process { child, stdin, lines }) };
        match worker.read_reply()? {
            Reply { ready: Some(true), .. } => Ok(worker),
            reply => Err(worker.failure("loading", reply)),
        }
    }

    /// The reward of each query, in order.
    pub fn score(&self, queries: Vec<RewardQuery>) -> Result<RewardAnswer, String> {
        let request = serde_json::json!({
            "queries": queries.iter().map(|q| format!("{}{}", q.prompt, q.response)).collect::<Vec<_>>(),
            "prompts": queries.iter().map(|q| q.prompt.as_str()).collect::<Vec<_>>(),
            "labels": queries.iter().map(|q| q.label.as_str()).collect::<Vec<_>>(),
        });
        {
            let mut process = self.lock();
            let line = format!("{request}\n");
            process
                .stdin
                .write_all(line.as_bytes())
                .and_then(|()| process.stdin.flush())
                .map_err(|e| self.context(&format!("the Python process took no batch ({e})")))?;
        }
        let reply = self.read_reply()?;
        if reply.error.is_some() {
            return Err(self.failure("scoring a batch", reply));
        }
        RewardAnswer::from_json(&reply.rest, queries.len()).map_err(|e| self.context(&e))
    }
}

impl PythonRewardWorker {
    fn lock(&self) -> std::sync::MutexGuard<'_, Process> {
        self.process.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The next answer line, within the timeout.
    fn read_reply(&self) -> Result<Reply, String> {
        let timeout = Duration::from_secs_f64(self.config.timeout_s);
        let line = match self.lock().lines.recv_timeout(timeout) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                let _ = self.lock().child.kill();
                return Err(self.context(&format!(
                    "no answer within reward.timeout_s = {}s; the process was stopped",
                    self.config.timeout_s
                )));
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.lock().child.wait().map(|s| s.to_string()).unwrap_or_default();
                return Err(self.context(&format!(
                    "the Python process exited ({status}); its stderr is in the worker's log"
                )));
            }
        };
        serde_json::from_str(&line)
            .map_err(|e| self.context(&format!("expected a JSON answer, found `{line}` ({e})")))
    }

    /// An error for `reply` while `doing`, with the Python traceback when there is one.
    fn failure(&self, doing: &str, reply: Reply) -> String {
        match reply.error {
            Some(traceback) => self.context(&format!("{doing} raised:\n{}", traceback.trim_end())),
            None => self.context(&format!("{doing}: the answer had no `rewards`")),
        }
    }

    fn context(&self, message: &str) -> String {
        format!(
            "reward.path {} (function `{}`): {message}",
            self.config.path.display(),
            self.config.function
        )
    }
}

impl Drop for PythonRewardWorker {
    fn drop(&mut self) {
        let process = self.process.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
        let _ = process.child.kill();
        let _ = process.child.wait();
    }
}
