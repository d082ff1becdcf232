//! A cluster of real processes on loopback for the multi-node tests: `rtrun head` and two
//! `rtrun join` nodes (distinct ports, store and data directories, fake resources), killed
//! and cleaned up when the test ends, and helpers to run `rtrun` commands against it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::rtrun_binary;

/// Processes killed when the test ends, whatever happens.
pub struct Cluster {
    pub dir: PathBuf,
    pub head: Child,
    pub nodes: Vec<Child>,
    pub address: String,
    pub token: String,
    /// How the head was started (for [`Cluster::restart_head`]).
    head_args: Vec<std::ffi::OsString>,
    head_env: Vec<(String, String)>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in self.nodes.iter_mut().chain(std::iter::once(&mut self.head)) {
            // Workers too: a daemon killed first would leave them to their own devices.
            for worker in crate::descendants(child.id()) {
                crate::kill9(worker);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Reads lines from `child`'s stdout until one starts with `prefix`.
pub fn wait_line(child: &mut Child, prefix: &str, what: &str) -> String {
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let prefix = prefix.to_owned();
    std::thread::spawn(move || {
        // Keeps reading after the line (the process may print more; a closed pipe would
        // fail its writes).
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with(&prefix) {
                let _ = tx.send(line);
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("{what} did not start"))
}

/// What one node of a test cluster offers.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    /// Its name (`--node-name`).
    pub name: &'static str,
    /// `--num-cpus`.
    pub cpus: u32,
    /// `--num-gpus` (fake ones on a machine without GPUs).
    pub gpus: u32,
    /// `--resources` JSON, if any.
    pub resources: Option<&'static str>,
}

/// The head (1 CPU, no GPU) and two joined nodes `n1`, `n2` with 1 CPU, 2 fake GPUs and one
/// `slot` each: the runtime tests' cluster.
pub fn start_cluster(name: &str, heartbeat_timeout: &str) -> Cluster {
    let node = |name| NodeSpec { name, cpus: 1, gpus: 2, resources: Some(r#"{"slot": 1}"#) };
    start_cluster_with(
        name,
        heartbeat_timeout,
        &NodeSpec { name: "head", cpus: 1, gpus: 0, resources: None },
        &[node("n1"), node("n2")],
    )
}

/// A head and joined nodes as given, on loopback, each with its own credentials, data
/// directory and a 700 MB store.
pub fn start_cluster_with(
    name: &str,
    heartbeat_timeout: &str,
    head_spec: &NodeSpec,
    nodes: &[NodeSpec],
) -> Cluster {
    start_cluster_with_args(name, heartbeat_timeout, head_spec, &[], nodes)
}

/// [`start_cluster_with`], with extra `rtrun head` arguments.
pub fn start_cluster_with_args(
    name: &str,
    heartbeat_timeout: &str,
    head_spec: &NodeSpec,
    head_args: &[&str],
    nodes: &[NodeSpec],
) -> Cluster {
    start_cluster_with_env(name, heartbeat_timeout, head_spec, head_args, &[], nodes)
}

/// [`start_cluster_with_args`], with extra environment variables for `rtrun head`.
pub fn start_cluster_with_env(
    name: &str,
    heartbeat_timeout: &str,
    head_spec: &NodeSpec,
    head_args: &[&str],
    head_env: &[(&str, &str)],
    nodes: &[NodeSpec],
) -> Cluster {
    let dir = std::env::temp_dir().join(format!("rtrun-cluster-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_udp_port();
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut arg = |a: &dyn AsRef<std::ffi::OsStr>| args.push(a.as_ref().to_owned());
    for a in ["head", "--bind", "127.0.0.1", "--port", &port.to_string()] {
        arg(&a);
    }
    for a in ["--num-cpus", &head_spec.cpus.to_string(), "--num-gpus", &head_spec.gpus.to_string()]
    {
        arg(&a);
    }
    for a in ["--node-name", head_spec.name, "--object-store-memory", "700000000"] {
        arg(&a);
    }
    for a in ["--heartbeat-timeout", heartbeat_timeout] {
        arg(&a);
    }
    for (flag, path) in [
        ("--credentials-dir", "head-credentials"),
        ("--data-dir", "head-data"),
        ("--object-spill-dir", "spill"),
    ] {
        arg(&flag);
        arg(&dir.join(path));
    }
    for a in head_args {
        arg(a);
    }
    let head_env: Vec<(String, String)> =
        head_env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    let mut head = spawn_head(&args, &head_env);
    let token_line = wait_line(&mut head, "join token: ", "rtrun head");
    let token = token_line.trim_start_matches("join token: ").to_owned();
    let address = format!("127.0.0.1:{port}");
    let mut cluster =
        Cluster { dir, head, nodes: Vec::new(), address, token, head_args: args, head_env };
    for node in nodes {
        cluster.join(node);
    }
    cluster
}

fn spawn_head(args: &[std::ffi::OsString], env: &[(String, String)]) -> Child {
    Command::new(rtrun_binary())
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .spawn()
        .expect("rtrun head starts")
}

impl Cluster {
    /// Starts the head again with the arguments it first had, those of `replace` given new
    /// values (after it was killed), and waits until it listens; the old head's process is
    /// replaced.
    pub fn restart_head(&mut self, replace: &[(&str, &str)]) {
        let mut args = self.head_args.clone();
        for (flag, value) in replace {
            let at = args.iter().position(|a| a == flag).expect("a flag the head was given");
            args[at + 1] = (*value).into();
        }
        let mut head = spawn_head(&args, &self.head_env);
        wait_line(&mut head, "join token: ", "the restarted rtrun head");
        let mut old = std::mem::replace(&mut self.head, head);
        let _ = old.kill();
        let _ = old.wait();
    }

    /// Starts a node that joins this cluster (appended to `nodes`) and waits until it has.
    pub fn join(&mut self, node: &NodeSpec) {
        self.join_with_args(node, &[]);
    }

    /// [`Cluster::join`], with extra `rtrun join` arguments.
    pub fn join_with_args(&mut self, node: &NodeSpec, args: &[&str]) {
        let dir = &self.dir;
        let mut command = Command::new(rtrun_binary());
        command
            .args(["join", "--address", &self.address, "--token", &self.token])
            .args(["--num-cpus", &node.cpus.to_string(), "--num-gpus", &node.gpus.to_string()])
            .args(["--node-name", node.name])
            .args(["--object-store-memory", "700000000"])
            .arg("--credentials-dir")
            .arg(dir.join(format!("{}-credentials", node.name)))
            .arg("--data-dir")
            .arg(dir.join(format!("{}-data", node.name)))
            .arg("--object-spill-dir")
            .arg(dir.join("spill"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(resources) = node.resources {
            command.args(["--resources", resources]);
        }
        command.args(args);
        let mut child = command.spawn().expect("rtrun join starts");
        wait_line(&mut child, "node ", "rtrun join");
        self.nodes.push(child);
    }

    /// Kills node `index`'s daemon and every process it started (SIGKILL): the machine is
    /// gone, its workers with it.
    pub fn kill_node_tree(&mut self, index: usize) {
        let pid = self.nodes[index].id();
        for victim in crate::descendants(pid).into_iter().chain([pid]) {
            crate::kill9(victim);
        }
        let _ = self.nodes[index].wait();
    }
}

pub fn rtrun(cluster: &Cluster, args: &[&str], credentials: &Path) -> std::process::Output {
    Command::new(rtrun_binary())
        .args(args)
        .args(["--address", &cluster.address])
        .arg("--credentials-dir")
        .arg(credentials)
        .output()
        .expect("rtrun runs")
}

pub fn status(cluster: &Cluster) -> String {
    let out = rtrun(cluster, &["status"], &cluster.dir.join("head-credentials"));
    assert!(out.status.success(), "rtrun status failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What a child wrote to its piped stderr (call once it has exited).
pub fn stderr_of(child: &mut Child) -> String {
    use std::io::Read;
    let mut text = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        let _ = stderr.read_to_string(&mut text);
    }
    text
}

/// Waits up to `timeout` for `child` to exit; `None` when it is still running.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `ip` with `args`; false when it fails.
fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).status().map(|s| s.success()).unwrap_or(false)
}

/// Network namespaces joined by a bridge, removed on drop (with their `/etc/netns` files).
pub struct Namespaces(Vec<String>);

impl Namespaces {
    /// Gives `ip netns exec NS` processes a hosts file (`ip netns exec` mounts
    /// `/etc/netns/NS/hosts` over `/etc/hosts`), so they resolve `names` as a cluster's DNS
    /// would.
    pub fn hosts(&self, ns: &str, names: &[(&str, &str)]) {
        let dir = Path::new("/etc/netns").join(ns);
        std::fs::create_dir_all(&dir).unwrap();
        let mut text = String::from("127.0.0.1 localhost\n");
        for (address, name) in names {
            text.push_str(&format!("{address} {name}\n"));
        }
        std::fs::write(dir.join("hosts"), text).unwrap();
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            ip(&["netns", "del", ns]);
            let _ = std::fs::remove_dir_all(Path::new("/etc/netns").join(ns));
        }
    }
}

/// `count` namespaces with one address each (`10.77.<n>.1`, ...) behind a bridge in another one, or
/// `None` where the sandbox does not allow creating them. Returns the guard, the namespaces'
/// names and their addresses.
pub fn namespaces(count: usize) -> Option<(Namespaces, Vec<String>, Vec<String>)> {
    let tag = format!("{:x}", std::process::id() % 0xffff);
    let bridge = format!("rtb{tag}");
    let nodes: Vec<String> = (0..count).map(|i| format!("rtn{tag}{i}")).collect();
    let mut all = vec![bridge.clone()];
    all.extend(nodes.iter().cloned());
    if !ip(&["netns", "add", &bridge]) {
        return None;
    }
    let guard = Namespaces(all);
    let subnet = std::process::id() % 200 + 20;
    let ok = ip(&["-n", &bridge, "link", "add", "br0", "type", "bridge"])
        && ip(&["-n", &bridge, "link", "set", "br0", "up"]);
    if !ok {
        return None;
    }
    let mut addresses = Vec::new();
    for (i, ns) in nodes.iter().enumerate() {
        let address = format!("10.77.{subnet}.{}", i + 1);
        let peer = format!("p{i}");
        let ok = ip(&["netns", "add", ns])
            && ip(&["-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", &peer])
            && ip(&["-n", ns, "link", "set", &peer, "netns", &bridge])
            && ip(&["-n", &bridge, "link", "set", &peer, "master", "br0"])
            && ip(&["-n", &bridge, "link", "set", &peer, "up"])
            && ip(&["-n", ns, "addr", "add", &format!("{address}/24"), "dev", "eth0"])
            && ip(&["-n", ns, "link", "set", "eth0", "up"])
            && ip(&["-n", ns, "link", "set", "lo", "up"]);
        if !ok {
            return None;
        }
        addresses.push(address);
    }
    Some((guard, nodes, addresses))
}
