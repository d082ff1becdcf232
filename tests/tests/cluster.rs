//! Multi-node clusters on loopback: a real `rtrun head` and two `rtrun join` processes (distinct
//! ports, store and data directories, fake resources), a driver that spreads a placement group
//! over the three nodes and moves a 256 MiB object between them, node death detection after
//! `kill -9`, refusal of clients without credentials, `rtrun submit`, and hostile frames
//! against the live head.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rtrun_tests::rtrun_binary;

use rtrun_tests::cluster as common;

use common::{rtrun, start_cluster, status, wait_line};

/// The multi-node tests' driver (`src/bin/cluster_driver.rs`), built with these tests.
fn driver_binary() -> &'static str {
    env!("CARGO_BIN_EXE_cluster_driver")
}

#[test]
fn a_three_node_cluster_spreads_actors_moves_objects_and_detects_a_killed_node() {
    let mut cluster = start_cluster("main", "3");
    let before = status(&cluster);
    assert!(before.contains("nodes: 3 alive, 0 dead"), "{before}");
    assert!(before.contains("GPU: 4"), "fake GPUs of both joined nodes are counted: {before}");

    // A driver joins with the head's credentials, spreads three actors and moves 256 MiB; then
    // it keeps an actor and an object on a joined node, which the test kills.
    let mut driver = Command::new(driver_binary())
        .env("RTRUN_ADDRESS", &cluster.address)
        .env("RTRUN_CREDENTIALS_DIR", cluster.dir.join("head-credentials"))
        .env("CLUSTER_FAILOVER", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the driver runs");
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let mut driver_stdin = driver.stdin.take().unwrap();
    let stdout = driver.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let mut next_line = |seen: &mut Vec<String>| {
        let line = lines.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| {
            let _ = driver.kill();
            panic!("driver stopped talking after: {seen:?}")
        });
        seen.push(line.clone());
        line
    };
    let victim = loop {
        let line = next_line(&mut seen);
        if let Some(node) = line.strip_prefix("victim ") {
            break node.to_owned();
        }
    };
    let output = seen.join("\n");
    let nodes_line = seen.iter().find(|l| l.starts_with("nodes ")).expect("nodes line");
    let mut nodes: Vec<&str> = nodes_line.split_whitespace().skip(1).collect();
    nodes.sort_unstable();
    nodes.dedup();
    assert_eq!(nodes.len(), 3, "one actor per node: {nodes_line}");
    assert!(seen.iter().any(|l| l == "ok"), "{output}");
    let checksum = seen.iter().find(|l| l.starts_with("checksum ")).unwrap();
    assert!(checksum.ends_with(&format!(" {}", 256u64 << 20)), "{checksum}");
    let shared = seen.iter().find(|l| l.starts_with("shared reads ok ")).expect(&output);
    eprintln!("{shared}");

    // `rtrun list` sees the nodes and the actors.
    let listing = rtrun(&cluster, &["list", "nodes"], &cluster.dir.join("head-credentials"));
    let listing = String::from_utf8_lossy(&listing.stdout).into_owned();
    for name in ["head", "n1", "n2"] {
        assert!(listing.contains(name), "{listing}");
    }
    let actors = rtrun(&cluster, &["list", "actors"], &cluster.dir.join("head-credentials"));
    assert!(String::from_utf8_lossy(&actors.stdout).contains("Probe"));
    // The same for scripts, and counted by class.
    let credentials = cluster.dir.join("head-credentials");
    let json = rtrun(&cluster, &["list", "nodes", "--format", "json"], &credentials);
    let nodes: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(nodes.as_array().map(Vec::len), Some(3), "{nodes}");
    let summary = rtrun(&cluster, &["summary", "actors", "--format", "json"], &credentials);
    let summary: serde_json::Value = serde_json::from_slice(&summary.stdout).unwrap();
    let probes: u64 = summary
        .as_object()
        .and_then(|classes| classes.iter().find(|(class, _)| class.contains("Probe")))
        .map(|(_, states)| states.as_object().unwrap().values().filter_map(|n| n.as_u64()).sum())
        .unwrap_or(0);
    assert!(probes >= 3, "one Probe per node: {summary}");

    // kill -9 of the victim's node process: detected within the heartbeat timeout and
    // reported dead; its actor dies and its object is lost, with errors that say so.
    let victim_name = listing
        .lines()
        .find(|l| l.split_whitespace().next() == Some(victim.as_str()))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_else(|| panic!("{victim} in {listing}"))
        .to_owned();
    let index = if victim_name == "n1" { 0 } else { 1 };
    let mut killed_node = cluster.nodes.remove(index);
    killed_node.kill().unwrap();
    killed_node.wait().unwrap();
    let killed = Instant::now();
    let deadline = killed + Duration::from_secs(20);
    loop {
        let now = status(&cluster);
        if now.contains("nodes: 2 alive, 1 dead") {
            assert!(now.contains("no heartbeat"), "{now}");
            break;
        }
        assert!(Instant::now() < deadline, "node death not detected: {now}");
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("node death detected after {:?}", killed.elapsed());
    use std::io::Write;
    driver_stdin.write_all(b"killed\n").unwrap();
    let mut failover = Vec::new();
    loop {
        let line = next_line(&mut seen);
        failover.push(line.clone());
        if line == "failover ok" {
            break;
        }
    }
    let status = driver.wait().unwrap();
    assert!(status.success());
    let died = failover.iter().find(|l| l.starts_with("actor died: ")).expect("ActorDied");
    assert!(died.contains(&victim) && died.contains("died"), "{died}");
    let lost = failover.iter().find(|l| l.starts_with("object lost: ")).expect("ObjectLost");
    assert!(lost.contains(&victim), "{lost}");
    let moved = failover.iter().find(|l| l.starts_with("mover restarted on ")).expect("restart");
    assert!(!moved.ends_with(&victim), "{moved}");
    eprintln!("{died}\n{lost}\n{moved}");
}

#[test]
fn clients_without_credentials_are_refused_and_jobs_run_through_submit() {
    let cluster = start_cluster("auth", "5");
    // No credentials and no token.
    let empty = cluster.dir.join("nothing");
    let out = rtrun(&cluster, &["status"], &empty);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("token"), "{stderr}");
    // A well-formed token of another cluster: the CA fingerprint does not match.
    let other = format!("rtrun1.{}.{}", "ab".repeat(32), "cd".repeat(32));
    let out = Command::new(rtrun_binary())
        .args(["status", "--address", &cluster.address, "--token", &other])
        .arg("--credentials-dir")
        .arg(cluster.dir.join("other"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "a foreign token must be refused");
    // The right token bootstraps a client certificate.
    let out = Command::new(rtrun_binary())
        .args(["status", "--address", &cluster.address, "--token", &cluster.token])
        .arg("--credentials-dir")
        .arg(cluster.dir.join("bootstrapped"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // `rtrun submit` ships the driver, streams its output and returns its exit code.
    let out = Command::new(rtrun_binary())
        .args(["submit", "--address", &cluster.address, "--env", "CLUSTER_OBJECT_BYTES=1000000"])
        .arg("--credentials-dir")
        .arg(cluster.dir.join("head-credentials"))
        .arg("--")
        .arg(driver_binary())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.lines().any(|l| l == "ok"), "{stdout}");
    // The `--env` reached the driver: its object is 1 MB, not the default 256 MiB.
    let sizes = stdout.lines().find(|l| l.starts_with("checksum ")).unwrap_or_default();
    assert!(sizes.ends_with(" 1000000"), "{stdout}");
    let jobs = rtrun(&cluster, &["list", "jobs"], &cluster.dir.join("head-credentials"));
    assert!(String::from_utf8_lossy(&jobs.stdout).contains("SUCCEEDED"));

    // Garbage datagrams at the head's port: it keeps serving.
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut seed = 0x1234_5678u64;
    for i in 0..300 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let len = (seed % 1400) as usize + 1;
        let bytes: Vec<u8> = (0..len).map(|j| (seed >> (j % 56)) as u8 ^ i as u8).collect();
        let _ = socket.send_to(&bytes, &cluster.address);
    }
    assert!(status(&cluster).contains("nodes: 3 alive"));
}

#[test]
fn nodes_on_distinct_addresses_in_network_namespaces() {
    let Some((_guard, nodes, addresses)) = common::namespaces(3) else {
        eprintln!("skipped: network namespaces cannot be created here (needs root and ip netns)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("rtrun-netns-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut children = Vec::new();
    let mut head = Command::new("ip")
        .args(["netns", "exec", &nodes[0]])
        .arg(rtrun_binary())
        .args(["head", "--bind", &addresses[0], "--port", "6390", "--num-cpus", "1"])
        .args(["--node-name", "head", "--object-store-memory", "200000000"])
        .arg("--credentials-dir")
        .arg(dir.join("hc"))
        .arg("--data-dir")
        .arg(dir.join("hd"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let token = wait_line(&mut head, "join token: ", "rtrun head")
        .trim_start_matches("join token: ")
        .to_owned();
    children.push(head);
    let address = format!("{}:6390", addresses[0]);
    for (i, ns) in nodes.iter().enumerate().skip(1) {
        let mut node = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(rtrun_binary())
            .args(["join", "--address", &address, "--token", &token, "--num-cpus", "1"])
            .args(["--node-name", &format!("n{i}"), "--object-store-memory", "200000000"])
            .arg("--credentials-dir")
            .arg(dir.join(format!("c{i}")))
            .arg("--data-dir")
            .arg(dir.join(format!("d{i}")))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        wait_line(&mut node, "node ", "rtrun join");
        children.push(node);
    }
    let out = Command::new("ip")
        .args(["netns", "exec", &nodes[0]])
        .arg(driver_binary())
        .env("RTRUN_ADDRESS", &address)
        .env("RTRUN_CREDENTIALS_DIR", dir.join("hc"))
        .env("CLUSTER_OBJECT_BYTES", "8000000")
        .output()
        .unwrap();
    for child in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let nodes_line = stdout.lines().find(|l| l.starts_with("nodes ")).expect("nodes line");
    let mut seen: Vec<&str> = nodes_line.split_whitespace().skip(1).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 3, "{nodes_line}");
    assert!(stdout.lines().any(|l| l == "ok"), "{stdout}");
}

/// An authenticated peer (holding the cluster's credentials) sends malformed runtime frames on
/// channels and malformed requests to a live head: each gets an error answer or a closed
/// connection, and the head keeps serving.
#[test]
fn malformed_frames_from_an_authenticated_peer_leave_the_head_serving() {
    let cluster = start_cluster("fuzz", "5");
    let credentials = rtrun_net::CredentialsDir::new(cluster.dir.join("head-credentials"))
        .load_node()
        .expect("the head's credentials");
    let head: std::net::SocketAddr = cluster.address.parse().unwrap();
    let net =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let refused = net.block_on(async move {
        let endpoint = rtrun_net::Endpoint::bind(
            "127.0.0.1:0".parse().unwrap(),
            credentials,
            rtrun_net::EndpointOptions::default(),
        )
        .unwrap();
        let mut seed = 0x9e37_79b9u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut answered_with_errors = 0;
        for round in 0..60 {
            let link = endpoint.connect(head).await.expect("an authenticated peer is admitted");
            // A runtime channel with a garbage frame: a plausible length then random bytes, an
            // oversized length, or a truncated frame.
            let (mut send, _recv) = link.open_channel(bytes::Bytes::new()).await.unwrap();
            let body_len = (next() % 512) as usize + 1;
            let mut frame = match round % 3 {
                0 => (body_len as u32).to_le_bytes().to_vec(),
                1 => u32::MAX.to_le_bytes().to_vec(),
                _ => ((body_len as u32) + 100).to_le_bytes().to_vec(),
            };
            frame.extend((0..body_len).map(|_| next() as u8));
            let _ = send.write_all(&frame).await;
            let _ = send.finish();
            // A request whose head is not a valid cluster request.
            let garbage: Vec<u8> = (0..(next() % 256) as usize).map(|_| next() as u8).collect();
            match link.request(bytes::Bytes::from(garbage), Vec::new()).await {
                Err(rtrun_net::NetError::Remote { .. }) => answered_with_errors += 1,
                Err(_) => {}
                Ok(frame) => panic!("garbage was answered as valid: {frame:?}"),
            }
            link.close();
        }
        answered_with_errors
    });
    assert!(refused > 0, "malformed requests get error answers");
    let now = status(&cluster);
    assert!(now.contains("nodes: 3 alive"), "{now}");
}

/// `rtrun` against the cluster with the head's credentials; stdout, stderr and success.
fn head_rtrun(cluster: &common::Cluster, args: &[&str]) -> (String, String, bool) {
    let out = rtrun(cluster, args, &cluster.dir.join("head-credentials"));
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (text(&out.stdout), text(&out.stderr), out.status.success())
}

#[test]
fn jobs_carry_env_and_working_dirs_run_detached_and_stop_by_name() {
    let cluster = start_cluster("jobs", "5");
    let submit = |extra: &[&str]| {
        Command::new(rtrun_binary())
            .args(["submit", "--address", &cluster.address])
            .arg("--credentials-dir")
            .arg(cluster.dir.join("head-credentials"))
            .args(extra)
            .arg("--")
            .arg(driver_binary())
            .args(["--bytes", "100000", "--hold", "120"])
            .output()
            .unwrap()
    };
    let job = [
        "--no-wait",
        "--submission-id",
        "echo-1",
        "--env",
        "CLUSTER_ECHO_ENV=JOB_MARK",
        "--env",
        "JOB_MARK=42",
    ];
    // --no-wait returns at once with the job's name.
    let out = submit(&job);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "echo-1");
    // The name is unique; a malformed --env or name is refused before anything runs.
    let again = submit(&job);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("echo-1` exists already"));
    let bad = submit(&["--env", "NOVALUE"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--env NOVALUE: expected KEY=VALUE"));
    let bad = submit(&["--submission-id", "12"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a number"));

    // The job runs detached: its log (read by name) shows the variables in driver and worker.
    let deadline = Instant::now() + Duration::from_secs(120);
    let log = loop {
        let (log, _, _) = head_rtrun(&cluster, &["job", "logs", "echo-1"]);
        if log.contains("holding") {
            break log;
        }
        assert!(Instant::now() < deadline, "the job did not reach `holding`: {log}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(log.contains("driver env JOB_MARK=42"), "{log}");
    assert!(log.contains("worker env JOB_MARK=42"), "{log}");
    let task_pid = |log: &str, mark: &str| -> u32 {
        let line = log
            .lines()
            .find(|l| l.contains(&format!("task env JOB_MARK={mark} pid ")))
            .unwrap_or_else(|| panic!("no task line with JOB_MARK={mark}: {log}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let first_task_worker = task_pid(&log, "42");
    let (state, _, ok) = head_rtrun(&cluster, &["job", "status", "echo-1"]);
    assert!(ok && state.contains("(echo-1): RUNNING"), "{state}");
    let number = state.split_whitespace().nth(1).unwrap().to_owned();
    let (groups, _, _) = head_rtrun(&cluster, &["list", "placement-groups"]);
    assert!(groups.contains("spread"), "{groups}");

    // Ray's state listings: the job's workers (its probes' actors, its task's pooled worker),
    // its task counted by function; a running job is not deleted.
    let (workers, err, ok) = head_rtrun(&cluster, &["list", "workers", "--format", "json"]);
    assert!(ok, "{err}");
    let workers: serde_json::Value = serde_json::from_str(&workers).unwrap();
    let workers = workers.as_array().unwrap();
    assert!(workers.iter().any(|w| w["kind"] == "actor" && w["registered"] == true), "{workers:?}");
    let task_worker = workers.iter().find(|w| w["pid"] == first_task_worker);
    assert!(
        task_worker.is_some_and(|w| w["kind"] == "idle" && !w["driver"].is_null()),
        "the job's task worker {first_task_worker}, idle: {workers:?}"
    );
    let (summary, err, ok) = head_rtrun(&cluster, &["summary", "tasks", "--format", "json"]);
    assert!(ok, "{err}");
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    let finished = summary
        .as_object()
        .and_then(|functions| functions.iter().find(|(name, _)| name.contains("env_in_task")))
        .and_then(|(_, counts)| counts["finished"].as_u64());
    assert!(finished >= Some(1), "{summary}");
    let (tasks, err, ok) = head_rtrun(&cluster, &["list", "tasks"]);
    assert!(ok && tasks.starts_with("TASK"), "{tasks}{err}");
    let (_, err, ok) = head_rtrun(&cluster, &["job", "delete", "echo-1"]);
    assert!(!ok && err.contains("is running; stop it first"), "{err}");

    // Stop by name: the driver goes, and with it its actors on every node and its group.
    let stopped = Instant::now();
    let (out, err, ok) = head_rtrun(&cluster, &["job", "stop", "echo-1"]);
    assert!(ok && out.contains("STOPPED"), "{out}{err}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = status(&cluster);
        let (groups, _, _) = head_rtrun(&cluster, &["list", "placement-groups"]);
        if now.contains("alive actors: 0") && !groups.contains("spread") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stopped job's actors or group remain: {now}{groups}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("job stopped, actors and group gone after {:?}", stopped.elapsed());
    // Its pooled task worker ends with it (it lived on until `rtrun stop`), and the next job's
    // task runs in a worker of its own, with its own environment (it ran in the first job's
    // worker and saw JOB_MARK=42).
    assert!(
        rtrun_tests::wait_until(Duration::from_secs(15), || {
            !rtrun_tests::process_alive(first_task_worker)
        }),
        "the stopped job's task worker {first_task_worker} lives on"
    );
    let second = submit(&[
        "--no-wait",
        "--submission-id",
        "echo-2",
        "--env",
        "CLUSTER_ECHO_ENV=JOB_MARK",
        "--env",
        "JOB_MARK=43",
    ]);
    assert!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    let deadline = Instant::now() + Duration::from_secs(120);
    let log2 = loop {
        let (log, _, _) = head_rtrun(&cluster, &["job", "logs", "echo-2"]);
        if log.contains("holding") {
            break log;
        }
        assert!(Instant::now() < deadline, "the second job did not reach `holding`: {log}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_ne!(task_pid(&log2, "43"), first_task_worker, "{log2}");
    let (_, err, ok) = head_rtrun(&cluster, &["job", "stop", "echo-2"]);
    assert!(ok, "{err}");
    // A finished job's log stays readable; the listing shows it stopped.
    let (log, _, ok) = head_rtrun(&cluster, &["job", "logs", &number]);
    assert!(ok && log.contains("holding"), "{log}");
    let (list, _, _) = head_rtrun(&cluster, &["job", "list"]);
    assert!(list.lines().any(|l| l.contains("echo-1") && l.contains("STOPPED")), "{list}");
    let (out, _, ok) = head_rtrun(&cluster, &["job", "stop", "echo-1"]);
    assert!(ok && out.contains("has ended: STOPPED"), "{out}");
    let (_, err, ok) = head_rtrun(&cluster, &["job", "status", "nope"]);
    assert!(!ok && err.contains("no job `nope`"), "{err}");
    // An ended job is deleted with its log (Ray's `ray job delete`).
    let (jobs, _, _) = head_rtrun(&cluster, &["list", "jobs", "--format", "json"]);
    let jobs: serde_json::Value = serde_json::from_str(&jobs).unwrap();
    let echo2 = jobs.as_array().unwrap().iter().find(|j| j["submission_id"] == "echo-2");
    let log2_file = std::path::PathBuf::from(echo2.and_then(|j| j["log"].as_str()).unwrap());
    assert!(log2_file.exists(), "{jobs}");
    let (out, err, ok) = head_rtrun(&cluster, &["job", "delete", "echo-2"]);
    assert!(ok && out.contains("deleted job") && out.contains("STOPPED"), "{out}{err}");
    assert!(!log2_file.exists(), "the deleted job's log {} stays", log2_file.display());
    let (list, _, _) = head_rtrun(&cluster, &["job", "list"]);
    assert!(!list.contains("echo-2") && list.contains("echo-1"), "{list}");
    let (_, err, ok) = head_rtrun(&cluster, &["job", "delete", "echo-2"]);
    assert!(!ok && err.contains("no job `echo-2`"), "{err}");

    // --working-dir: the job starts in a copy of the directory, made on the head's node from
    // a package uploaded by content; when the job ends its copy and the package are removed
    // (they stayed until after `rtrun stop`: two jobs of a 490 MiB directory left 1.2 GB), its
    // log stays. A missing directory is refused before anything is uploaded.
    let files = cluster.dir.join("job-files");
    std::fs::create_dir_all(files.join("data")).unwrap();
    std::fs::write(files.join("data/prompts.txt"), "reverse 4071\nreverse 123\n").unwrap();
    let cache = cluster.dir.join("head-data").join("binaries");
    let cached = || std::fs::read_dir(&cache).unwrap().count();
    let run_in_dir = || {
        Command::new(rtrun_binary())
            .args(["submit", "--address", &cluster.address])
            .arg("--credentials-dir")
            .arg(cluster.dir.join("head-credentials"))
            .arg("--working-dir")
            .arg(&files)
            .arg("--")
            .arg(driver_binary())
            .args(["--bytes", "1000", "--read", "data/prompts.txt"])
            .output()
            .unwrap()
    };
    let mut seen = Vec::new();
    let before = cached();
    for attempt in 0..2 {
        let out = run_in_dir();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        let line = stdout.lines().find(|l| l.starts_with("read ")).expect("a read line");
        assert!(line.starts_with("read data/prompts.txt: reverse 4071 (in "), "{line}");
        let dir = line.rsplit_once("(in ").unwrap().1.trim_end_matches(')').to_owned();
        assert!(dir.starts_with(&*cluster.dir.join("head-data").join("jobs").to_string_lossy()));
        let cleaned = rtrun_tests::wait_until(Duration::from_secs(10), || {
            !std::path::Path::new(&dir).exists() && cached() == before
        });
        assert!(cleaned, "job {attempt}'s copy {dir} or its package outlived it");
        seen.push(dir);
        eprintln!("working-dir submission {attempt}: {line}");
    }
    assert_ne!(seen[0], seen[1], "each job has its own copy");
    let (list, _, _) = head_rtrun(&cluster, &["job", "list"]);
    let ended = list.lines().filter(|l| l.contains("SUCCEEDED")).count();
    assert!(ended >= 2, "the ended jobs are still listed: {list}");
    let out = Command::new(rtrun_binary())
        .args(["submit", "--address", &cluster.address])
        .arg("--credentials-dir")
        .arg(cluster.dir.join("head-credentials"))
        .args(["--working-dir", "/nonexistent/job-files", "--"])
        .arg(driver_binary())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--working-dir /nonexistent/job-files"), "{err}");
}

/// Worker output, as an operator reads it: a cluster driver's actors print on every node and
/// their lines reach the driver's stderr prefixed `(Probe pid=…, node=…)`; `rtrun logs` reads an
/// actor's, a worker's and a whole node's output through the head; worker logs rotate by size
/// (`RTRUN_LOG_ROTATION_MAX_BYTES`, set small here for the node daemons).
#[test]
fn worker_output_reaches_its_driver_prefixed_and_rtrun_logs_reads_any_node() {
    // SAFETY: this test's process has no other threads yet (nextest runs one test per process).
    unsafe {
        std::env::set_var("RTRUN_LOG_ROTATION_MAX_BYTES", "3000");
    }
    let cluster = start_cluster("logs", "5");
    let mut driver = Command::new(driver_binary())
        .args(["--bytes", "1000", "--say", "400", "--hold", "120"])
        .env("RTRUN_ADDRESS", &cluster.address)
        .env("RTRUN_CREDENTIALS_DIR", cluster.dir.join("head-credentials"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_line(&mut driver, "holding", "the driver");
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = driver.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // Every node's last line and its stderr line arrive, prefixed with type, pid and node.
    let mut seen: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let complete = |seen: &[String], node: &str| {
        let says = format!(", node={node}) probe says 399 on ");
        let warns = format!(", node={node}) probe warns on ");
        let prefixed = |l: &&String| l.starts_with("(Probe pid=");
        seen.iter().filter(prefixed).any(|l| l.contains(&says))
            && seen.iter().filter(prefixed).any(|l| l.contains(&warns))
    };
    while !["head", "n1", "n2"].iter().all(|n| complete(&seen, n)) {
        assert!(Instant::now() < deadline, "prefixed actor output on the driver: {seen:#?}");
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            seen.push(line);
            seen.extend(rx.try_iter());
        }
    }
    let says = seen.iter().filter(|l| l.contains(") probe says ")).count();
    assert_eq!(says, 3 * 400, "every line once, across rotations");

    // `rtrun logs --actor`: the first live actor's whole output (its file was rotated, so the
    // current file holds the newest lines).
    let (actors, _, ok) = head_rtrun(&cluster, &["list", "actors"]);
    assert!(ok, "{actors}");
    let actor = actors.lines().nth(1).and_then(|l| l.split_whitespace().next()).unwrap().to_owned();
    let (out, err, ok) = head_rtrun(&cluster, &["logs", "--actor", &actor]);
    assert!(ok && out.contains("probe says 399 on ") && out.contains("probe warns"), "{out}{err}");
    // `--node n1`: every file's lines, prefixed with the file; `--worker` one of them.
    let (out, err, ok) = head_rtrun(&cluster, &["logs", "--node", "n1"]);
    assert!(ok, "{err}");
    let line =
        out.lines().find(|l| l.contains("probe says 399")).unwrap_or_else(|| panic!("{out}"));
    let worker = line.trim_start_matches('(').split(')').next().unwrap().to_owned();
    assert!(worker.starts_with("worker-"), "{line}");
    let (out, err, ok) = head_rtrun(&cluster, &["logs", "--worker", &worker]);
    assert!(ok && out.contains("probe says 399 on "), "{out}{err}");
    // The log rotated on the node: the newest file stays under the limit, backups beside it.
    let logs = cluster.dir.join("n1-data").join("logs");
    let file = logs.join(format!("{worker}.log"));
    assert!(std::fs::metadata(&file).unwrap().len() <= 3000);
    assert!(logs.join(format!("{worker}.log.1")).exists(), "a rotated backup");
    // Bad names are refused with what was wrong.
    let (_, err, ok) = head_rtrun(&cluster, &["logs", "--node", "nope"]);
    assert!(!ok && err.contains("no node `nope`"), "{err}");
    let (_, err, ok) = head_rtrun(&cluster, &["logs", "--actor", "actor-999999"]);
    assert!(!ok && err.contains("no actor `actor-999999`"), "{err}");
    let _ = driver.kill();
    let _ = driver.wait();

    // A driver that exits right after its actors printed still shows their last lines.
    let out = Command::new(driver_binary())
        .args(["--bytes", "1000", "--say", "5", "--group", "last-lines"])
        .env("RTRUN_ADDRESS", &cluster.address)
        .env("RTRUN_CREDENTIALS_DIR", cluster.dir.join("head-credentials"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for node in ["head", "n1", "n2"] {
        let last = format!(", node={node}) probe says 4 on ");
        assert!(stderr.lines().any(|l| l.contains(&last)), "{node}'s last line in:\n{stderr}");
    }
}

/// An embedded session (no cluster) prints its workers' output on the driver's own stdout and
/// stderr, each line prefixed with the actor's type and pid, including the lines written just
/// before the driver exits (and while its main thread holds the stdout lock).
#[test]
fn embedded_workers_print_on_the_drivers_terminal_prefixed() {
    let out = Command::new(driver_binary())
        .args(["--nodes", "1", "--bytes", "1000", "--say", "3"])
        .env_remove("RTRUN_ADDRESS")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    let said: Vec<&str> = stdout.lines().filter(|l| l.contains("probe says")).collect();
    assert_eq!(said.len(), 3, "{stdout}");
    let pid = said[0].strip_prefix("(Probe pid=").and_then(|r| r.split(')').next()).unwrap();
    assert!(pid.parse::<u32>().is_ok(), "{}", said[0]);
    assert_eq!(said[2], format!("(Probe pid={pid}) probe says 2 on node-0"));
    assert!(stderr.contains(&format!("(Probe pid={pid}) probe warns on node-0")), "{stderr}");
}

/// Ray's `lifetime="detached"` and `get_if_exists=True`: a detached named service outlives the
/// driver that made it (the next driver finds the same process with its state), two drivers
/// getting-or-creating at once get one actor, an ordinary named actor dies with its driver and
/// frees its name, and `rtrun kill` stops a detached one. A task worker idle for the head's
/// `RTRUN_TASK_WORKER_IDLE_TIMEOUT_S` (here 2 s) ends, while the detached actor that ran the
/// task lives on (a finished detached `train` run's reward task worker lived until `rtrun
/// stop`, with its job's environment; issue 46, item 3).
#[test]
fn detached_actors_outlive_their_driver_and_get_if_exists_makes_one() {
    let head = common::NodeSpec { name: "head", cpus: 2, gpus: 0, resources: None };
    let idle = [(rtrun::TASK_WORKER_IDLE_TIMEOUT_ENV, "2")];
    let cluster = common::start_cluster_with_env("lifetimes", "5", &head, &[], &idle, &[]);
    let driver = |args: &[&str]| {
        Command::new(driver_binary())
            .env("RTRUN_ADDRESS", &cluster.address)
            .env("RTRUN_CREDENTIALS_DIR", cluster.dir.join("head-credentials"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the driver runs")
    };
    // `count N pid P` of a driver that must succeed, and its whole output.
    let finish = |child: std::process::Child| -> (u64, u32, String) {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        let line = stdout.lines().find(|l| l.starts_with("count ")).expect("a count line");
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields[1].parse().unwrap(), fields[3].parse().unwrap(), stdout)
    };
    let run = |args: &[&str]| finish(driver(args));

    let (count, service_pid, out) = run(&["--shared", "svc"]);
    assert_eq!(count, 1, "{out}");
    assert!(
        out.lines().any(|l| l == "named default/svc cluster_driver::Counter detached"),
        "{out}"
    );
    // Its driver exited; the next driver gets the same actor, state included.
    let (count, pid, out) = run(&["--shared", "svc"]);
    assert_eq!((count, pid), (2, service_pid), "{out}");
    let (count, pid, _) = run(&["--lookup", "svc"]);
    assert_eq!((count, pid), (3, service_pid));

    // The service runs a task; its driver is gone. The task worker ends once idle for 2 s,
    // the service lives on, and its next task gets a new worker.
    let task_pid = |out: &str| -> u32 {
        let line = out.lines().find(|l| l.starts_with("task pid ")).expect("a task line");
        line.trim_start_matches("task pid ").parse().unwrap()
    };
    let (_, _, out) = run(&["--lookup", "svc", "--task"]);
    let worker = task_pid(&out);
    let started = Instant::now();
    assert!(
        rtrun_tests::wait_until(Duration::from_secs(20), || !rtrun_tests::process_alive(worker)),
        "the idle task worker {worker} lives on"
    );
    eprintln!("the idle task worker ended after {:?}", started.elapsed());
    assert!(rtrun_tests::process_alive(service_pid), "the detached service ended with it");
    let (count, _, out) = run(&["--lookup", "svc", "--task"]);
    assert_eq!(count, 5);
    assert_ne!(task_pid(&out), worker);

    // Two drivers at once: one actor, whatever the interleaving.
    let (a, b) = (driver(&["--shared", "race"]), driver(&["--shared", "race"]));
    let ((count_a, pid_a, out_a), (count_b, pid_b, out_b)) = (finish(a), finish(b));
    let mut counts = [count_a, count_b];
    counts.sort_unstable();
    assert_eq!(counts, [1, 2], "{out_a}{out_b}");
    assert_eq!(pid_a, pid_b);

    // An ordinary named actor dies with its driver, and its name is free again.
    let (count, owned_pid, out) = run(&["--owned", "tmp"]);
    assert_eq!(count, 1);
    assert!(out.lines().any(|l| l == "named default/tmp cluster_driver::Counter"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = driver(&["--lookup", "tmp"]).wait_with_output().unwrap();
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(stderr.contains("tmp"), "{stderr}");
            break;
        }
        assert!(Instant::now() < deadline, "the owned actor outlived its driver");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (count, pid, _) = run(&["--owned", "tmp"]);
    assert_eq!(count, 1);
    assert_ne!(pid, owned_pid);

    // `rtrun list actors` shows the lifetime; `rtrun kill` stops the detached service.
    let (actors, _, ok) = head_rtrun(&cluster, &["list", "actors"]);
    assert!(ok, "{actors}");
    let svc = actors.lines().find(|l| l.contains(" svc ")).unwrap_or_else(|| panic!("{actors}"));
    assert!(svc.contains("detached") && svc.ends_with("ALIVE"), "{svc}");
    let (out, err, ok) = head_rtrun(&cluster, &["kill", "svc"]);
    assert!(ok && out.contains("killed actor svc"), "{out}{err}");
    let (_, err, ok) = head_rtrun(&cluster, &["kill", "svc"]);
    assert!(!ok && err.contains("svc"), "killing it twice: {err}");
    let (count, pid, _) = run(&["--shared", "svc"]);
    assert_eq!(count, 1, "a new service after the kill");
    assert_ne!(pid, service_pid);
}

/// `GET http://address/metrics`: the samples by `name{labels}`.
fn scrape(address: &str) -> std::collections::BTreeMap<String, f64> {
    let url = format!("http://{address}/metrics");
    let mut response = ureq::get(&url).call().unwrap_or_else(|e| panic!("{url}: {e}"));
    let text = response.body_mut().read_to_string().unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .map(|line| {
            let (key, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
            (key.to_owned(), value.parse().unwrap_or_else(|_| panic!("{line}")))
        })
        .collect()
}

/// Sum of the samples of metric `name` whose labels contain `label` (`""`: all).
fn sum_of(samples: &std::collections::BTreeMap<String, f64>, name: &str, label: &str) -> f64 {
    samples
        .iter()
        .filter(|(key, _)| {
            let metric = key.split('{').next().unwrap_or_default();
            metric == name && key.contains(label)
        })
        .map(|(_, value)| value)
        .sum()
}

/// The head's and a node's Prometheus endpoints: the values `rtrun status` shows (nodes,
/// resources per resource, workers, alive actors), object stores and pulls between nodes; a
/// scrape while a node dies still answers and then counts it dead; a port in use is refused.
#[test]
fn metrics_endpoints_agree_with_rtrun_status() {
    let (head_port, node_port) = (common::free_udp_port(), common::free_udp_port());
    let head_metrics = format!("127.0.0.1:{head_port}");
    let head = common::NodeSpec { name: "head", cpus: 2, gpus: 0, resources: None };
    let mut cluster = common::start_cluster_with_args(
        "metrics",
        "3",
        &head,
        &["--metrics-port", &head_port.to_string()],
        &[],
    );
    let node = common::NodeSpec { name: "n1", cpus: 1, gpus: 2, resources: Some(r#"{"slot": 1}"#) };
    cluster.join_with_args(&node, &["--metrics-port", &node_port.to_string()]);
    let node_metrics = format!("127.0.0.1:{node_port}");
    let driver = |args: &[&str]| {
        let out = Command::new(driver_binary())
            .env("RTRUN_ADDRESS", &cluster.address)
            .env("RTRUN_CREDENTIALS_DIR", cluster.dir.join("head-credentials"))
            .args(args)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    };
    // An object moves between the two nodes; a detached actor stays alive afterwards.
    driver(&["--nodes", "2", "--bytes", "3000000"]);
    driver(&["--shared", "svc"]);

    let samples = scrape(&head_metrics);
    let status = status(&cluster);
    assert!(status.contains("nodes: 2 alive, 0 dead"), "{status}");
    assert_eq!(sum_of(&samples, "rtrun_nodes", r#"state="alive""#), 2.0);
    assert_eq!(sum_of(&samples, "rtrun_nodes", r#"state="dead""#), 0.0);
    let resources = status.lines().find_map(|l| l.strip_prefix("resources: ")).unwrap();
    for pair in resources.split(", ") {
        let (resource, amount) = pair.split_once(": ").unwrap();
        let label = format!(r#"resource="{resource}""#);
        let served = sum_of(&samples, "rtrun_node_resource_total", &label);
        assert_eq!(served, amount.parse::<f64>().unwrap(), "{resource}: {status}");
    }
    let (workers, actors) = status
        .lines()
        .find_map(|l| l.strip_prefix("workers: "))
        .and_then(|l| l.split_once(", alive actors: "))
        .unwrap();
    assert_eq!(sum_of(&samples, "rtrun_worker_processes", ""), workers.parse::<f64>().unwrap());
    assert_eq!(
        sum_of(&samples, "rtrun_actors", r#"state="alive""#),
        actors.parse::<f64>().unwrap()
    );
    assert_eq!(sum_of(&samples, "rtrun_actors", r#"state="alive""#), 1.0, "the detached service");
    assert!(sum_of(&samples, "rtrun_actors", r#"state="dead""#) >= 2.0, "the probes");
    assert_eq!(sum_of(&samples, "rtrun_placement_groups", ""), 0.0, "removed with the driver");

    // Each node serves its own store; the 3 MB object crossed once (into whichever node pulled).
    let on_node = scrape(&node_metrics);
    for served in [&samples, &on_node] {
        assert_eq!(sum_of(served, "rtrun_object_store_capacity_bytes", ""), 700_000_000.0);
    }
    let pulled = sum_of(&samples, "rtrun_object_pulled_bytes_total", "")
        + sum_of(&on_node, "rtrun_object_pulled_bytes_total", "");
    assert!(pulled >= 3_000_000.0, "pulled {pulled} bytes");
    assert!(on_node.keys().all(|k| !k.starts_with("rtrun_nodes")), "a node has no cluster view");

    // The node dies: every scrape meanwhile answers, and the head soon counts it dead.
    cluster.kill_node_tree(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let samples = scrape(&head_metrics);
        if sum_of(&samples, "rtrun_nodes", r#"state="dead""#) == 1.0 {
            assert_eq!(sum_of(&samples, "rtrun_nodes", r#"state="alive""#), 1.0);
            assert_eq!(sum_of(&samples, "rtrun_node_resource_total", r#"resource="GPU""#), 0.0);
            break;
        }
        assert!(Instant::now() < deadline, "the dead node was never counted");
        std::thread::sleep(Duration::from_millis(200));
    }

    // A second head on the same metrics port: refused, naming the flag and the address.
    let out = Command::new(rtrun_binary())
        .args(["head", "--bind", "127.0.0.1", "--port", &common::free_udp_port().to_string()])
        .args(["--node-name", "other", "--metrics-port", &head_port.to_string()])
        .arg("--credentials-dir")
        .arg(cluster.dir.join("other-credentials"))
        .arg("--data-dir")
        .arg(cluster.dir.join("other-data"))
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("--metrics-port {head_port}"))
            && stderr.contains(&format!("cannot listen on {head_metrics}")),
        "{stderr}"
    );
}

/// The head's web dashboard in a real browser: a cluster with a job (its placement group spread
/// over two nodes, its actors, its live log) and a detached service; every page shows them, a
/// request without the token gets 401, and the screenshots go to `target/tmp/dashboard/`.
#[test]
fn the_dashboard_shows_nodes_actors_groups_jobs_and_logs_in_chromium() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let head = common::NodeSpec { name: "head", cpus: 2, gpus: 0, resources: None };
    let args = ["--dashboard-port", &port.to_string(), "--dashboard-token", "s3cret-token"];
    let mut cluster = common::start_cluster_with_args("dashboard", "5", &head, &args, &[]);
    let node = common::NodeSpec { name: "n1", cpus: 1, gpus: 2, resources: Some(r#"{"slot": 1}"#) };
    cluster.join(&node);
    let shots = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    let _ = std::fs::remove_dir_all(&shots);
    std::fs::create_dir_all(&shots).unwrap();

    let submit = Command::new(rtrun_binary())
        .args(["submit", "--address", &cluster.address, "--no-wait", "--submission-id", "dash-job"])
        .arg("--credentials-dir")
        .arg(cluster.dir.join("head-credentials"))
        .arg("--")
        .arg(driver_binary())
        .args(["--nodes", "2", "--bytes", "100000", "--say", "3", "--hold", "120"])
        .output()
        .unwrap();
    assert!(submit.status.success(), "{}", String::from_utf8_lossy(&submit.stderr));
    let service = Command::new(driver_binary())
        .env("RTRUN_ADDRESS", &cluster.address)
        .env("RTRUN_CREDENTIALS_DIR", cluster.dir.join("head-credentials"))
        .args(["--shared", "svc"])
        .output()
        .unwrap();
    assert!(service.status.success(), "{}", String::from_utf8_lossy(&service.stderr));
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (logs, _, _) = head_rtrun(&cluster, &["job", "logs", "dash-job"]);
        if logs.lines().any(|l| l == "ok") {
            break;
        }
        assert!(Instant::now() < deadline, "the job did not get going: {logs}");
        std::thread::sleep(Duration::from_millis(300));
    }

    // Without the token: 401 and a sentence; with it (bearer), the page.
    match ureq::get(&format!("{base}/actors")).call() {
        Err(ureq::Error::StatusCode(401)) => {}
        other => panic!("expected 401 without the token, got {other:?}"),
    }
    let mut bearer = ureq::get(&format!("{base}/nodes"))
        .header("Authorization", "Bearer s3cret-token")
        .call()
        .unwrap();
    assert!(bearer.body_mut().read_to_string().unwrap().contains("n1"));

    let page = |path: &str, name: &str| {
        let sep = if path.contains('?') { '&' } else { '?' };
        rtrun_tests::browse(
            &format!("{base}{path}{sep}token=s3cret-token"),
            &shots.join(format!("{name}.png")),
        )
    };
    let overview = page("/", "overview");
    assert!(overview.contains("2 alive") && overview.contains("Cluster overview"), "{overview}");
    let nodes = page("/nodes", "nodes");
    assert!(
        nodes.contains(">n1<") && nodes.contains(">head<") && nodes.contains("GPU: 2"),
        "{nodes}"
    );
    let actors = page("/actors", "actors");
    assert!(actors.matches(">Probe<").count() >= 2, "{actors}");
    assert!(actors.contains(">svc<") && actors.contains(">detached<"), "{actors}");
    let groups = page("/placement-groups", "placement-groups");
    assert!(groups.contains("spread") && groups.contains("Spread"), "{groups}");
    let info = status(&cluster);
    for line in info.lines().filter(|l| l.trim_start().starts_with("node-")) {
        let id = line.split_whitespace().next().unwrap();
        assert!(groups.contains(&format!("<td>{id}</td>")), "bundle on {id}: {groups}");
    }
    let jobs = page("/jobs", "jobs");
    assert!(jobs.contains("dash-job") && jobs.contains("RUNNING"), "{jobs}");
    let job = page("/jobs/dash-job", "job-log");
    assert!(job.contains("nodes node-") && job.contains("checksum"), "{job}");
    let objects = page("/objects", "objects");
    assert!(objects.matches(" objects: ").count() == 2, "one section per node: {objects}");
    let probe = actors
        .split("<tr>")
        .find(|row| row.contains(">Probe<") && row.contains("/log\""))
        .and_then(|row| row.split("href=\"").nth(1))
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("a Probe log link in {actors}"))
        .to_owned();
    let log = page(&probe, "actor-log");
    assert!(log.contains("probe says 2 on ") && log.contains("probe warns"), "{log}");
    let missing = ureq::get(&format!("{base}/jobs/nope"))
        .header("Authorization", "Bearer s3cret-token")
        .call();
    assert!(matches!(missing, Err(ureq::Error::StatusCode(404))), "{missing:?}");

    // An actor that is no longer ALIVE renders on every page (the actors page answered 503:
    // its template called a `startswith` method minijinja does not have).
    let (_, err, killed) = head_rtrun(&cluster, &["kill", "svc"]);
    assert!(killed, "{err}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (out, _, _) = head_rtrun(&cluster, &["list", "actors"]);
        if out.lines().any(|l| l.contains("svc") && l.contains("DEAD")) {
            break;
        }
        assert!(Instant::now() < deadline, "svc is not DEAD yet: {out}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let actors = page("/actors", "actors-with-a-dead-one");
    let dead_row = actors.split("<tr>").find(|row| row.contains(">svc<")).unwrap_or_default();
    assert!(dead_row.contains("class=\"dead\"") && dead_row.contains("DEAD"), "{actors}");
    for (path, name) in [
        ("/", "overview-dead"),
        ("/nodes", "nodes-dead"),
        ("/placement-groups", "groups-dead"),
        ("/jobs", "jobs-dead"),
        ("/objects", "objects-dead"),
    ] {
        let html = page(path, name);
        assert!(!html.contains("unknown method") && html.contains("</table>"), "{path}: {html}");
    }
    let (_, _, stopped) = head_rtrun(&cluster, &["job", "stop", "dash-job"]);
    assert!(stopped);
}

/// Ray's RL scheduling shape on real processes (issue 44; `scripts/cluster-scale.sh` runs 64
/// nodes): 16 node daemons join one head, a driver creates a single-bundle group per node and
/// 4 actors in each and calls every one; `rtrun status`, the metrics endpoint and the
/// dashboard answer while it runs and count every node and actor.
#[test]
fn sixteen_nodes_host_a_group_per_node_and_answer_status_metrics_and_dashboard() {
    const NODES: usize = 16;
    let (metrics_port, dashboard_port) = (common::free_udp_port(), {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    });
    let head = common::NodeSpec { name: "head", cpus: 0, gpus: 0, resources: None };
    let nodes: Vec<common::NodeSpec> = (0..NODES)
        .map(|i| common::NodeSpec {
            name: Box::leak(format!("s{i}").into_boxed_str()),
            cpus: 4,
            gpus: 0,
            resources: None,
        })
        .collect();
    let args = [
        "--metrics-port",
        &metrics_port.to_string(),
        "--dashboard-port",
        &dashboard_port.to_string(),
    ];
    let cluster = common::start_cluster_with_args("scale", "10", &head, &args, &nodes);
    let mut driver = Command::new(env!("CARGO_BIN_EXE_scale_driver"))
        .env("RTRUN_ADDRESS", &cluster.address)
        .env("RTRUN_CREDENTIALS_DIR", cluster.dir.join("head-credentials"))
        .args(["--nodes", &NODES.to_string(), "--actors-per-node", "4", "--hold", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = driver.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // While the actors start, the head keeps answering.
    let metrics = format!("127.0.0.1:{metrics_port}");
    let dashboard = format!("http://127.0.0.1:{dashboard_port}");
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut polls = 0;
    while !lines.iter().any(|l| l == "ok") {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => lines.push(line),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("the driver ended early ({e}): {lines:?} {:?}", driver.wait()),
        }
        if lines.is_empty() || polls < 3 {
            assert!(status(&cluster).contains(&format!("nodes: {} alive", NODES + 1)));
            assert_eq!(
                sum_of(&scrape(&metrics), "rtrun_nodes", r#"state="alive""#),
                (NODES + 1) as f64
            );
            polls += 1;
        }
        assert!(Instant::now() < deadline, "the driver did not finish: {lines:?}");
    }
    assert!(polls >= 1, "nothing was polled while the driver ran");
    let field = |key: &str| -> f64 {
        let line = lines.iter().find(|l| l.starts_with(&format!("{key} "))).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    assert_eq!(field("groups"), NODES as f64);
    assert_eq!(field("actors"), (4 * NODES) as f64);
    assert_eq!(field("nodes"), NODES as f64, "one node per group: {lines:?}");
    eprintln!("{}", lines.join("\n"));

    // Everything is alive and counted the same way by all three.
    let status = status(&cluster);
    assert!(status.contains("alive actors: 64"), "{status}");
    let samples = scrape(&metrics);
    assert_eq!(sum_of(&samples, "rtrun_actors", r#"state="alive""#), 64.0, "{samples:?}");
    let mut page = ureq::get(&format!("{dashboard}/nodes")).call().unwrap();
    let body = page.body_mut().read_to_string().unwrap();
    for i in 0..NODES {
        assert!(body.contains(&format!(">s{i}<")), "node s{i} is missing from the dashboard");
    }
    // A reader that leaves early (`rtrun status | head -1`) ends the client quietly by SIGPIPE,
    // not with a panic about a broken pipe.
    let mut piped = Command::new(rtrun_binary())
        .args(["status", "--address", &cluster.address])
        .arg("--credentials-dir")
        .arg(cluster.dir.join("head-credentials"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(piped.stdout.take());
    let out = piped.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&out.status), Some(13), "{stderr}");
    let _ = driver.kill();
    let _ = driver.wait();
}
