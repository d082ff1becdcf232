//! `rtrun head`, `join`, `status`, `list`, `logs`, `submit`, `job`, `stop`.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use rtrun::cluster::client::{LinePrefixer, LogCursor};
use rtrun::cluster::{self, Client, HeadOptions, JoinOptions};
use rtrun::protocol::JobState;

use crate::inspect::Inspect;

/// Resources a node offers (as `ray start`).
#[derive(Args, Debug, Clone)]
pub struct NodeArgs {
    /// CPUs this node offers (default: its cores).
    #[arg(long)]
    num_cpus: Option<f64>,
    /// GPUs this node offers (default: detected; more adds fake GPUs).
    #[arg(long)]
    num_gpus: Option<f64>,
    /// Custom resources as JSON, e.g. '{"x": 2}'.
    #[arg(long)]
    resources: Option<String>,
    /// Bytes of the node's object store (default: 30 % of memory).
    #[arg(long)]
    object_store_memory: Option<u64>,
    /// This node's name (default: the host name).
    #[arg(long)]
    node_name: Option<String>,
    /// Credentials directory (default: $RTRUN_CREDENTIALS_DIR or ~/.rtrun/credentials).
    #[arg(long)]
    credentials_dir: Option<PathBuf>,
    /// Where job binaries and worker logs go (default: ~/.rtrun/<node name>).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Where objects spill when the store is full (default: $RTRUN_OBJECT_SPILL_DIR, else a
    /// per-session directory under the system temp dir, removed at exit).
    #[arg(long)]
    object_spill_dir: Option<PathBuf>,
    /// Serves Prometheus metrics at http://<bind IP>:<port>/metrics (the head: the cluster's
    /// nodes, resources, actors, tasks, groups and jobs; every node: its object store).
    #[arg(long)]
    metrics_port: Option<u16>,
}

impl NodeArgs {
    /// Starts the metrics endpoint when `--metrics-port` asks for one, on `ip`.
    fn serve_metrics(&self, ip: IpAddr) -> anyhow::Result<Option<rtrun::metrics::MetricsServer>> {
        let Some(port) = self.metrics_port else { return Ok(None) };
        let server = rtrun::metrics::serve(SocketAddr::new(ip, port), Vec::new())
            .with_context(|| format!("--metrics-port {port}"))?;
        println!("metrics: http://{}/metrics", server.address());
        Ok(Some(server))
    }

    fn config(&self) -> anyhow::Result<rtrun::Config> {
        let resources: BTreeMap<String, f64> = match &self.resources {
            Some(json) => serde_json::from_str(json).with_context(|| {
                format!("--resources must be a JSON object of numbers, found `{json}`")
            })?,
            None => BTreeMap::new(),
        };
        Ok(rtrun::Config {
            num_cpus: self.num_cpus,
            num_gpus: self.num_gpus,
            resources,
            object_store_memory: self.object_store_memory,
            object_spill_dir: self.object_spill_dir.clone(),
            ..rtrun::Config::default()
        })
    }

    fn node_name(&self) -> String {
        self.node_name.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "node".into())
        })
    }

    fn credentials_dir(&self) -> PathBuf {
        self.credentials_dir.clone().unwrap_or_else(cluster::default_credentials_dir)
    }

    fn data_dir(&self, name: &str) -> PathBuf {
        self.data_dir.clone().unwrap_or_else(|| {
            let home =
                std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
            home.join(".rtrun").join(name)
        })
    }
}

/// `rtrun head`.
pub fn head(
    port: u16,
    bind: IpAddr,
    advertise: Option<IpAddr>,
    heartbeat_timeout: f64,
    persistence: PersistenceArgs,
    dashboard: DashboardArgs,
    node: NodeArgs,
) -> anyhow::Result<()> {
    if !(persistence.reconnect_window.is_finite() && persistence.reconnect_window > 0.0) {
        bail!(
            "--reconnect-window: expected a positive number of seconds, found {}",
            persistence.reconnect_window
        );
    }
    let name = node.node_name();
    let credentials_dir = node.credentials_dir();
    let handle = cluster::start_head(HeadOptions {
        bind: SocketAddr::new(bind, port),
        advertise,
        node_name: name.clone(),
        credentials_dir: credentials_dir.clone(),
        data_dir: node.data_dir(&name),
        config: node.config()?,
        heartbeat_timeout: Duration::from_secs_f64(heartbeat_timeout),
        state_dir: persistence.state_dir,
        reconnect_window: Duration::from_secs_f64(persistence.reconnect_window),
    })?;
    let address_file = credentials_dir.join(cluster::client::HEAD_ADDRESS_FILE);
    std::fs::write(&address_file, handle.address.to_string())
        .with_context(|| format!("cannot write {}", address_file.display()))?;
    println!("rtrun head is running at {}", handle.address);
    println!(
        "credentials: {}{}",
        handle.credentials_dir.display(),
        if handle.created_credentials { " (created)" } else { "" }
    );
    println!("join token: {}", handle.token);
    println!("to add a node: rtrun join --address {} --token <token>", handle.address);
    let _metrics = node.serve_metrics(bind)?;
    let _dashboard = dashboard.serve()?;
    std::io::stdout().flush()?;
    // Runs until `rtrun stop` has stopped every node.
    rtrun::current()?.wait_for_end().exit()
}

/// Head fault tolerance (Ray's GCS fault tolerance).
#[derive(Args, Debug, Clone)]
pub struct PersistenceArgs {
    /// Persists the cluster's durable state here (nodes, actors, placement groups, jobs, the
    /// key-value store): a head restarted on the same directory and address recovers the
    /// cluster while its nodes, workers and drivers reconnect. Without it, losing the head
    /// ends every node and job.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Seconds the nodes, workers and drivers of a head with --state-dir keep reconnecting
    /// after losing it (and the restarted head waits for them) before giving up.
    #[arg(long, default_value_t = 60.0)]
    reconnect_window: f64,
}

/// The web dashboard of a head.
#[derive(Args, Debug, Clone)]
pub struct DashboardArgs {
    /// Serves the web dashboard on this TCP port (Ray's is 8265).
    #[arg(long)]
    dashboard_port: Option<u16>,
    /// The IP the dashboard listens on; any but loopback needs a token.
    #[arg(long, default_value = "127.0.0.1")]
    dashboard_host: IpAddr,
    /// The dashboard's token (else $RTRUN_DASHBOARD_TOKEN; off loopback by default generated
    /// and printed with the URL).
    #[arg(long)]
    dashboard_token: Option<String>,
}

impl DashboardArgs {
    /// Starts the dashboard when `--dashboard-port` asks for one and prints its URL.
    pub fn serve(&self) -> anyhow::Result<Option<rtrun::dashboard::Dashboard>> {
        let Some(port) = self.dashboard_port else { return Ok(None) };
        let dashboard = rtrun::dashboard::serve(rtrun::dashboard::DashboardOptions {
            bind: Some(SocketAddr::new(self.dashboard_host, port)),
            token: self
                .dashboard_token
                .clone()
                .or_else(|| std::env::var("RTRUN_DASHBOARD_TOKEN").ok()),
            panels: Vec::new(),
        })
        .with_context(|| format!("--dashboard-port {port}"))?;
        println!("dashboard: {}", dashboard.url());
        Ok(Some(dashboard))
    }
}

/// `rtrun join`.
pub fn join(
    address: String,
    token: Option<String>,
    bind_ip: Option<IpAddr>,
    connect_timeout: Option<f64>,
    node: NodeArgs,
) -> anyhow::Result<()> {
    let name = node.node_name();
    let config = rtrun::Config { connect_timeout: seconds(connect_timeout)?, ..node.config()? };
    let runtime = cluster::start_node(JoinOptions {
        address: address.clone(),
        token,
        node_name: name.clone(),
        credentials_dir: node.credentials_dir(),
        data_dir: node.data_dir(&name),
        config,
        bind_ip,
    })?;
    println!("node {name} joined the cluster at {address} as {}", runtime.node());
    let ip = bind_ip.unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
    let _metrics = node.serve_metrics(ip)?;
    std::io::stdout().flush()?;
    // The daemon runs until the head stops it, declares it dead, or its connection is lost.
    runtime.wait_for_end().exit()
}

/// How to reach the cluster from a command.
#[derive(Args, Debug, Clone)]
pub struct ClientArgs {
    /// The head's host:port (default: $RTRUN_ADDRESS, else the address `rtrun head` recorded).
    #[arg(long)]
    address: Option<String>,
    /// The join token, when this machine has no credentials.
    #[arg(long)]
    token: Option<String>,
    /// Credentials directory.
    #[arg(long)]
    credentials_dir: Option<PathBuf>,
    /// Seconds to wait for the head to answer (default: $RTRUN_CONNECT_TIMEOUT, else 5).
    #[arg(long)]
    connect_timeout: Option<f64>,
    /// An embedded session on this machine (the hex name `rtrun memory` prints) instead of a
    /// cluster; `status`, `list` and `kill` also pick the only running one when no cluster
    /// address is known.
    #[arg(long)]
    session: Option<String>,
}

impl ClientArgs {
    /// The control plane that `status`, `list` and `kill` ask: `--session`, else the cluster
    /// (`--address`, `RTRUN_ADDRESS`, the recorded head address), else the only embedded
    /// session running on this machine.
    fn inspect(&self) -> anyhow::Result<Inspect> {
        if let Some(session) = &self.session {
            return Ok(Inspect::Session(rtrun::session::pick_session(Some(session))?));
        }
        let dir = self.credentials_dir.clone().unwrap_or_else(cluster::default_credentials_dir);
        match cluster::client::resolve_address(self.address.as_deref(), &dir) {
            Ok(_) => Ok(Inspect::Cluster(self.connect()?)),
            Err(no_cluster) => match rtrun::session::pick_session(None) {
                Ok(session) => {
                    eprintln!("rtrun: session {session} (the only one of yours on this machine)");
                    Ok(Inspect::Session(session))
                }
                Err(no_session) => bail!("{no_cluster}; and {no_session}"),
            },
        }
    }

    fn connect(&self) -> anyhow::Result<Client> {
        let dir = self.credentials_dir.clone().unwrap_or_else(cluster::default_credentials_dir);
        let address = cluster::client::resolve_address(self.address.as_deref(), &dir)?;
        let timeout = seconds(self.connect_timeout)?;
        Ok(Client::connect(&address, self.token.clone(), dir, timeout)?)
    }
}

/// A `--connect-timeout` value as a duration.
fn seconds(value: Option<f64>) -> anyhow::Result<Option<Duration>> {
    match value {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => bail!("--connect-timeout: expected a positive number of seconds, found {s}"),
    }
}

fn resources(map: &BTreeMap<String, f64>) -> String {
    map.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ")
}

/// `rtrun status`; with `node`, fails unless that node is alive.
pub fn status(node: Option<&str>, client: ClientArgs) -> anyhow::Result<()> {
    let info = client.inspect()?.status()?;
    println!(
        "nodes: {} alive, {} dead",
        info.nodes.iter().filter(|n| n.alive).count(),
        info.nodes.iter().filter(|n| !n.alive).count()
    );
    println!("resources: {}", resources(&info.total));
    println!("available: {}", resources(&info.available));
    println!("workers: {}, alive actors: {}", info.workers, info.alive_actors);
    for node in &info.nodes {
        let state = match &node.death_reason {
            None => "ALIVE".to_owned(),
            Some(reason) => format!("DEAD ({reason})"),
        };
        println!(
            "  {} {} {} [{}] {}",
            node.node,
            node.name,
            state,
            resources(&node.total),
            node.address
        );
    }
    let Some(name) = node else { return Ok(()) };
    match info.nodes.iter().rev().find(|n| n.name == name) {
        Some(n) if n.alive => Ok(()),
        Some(n) => bail!(
            "node `{name}` is dead ({})",
            n.death_reason.as_deref().unwrap_or("no reason given")
        ),
        None => {
            let names: Vec<&str> = info.nodes.iter().map(|n| n.name.as_str()).collect();
            bail!("node `{name}` is not in the cluster (its nodes: {})", names.join(", "))
        }
    }
}

/// `rtrun credentials …`.
#[derive(Subcommand, Debug)]
pub enum CredentialsCommand {
    /// Creates a new cluster's credentials in DIR (CA, CA key, the head's certificate, join
    /// token) and prints the token; `rtrun head --credentials-dir` with a copy of DIR serves
    /// that cluster. Refuses a directory that already holds credentials.
    Init {
        /// The directory to create (mode 0700, files 0600).
        dir: PathBuf,
        /// The head's node name, in its certificate.
        #[arg(long, default_value = "rtrun-head")]
        node_name: String,
    },
}

/// `rtrun credentials`.
pub fn credentials(command: CredentialsCommand) -> anyhow::Result<()> {
    let CredentialsCommand::Init { dir, node_name } = command;
    let credentials = rtrun_net::CredentialsDir::new(&dir);
    if dir.read_dir().is_ok_and(|mut entries| entries.next().is_some()) {
        bail!(
            "`{}` is not empty: credentials init never replaces a cluster's credentials \
             (a new CA would lock every node out); choose a new directory",
            dir.display()
        );
    }
    let (head, _) = credentials
        .load_or_create_head(&node_name)
        .with_context(|| format!("creating credentials in `{}`", dir.display()))?;
    println!("created cluster credentials in {} for head node {node_name}", dir.display());
    println!("join token: {}", head.node.token);
    Ok(())
}

/// What `rtrun list` lists.
#[derive(ValueEnum, Debug, Clone, Copy)]
pub enum Listing {
    Actors,
    Tasks,
    Workers,
    Nodes,
    PlacementGroups,
    Objects,
    Jobs,
}

/// How `rtrun list` and `rtrun summary` print.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Aligned columns.
    Table,
    /// One JSON array (or object), every field.
    Json,
}

/// What `rtrun summary` counts.
#[derive(ValueEnum, Debug, Clone, Copy)]
pub enum Summarised {
    Actors,
    Tasks,
}

/// Prints `value` as pretty JSON.
fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// `rtrun summary actors|tasks`: actors by class and state, tasks by function and state.
pub fn summary(what: Summarised, format: Format, client: ClientArgs) -> anyhow::Result<()> {
    let client = client.inspect()?;
    match what {
        Summarised::Tasks => {
            let counts = client.tasks()?.by_function;
            if format == Format::Json {
                return print_json(&counts);
            }
            println!(
                "{:<40} {:>8} {:>8} {:>9} {:>8}",
                "FUNCTION", "QUEUED", "RUNNING", "FINISHED", "FAILED"
            );
            for (function, c) in &counts {
                println!(
                    "{function:<40} {:>8} {:>8} {:>9} {:>8}",
                    c.queued, c.running, c.finished, c.failed
                );
            }
        }
        Summarised::Actors => {
            let mut counts: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
            for a in client.actors()? {
                *counts.entry(a.type_name).or_default().entry(a.state.to_string()).or_default() +=
                    1;
            }
            if format == Format::Json {
                return print_json(&counts);
            }
            println!("{:<32} {:>6}  STATES", "CLASS", "ACTORS");
            for (class, states) in &counts {
                let total: usize = states.values().sum();
                let states: Vec<String> =
                    states.iter().map(|(state, n)| format!("{state}: {n}")).collect();
                println!("{class:<32} {total:>6}  {}", states.join(", "));
            }
        }
    }
    Ok(())
}

/// `rtrun list`.
pub fn list(what: Listing, format: Format, client: ClientArgs) -> anyhow::Result<()> {
    let client = client.inspect()?;
    if format == Format::Json {
        return match what {
            Listing::Actors => print_json(&client.actors()?),
            Listing::Tasks => print_json(&client.tasks()?.live),
            Listing::Workers => print_json(&client.workers()?),
            Listing::Nodes => print_json(&client.status()?.nodes),
            Listing::PlacementGroups => print_json(&client.placement_groups()?),
            Listing::Objects => print_json(&client.objects()?),
            Listing::Jobs => print_json(&client.jobs()?),
        };
    }
    match what {
        Listing::Actors => {
            println!(
                "{:<10} {:<24} {:<16} {:<9} {:<10} {:>8} {:>8}  STATE",
                "ACTOR", "TYPE", "NAME", "LIFETIME", "NODE", "PID", "RESTARTS"
            );
            for a in client.actors()? {
                println!(
                    "{:<10} {:<24} {:<16} {:<9} {:<10} {:>8} {:>8}  {}",
                    a.actor.to_string(),
                    a.type_name,
                    a.name.unwrap_or_default(),
                    if a.detached { "detached" } else { "" },
                    a.node.map(|n| n.to_string()).unwrap_or_default(),
                    a.pid.map(|p| p.to_string()).unwrap_or_default(),
                    a.restarts,
                    a.state
                );
            }
        }
        Listing::Tasks => {
            println!(
                "{:<18} {:<32} {:<8} {:>7} {:<10} {:<10} {:>8}",
                "TASK", "FUNCTION", "STATE", "RETRIES", "WORKER", "NODE", "PID"
            );
            for t in client.tasks()?.live {
                println!(
                    "{:<18} {:<32} {:<8} {:>7} {:<10} {:<10} {:>8}",
                    t.task.to_string(),
                    t.function,
                    t.state,
                    t.retries,
                    t.worker.map(|w| w.to_string()).unwrap_or_default(),
                    t.node.map(|n| n.to_string()).unwrap_or_default(),
                    t.pid.map(|p| p.to_string()).unwrap_or_default(),
                );
            }
        }
        Listing::Workers => {
            println!(
                "{:<10} {:<10} {:>8} {:<6} {:<10} {:<10}  STATE",
                "WORKER", "NODE", "PID", "KIND", "ACTOR", "DRIVER"
            );
            for w in client.workers()? {
                println!(
                    "{:<10} {:<10} {:>8} {:<6} {:<10} {:<10}  {}",
                    w.worker.to_string(),
                    w.node.to_string(),
                    w.pid.map(|p| p.to_string()).unwrap_or_default(),
                    w.kind,
                    w.actor.map(|a| a.to_string()).unwrap_or_default(),
                    w.driver.map(|d| d.to_string()).unwrap_or_else(|| "embedded".into()),
                    if w.registered { "REGISTERED" } else { "STARTING" },
                );
            }
        }
        Listing::Nodes => {
            println!(
                "{:<10} {:<16} {:<6} {:<40} RESOURCES (available)",
                "NODE", "NAME", "STATE", "ADDRESS"
            );
            for n in client.status()?.nodes {
                println!(
                    "{:<10} {:<16} {:<6} {:<40} {} ({})",
                    n.node.to_string(),
                    n.name,
                    if n.alive { "ALIVE" } else { "DEAD" },
                    n.address,
                    resources(&n.total),
                    resources(&n.available)
                );
            }
        }
        Listing::PlacementGroups => {
            for g in client.placement_groups()? {
                println!(
                    "{} {} {:?} {:?} bundles: {}",
                    g.id,
                    g.name,
                    g.strategy,
                    g.status,
                    g.bundles.len()
                );
            }
        }
        Listing::Objects => {
            for node in client.objects()? {
                let s = &node.stats;
                println!(
                    "{}: {} objects, {} bytes in memory, {} bytes spilled, capacity {}",
                    node.node, s.objects, s.bytes_in_memory, s.bytes_spilled, s.capacity
                );
            }
        }
        Listing::Jobs => print_jobs(&client.jobs()?),
    }
    Ok(())
}

/// Prints a job's log from `offset` until it ends (when `follow`); returns its state.
fn stream_logs(client: &Client, job: u64, follow: bool) -> anyhow::Result<JobState> {
    let mut offset = 0;
    let mut out = std::io::stdout();
    loop {
        let (bytes, info) = client.job_logs(job, offset)?;
        offset += bytes.len() as u64;
        out.write_all(&bytes)?;
        out.flush()?;
        if bytes.is_empty() {
            if !follow || info.state != JobState::Running {
                return Ok(info.state);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Whose output `rtrun logs` prints.
#[derive(Debug)]
pub enum LogSource {
    Job(String),
    Actor(String),
    Worker(String),
    Node(String),
}

/// `rtrun logs`.
pub fn logs(what: LogSource, follow: bool, client: ClientArgs) -> anyhow::Result<()> {
    let client = client.connect()?;
    match what {
        LogSource::Job(name) => {
            let job = client.job(&name)?;
            stream_logs(&client, job.job, follow)?;
        }
        LogSource::Actor(name) => actor_logs(&client, &name, follow)?,
        LogSource::Worker(name) => {
            let number = id_number(&name, "worker-")
                .with_context(|| format!("--worker {name}: expected worker-N or N"))?;
            let file = format!("worker-{number}.log");
            let nodes = client.status()?.nodes;
            let node = nodes
                .iter()
                .filter(|n| n.alive)
                .find(|n| {
                    client.list_logs(n).is_ok_and(|files| files.iter().any(|(f, _)| *f == file))
                })
                .with_context(|| {
                    format!("no live node has the log of worker-{number} (see `rtrun list actors`)")
                })?;
            let mut cursor = LogCursor::new(&file);
            loop {
                let read = follow_file(&client, node, &mut cursor, None)?;
                if !follow {
                    break;
                }
                if read == 0 {
                    std::thread::sleep(Duration::from_millis(250));
                }
            }
        }
        LogSource::Node(name) => node_logs(&client, &name, follow)?,
    }
    Ok(())
}

/// N from `prefixN` or `N`.
fn id_number(text: &str, prefix: &str) -> Option<u64> {
    text.strip_prefix(prefix).unwrap_or(text).parse().ok()
}

/// Prints what the log under `cursor` on `node` has that was not printed yet, older rotated
/// copies first (each line prefixed with `prefix`, if any); returns the bytes read.
fn follow_file(
    client: &Client,
    node: &rtrun::protocol::NodeInfo,
    cursor: &mut LogCursor,
    prefix: Option<(&str, &mut LinePrefixer)>,
) -> anyhow::Result<usize> {
    let bytes = cursor.read_new(client, node)?;
    let mut out = std::io::stdout().lock();
    match prefix {
        None => out.write_all(&bytes)?,
        Some((label, lines)) => out.write_all(&lines.prefix(label, &bytes))?,
    }
    out.flush()?;
    Ok(bytes.len())
}

/// `rtrun logs --actor`: the actor's worker log, then its next worker's after a restart.
fn actor_logs(client: &Client, name: &str, follow: bool) -> anyhow::Result<()> {
    let find = || -> anyhow::Result<rtrun::protocol::ActorSummary> {
        let number = id_number(name, "actor-");
        client
            .actors()?
            .into_iter()
            .find(|a| Some(a.actor.0) == number || a.name.as_deref() == Some(name))
            .with_context(|| format!("no actor `{name}` (see `rtrun list actors`)"))
    };
    let mut current: Option<(u64, u64)> = None;
    let mut cursor = LogCursor::new("");
    loop {
        let actor = find()?;
        let (Some(worker), Some(node_id)) = (actor.worker, actor.log_node) else {
            if !follow {
                bail!("actor `{name}` has not started a worker yet ({})", actor.state);
            }
            std::thread::sleep(Duration::from_millis(250));
            continue;
        };
        if current != Some((node_id.0, worker.0)) {
            if current.is_some() {
                eprintln!("rtrun logs: actor {} restarted as {worker} on {node_id}", actor.actor);
            }
            current = Some((node_id.0, worker.0));
            cursor = LogCursor::new(&format!("worker-{}.log", worker.0));
        }
        let nodes = client.status()?.nodes;
        let node = nodes.iter().find(|n| n.node == node_id).context("the actor's node")?;
        if !node.alive {
            bail!("the log of actor `{name}` was on {node_id} ({}), which is dead", node.name);
        }
        let read = follow_file(client, node, &mut cursor, None)?;
        if !follow || (read == 0 && actor.state.starts_with("DEAD")) {
            return Ok(());
        }
        if read == 0 {
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// `rtrun logs --node`: every log file on the node (not the rotated copies), each line
/// prefixed with its file's name; with `follow`, new lines and new files as they come.
fn node_logs(client: &Client, name: &str, follow: bool) -> anyhow::Result<()> {
    let nodes = client.status()?.nodes;
    let number = id_number(name, "node-");
    let node =
        nodes.iter().rev().find(|n| Some(n.node.0) == number || n.name == name).with_context(
            || {
                let names: Vec<String> =
                    nodes.iter().map(|n| format!("{} {}", n.node, n.name)).collect();
                format!("no node `{name}` (nodes: {})", names.join(", "))
            },
        )?;
    if !node.alive {
        bail!("node `{name}` is dead: its logs cannot be read through the head");
    }
    let mut cursors: BTreeMap<String, (LogCursor, LinePrefixer)> = BTreeMap::new();
    loop {
        let mut read = 0;
        for (file, _) in client.list_logs(node)? {
            if file.rsplit_once(".log.").is_some() {
                continue;
            }
            let prefix = file.trim_end_matches(".log").to_owned();
            let (cursor, lines) = cursors
                .entry(file.clone())
                .or_insert_with(|| (LogCursor::new(&file), LinePrefixer::default()));
            read += follow_file(client, node, cursor, Some((&prefix, lines)))?;
        }
        if !follow {
            return Ok(());
        }
        if read == 0 {
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// One line per job: number, submission id, state, binary digest and arguments.
fn print_jobs(jobs: &[rtrun::protocol::JobInfo]) {
    println!("{:<5} {:<32} {:<28} COMMAND", "JOB", "SUBMISSION ID", "STATE");
    for j in jobs {
        let digest = j.binary.get(..12).unwrap_or(&j.binary);
        let state = j.state.to_string();
        println!(
            "{:<5} {:<32} {:<28} {digest}… {}",
            j.job,
            j.submission_id,
            state,
            j.args.join(" ")
        );
    }
}

/// What `rtrun submit` does besides running the driver.
#[derive(Args, Debug, Clone)]
pub struct SubmitArgs {
    /// `KEY=VALUE` for the driver and every worker of the job (repeatable).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Print the job's number and submission id and return at once (then `rtrun job logs`).
    #[arg(long)]
    no_wait: bool,
    /// The job's name, unique in the cluster (default: generated).
    #[arg(long)]
    submission_id: Option<String>,
    /// A directory of files the job needs (configs, small datasets, scripts): packed,
    /// uploaded once by content and unpacked for the job where its driver runs, which starts
    /// in it (as Ray's `working_dir`; at most 500 MiB).
    #[arg(long)]
    working_dir: Option<PathBuf>,
}

/// `--env` values as pairs, each checked.
fn env_pairs(values: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    values
        .iter()
        .map(|value| match value.split_once('=') {
            Some((key, val)) if !key.is_empty() && !key.contains('\0') && !val.contains('\0') => {
                Ok((key.to_owned(), val.to_owned()))
            }
            _ => bail!("--env {value}: expected KEY=VALUE with a non-empty KEY"),
        })
        .collect()
}

/// `rtrun submit`: returns the job's exit code (0 with `--no-wait` once it is submitted).
pub fn submit(
    command: Vec<String>,
    options: SubmitArgs,
    client: ClientArgs,
) -> anyhow::Result<i32> {
    let Some((binary, args)) = command.split_first() else {
        bail!("expected a driver binary after `--`");
    };
    let path = PathBuf::from(binary);
    if !path.is_file() {
        bail!("driver binary {} does not exist", path.display());
    }
    let env = env_pairs(&options.env)?;
    let client = client.connect()?;
    let job = client.submit(
        &path,
        args.to_vec(),
        env,
        options.submission_id,
        options.working_dir.as_deref(),
    )?;
    eprintln!("submitted job {} ({}, binary {})", job.job, job.submission_id, job.binary);
    if options.no_wait {
        println!("{}", job.submission_id);
        return Ok(0);
    }
    job_exit_code(&job, stream_logs(&client, job.job, true)?)
}

/// The exit code `rtrun submit` (and `rtrun job logs -f`) end with for a job that ended so.
fn job_exit_code(job: &rtrun::protocol::JobInfo, state: JobState) -> anyhow::Result<i32> {
    match state {
        JobState::Exited { code } => Ok(code),
        JobState::Failed { reason } => {
            eprintln!("job {} failed: {reason}", job.job);
            Ok(1)
        }
        JobState::Stopped => {
            eprintln!("job {} was stopped", job.job);
            Ok(1)
        }
        JobState::Running => Ok(1),
    }
}

/// `rtrun job ...`.
#[derive(Subcommand, Debug)]
pub enum JobCommand {
    /// Shows one job's state.
    Status {
        /// Its number or submission id.
        job: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Stops a running job: its driver, its workers on every node, its placement groups.
    Stop {
        /// Its number or submission id.
        job: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Prints a job's output (kept after it ends).
    Logs {
        /// Its number or submission id.
        job: String,
        /// Keep printing until the job ends.
        #[arg(long, short)]
        follow: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Lists every job.
    List {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Forgets an ended job: its record and its log (a running job is refused: stop it first).
    Delete {
        /// Its number or submission id.
        job: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// `rtrun job`: returns the exit code (for `logs -f`, the job's).
pub fn job(command: JobCommand) -> anyhow::Result<i32> {
    match command {
        JobCommand::Status { job, client } => {
            let client = client.connect()?;
            let info = client.job(&job)?;
            println!("job {} ({}): {}", info.job, info.submission_id, info.state);
            Ok(0)
        }
        JobCommand::Stop { job, client } => {
            let client = client.connect()?;
            let info = client.job(&job)?;
            let info = client.stop_job(info.job)?;
            if info.state != JobState::Running {
                println!("job {} ({}) has ended: {}", info.job, info.submission_id, info.state);
                return Ok(0);
            }
            // Wait for the driver to go, up to 30 s.
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                let now = client.job(&info.job.to_string())?;
                if now.state != JobState::Running {
                    println!("job {} ({}): {}", now.job, now.submission_id, now.state);
                    return Ok(0);
                }
                if std::time::Instant::now() > deadline {
                    bail!("job {} ({}) did not stop within 30 s", now.job, now.submission_id);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        JobCommand::Logs { job, follow, client } => {
            let client = client.connect()?;
            let info = client.job(&job)?;
            let state = stream_logs(&client, info.job, follow)?;
            if follow { job_exit_code(&info, state) } else { Ok(0) }
        }
        JobCommand::List { client } => {
            print_jobs(&client.connect()?.jobs()?);
            Ok(0)
        }
        JobCommand::Delete { job, client } => {
            let client = client.connect()?;
            let info = client.delete_job(client.job(&job)?.job)?;
            println!("deleted job {} ({}): {}", info.job, info.submission_id, info.state);
            Ok(0)
        }
    }
}

/// `rtrun remove-placement-group`.
pub fn remove_placement_group(name: &str, client: ClientArgs) -> anyhow::Result<()> {
    let group = client.connect()?.remove_placement_group(name)?;
    println!("removed placement group {} ({})", group.name, group.id);
    Ok(())
}

/// `rtrun kill`: kills the named actor (detached ones included); `restart` lets it restart as
/// after a crash, within its `max_restarts`.
pub fn kill(name: &str, namespace: &str, restart: bool, client: ClientArgs) -> anyhow::Result<()> {
    let info = client.inspect()?.kill_actor(name, namespace, restart)?;
    let what = if restart { "restarting" } else { "killed" };
    println!("{what} actor {name} ({}, {}) in namespace {namespace}", info.id, info.type_name);
    Ok(())
}

/// `rtrun stop`.
pub fn stop(client: ClientArgs) -> anyhow::Result<()> {
    client.connect()?.stop()?;
    println!("cluster stopping");
    Ok(())
}
