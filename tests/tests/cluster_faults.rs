//! Faults of a cluster of real processes on loopback, as an operator meets them: a driver's
//! placement groups outliving its job, the head killed under its drivers, clients and nodes, a
//! node paused past the heartbeat timeout, credentials of token-only clients left on disk,
//! `rtrun stop` racing its nodes, and commands against a dead head.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use rtrun_tests::{kill9, rtrun_binary, signal};

use rtrun_tests::cluster as common;

use common::{Cluster, rtrun, start_cluster, status, stderr_of, wait_exit};

/// The multi-node tests' driver (`src/bin/cluster_driver.rs`), built with these tests.
fn driver_binary() -> &'static str {
    env!("CARGO_BIN_EXE_cluster_driver")
}

/// The exit code of a process that lost its head (`rtrun::EXIT_HEAD_LOST`).
const HEAD_LOST: i32 = 75;

/// Starts `cluster_driver` with `args` as a driver of `cluster` (the head's credentials).
fn start_driver(cluster: &Cluster, args: &[&str]) -> (Child, Receiver<String>) {
    let mut driver = Command::new(driver_binary())
        .args(args)
        .env("RTRUN_ADDRESS", &cluster.address)
        .env("RTRUN_CREDENTIALS_DIR", cluster.dir.join("head-credentials"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the driver runs");
    let lines = read_lines(driver.stdout.take().unwrap());
    (driver, lines)
}

/// Every line `stream` produces, as they come.
fn read_lines(stream: impl std::io::Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Waits for the line `expected`, failing with what came instead.
fn expect_line(lines: &Receiver<String>, expected: &str, what: &str) {
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        match lines.recv_timeout(Duration::from_millis(200)) {
            Ok(line) if line == expected => return,
            Ok(line) => seen.push(line),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(_) => break,
        }
    }
    panic!("{what}: no `{expected}` line; output: {seen:?}");
}

fn list_groups(cluster: &Cluster) -> String {
    let out = rtrun(cluster, &["list", "placement-groups"], &cluster.dir.join("head-credentials"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `rtrun submit` of `cluster_driver` with `args` (the head's credentials).
fn submit_command(cluster: &Cluster, args: &[&str]) -> Command {
    let mut command = Command::new(rtrun_binary());
    command
        .args(["submit", "--address", &cluster.address])
        .arg("--credentials-dir")
        .arg(cluster.dir.join("head-credentials"))
        .arg("--")
        .arg(driver_binary())
        .args(args);
    command
}

/// `rtrun submit` of the driver with `args`, running, once its job printed `holding`.
fn submit_holding(cluster: &Cluster, args: &[&str]) -> Child {
    let mut submitted = submit_command(cluster, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = read_lines(submitted.stdout.take().unwrap());
    expect_line(&lines, "holding", "the submitted job");
    submitted
}

fn submit(cluster: &Cluster, args: &[&str]) -> std::process::Output {
    submit_command(cluster, args).output().unwrap()
}

#[test]
fn a_drivers_placement_groups_go_with_it_and_operators_can_remove_one() {
    let cluster = start_cluster("groups", "5");
    // A submitted job that ends normally: its group `spread` goes with it, so the same job
    // can run again (before: "placement group name `spread` is already in use").
    for attempt in 0..2 {
        let out = submit(&cluster, &["--bytes", "100000"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "submission {attempt}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The head hears the driver leave as its process exits: allow it a moment.
        let gone = rtrun_tests::wait_until(Duration::from_secs(20), || {
            !list_groups(&cluster).contains("spread")
        });
        assert!(gone, "submission {attempt} left its group: {}", list_groups(&cluster));
    }
    assert!(status(&cluster).contains("available: CPU: 3"), "every CPU is free again");

    // A driver killed with SIGKILL: its group goes once the head notices (its heartbeats stop).
    let (mut driver, lines) = start_driver(&cluster, &["--bytes", "100000", "--hold", "300"]);
    expect_line(&lines, "holding", "the holding driver");
    assert!(list_groups(&cluster).contains("spread"));
    kill9(driver.id());
    let _ = driver.wait();
    let gone = rtrun_tests::wait_until(Duration::from_secs(40), || {
        !list_groups(&cluster).contains("spread")
    });
    assert!(gone, "the killed driver's group is still there: {}", list_groups(&cluster));

    // An operator removes a live driver's group by name: its actors stop, its CPUs are free.
    let (mut driver, lines) = start_driver(&cluster, &["--bytes", "100000", "--hold", "300"]);
    expect_line(&lines, "holding", "the holding driver");
    let credentials = cluster.dir.join("head-credentials");
    let out = rtrun(&cluster, &["remove-placement-group", "spread"], &credentials);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("removed placement group spread"));
    assert!(!list_groups(&cluster).contains("spread"));
    let freed = rtrun_tests::wait_until(Duration::from_secs(20), || {
        status(&cluster).contains("available: CPU: 3")
    });
    assert!(freed, "the removed group's CPUs: {}", status(&cluster));
    let out = rtrun(&cluster, &["remove-placement-group", "spread"], &credentials);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no placement group named `spread`"), "{stderr}");
    let _ = driver.kill();
    let _ = driver.wait();
}

/// The worker pids of the cluster's live actors (`rtrun list actors`).
fn live_actor_pids(cluster: &Cluster) -> Vec<u32> {
    let out = rtrun(cluster, &["list", "actors"], &cluster.dir.join("head-credentials"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The name column may be empty: count from the end (… PID RESTARTS STATE).
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let state = *fields.last()?;
            let pid = fields.get(fields.len().checked_sub(3)?)?;
            (state == "ALIVE").then(|| pid.parse().ok()).flatten()
        })
        .collect()
}

/// Whether `pid` is a running process (not gone, not a zombie).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// How long after `t0` every process in `pids` stopped running (at most `limit`).
fn all_gone_after(pids: &[u32], t0: Instant, limit: Duration) -> Duration {
    let gone = rtrun_tests::wait_until(limit, || pids.iter().all(|&pid| !running(pid)));
    let alive: Vec<_> = pids.iter().filter(|&&pid| running(pid)).collect();
    assert!(gone, "workers {alive:?} outlived their driver by {limit:?}");
    t0.elapsed()
}

/// A driver that dies without a word (SIGKILL) or stops answering (SIGSTOP) is declared gone
/// by its heartbeats: its actors' worker processes on every node die within the heartbeat
/// timeout (2 s here) plus a beat, not after the 10 s QUIC idle timeout, and its groups go.
/// Another driver with the same credentials (the same peer name) beats on meanwhile: its
/// beats keep only itself alive, and its actors live on.
#[test]
fn a_killed_or_paused_driver_loses_its_workers_on_every_node_within_the_heartbeat_timeout() {
    // Two CPUs a node: one for the SPREAD group's bundle there, one for the bystander's.
    let node = |name| common::NodeSpec { name, cpus: 2, gpus: 0, resources: None };
    let cluster = common::start_cluster_with(
        "driver-heartbeats",
        "2",
        &node("head"),
        &[node("n1"), node("n2")],
    );
    let quic_idle = Duration::from_secs(10);
    let bystander_args =
        ["--nodes", "1", "--group", "bystander", "--bytes", "1000", "--hold", "300"];
    let (mut bystander, lines) = start_driver(&cluster, &bystander_args);
    expect_line(&lines, "holding", "the bystanding driver");
    let bystanders = live_actor_pids(&cluster);
    assert!(!bystanders.is_empty(), "the bystander's actors");
    for (how, sig) in [("SIGKILL", libc::SIGKILL), ("SIGSTOP", libc::SIGSTOP)] {
        let (mut driver, lines) = start_driver(&cluster, &["--bytes", "100000", "--hold", "300"]);
        expect_line(&lines, "holding", "the holding driver");
        let pids: Vec<u32> =
            live_actor_pids(&cluster).into_iter().filter(|p| !bystanders.contains(p)).collect();
        // One actor per node of the SPREAD group, at least.
        assert!(pids.len() >= 3, "{how}: the driver's actors: {pids:?}");
        assert!(pids.iter().all(|&pid| running(pid)));
        signal(driver.id(), sig);
        let t0 = Instant::now();
        let after = all_gone_after(&pids, t0, Duration::from_secs(30));
        eprintln!("{how}: the driver's {} workers were gone {after:?} after it", pids.len());
        assert!(
            after < quic_idle,
            "{how}: workers died {after:?} after their driver, not within the 2 s heartbeat \
             timeout (the QUIC idle timeout is {quic_idle:?})"
        );
        let gone = rtrun_tests::wait_until(Duration::from_secs(10), || {
            !list_groups(&cluster).contains("spread")
        });
        assert!(gone, "{how}: the driver's group is still there: {}", list_groups(&cluster));
        signal(driver.id(), libc::SIGCONT);
        let _ = driver.kill();
        let _ = driver.wait();
        assert!(bystanders.iter().all(|&pid| running(pid)), "{how}: the bystander lost actors");
        assert!(list_groups(&cluster).contains("bystander"), "{}", list_groups(&cluster));
    }
    assert!(bystander.try_wait().unwrap().is_none(), "the bystanding driver ended");
    let _ = bystander.kill();
    let _ = bystander.wait();
    assert!(status(&cluster).contains("nodes: 3 alive"), "{}", status(&cluster));
}

#[test]
fn losing_the_head_fails_its_drivers_clients_and_nodes_and_dead_heads_are_reported_fast() {
    let mut cluster = start_cluster("headloss", "5");
    // One bundle each, so that both fit.
    let (mut driver, lines) = start_driver(
        &cluster,
        &["--nodes", "1", "--group", "a", "--bytes", "100000", "--hold", "300"],
    );
    expect_line(&lines, "holding", "the attached driver");
    let mut submitted = submit_holding(
        &cluster,
        &["--nodes", "1", "--group", "b", "--bytes", "100000", "--hold", "300"],
    );

    kill9(cluster.head.id());
    let _ = cluster.head.wait();
    let killed = Instant::now();
    // Each notices within the control plane's QUIC idle timeout (30 s) and exits non-zero,
    // saying why.
    let head = &cluster.address;
    let mut processes: Vec<(&str, &mut Child)> =
        vec![("the attached driver", &mut driver), ("rtrun submit", &mut submitted)];
    for (i, node) in cluster.nodes.iter_mut().enumerate() {
        processes.push((if i == 0 { "node n1" } else { "node n2" }, node));
    }
    for (what, child) in processes {
        let status = wait_exit(child, Duration::from_secs(40))
            .unwrap_or_else(|| panic!("{what} lives on after its head was killed"));
        let stderr = stderr_of(child);
        assert_eq!(status.code(), Some(HEAD_LOST), "{what}: {status:?}\n{stderr}");
        assert!(
            stderr.contains(&format!("lost the connection to the cluster head at {head}")),
            "{what}: {stderr}"
        );
        eprintln!("{what} exited {status:?} after {:?}", killed.elapsed());
    }

    // Commands against the dead head fail within the connect timeout and name the address
    // (before: 30 s, saying "timed out after 10000 ms").
    let started = Instant::now();
    let out = rtrun(&cluster, &["status"], &cluster.dir.join("head-credentials"));
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("cannot reach the cluster head at {head}"))
            && stderr.contains("no answer within 5.0 s"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(15), "rtrun status took {took:?}: {stderr}");
    let started = Instant::now();
    let out = Command::new(rtrun_binary())
        .args(["join", "--address", head, "--token", &cluster.token, "--connect-timeout", "2"])
        .arg("--credentials-dir")
        .arg(cluster.dir.join("late-credentials"))
        .arg("--data-dir")
        .arg(cluster.dir.join("late-data"))
        .output()
        .unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("cannot reach the cluster head at {head}"))
            && stderr.contains("no answer within 2.0 s"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(12), "rtrun join took {took:?}: {stderr}");
}

#[test]
fn a_node_paused_past_the_heartbeat_timeout_exits_instead_of_living_on_as_a_zombie() {
    let mut cluster = start_cluster("paused", "2");
    let mut node = Guard(cluster.nodes.remove(0));
    let pid = node.0.id();
    signal(pid, libc::SIGSTOP);
    let declared = rtrun_tests::wait_until(Duration::from_secs(30), || {
        status(&cluster).contains("nodes: 2 alive, 1 dead")
    });
    signal(pid, libc::SIGCONT);
    assert!(declared, "the paused node was never declared dead: {}", status(&cluster));
    let exited = wait_exit(&mut node.0, Duration::from_secs(30))
        .expect("the node declared dead lives on after SIGCONT");
    let stderr = stderr_of(&mut node.0);
    assert_eq!(exited.code(), Some(HEAD_LOST), "{stderr}");
    assert!(stderr.contains("the head declared this node dead"), "{stderr}");
    assert!(stderr.contains("no heartbeat"), "the reason is given: {stderr}");
    // The cluster goes on with the others.
    assert!(status(&cluster).contains("nodes: 2 alive, 1 dead"));
}

/// The head paused (SIGSTOP) for twice the default heartbeat timeout (5 s), then resumed, with
/// an attached driver and a submitted job running: its own pause is not read as every peer's
/// death. Before, the head declared both nodes and both drivers dead at once after such a
/// pause (`no heartbeat for 5s`), the nodes exited 75 and the job failed; with the failure
/// detector alone fixed, the 10 s of silence still ended every connection with the head (QUIC
/// idle timeout 10 s), which now lasts 30 s on the control plane. Whether the head's failure
/// detector polls before or after it reads the queued heartbeats is a race here, which
/// `rtrun-net`'s `its_own_stall_is_not_read_as_the_nodes_death` decides deterministically.
#[test]
fn a_head_paused_for_twice_the_heartbeat_timeout_keeps_every_node_driver_and_job() {
    let mut cluster = start_cluster("head-paused", "5");
    let hold = ["--nodes", "1", "--bytes", "1000", "--hold", "30"];
    let (mut driver, lines) = start_driver(&cluster, &[&hold[..], &["--group", "a"]].concat());
    expect_line(&lines, "holding", "the holding driver");
    let mut submitted = submit_holding(&cluster, &[&hold[..], &["--group", "b"]].concat());
    let head = cluster.head.id();
    signal(head, libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(10));
    signal(head, libc::SIGCONT);
    // Long enough for a verdict on the paused time, and for a real one after it.
    std::thread::sleep(Duration::from_secs(8));
    let info = status(&cluster);
    assert!(info.contains("nodes: 3 alive, 0 dead"), "{info}");
    for node in &mut cluster.nodes {
        assert!(node.try_wait().unwrap().is_none(), "a node exited after the head's pause");
    }
    for (what, child) in [("the driver", &mut driver), ("the submitted job", &mut submitted)] {
        let ended = wait_exit(child, Duration::from_secs(60)).expect("it ends");
        let stderr = stderr_of(child);
        assert!(ended.success(), "{what} failed after the head's pause: {stderr}");
    }
}

/// A child killed when dropped (a test that fails must not leave a stopped process).
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        signal(self.0.id(), libc::SIGCONT);
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn token_only_clients_leave_no_credentials_and_stop_waits_for_every_node() {
    let mut cluster = start_cluster("clients", "5");
    // A token-only client and a token-only driver, with their own temp dir to inspect.
    let tmp = cluster.dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let unused = cluster.dir.join("client-credentials");
    let out = Command::new(rtrun_binary())
        .args(["status", "--address", &cluster.address, "--token", &cluster.token])
        .arg("--credentials-dir")
        .arg(&unused)
        .env("TMPDIR", &tmp)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(driver_binary())
        .args(["--bytes", "100000"])
        .env("RTRUN_ADDRESS", &cluster.address)
        .env("RTRUN_TOKEN", &cluster.token)
        .env("RTRUN_CREDENTIALS_DIR", &unused)
        .env("TMPDIR", &tmp)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "token-only processes left {left:?} in their temp dir");
    assert!(!unused.exists(), "a token-only client wrote credentials to {}", unused.display());

    // `rtrun stop`: every node acknowledges and exits (code 0) before the head does.
    let out = rtrun(&cluster, &["stop"], &cluster.dir.join("head-credentials"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stopped = Instant::now();
    for (i, node) in cluster.nodes.iter_mut().enumerate() {
        let status = wait_exit(node, Duration::from_secs(8)).unwrap_or_else(|| {
            panic!("node {i} lives on {:?} after rtrun stop", stopped.elapsed())
        });
        assert_eq!(status.code(), Some(0), "node {i}: {}", stderr_of(node));
    }
    let head = wait_exit(&mut cluster.head, Duration::from_secs(20)).expect("the head exits");
    assert!(head.success(), "{head:?}");
    // Nothing spilled, so no process made a spill directory under `--object-spill-dir`
    // (before: an empty `rtrun-spill-<pid>-0` per process, left at exit).
    let spill = cluster.dir.join("spill");
    let left: Vec<_> = std::fs::read_dir(&spill)
        .map(|dirs| dirs.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left in {}: {left:?}", spill.display());
}

/// Waits for a line of `lines` containing `needle`; returns it.
fn expect_containing(lines: &Receiver<String>, needle: &str, what: &str) -> String {
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        match lines.recv_timeout(Duration::from_millis(100)) {
            Ok(line) if line.contains(needle) => return line,
            Ok(line) => seen.push(line),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(_) => break,
        }
    }
    panic!("{what}: no line with `{needle}`; output: {seen:?}");
}

/// A cluster whose head persists its state (`--state-dir`) and has no CPUs, so actors go to
/// its two nodes (3 CPUs each); the state directory is removed when the guard goes.
fn start_persistent_cluster(name: &str) -> (Cluster, tempfile::TempDir) {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path().display().to_string();
    let node = |name| common::NodeSpec { name, cpus: 3, gpus: 0, resources: None };
    let cluster = common::start_cluster_with_args(
        name,
        "5",
        &common::NodeSpec { name: "head", cpus: 0, gpus: 0, resources: None },
        &["--state-dir", &dir, "--reconnect-window", "20"],
        &[node("n1"), node("n2")],
    );
    (cluster, state)
}

/// SIGKILL the head of a cluster with a state directory and start it again on the same
/// address and directory: both nodes reconnect (timed: restart to every node re-registered),
/// a driver blocked in `get` on a call to its actor gets its answer, and so does a submitted
/// job's (its driver outlives the head, which adopts it; `rtrun submit` follows it to its end),
/// the detached actor a finished driver left keeps its state and process, the key-value store
/// is whole, and new actors and tasks run after the restart.
#[test]
fn a_head_killed_and_restarted_on_its_state_directory_keeps_the_cluster_running() {
    let (mut cluster, _state) = start_persistent_cluster("restart");
    let shared = |cluster: &Cluster| {
        let (mut driver, lines) =
            start_driver(cluster, &["--shared", "kept", "--counter-cpus", "1"]);
        let line = expect_containing(&lines, "count ", "the shared counter's driver");
        assert!(driver.wait().unwrap().success());
        line
    };
    let before = shared(&cluster);
    assert!(before.starts_with("count 1 pid "), "{before}");
    let across = ["--across-restart", "5", "--counter-cpus", "1"];
    let (mut driver, lines) = start_driver(&cluster, &across);
    let ready = expect_containing(&lines, "ready pid ", "the driver across the restart");
    let pid = ready.trim_start_matches("ready pid ").to_owned();
    let mut submitted = submit_command(&cluster, &across)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let job_lines = read_lines(submitted.stdout.take().unwrap());
    expect_containing(&job_lines, "ready pid ", "the submitted job");
    let node_logs: Vec<Receiver<String>> =
        cluster.nodes.iter_mut().map(|n| read_lines(n.stderr.take().unwrap())).collect();

    kill9(cluster.head.id());
    let _ = cluster.head.wait();
    let restarted = Instant::now();
    cluster.restart_head(&[]);
    for (i, log) in node_logs.iter().enumerate() {
        expect_containing(log, "reconnected to the restarted cluster head", &format!("node {i}"));
    }
    let recovery = restarted.elapsed();
    eprintln!("head restart to both nodes re-registered: {:.3} s", recovery.as_secs_f64());
    assert!(recovery < Duration::from_secs(20), "recovery took {recovery:?}");

    // The driver blocked in `get` got its answer from the same actor process, and goes on.
    for expected in
        [format!("slow count 2 pid {pid}"), "kv kept".into(), format!("after count 3 pid {pid}")]
    {
        expect_line(&lines, &expected, "the driver across the restart");
    }
    expect_containing(&lines, "second count 1 pid ", "the driver across the restart");
    expect_containing(&lines, "task pid ", "the driver across the restart");
    expect_line(&lines, "ok", "the driver across the restart");
    let ended = wait_exit(&mut driver, Duration::from_secs(30)).expect("the driver ends");
    assert!(ended.success(), "{ended:?}: {}", stderr_of(&mut driver));
    // The submitted job too: `rtrun submit` printed its log to the end and exits 0.
    for needle in ["slow count 2 pid ", "kv kept", "after count 3 pid ", "task pid "] {
        expect_containing(&job_lines, needle, "the submitted job");
    }
    expect_line(&job_lines, "ok", "the submitted job");
    let ended = wait_exit(&mut submitted, Duration::from_secs(30)).expect("rtrun submit ends");
    assert!(ended.success(), "{ended:?}: {}", stderr_of(&mut submitted));
    let jobs = rtrun(&cluster, &["job", "list"], &cluster.dir.join("head-credentials"));
    let jobs = String::from_utf8_lossy(&jobs.stdout);
    assert!(jobs.contains("SUCCEEDED"), "{jobs}");
    // The detached counter kept its count and its process.
    let after = shared(&cluster);
    assert_eq!(after, before.replace("count 1 ", "count 2 "));
    let text = status(&cluster);
    assert!(text.contains("nodes: 3 alive, 0 dead"), "{text}");
}

/// What a restarted head cannot take up is refused with an error that names it: a head
/// restarted on another port (its nodes name both addresses and exit), a state directory with
/// a damaged file, another cluster's, or one a running head holds.
#[test]
fn a_restarted_head_refuses_what_it_cannot_recover_and_says_which() {
    let (mut cluster, state) = start_persistent_cluster("refuse");
    let node_logs: Vec<Receiver<String>> =
        cluster.nodes.iter_mut().map(|n| read_lines(n.stderr.take().unwrap())).collect();
    // A second head on the same state directory.
    let out = Command::new(rtrun_binary())
        .args(["head", "--bind", "127.0.0.1", "--port", "0", "--num-cpus", "0"])
        .arg("--credentials-dir")
        .arg(cluster.dir.join("head-credentials"))
        .arg("--state-dir")
        .arg(state.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("is in use by another head"), "{stderr}");

    kill9(cluster.head.id());
    let _ = cluster.head.wait();
    let port = common::free_udp_port().to_string();
    cluster.restart_head(&[("--port", &port)]);
    let old = cluster.address.clone();
    let new = format!("127.0.0.1:{port}");
    for (i, log) in node_logs.iter().enumerate() {
        let line = expect_containing(log, "the cluster head restarted at", &format!("node {i}"));
        assert!(line.contains(&new) && line.contains(&old), "{line}");
    }
    for node in &mut cluster.nodes {
        let status = wait_exit(node, Duration::from_secs(20)).expect("a node of a moved head");
        assert_eq!(status.code(), Some(HEAD_LOST));
    }
    kill9(cluster.head.id());
    let _ = cluster.head.wait();

    let head_on = |credentials: &str| {
        let out = Command::new(rtrun_binary())
            .args(["head", "--bind", "127.0.0.1", "--port", "0", "--num-cpus", "0"])
            .arg("--credentials-dir")
            .arg(cluster.dir.join(credentials))
            .arg("--data-dir")
            .arg(cluster.dir.join("refused-data"))
            .arg("--state-dir")
            .arg(state.path())
            .stdout(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success(), "a head started on a state it must refuse");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // Another cluster's credentials.
    let stderr = head_on("other-credentials");
    assert!(stderr.contains("belongs to another cluster"), "{stderr}");
    // A damaged snapshot.
    let snapshot = std::fs::read_dir(state.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("snapshot-"))
        .expect("a snapshot");
    let mut bytes = std::fs::read(&snapshot).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&snapshot, &bytes).unwrap();
    let stderr = head_on("head-credentials");
    assert!(stderr.contains(&format!("state file {} is corrupt", snapshot.display())), "{stderr}");
}

/// A node paused across a head restart until the restarted head gave up on it (its reconnect
/// window closed: what ran there is written off) is told so when it wakes up, and exits saying
/// why instead of living on as a zombie; the node that reconnected in time keeps running.
#[test]
fn a_node_given_up_by_a_restarted_head_is_told_so_and_exits() {
    let (mut cluster, _state) = start_persistent_cluster("givenup");
    let mut node_logs: Vec<Receiver<String>> =
        cluster.nodes.iter_mut().map(|n| read_lines(n.stderr.take().unwrap())).collect();
    let paused = cluster.nodes[1].id();
    signal(paused, libc::SIGSTOP);
    kill9(cluster.head.id());
    let _ = cluster.head.wait();
    cluster.restart_head(&[("--reconnect-window", "2")]);
    expect_containing(&node_logs[0], "reconnected to the restarted cluster head", "node n1");
    // Past the window (and a tick of the head's clock) the paused node is dead to the head.
    let given_up = rtrun_tests::wait_until(Duration::from_secs(20), || {
        status(&cluster).contains("nodes: 2 alive, 1 dead")
    });
    assert!(given_up, "{}", status(&cluster));
    signal(paused, libc::SIGCONT);
    let status = wait_exit(&mut cluster.nodes[1], Duration::from_secs(40))
        .expect("the node given up exits once it wakes up");
    let log = node_logs.remove(1);
    let said: Vec<String> = log.try_iter().collect();
    assert_eq!(status.code(), Some(HEAD_LOST), "{said:?}");
    assert!(
        said.iter().any(|l| l.contains("declared") && l.contains("dead")),
        "the node does not say it was given up: {said:?}"
    );
    assert!(cluster.nodes[0].try_wait().unwrap().is_none(), "the node that reconnected exited");
    eprintln!("the node given up said: {:?}", said.iter().rev().take(2).collect::<Vec<_>>());
}
