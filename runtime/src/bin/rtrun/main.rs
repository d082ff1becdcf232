//! The `rtrun` command: cluster operations (growing with the multi-node work), `rtrun memory`,
//! and the microbenchmark that compares rtrun with `ray microbenchmark`.

mod cluster;
mod inspect;
mod memory;
mod microbenchmark;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "rtrun",
    version,
    about = "rtrun: a Rust runtime for distributed actors and tasks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the runtime microbenchmarks (Ray's metric names and output format).
    Microbenchmark {
        /// Runs only the metrics whose name contains this text (like Ray's TESTS_TO_RUN).
        pattern: Option<String>,
        /// Seconds per measured round (Ray: 2).
        #[arg(long, default_value_t = 2.0)]
        round_seconds: f64,
    },
    /// Shows the object store of a running session: objects per node, sizes, pins, spilled
    /// bytes.
    Memory {
        /// The session to inspect (the hex name in its sockets); needed only when several run.
        #[arg(long)]
        session: Option<String>,
    },
    /// Starts a cluster head (control plane and a node) and prints its address and join token.
    Head {
        /// UDP port to listen on.
        #[arg(long, default_value_t = 6379)]
        port: u16,
        /// IP to listen on.
        #[arg(long, default_value = "0.0.0.0")]
        bind: std::net::IpAddr,
        /// IP other nodes reach this head at (default: the bind IP, or 127.0.0.1).
        #[arg(long)]
        advertise: Option<std::net::IpAddr>,
        /// Seconds without heartbeats after which a node is declared dead.
        #[arg(long, default_value_t = 5.0)]
        heartbeat_timeout: f64,
        #[command(flatten)]
        persistence: cluster::PersistenceArgs,
        #[command(flatten)]
        dashboard: cluster::DashboardArgs,
        #[command(flatten)]
        node: cluster::NodeArgs,
    },
    /// Starts a node daemon that joins the cluster at --address.
    Join {
        /// The head's host:port.
        #[arg(long)]
        address: String,
        /// The join token (else $RTRUN_TOKEN, else the credentials directory's token file).
        #[arg(long)]
        token: Option<String>,
        /// IP to bind and advertise (default: the one that routes to the head).
        #[arg(long)]
        bind_ip: Option<std::net::IpAddr>,
        /// Seconds to wait for the head to answer (default: $RTRUN_CONNECT_TIMEOUT, else 5).
        #[arg(long)]
        connect_timeout: Option<f64>,
        #[command(flatten)]
        node: cluster::NodeArgs,
    },
    /// Shows the cluster's nodes and resources.
    Status {
        /// Fails (exit code 1) unless the node of this name is in the cluster and alive: a
        /// readiness check for a head or a joined node.
        #[arg(long)]
        node: Option<String>,
        #[command(flatten)]
        client: cluster::ClientArgs,
    },
    /// Cluster credentials made ahead of `rtrun head`, e.g. for a Kubernetes Secret.
    Credentials {
        #[command(subcommand)]
        command: cluster::CredentialsCommand,
    },
    /// Lists actors, tasks, workers, nodes, placement groups, objects or jobs.
    List {
        /// What to list.
        what: cluster::Listing,
        /// `table` for people, `json` (one array, every field) for scripts.
        #[arg(long, value_enum, default_value = "table")]
        format: cluster::Format,
        #[command(flatten)]
        client: cluster::ClientArgs,
    },
    /// Counts actors by class and state, or tasks by function and state (Ray's `ray summary`).
    Summary {
        /// What to summarise.
        what: cluster::Summarised,
        /// `table` for people, `json` for scripts.
        #[arg(long, value_enum, default_value = "table")]
        format: cluster::Format,
        #[command(flatten)]
        client: cluster::ClientArgs,
    },
    /// Prints a job's output, or a worker's, an actor's or every worker's on a node, read
    /// through the head from the node that holds it.
    Logs {
        /// The job (its number or submission id): its driver's output.
        #[arg(required_unless_present_any = ["actor", "worker", "node"])]
        job: Option<String>,
        /// An actor (`actor-N`, N, or its name): its worker's output, following restarts.
        #[arg(long, conflicts_with_all = ["job", "worker", "node"])]
        actor: Option<String>,
        /// A worker (`worker-N` or N): its output.
        #[arg(long, conflicts_with_all = ["job", "node"])]
        worker: Option<String>,
        /// A node (`node-N`, N, or its name): every worker's output there, each line prefixed
        /// with its file.
        #[arg(long, conflicts_with = "job")]
        node: Option<String>,
        /// Keep printing: until the job ends or the actor is dead; for a worker or node, until
        /// interrupted.
        #[arg(long, short)]
        follow: bool,
        #[command(flatten)]
        client: cluster::ClientArgs,
    },
    /// Uploads a driver binary, runs it on the cluster, streams its output, exits with its code.
    Submit {
        #[command(flatten)]
        client: cluster::ClientArgs,
        #[command(flatten)]
        options: cluster::SubmitArgs,
        /// The driver binary and its arguments (after `--`).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Jobs: `status`, `stop`, `logs`, `list`, `delete` (a job is its number or submission id).
    Job {
        #[command(subcommand)]
        command: cluster::JobCommand,
    },
    /// Removes a placement group by name (its actors and tasks stop, its resources are freed),
    /// e.g. one left by a driver of an older version.
    RemovePlacementGroup {
        /// The group's name (see `rtrun list placement-groups`).
        name: String,
        #[command(flatten)]
        client: cluster::ClientArgs,
    },
    /// Kills a named actor (a detached one included): it is not restarted unless --restart.
    Kill {
        /// The actor's name (see `rtrun list actors`).
        name: String,
        /// The namespace of the name.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// Kill its process as a crash would: it restarts if its `max_restarts` allows.
        #[arg(long)]
        restart: bool,
        #[command(flatten)]
        client: cluster::ClientArgs,
    },
    /// Stops every node and the head.
    Stop {
        #[command(flatten)]
        client: cluster::ClientArgs,
    },
}

fn main() -> anyhow::Result<()> {
    // Worker processes are this binary re-run; they serve here and never parse arguments.
    rtrun::run_worker_if_requested();
    // Daemons and clients log to stderr: warnings by default, `RUST_LOG` for more.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // A client piped into `head` ends quietly when the reader leaves; daemons keep running.
    if !matches!(cli.command, Command::Head { .. } | Command::Join { .. }) {
        rtrun::logs::exit_on_closed_stdout();
    }
    match cli.command {
        Command::Microbenchmark { pattern, round_seconds } => {
            let pattern =
                pattern.or_else(|| std::env::var("TESTS_TO_RUN").ok()).unwrap_or_default();
            microbenchmark::run(&pattern, round_seconds)
        }
        Command::Memory { session } => memory::run(session.as_deref()),
        Command::Head {
            port,
            bind,
            advertise,
            heartbeat_timeout,
            persistence,
            dashboard,
            node,
        } => cluster::head(port, bind, advertise, heartbeat_timeout, persistence, dashboard, node),
        Command::Join { address, token, bind_ip, connect_timeout, node } => {
            cluster::join(address, token, bind_ip, connect_timeout, node)
        }
        Command::Status { node, client } => cluster::status(node.as_deref(), client),
        Command::Credentials { command } => cluster::credentials(command),
        Command::List { what, format, client } => cluster::list(what, format, client),
        Command::Summary { what, format, client } => cluster::summary(what, format, client),
        Command::Logs { job, actor, worker, node, follow, client } => {
            let what = match (job, actor, worker, node) {
                (Some(job), ..) => cluster::LogSource::Job(job),
                (_, Some(actor), ..) => cluster::LogSource::Actor(actor),
                (_, _, Some(worker), _) => cluster::LogSource::Worker(worker),
                (_, _, _, Some(node)) => cluster::LogSource::Node(node),
                _ => anyhow::bail!("name a job, --actor, --worker or --node"),
            };
            cluster::logs(what, follow, client)
        }
        Command::Submit { client, options, command } => {
            let code = cluster::submit(command, options, client)?;
            std::process::exit(code)
        }
        Command::Job { command } => {
            let code = cluster::job(command)?;
            std::process::exit(code)
        }
        Command::RemovePlacementGroup { name, client } => {
            cluster::remove_placement_group(&name, client)
        }
        Command::Kill { name, namespace, restart, client } => {
            cluster::kill(&name, &namespace, restart, client)
        }
        Command::Stop { client } => cluster::stop(client),
    }
}
