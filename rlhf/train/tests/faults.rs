//! Faults of a run, with the real `train` driver and its worker processes: a role's worker
//! killed (SIGKILL) or stopped (SIGSTOP) mid-run must end the run with an error naming the role
//! and rank, a rerun must not silently replace a finished run, and what can be checked before
//! the warm-up (placement spec, GPU count) is checked before it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rtrun_tests::signal;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rtrun-faults-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small, fast config file: few prompts, a 5-step warm-up, GRPO with a reference; `train`
/// adds keys to the `train` section.
fn write_config(dir: &Path, train: &str, extra: &str) -> PathBuf {
    let path = dir.join("config.yaml");
    let yaml = format!(
        "seed: 7\n\
         data: {{synthetic: {{kind: reverse_digits, min_digits: 2, max_digits: 4, train_size: 64, eval_size: 8}}}}\n\
         model: {{hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 64}}\n\
         warmup: {{steps: 5, batch_size: 16, lr: 0.003}}\n\
         algo: {{advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, init_kl_coef: 0.01}}\n\
         rollout: {{prompts_per_step: 4, n_samples_per_prompt: 2}}\n\
         train: {{train_batch_size: 4, micro_batch_size: 2, actor_lr: 0.001{train}}}\n\
         eval: {{every_steps: 0}}\n{extra}"
    );
    std::fs::write(&path, yaml).unwrap();
    path
}

/// The driver, its stderr going to `stderr_file` (a pipe nobody reads could fill and block it).
fn train(config: &Path, run_dir: &Path, sets: &[&str], stderr_file: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train"));
    cmd.arg("--config").arg(config).arg("--set").arg(format!("run_dir={}", run_dir.display()));
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    cmd.stdout(Stdio::null()).stderr(std::fs::File::create(stderr_file).unwrap());
    cmd
}

/// A running driver, killed (with a stopped worker resumed and killed) when the test ends,
/// whatever happens.
struct Running {
    child: Child,
    stopped: Option<u32>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(pid) = self.stopped {
            signal(pid, libc::SIGCONT);
            signal(pid, libc::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `done` every 20 ms until it holds; panics with `what` after `limit`.
fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The driver's worker process that hosts rank `rank` of `role` (the trainer marks each rank's
/// process with `RTRUN_RLHF_ROLE=<role>:<rank>`).
fn worker_pid(driver: u32, role: &str, rank: usize) -> Option<u32> {
    rtrun_tests::descendant_with_env(driver, "RTRUN_RLHF_ROLE", &format!("{role}:{rank}"))
}

/// Starts a long run and waits until its first training step is recorded (every role is up and
/// has answered at least once).
fn start_long_run(dir: &Path, sets: &[&str]) -> (Running, PathBuf) {
    let config = write_config(dir, ", num_episodes: 100, max_steps: 1000", "");
    let run_dir = dir.join("run");
    let stderr = dir.join("stderr.txt");
    let child = train(&config, &run_dir, sets, &stderr).spawn().unwrap();
    let mut running = Running { child, stopped: None };
    let metrics = run_dir.join("metrics.jsonl");
    wait_until(Duration::from_secs(180), "the run records step 1", || {
        if let Some(status) = running.child.try_wait().unwrap() {
            let err = std::fs::read_to_string(&stderr).unwrap_or_default();
            panic!("the run ended ({status}) before step 1: {err}");
        }
        std::fs::read_to_string(&metrics).is_ok_and(|m| m.lines().count() >= 2)
    });
    (running, stderr)
}

/// Waits for the driver to end (at most `limit`); returns whether it succeeded and its stderr.
fn wait_exit(running: &mut Running, stderr: &Path, limit: Duration) -> (bool, String) {
    let mut status = None;
    wait_until(limit, "the driver exits", || {
        status = running.child.try_wait().unwrap();
        status.is_some()
    });
    (status.unwrap().success(), std::fs::read_to_string(stderr).unwrap())
}

#[test]
fn a_killed_worker_fails_the_run_with_an_error_naming_its_role_and_rank() {
    for (role, rank) in [("vllm_engine", 0), ("actor", 0)] {
        let dir = scratch(&format!("kill-{role}"));
        let (mut running, stderr) = start_long_run(&dir, &[]);
        let pid = worker_pid(running.child.id(), role, rank)
            .unwrap_or_else(|| panic!("no worker process of {role} rank {rank}"));
        signal(pid, libc::SIGKILL);
        let (ok, err) = wait_exit(&mut running, &stderr, Duration::from_secs(60));
        assert!(!ok, "the run must fail when {role} rank {rank} dies: {err}");
        let expected = format!("{role} rank {rank} (actor-");
        let line = err.lines().find(|l| l.starts_with("Error:")).unwrap_or_default();
        assert!(line.contains(&expected) && line.contains(" died: "), "{err}");
        drop(running);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A tensor-parallel engine whose rank 1 is SIGKILLed mid-run: the run fails (no hang in the
/// rank's collectives) with an error naming the engine, the tensor-parallel rank and its node.
#[test]
fn a_killed_tensor_parallel_rank_fails_the_run_naming_the_rank_and_its_node() {
    let dir = scratch("kill-tp-rank");
    let (mut running, stderr) = start_long_run(&dir, &["engine.tensor_parallel_size=2"]);
    // Engine 0's ranks are `vllm_engine:0` and `vllm_engine:1`.
    let pid = worker_pid(running.child.id(), "vllm_engine", 1).expect("the engine's rank 1");
    signal(pid, libc::SIGKILL);
    let (ok, err) = wait_exit(&mut running, &stderr, Duration::from_secs(60));
    assert!(!ok, "the run must fail when a tensor-parallel rank dies: {err}");
    let line = err.lines().find(|l| l.starts_with("Error:")).unwrap_or_default();
    assert!(
        line.contains("vllm_engine rank 0 (actor-")
            && line.contains("tensor-parallel rank 1")
            && line.contains("on node"),
        "{err}"
    );
    drop(running);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `rollout.mode: async`: the engine SIGKILLed while the rollout thread streams from it fails
/// the run naming it; a rerun resumes from the newest checkpoint, and its first step trains on
/// fresh samples of the resumed policy, none of the killed run's queue.
#[test]
fn a_killed_engine_in_async_mode_fails_the_run_naming_it_and_a_rerun_resumes() {
    killed_engine_in_async_mode("kill-async", &[]);
}

/// The same with `train.pipeline: dock`: the killed run's groups were in its dock, and the
/// rerun's new dock holds none of them.
#[test]
fn a_killed_engine_in_async_mode_on_the_dock_fails_the_run_naming_it_and_a_rerun_resumes() {
    killed_engine_in_async_mode(
        "kill-async-dock",
        &["train.pipeline=dock", "logging.samples_per_step=0"],
    );
}

fn killed_engine_in_async_mode(name: &str, extra: &[&str]) {
    let dir = scratch(name);
    let mut sets = vec!["rollout.mode=async", "checkpoint.every_steps=2"];
    sets.extend_from_slice(extra);
    let (mut running, stderr) = start_long_run(&dir, &sets);
    let run_dir = dir.join("run");
    let checkpoints = run_dir.join("checkpoints");
    wait_until(Duration::from_secs(120), "a checkpoint", || {
        std::fs::read_dir(&checkpoints).is_ok_and(|mut d| d.next().is_some())
    });
    let pid = worker_pid(running.child.id(), "vllm_engine", 0).expect("the engine's worker");
    signal(pid, libc::SIGKILL);
    let (ok, err) = wait_exit(&mut running, &stderr, Duration::from_secs(60));
    assert!(!ok, "the run must fail when its engine dies: {err}");
    let line = err.lines().find(|l| l.starts_with("Error:")).unwrap_or_default();
    assert!(line.contains("vllm_engine rank 0 (actor-") && line.contains(" died: "), "{err}");
    drop(running);

    let newest = std::fs::read_dir(&checkpoints)
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step_")?.parse::<u64>().ok())
        .max()
        .expect("a checkpoint");
    let until = format!("train.max_steps={}", newest + 2);
    let rerun_err = dir.join("rerun.txt");
    let config = dir.join("config.yaml");
    sets.push(&until);
    let status = train(&config, &run_dir, &sets, &rerun_err).status().unwrap();
    let log = std::fs::read_to_string(&rerun_err).unwrap();
    assert!(status.success(), "the rerun failed: {log}");
    assert_eq!(rtrun_tests::resumed_from(&log), Some(newest), "{log}");
    let records: Vec<rtrun_rlhf_telemetry::StepMetrics> =
        rtrun_rlhf_telemetry::jsonl::read_jsonl(&run_dir.join("metrics.jsonl")).unwrap();
    let first = records.iter().rev().find(|r| r.step() == newest + 1).expect("the resumed step");
    assert_eq!(first.get("rollout/oldest_version"), Some(newest as f64), "{first:?}");
    assert_eq!(records.last().unwrap().step(), newest + 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_stopped_worker_fails_the_step_at_the_call_deadline_naming_its_role_and_rank() {
    let dir = scratch("stop");
    let (mut running, stderr) =
        start_long_run(&dir, &["cluster.call_timeout_s=8", "cluster.stall_warn_s=2"]);
    let pid = worker_pid(running.child.id(), "vllm_engine", 0).expect("the engine's worker");
    signal(pid, libc::SIGSTOP);
    running.stopped = Some(pid);
    let stopped = Instant::now();
    // Deadline 8 s, plus the step's work before its next engine call and the shutdown.
    let (ok, err) = wait_exit(&mut running, &stderr, Duration::from_secs(60));
    eprintln!(
        "the run ended {:.1} s after the engine was stopped",
        stopped.elapsed().as_secs_f64()
    );
    assert!(!ok, "the run must fail while its engine is stopped: {err}");
    let line = err.lines().find(|l| l.starts_with("Error:")).unwrap_or_default();
    assert!(
        line.contains("vllm_engine rank 0 (actor-") && line.contains("cluster.call_timeout_s = 8"),
        "{err}"
    );
    // The watchdog warned, naming the late rank, before the deadline.
    assert!(
        err.lines().any(|l| l.contains("WARN") && l.contains("vllm_engine rank 0 (actor-")),
        "{err}"
    );
    drop(running);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The files of a finished run, by name (the event file by its prefix).
fn outputs(run_dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(run_dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect();
    files.sort();
    files
}

#[test]
fn a_rerun_refuses_to_replace_a_finished_run_without_overwrite() {
    let dir = scratch("rerun");
    let config = write_config(&dir, ", max_steps: 1", "checkpoint: {every_steps: 0}\n");
    let run_dir = dir.join("run");
    let stderr = dir.join("stderr.txt");
    let status = train(&config, &run_dir, &[], &stderr).status().unwrap();
    assert!(status.success(), "{}", std::fs::read_to_string(&stderr).unwrap());
    let first = outputs(&run_dir);
    for name in ["metrics.jsonl", "summary.md", "reward.png"] {
        assert!(first.iter().any(|(n, _)| n == name), "the first run wrote {name}");
    }
    assert!(first.iter().any(|(n, _)| n.starts_with("events.out.tfevents.")));

    // The same command again: refused before any work, naming the directory and the way out.
    let started = Instant::now();
    let status = train(&config, &run_dir, &[], &stderr).status().unwrap();
    let err = std::fs::read_to_string(&stderr).unwrap();
    assert!(!status.success(), "a rerun over a finished run must fail: {err}");
    let line = err.lines().find(|l| l.starts_with("Error:")).unwrap_or_default();
    for part in [&run_dir.display().to_string(), "metrics.jsonl", "--overwrite", "run_dir"] {
        assert!(line.contains(part), "`{part}` in {err}");
    }
    assert!(!err.contains("warm-up"), "refused before the warm-up: {err}");
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(outputs(&run_dir), first, "the first run's files are untouched");

    // With --overwrite it runs, and the earlier run's event file is gone.
    let mut cmd = train(&config, &run_dir, &[], &stderr);
    let status = cmd.arg("--overwrite").status().unwrap();
    assert!(status.success(), "{}", std::fs::read_to_string(&stderr).unwrap());
    let second = outputs(&run_dir);
    let events = |files: &[(String, Vec<u8>)]| -> Vec<String> {
        files.iter().map(|(n, _)| n.clone()).filter(|n| n.starts_with("events.out")).collect()
    };
    assert_eq!(events(&second).len(), 1, "one event file: {:?}", events(&second));
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "steps 0 and 1 once: {metrics}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_placement_spec_and_gpu_count_are_checked_before_the_warm_up() {
    let dir = scratch("preflight");
    let config = write_config(&dir, "", "");
    let run_dir = dir.join("run");
    let stderr = dir.join("stderr.txt");
    let spec = repo_root().join("deploy/examples/rlhf/placement/separate.yaml");
    for (sets, key) in [
        (
            vec!["cluster.placement_spec=/nonexistent/spec.yaml".to_owned()],
            "cluster.placement_spec",
        ),
        (
            vec![
                format!("cluster.placement_spec={}", spec.display()),
                "cluster.num_gpus=2".into(),
                "cluster.fake_gpus=true".into(),
            ],
            "cluster.num_gpus",
        ),
        // More GPUs than the host has, without naming them fake.
        (vec!["cluster.num_gpus=64".into()], "cluster.num_gpus"),
    ] {
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let status = train(&config, &run_dir, &sets, &stderr).status().unwrap();
        let err = std::fs::read_to_string(&stderr).unwrap();
        assert!(!status.success(), "{err}");
        let line = err.lines().find(|l| l.starts_with("Error:")).unwrap_or_default();
        assert!(line.contains(key), "`{key}` in {err}");
        assert!(!err.contains("warm-up"), "no warm-up before the error: {err}");
        assert!(!run_dir.join("models").exists(), "no initial policy was made");
    }

    // An empty config file says it runs on defaults (here it stops at the missing spec).
    let empty = dir.join("empty.yaml");
    std::fs::write(&empty, "# nothing set\n").unwrap();
    let sets = ["cluster.placement_spec=/nonexistent/spec.yaml"];
    let status = train(&empty, &run_dir, &sets, &stderr).status().unwrap();
    let err = std::fs::read_to_string(&stderr).unwrap();
    assert!(!status.success());
    let expected = format!("config: {} (empty: running on defaults)", empty.display());
    assert!(err.contains(&expected), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
