//! Integration tests of the runtime core with real worker processes: actors, tasks, objects,
//! options, failures and actor groups, on the embedded single-node default.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rtrun::{ActorGroup, ActorOptions, Config, Error, ObjectRef, TaskOptions};
use rtrun_tests::{kill9, process_alive, wait_until};

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

fn init() {
    rtrun::init_with(Config {
        num_cpus: Some(2.0),
        num_gpus: Some(2.0),
        resources: BTreeMap::from([("custom".to_owned(), 1.0)]),
        ..Default::default()
    })
    .expect("runtime starts");
}

const LONG: Duration = Duration::from_secs(30);

struct Counter {
    value: u64,
    log: Vec<u64>,
}

#[rtrun::actor]
impl Counter {
    pub fn new(start: u64) -> Self {
        Counter { value: start, log: Vec::new() }
    }

    pub fn add(&mut self, by: u64) -> u64 {
        self.value += by;
        self.log.push(by);
        self.value
    }

    pub fn log(&self) -> Vec<u64> {
        self.log.clone()
    }

    pub fn value(&self) -> u64 {
        self.value
    }

    pub fn pid(&self) -> u32 {
        std::process::id()
    }

    pub fn fail(&mut self, message: String) -> u64 {
        panic!("{message}");
    }

    pub fn incarnation(&self) -> u64 {
        rtrun::context().map(|c| c.incarnation).unwrap_or(u64::MAX)
    }

    pub fn env(&self, key: String) -> Option<String> {
        std::env::var(key).ok()
    }

    pub fn sleep_ms(&self, ms: u64) -> u64 {
        std::thread::sleep(Duration::from_millis(ms));
        ms
    }

    /// [`Counter::sleep_ms`] that first creates the file `started` (see [`Started`]).
    pub fn sleep_ms_after(&self, started: String, ms: u64) -> u64 {
        let _ = std::fs::write(started, b"");
        std::thread::sleep(Duration::from_millis(ms));
        ms
    }

    /// Calls another counter from inside this actor.
    pub fn add_to(&self, other: CounterRef, by: u64) -> Result<u64, String> {
        other.add(by).get().map_err(|e| e.to_string())
    }

    pub fn group(&self) -> Option<(usize, usize)> {
        rtrun::context().ok().and_then(|c| c.group).map(|g| (g.rank, g.world_size))
    }

    pub fn scale(&self, batch: Vec<u64>) -> Vec<u64> {
        batch.into_iter().map(|x| x * 10 + self.value).collect()
    }
}

struct Gate {
    in_flight: AtomicUsize,
    max_seen: AtomicUsize,
}

#[rtrun::actor]
impl Gate {
    pub fn new() -> Self {
        Gate { in_flight: AtomicUsize::new(0), max_seen: AtomicUsize::new(0) }
    }

    /// Waits until `n` calls have been inside at once (or a deadline) and returns the most
    /// seen.
    pub async fn rendezvous(&self, n: usize, deadline_ms: u64) -> usize {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_seen.fetch_max(now, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + Duration::from_millis(deadline_ms);
        while self.max_seen.load(Ordering::SeqCst) < n && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.max_seen.load(Ordering::SeqCst)
    }

    /// Creates the file `started` (see [`Started`]), then never answers.
    pub async fn hang(&self, started: String) -> u64 {
        let _ = std::fs::write(started, b"");
        tokio::time::sleep(Duration::from_secs(3600)).await;
        0
    }
}

/// Creates actors and a placement group from inside an actor: what it creates is owned by it.
struct Owner {
    children: Vec<CounterRef>,
    groups: Vec<rtrun::PlacementGroup>,
}

#[rtrun::actor]
impl Owner {
    pub fn new() -> Self {
        Owner { children: Vec::new(), groups: Vec::new() }
    }

    pub fn spawn(&mut self, start: u64) -> Result<CounterRef, String> {
        let child = Counter::remote(start).map_err(|e| e.to_string())?;
        self.children.push(child.clone());
        Ok(child)
    }

    pub fn reserve(&mut self, name: String) -> Result<(), String> {
        let options = rtrun::PlacementGroupOptions::uniform(1, &[("CPU", 0.01)])
            .map_err(|e| e.to_string())?
            .name(&name);
        let group = rtrun::placement_group(options).map_err(|e| e.to_string())?;
        group.wait(LONG).map_err(|e| e.to_string())?;
        self.groups.push(group);
        Ok(())
    }
}

struct Fragile;

#[rtrun::actor]
impl Fragile {
    pub fn new(ok: bool) -> Result<Self, String> {
        if ok { Ok(Fragile) } else { Err("refusing to start".into()) }
    }

    pub fn ping(&self) -> u8 {
        1
    }
}

#[rtrun::remote]
fn add(a: u64, b: u64) -> u64 {
    a + b
}

#[rtrun::remote]
fn sum_of_squares(n: u64) -> u64 {
    // A task submitting tasks: nested submission goes through the control plane.
    let refs: Vec<ObjectRef<u64>> = (0..n).map(square::remote).collect();
    rtrun::get_all(&refs).expect("nested tasks").into_iter().sum()
}

#[rtrun::remote]
fn square(x: u64) -> u64 {
    x * x
}

#[rtrun::remote]
fn sleepy(ms: u64) -> u64 {
    std::thread::sleep(Duration::from_millis(ms));
    ms
}

/// [`sleepy`] that first creates the file `started` (see [`Started`]).
#[rtrun::remote]
fn sleepy_after(started: String, ms: u64) -> u64 {
    let _ = std::fs::write(started, b"");
    std::thread::sleep(Duration::from_millis(ms));
    ms
}

/// A file a call creates once it runs in its worker: the test waits on it instead of sleeping
/// for a guessed time before acting on a call in flight.
struct Started(std::path::PathBuf);

impl Started {
    fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let path = std::env::temp_dir().join(format!("rtrun-started-{}-{n}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        Started(path)
    }

    fn path(&self) -> String {
        self.0.display().to_string()
    }

    /// Waits until the call has started.
    fn wait(&self) {
        assert!(wait_until(LONG, || self.0.exists()), "the call never started");
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[rtrun::remote]
fn boom() -> u64 {
    panic!("task exploded")
}

#[rtrun::remote]
fn pid_of_worker() -> u32 {
    std::process::id()
}

#[test]
fn actor_sync_methods_run_one_at_a_time_in_call_order() {
    init();
    let counter = Counter::remote(100).unwrap();
    let refs: Vec<ObjectRef<u64>> = (1..=500).map(|i| counter.add(i)).collect();
    let values = rtrun::get_all(&refs).unwrap();
    let mut expected = 100;
    for (i, v) in values.iter().enumerate() {
        expected += i as u64 + 1;
        assert_eq!(*v, expected);
    }
    assert_eq!(counter.log().get().unwrap(), (1..=500).collect::<Vec<_>>());
}

#[test]
fn async_methods_run_concurrently_up_to_max_concurrency() {
    init();
    let gate = Gate::remote_with(ActorOptions::default().max_concurrency(4)).unwrap();
    // Four calls can all be inside at once: each sees four.
    let refs: Vec<_> = (0..4).map(|_| gate.rendezvous(4usize, 20_000u64)).collect();
    for r in &refs {
        assert_eq!(r.get_timeout(LONG).unwrap(), 4);
    }
    // Five calls never get more than four inside: the fifth waits for a permit.
    let refs: Vec<_> = (0..5).map(|_| gate.rendezvous(5usize, 300u64)).collect();
    for r in &refs {
        assert_eq!(r.get_timeout(LONG).unwrap(), 4);
    }
}

#[test]
fn tasks_run_in_worker_processes_and_nest() {
    init();
    assert_eq!(add::remote(2u64, 3u64).get().unwrap(), 5);
    let many: Vec<_> = (0..50u64).map(|i| add::remote(i, 1u64)).collect();
    assert_eq!(rtrun::get_all(&many).unwrap(), (1..=50).collect::<Vec<u64>>());
    assert_eq!(sum_of_squares::remote(10u64).get_timeout(LONG).unwrap(), 285);
    let worker = pid_of_worker::remote().get().unwrap();
    assert_ne!(worker, std::process::id());
}

#[test]
fn object_refs_as_arguments_are_resolved_before_the_call() {
    init();
    let five = rtrun::put(&5u64).unwrap();
    assert_eq!(add::remote(&five, 10u64).get().unwrap(), 15);
    // A ref produced by a task, passed to an actor before it is ready.
    let slow = sleepy::remote(200u64);
    let counter = Counter::remote(1).unwrap();
    assert_eq!(counter.add(&slow).get_timeout(LONG).unwrap(), 201);
    // A ref made by an actor, consumed by a task.
    let from_actor = counter.value();
    assert_eq!(add::remote(from_actor, 1u64).get().unwrap(), 202);
}

#[test]
fn wait_returns_the_ready_refs_first() {
    init();
    let slow = sleepy::remote(5_000u64);
    let fast = sleepy::remote(1u64);
    let refs = vec![slow.clone(), fast.clone()];
    let (ready, rest) = rtrun::wait(&refs, 1, Some(LONG)).unwrap();
    assert_eq!(ready.len(), 1);
    assert_eq!(ready[0].id(), fast.id());
    assert_eq!(rest[0].id(), slow.id());
    let (ready, rest) = rtrun::wait(&[slow], 1, Some(Duration::from_millis(50))).unwrap();
    assert!(ready.is_empty());
    assert_eq!(rest.len(), 1);
    assert!(rtrun::wait(&refs, 3, None).is_err());
}

#[test]
fn put_get_and_free() {
    init();
    let value = vec![String::from("a"), String::from("b")];
    let r = rtrun::put(&value).unwrap();
    assert_eq!(r.get().unwrap(), value);
    let big: Vec<u8> = (0..(4 << 20)).map(|i| (i % 251) as u8).collect();
    let big_ref = rtrun::put(&big).unwrap();
    let counter = Counter::remote(0).unwrap();
    // The actor fetches the 4 MiB object from the driver and hands it back.
    let echoed: Vec<u64> = counter.scale(vec![1, 2]).get().unwrap();
    assert_eq!(echoed, vec![10, 20]);
    assert_eq!(big_ref.get().unwrap(), big);
    rtrun::free(std::slice::from_ref(&r)).unwrap();
    assert!(matches!(r.get(), Err(Error::ObjectFreed(_))));
    // A task asked to resolve a freed object fails clearly too.
    let freed = rtrun::put(&1u64).unwrap();
    rtrun::free(std::slice::from_ref(&freed)).unwrap();
    let err = add::remote(freed, 1u64).get().unwrap_err();
    assert!(matches!(err, Error::ObjectFreed(_)), "{err}");
}

#[test]
fn actor_handles_travel_to_other_actors() {
    init();
    let target = Counter::remote(0).unwrap();
    let caller = Counter::remote(0).unwrap();
    assert_eq!(caller.add_to(target.clone(), 7u64).get().unwrap(), Ok(7));
    assert_eq!(caller.add_to(target.clone(), 3u64).get().unwrap(), Ok(10));
    assert_eq!(target.value().get().unwrap(), 10);
}

#[test]
fn a_panicking_method_is_an_error_and_the_actor_lives_on() {
    init();
    let counter = Counter::remote(1).unwrap();
    counter.add(1u64).get().unwrap();
    let err = counter.fail("kaboom".to_string()).get().unwrap_err();
    match err {
        Error::TaskFailed { target, message } => {
            assert!(target.ends_with("Counter::fail"), "{target}");
            assert_eq!(message, "kaboom");
        }
        other => panic!("expected TaskFailed, got {other}"),
    }
    assert_eq!(counter.value().get().unwrap(), 2, "state survives the panic");
    let err = boom::remote().get().unwrap_err();
    assert!(matches!(err, Error::TaskFailed { ref message, .. } if message == "task exploded"));
}

#[test]
fn resources_are_accounted_fractional_gpus_included() {
    init();
    let half = ActorOptions::default().num_gpus(0.5);
    let actors: Vec<_> =
        (0..4).map(|_| Counter::remote_with(half.clone(), 0u64).unwrap()).collect();
    for a in &actors {
        a.value().get_timeout(LONG).unwrap();
    }
    let info = rtrun::current().unwrap().cluster_info().unwrap();
    assert_eq!(info.available.get("GPU").copied().unwrap_or(0.0), 0.0);
    // A fifth half-GPU actor waits for resources...
    let fifth = Counter::remote_with(half, 5u64).unwrap();
    let pending = fifth.value();
    assert!(pending.get_timeout(Duration::from_millis(300)).is_err());
    // ...and starts once one is killed.
    actors[0].kill().unwrap();
    assert_eq!(pending.get_timeout(LONG).unwrap(), 5);
    // An impossible request fails at once, naming what is missing.
    let err = Counter::remote_with(ActorOptions::default().num_gpus(3.0), 0u64).unwrap_err();
    assert!(
        matches!(&err, Error::Infeasible(m) if m.contains("GPU: 3") && m.contains("has 2")),
        "{err}"
    );
    let err = Counter::remote_with(ActorOptions::default().resource("tpu", 1.0), 0u64).unwrap_err();
    assert!(err.to_string().contains("tpu: 1"), "{err}");
    let custom =
        Counter::remote_with(ActorOptions::default().resource("custom", 1.0), 9u64).unwrap();
    assert_eq!(custom.value().get_timeout(LONG).unwrap(), 9);
    let err = Counter::remote_with(ActorOptions::default().num_gpus(-1.0), 0u64).unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err}");
}

#[test]
fn named_actors_env_and_namespaces() {
    init();
    let opts = ActorOptions::default().name("keeper").env("RTRUN_TEST_VAR", "hello");
    let keeper = Counter::remote_with(opts.clone(), 3u64).unwrap();
    assert_eq!(keeper.env("RTRUN_TEST_VAR".to_string()).get().unwrap().as_deref(), Some("hello"));
    let found = rtrun::get_actor::<Counter>("keeper", None).unwrap();
    assert_eq!(found.value().get().unwrap(), 3);
    let err = Counter::remote_with(opts, 0u64).unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    assert!(
        matches!(&err, Error::NameTaken { name, namespace } if name == "keeper" && namespace == "default"),
        "{err:?}"
    );
    let other_ns =
        Counter::remote_with(ActorOptions::default().name("keeper").namespace("other"), 4u64)
            .unwrap();
    assert_eq!(
        rtrun::get_actor::<Counter>("keeper", Some("other")).unwrap().value().get().unwrap(),
        4
    );
    drop(other_ns);
    assert!(matches!(
        rtrun::get_actor::<Counter>("nobody", None),
        Err(Error::ActorNotFound { .. })
    ));
    assert!(matches!(rtrun::get_actor::<Gate>("keeper", None), Err(Error::Invalid(_))));
    keeper.kill().unwrap();
    assert!(wait_until(LONG, || rtrun::get_actor::<Counter>("keeper", None).is_err()));
}

/// `get_if_exists` (Ray's get-or-create) in the embedded session: the second create returns the
/// live actor (its constructor arguments unused), `list_named_actors` lists it by namespace, a
/// dead actor's name is taken by the next create; a different type or no name is an error.
#[test]
fn get_if_exists_returns_the_live_actor_and_named_actors_are_listed() {
    init();
    let opts = ActorOptions::default().name("registry").namespace("services").get_if_exists();
    let first = Counter::remote_with(opts.clone(), 10u64).unwrap();
    let second = Counter::remote_with(opts.clone(), 99u64).unwrap();
    assert_eq!(second.add(1).get().unwrap(), 11);
    assert_eq!(first.pid().get().unwrap(), second.pid().get().unwrap());
    let everywhere = rtrun::list_named_actors(true).unwrap();
    let listed = everywhere.iter().find(|a| a.name == "registry").expect("listed");
    assert_eq!(listed.namespace, "services");
    assert!(listed.type_name.ends_with("Counter") && !listed.detached, "{listed:?}");
    let here = rtrun::list_named_actors(false).unwrap();
    assert!(here.iter().all(|a| a.namespace == "default"), "{here:?}");

    let err = Gate::remote_with(opts.clone()).unwrap_err();
    assert!(err.to_string().contains("has type") && err.to_string().contains("Gate"), "{err}");
    let err = Counter::remote_with(ActorOptions::default().get_if_exists(), 0u64).unwrap_err();
    assert!(err.to_string().contains("get_if_exists needs a name"), "{err}");

    first.kill().unwrap();
    assert!(wait_until(LONG, || rtrun::get_actor::<Counter>("registry", Some("services")).is_err()));
    let fresh = Counter::remote_with(opts, 7u64).unwrap();
    assert_eq!(fresh.value().get().unwrap(), 7);
    assert!(rtrun::list_named_actors(true).unwrap().iter().any(|a| a.name == "registry"));
}

/// Ray's fate-sharing: an actor's children and placement groups end with it, while what the
/// driver created beside it lives on.
#[test]
fn an_actors_children_and_groups_end_with_it() {
    init();
    let owner = Owner::remote().unwrap();
    let child = owner.spawn(5).get().unwrap().unwrap();
    assert_eq!(child.value().get().unwrap(), 5);
    let child_pid = child.pid().get().unwrap();
    owner.reserve("owned-by-an-actor".to_owned()).get().unwrap().unwrap();
    assert!(rtrun::get_placement_group("owned-by-an-actor").is_ok());
    let bystander = Counter::remote(1).unwrap();
    assert_eq!(bystander.value().get().unwrap(), 1);

    owner.kill().unwrap();
    assert!(wait_until(LONG, || !process_alive(child_pid)), "the child's worker lives on");
    let err = child.value().get().unwrap_err();
    assert!(err.to_string().contains("owner"), "{err}");
    assert!(wait_until(LONG, || rtrun::get_placement_group("owned-by-an-actor").is_err()));
    assert_eq!(bystander.add(1).get().unwrap(), 2);
}

/// The embedded session answers `rtrun status`, `rtrun list` and `rtrun kill` from outside
/// (through its driver's Unix socket), as a cluster's head does.
#[test]
fn rtrun_status_list_and_kill_inspect_the_embedded_session() {
    init();
    let counter = Counter::remote_with(ActorOptions::default().name("inspected"), 5u64).unwrap();
    let pid = counter.pid().get().unwrap();
    let session = rtrun::context().unwrap().session;
    let rtrun = |args: &[&str]| {
        let out = std::process::Command::new(rtrun_tests::rtrun_binary())
            .args(args)
            .args(["--session", &session])
            .env_remove("RTRUN_ADDRESS")
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (text(&out.stdout), text(&out.stderr), out.status.success())
    };
    let (status, err, ok) = rtrun(&["status"]);
    assert!(ok, "{err}");
    assert!(status.contains("nodes: 1 alive, 0 dead") && status.contains("embedded"), "{status}");
    let (actors, err, ok) = rtrun(&["list", "actors"]);
    assert!(ok, "{err}");
    let line =
        actors.lines().find(|l| l.contains(" inspected ")).unwrap_or_else(|| panic!("{actors}"));
    assert!(line.contains(&pid.to_string()) && line.ends_with("ALIVE"), "{line}");
    let (objects, err, ok) = rtrun(&["list", "objects"]);
    assert!(ok && objects.contains("objects"), "{objects}{err}");
    let (out, err, ok) = rtrun(&["kill", "inspected"]);
    assert!(ok && out.contains("killed actor inspected"), "{out}{err}");
    assert!(wait_until(LONG, || rtrun::get_actor::<Counter>("inspected", None).is_err()));
    let (_, err, ok) = rtrun(&["kill", "nobody"]);
    assert!(!ok && err.contains("no actor named `nobody`"), "{err}");
}

/// Another local user (uid 65534, no credentials) can neither see nor reach this user's
/// session. Before, as that user `rtrun status/list/kill --session HEX` answered and killed
/// actors, and `rtrun status` listed every user's sessions: abstract sockets have no file
/// permissions. Needs root (to run as another user).
#[test]
fn another_local_user_can_neither_see_nor_reach_the_session() {
    init();
    assert_eq!(effective_uid(), 0, "this test runs as root, to start processes as another user");
    let counter = Counter::remote_with(ActorOptions::default().name("guarded"), 1u64).unwrap();
    let session = rtrun::context().unwrap().session;
    // The binary where uid 65534 can run it.
    let dir = std::env::temp_dir().join(format!("rtrun-other-user-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let binary = dir.join("rtrun");
    std::fs::copy(rtrun_tests::rtrun_binary(), &binary).unwrap();
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    for path in [&dir, &binary] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let as_nobody = |args: &[&str]| {
        let out = std::process::Command::new(&binary)
            .args(args)
            .uid(65534)
            .gid(65534)
            .env_remove("RTRUN_ADDRESS")
            .env("HOME", &dir)
            .current_dir(&dir)
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (text(&out.stdout), text(&out.stderr), out.status.success())
    };
    let (_, err, ok) = as_nobody(&["status", "--session", &session]);
    assert!(!ok && err.contains("belongs to another user"), "{err}");
    let (_, err, ok) = as_nobody(&["kill", "guarded", "--session", &session]);
    assert!(!ok && err.contains("belongs to another user"), "{err}");
    let (out, err, ok) = as_nobody(&["status"]);
    assert!(!ok && !out.contains(&session) && !err.contains(&session), "{out}{err}");
    // The socket itself refuses the user (not only the CLI): a raw connection as uid 65534 is
    // closed at once, where this user's stays open waiting for its first frame.
    let probe = format!(
        "import socket\ns = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n\
         s.connect('\\0rtrun-{session}-0')\ns.settimeout(3)\n\
         try:\n    print('closed' if s.recv(64) == b'' else 'answered')\n\
         except socket.timeout:\n    print('open')\n"
    );
    let out = std::process::Command::new("python3")
        .args(["-c", &probe])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(said.trim(), "closed", "{}", String::from_utf8_lossy(&out.stderr));
    // The actor lives on, and this user still reaches the session.
    assert_eq!(counter.add(1).get().unwrap(), 2);
    let mine = std::process::Command::new(rtrun_tests::rtrun_binary())
        .args(["status", "--session", &session])
        .env_remove("RTRUN_ADDRESS")
        .output()
        .unwrap();
    assert!(mine.status.success(), "{}", String::from_utf8_lossy(&mine.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Actors created, called and killed one after another leave no socket behind in the process
/// that holds the control plane (a head kept one file descriptor per actor ever created:
/// 200 detached actors created and killed took it from 49 to 249).
#[test]
fn killed_actors_leave_no_sockets_behind() {
    init();
    let fds = || std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
    let warm = Counter::remote(0u64).unwrap();
    warm.add(1u64).get().unwrap();
    warm.kill().unwrap();
    let before = fds();
    for i in 0..40u64 {
        let counter = Counter::remote(i).unwrap();
        assert_eq!(counter.add(1u64).get().unwrap(), i + 1);
        counter.kill().unwrap();
        assert!(wait_until(LONG, || counter.add(0u64).get().is_err()));
    }
    let settled = wait_until(LONG, || fds() <= before + 10);
    assert!(settled, "{} file descriptors after 40 actors, {before} before", fds());
}

/// This process's effective user id.
fn effective_uid() -> u32 {
    std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap_or(1)
}

#[test]
fn a_worker_killed_mid_call_gives_actor_died_for_pending_and_later_calls() {
    init();
    let counter = Counter::remote(0).unwrap();
    let pid = counter.pid().get().unwrap();
    let started = Started::new();
    let in_flight = counter.sleep_ms_after(started.path(), 10_000u64);
    let queued = counter.add(1u64);
    started.wait();
    kill9(pid);
    assert!(matches!(in_flight.get_timeout(LONG), Err(Error::ActorDied { .. })));
    assert!(matches!(queued.get_timeout(LONG), Err(Error::ActorDied { .. })));
    let later = counter.value().get_timeout(LONG).unwrap_err();
    assert!(
        matches!(&later, Error::ActorDied { reason, .. } if reason.contains("signal 9")),
        "{later}"
    );
    assert!(wait_until(LONG, || !process_alive(pid)));
}

#[test]
fn max_restarts_reruns_the_constructor_and_retries_calls() {
    init();
    let opts = ActorOptions::default().max_restarts(1).max_task_retries(1);
    let counter = Counter::remote_with(opts, 40u64).unwrap();
    counter.add(2u64).get().unwrap();
    let first_pid = counter.pid().get().unwrap();
    assert_eq!(counter.incarnation().get().unwrap(), 0);
    let started = Started::new();
    let retried = counter.sleep_ms_after(started.path(), 5_000u64);
    started.wait();
    kill9(first_pid);
    // The in-flight call is retried on the restarted actor (max_task_retries = 1).
    assert_eq!(retried.get_timeout(LONG).unwrap(), 5_000);
    assert_eq!(counter.incarnation().get().unwrap(), 1);
    assert_eq!(counter.value().get().unwrap(), 40, "the constructor ran again");
    let second_pid = counter.pid().get().unwrap();
    assert_ne!(first_pid, second_pid);
    // No restarts are left: the next death is final.
    kill9(second_pid);
    assert!(matches!(counter.value().get_timeout(LONG), Err(Error::ActorDied { .. })));
}

#[test]
fn kill_fails_pending_and_later_calls_and_reaps_the_worker() {
    init();
    let counter = Counter::remote_with(ActorOptions::default().max_restarts(5), 0u64).unwrap();
    let pid = counter.pid().get().unwrap();
    let pending = counter.sleep_ms(10_000u64);
    counter.kill().unwrap();
    assert!(matches!(pending.get_timeout(LONG), Err(Error::ActorDied { .. })));
    let err = counter.add(1u64).get_timeout(LONG).unwrap_err();
    assert!(matches!(&err, Error::ActorDied { reason, .. } if reason.contains("killed")), "{err}");
    assert!(wait_until(LONG, || !process_alive(pid)));
}

#[test]
fn a_failing_constructor_is_reported_to_callers() {
    init();
    let fragile = Fragile::remote(false).unwrap();
    let err = fragile.ping().get_timeout(LONG).unwrap_err();
    assert!(
        matches!(&err, Error::ActorDied { reason, .. } if reason.contains("refusing to start")),
        "{err}"
    );
    let fine = Fragile::remote(true).unwrap();
    assert_eq!(fine.ping().get_timeout(LONG).unwrap(), 1);
}

#[test]
fn cancel_queued_and_running_async_calls() {
    init();
    let counter = Counter::remote(0).unwrap();
    let busy = counter.sleep_ms(1_000u64);
    let queued = counter.add(5u64);
    rtrun::cancel(&queued, false).unwrap();
    assert!(matches!(queued.get_timeout(LONG), Err(Error::Cancelled)));
    assert_eq!(busy.get_timeout(LONG).unwrap(), 1_000);
    assert_eq!(counter.value().get().unwrap(), 0, "the cancelled call never ran");
    let gate = Gate::remote().unwrap();
    let started = Started::new();
    let hanging = gate.hang(started.path());
    started.wait();
    rtrun::cancel(&hanging, false).unwrap();
    assert!(matches!(hanging.get_timeout(LONG), Err(Error::Cancelled)));
    // A queued task is cancelled before it runs; a running one can be force-killed.
    let started = Started::new();
    let two_cpus = TaskOptions { num_cpus: 2.0, ..Default::default() };
    let running = sleepy_after::remote_with(two_cpus.clone(), started.path(), 20_000u64);
    // Once it runs it holds both CPUs, so the next one is queued behind it.
    started.wait();
    let queued = sleepy::remote_with(two_cpus, 1u64);
    rtrun::cancel(&queued, false).unwrap();
    assert!(matches!(queued.get_timeout(LONG), Err(Error::Cancelled)));
    rtrun::cancel(&running, true).unwrap();
    assert!(matches!(running.get_timeout(LONG), Err(Error::Cancelled)));
}

#[test]
fn actor_groups_broadcast_scatter_and_gather() {
    init();
    let group: ActorGroup<Counter> =
        ActorGroup::create("dp", 3, ActorOptions::default(), |rank, opts| {
            Counter::remote_with(opts, rank as u64)
        })
        .unwrap();
    let ranks = rtrun::get_all(&group.call_all(|m| m.group())).unwrap();
    assert_eq!(ranks, vec![Some((0, 3)), Some((1, 3)), Some((2, 3))]);
    let added =
        rtrun::get_all(&group.call_each(vec![10u64, 20, 30], |m, x| m.add(x)).unwrap()).unwrap();
    assert_eq!(added, vec![10, 21, 32]);
    assert!(group.call_each(vec![1u64], |m, x| m.add(x)).is_err());
    // Split a batch of 8 over 3 ranks (3, 3, 2), run, and concatenate in rank order.
    let out = group.dispatch_gather((0..8u64).collect(), |m, chunk| m.scale(chunk)).unwrap();
    let rank_of = |i: u64| {
        if i < 3 {
            0
        } else if i < 6 {
            1
        } else {
            2
        }
    };
    let expected: Vec<u64> = (0..8u64).map(|i| i * 10 + [10u64, 21, 32][rank_of(i)]).collect();
    assert_eq!(out, expected);
    group.kill().unwrap();
}

#[test]
fn driver_killed_with_sigkill_leaves_no_process_or_shared_memory_behind() {
    use std::io::BufRead;
    let mut driver = std::process::Command::new(env!("CARGO_BIN_EXE_sigkill_driver"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = driver.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(stdout).lines();
    let session = lines.next().unwrap().unwrap();
    let session = session.strip_prefix("session ").unwrap().to_owned();
    let pids_line = lines.next().unwrap().unwrap();
    let pids: Vec<u32> = pids_line
        .strip_prefix("pids ")
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 4);
    assert!(pids.iter().all(|p| process_alive(*p)));
    kill9(driver.id());
    driver.wait().unwrap();
    assert!(
        wait_until(LONG, || pids.iter().all(|p| !process_alive(*p))),
        "workers outlived the driver"
    );
    let leftovers: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect()
        })
        .unwrap_or_else(|_| Vec::new())
        .into_iter()
        .filter(|name: &String| name.contains(&session) || name.contains("rtrun"))
        .collect();
    assert!(leftovers.is_empty(), "shared memory left behind: {leftovers:?}");
}

#[test]
fn workers_start_after_the_driver_binary_is_replaced() {
    use std::io::{BufRead, Write};
    // Run a copy of the driver, then delete the copy and put other bytes at its path (what a
    // rebuild does) before the driver starts its next worker.
    let dir = std::env::temp_dir().join(format!("rtrun-replaced-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("driver");
    std::fs::copy(env!("CARGO_BIN_EXE_sigkill_driver"), &copy).unwrap();
    let mut driver = std::process::Command::new(&copy)
        .arg("--late-actor")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(driver.stdout.take().unwrap()).lines();
    let _session = lines.next().unwrap().unwrap();
    let pids_line = lines.next().unwrap().unwrap();
    assert!(pids_line.starts_with("pids "), "{pids_line}");
    std::fs::remove_file(&copy).unwrap();
    std::fs::write(&copy, b"#!/bin/sh\nexit 3\n").unwrap();
    let mut stdin = driver.stdin.take().unwrap();
    writeln!(stdin, "go").unwrap();
    stdin.flush().unwrap();
    let late = lines.next().unwrap().unwrap();
    kill9(driver.id());
    driver.wait().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let pid: u32 = late
        .strip_prefix("late ")
        .unwrap_or_else(|| panic!("the late actor failed: {late}"))
        .parse()
        .unwrap();
    assert!(wait_until(LONG, || !process_alive(pid)), "the late worker outlived the driver");
}

#[test]
fn requests_name_their_service_and_typed_answers_name_a_mismatch() {
    use rtrun::protocol::{HeadRequest, JobInfo, Reply, Request, ask};
    init();
    let session = rtrun::context().unwrap().session;
    // The embedded driver holds the control plane and the node's store; it is no node daemon.
    let err = rtrun::session::ask(&session, ask::KillProcess { pid: 1 }).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("not a node daemon") && message.contains("KillProcess"), "{message}");
    // It answers for its own node's logs (an embedded session keeps none).
    let files = rtrun::session::ask(&session, ask::ListLogs).unwrap();
    assert!(files.is_empty(), "{files:?}");
    let info = rtrun::session::ask(&session, ask::ClusterInfo).unwrap();
    assert_eq!(info.nodes.len(), 1);
    // A typed ask's answer type comes with its request; an answer decoded as another type (a
    // raw request's, read by hand) says which it expected and what came.
    let raw = rtrun::session::ask(&session, Request::Head(HeadRequest::ClusterInfo)).unwrap();
    let err = <Vec<JobInfo> as Reply>::from_response(raw).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("expected a `Jobs` answer, found ClusterInfo"), "{message}");
}

/// One actor call and one task followed through the logs of the driver, the control plane and
/// the worker by the ids their spans carry (decision: `tracing` spans, no custom log format).
#[test]
fn a_call_and_a_task_are_followed_through_the_logs_by_their_ids() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_trace_driver"))
        .env("RUST_LOG", "rtrun=debug,trace_driver=info")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("sum 5") && stdout.contains("double 42"), "{stdout}");
    // `name=value` as a span (`call{job="-" …}`) or an event (`… call=4`) writes it.
    let field = |line: &str, name: &str| -> Option<String> {
        let at = [" ", "{"].iter().filter_map(|p| line.find(&format!("{p}{name}="))).min()?;
        let rest = line[at + name.len() + 2..].trim_start_matches('"');
        Some(rest.chars().take_while(|c| !matches!(c, ' ' | '}' | '"' | ':')).collect())
    };
    // The caller's line names the call, the actor and itself.
    let sent = stderr
        .lines()
        .find(|l| l.contains("call sent"))
        .unwrap_or_else(|| panic!("no `call sent` line:\n{stderr}"));
    let (call, actor, caller) =
        (field(sent, "call").unwrap(), field(sent, "actor").unwrap(), field(sent, "caller"));
    // The worker: the method's own line carries the same call, actor and caller, and the
    // worker, node and job it ran in.
    let ran = stderr
        .lines()
        .find(|l| l.contains("adding 2 and 3"))
        .unwrap_or_else(|| panic!("no line from the method:\n{stderr}"));
    assert!(ran.contains("call{") && ran.contains("Echo::add"), "{ran}");
    assert_eq!(field(ran, "call").as_ref(), Some(&call), "{ran}\n{sent}");
    assert_eq!(field(ran, "actor").as_ref(), Some(&actor), "{ran}");
    assert_eq!(field(ran, "caller"), caller, "{ran}\n{sent}");
    for name in ["worker", "node", "job"] {
        assert!(field(ran, name).is_some(), "no {name} in {ran}");
    }
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("call answered") && field(l, "call") == Some(call.clone())),
        "the caller's answer line for call {call}:\n{stderr}"
    );
    // A task: the head's dispatch line and the worker's line share the head's call id.
    let ran = stderr
        .lines()
        .find(|l| l.contains("doubling 21"))
        .unwrap_or_else(|| panic!("no line from the task:\n{stderr}"));
    assert!(ran.contains("task{") && ran.contains("double"), "{ran}");
    let task_call = field(ran, "call").unwrap();
    let dispatched = stderr
        .lines()
        .find(|l| l.contains("task dispatched") && field(l, "call") == Some(task_call.clone()));
    assert!(dispatched.is_some_and(|l| l.contains("double")), "call {task_call}:\n{stderr}");
    assert!(
        stderr.contains("head_request{kind=\"SubmitTask\"")
            || stderr.contains("head_request{kind=SubmitTask"),
        "{stderr}"
    );
}
