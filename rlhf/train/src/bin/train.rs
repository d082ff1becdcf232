//! The training driver: `train --config X.yaml [--mode rl|sft|rm|dpo] [--set key=value]…
//! [--overwrite] [--address A] [--detach]`, or `train --attach RUN [--address A]`;
//! `train --print-default-config [--mode M]` and `--print-config-schema` describe the config. The config's
//! `mode:` (or `--mode`) picks the trainer: PPO / GRPO (`rl`, the default), supervised
//! fine-tuning (`sft`), a reward model (`rm`) or DPO (`dpo`).
//!
//! Runs on the embedded single-node runtime, or on a cluster with `--address`. The run itself
//! lives in a trainer actor (`rtrun_rlhf::trainer_actor`) that this driver creates and follows:
//! it prints a progress bar with the live metrics (reward and KL, or loss) and phase timings.
//! The run leaves `metrics.jsonl`, TensorBoard event files, a curve PNG (`reward.png` /
//! `loss.png`) and `summary.md` in the run directory, and the trained model in
//! `final_policy/`; the driver prints the summary (baseline vs final held-out results and
//! per-phase timings) at the end. With `--detach` (on a cluster) the run goes on when the driver
//! goes, and `train --attach RUN` follows it again.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Parser;

use rtrun_rlhf::TrainConfig;
use rtrun_rlhf::config::{CheckedConfig, ConfigTree, Mode};
use rtrun_rlhf::trainer_actor::{self, Event, RunRequest, TrainerActor, TrainerActorRef};
use rtrun_rlhf_telemetry::live::{ChartSpec, LiveMetrics};
use rtrun_rlhf_telemetry::{ProgressField, ProgressOptions, RunProgress};

/// Command line of the driver.
#[derive(Debug, Parser)]
#[command(name = "train", about = "PPO / GRPO and supervised fine-tuning on rtrun")]
struct Args {
    /// The YAML config.
    #[arg(long, required_unless_present_any = ["attach", "print_default_config", "print_config_schema"])]
    config: Option<PathBuf>,
    /// The trainer: `rl` (PPO / GRPO), `sft`, `rm` (a reward model on preference pairs) or
    /// `dpo`; the same as `--set mode=M` (the config's `mode:` when absent, else `rl`).
    #[arg(long)]
    mode: Option<String>,
    /// Overrides, `key=value` with dotted keys (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// A running cluster's head, `host:port` (`rtrun head`); the roles are placed on its
    /// nodes. The same as `--set cluster.address=A`; `RTRUN_ADDRESS` when neither is given.
    /// Without any, the run starts an embedded single-node runtime.
    #[arg(long)]
    address: Option<String>,
    /// Start afresh in a run directory that holds an earlier run (its metrics, event files,
    /// summary, plot, final policy and checkpoints are removed first); the same as
    /// `--set overwrite=true`. Without it such a directory is refused unless it has a
    /// checkpoint to resume from.
    #[arg(long)]
    overwrite: bool,
    /// Serves Prometheus metrics at http://0.0.0.0:PORT/metrics while the run goes, from the
    /// trainer actor's process (on a cluster: the head's node): the newest step's metrics,
    /// phase times and tokens/s, the calls to the roles, and the session's runtime (nodes,
    /// resources, actors, tasks, object store).
    #[arg(long)]
    metrics_port: Option<u16>,
    /// Serves the web dashboard on this port while the run goes: the session's nodes, actors
    /// (the roles and engines), placement groups and objects, and a page with the live reward
    /// and KL curves.
    #[arg(long)]
    dashboard_port: Option<u16>,
    /// The IP the dashboard listens on; any but loopback needs a token ($RTRUN_DASHBOARD_TOKEN,
    /// else generated and printed with the URL).
    #[arg(long, default_value = "127.0.0.1")]
    dashboard_host: std::net::IpAddr,
    /// Keep training when this driver exits or disconnects (a cluster only: the embedded
    /// runtime ends with this process); `train --attach RUN` follows the run again.
    #[arg(long)]
    detach: bool,
    /// Follow the run training in the run directory RUN on the cluster (started with
    /// `--detach`): its progress from the start, then its summary.
    #[arg(long, value_name = "RUN", conflicts_with_all = ["config", "mode", "overrides", "overwrite", "detach", "metrics_port"])]
    attach: Option<PathBuf>,
    /// Print the config of `--mode` (default `rl`) with every key at its default, each under
    /// its doc as a comment, and exit: a starting point that `--config` reads back as the
    /// defaults (docs/config-reference.md lists every key with its type).
    #[arg(long, conflicts_with_all = ["config", "attach", "print_config_schema"])]
    print_default_config: bool,
    /// Print the JSON Schema of `--mode`'s config (default `rl`) and exit, for editors that
    /// check YAML against a schema.
    #[arg(long, conflicts_with_all = ["config", "attach"])]
    print_config_schema: bool,
}

/// The dashboard page of the run: its live curves and newest metrics.
struct TrainPanel(Arc<LiveMetrics>);

impl rtrun::dashboard::Panel for TrainPanel {
    fn title(&self) -> String {
        "Training".into()
    }

    fn body_html(&self) -> String {
        self.0.dashboard_html()
    }
}

fn main() -> anyhow::Result<()> {
    // Worker processes are this binary re-run; they serve here and never return.
    rtrun::run_worker_if_requested();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if args.print_default_config || args.print_config_schema {
        let sets: Vec<String> = args.mode.iter().map(|m| format!("mode={m}")).collect();
        let mode = ConfigTree::parse("", "--mode", &sets)?.mode;
        if args.print_default_config {
            print!("{}", rtrun_rlhf::config::reference::default_yaml(mode));
        } else {
            let schema = rtrun_rlhf::config::reference::schema(mode);
            println!("{}", serde_json::to_string_pretty(&schema)?);
        }
        return Ok(());
    }
    if let Some(run_dir) = &args.attach {
        return attach(&args, run_dir);
    }
    let Some(config_file) = &args.config else { bail!("--config is required") };
    let mut overrides = args.overrides.clone();
    if let Some(address) = &args.address {
        overrides.push(format!("cluster.address={address}"));
    }
    if args.overwrite {
        overrides.push("overwrite=true".to_owned());
    }
    if let Some(mode) = &args.mode {
        overrides.push(format!("mode={mode}"));
    }
    // The config is parsed and checked here, once, before anything starts; the trainer actor
    // gets the checked config.
    let tree = ConfigTree::read(config_file, &overrides)?;
    let origin = tree.origin(args.overrides.len());
    let mode = tree.mode;
    let (run_dir, address, config) = match mode {
        Mode::Rl => {
            let config = TrainConfig::from_tree(tree)?;
            eprintln!("{origin}");
            let address = rtrun_rlhf::run::cluster_address(&config);
            check_detach(&args, address.as_deref())?;
            let placements = rtrun_rlhf::placement_map::RolePlacements::from_config(&config)?;
            rtrun_rlhf::run::start_runtime(&config, &placements)?;
            (config.run_dir.clone(), address, CheckedConfig::rl(&config)?)
        }
        Mode::Sft | Mode::Rm | Mode::Dpo => {
            let config = rtrun_rlhf::stage::StageConfig::from_tree(tree)?;
            eprintln!("{origin}");
            let address = rtrun_rlhf::run::address_or_env(config.cluster.address.as_deref());
            check_detach(&args, address.as_deref())?;
            rtrun_rlhf::stage::trainer::start_runtime(&config)?;
            (config.run_dir.clone(), address, CheckedConfig::stage(&config)?)
        }
    };
    let request = RunRequest {
        config_file: config_file.display().to_string(),
        config,
        overrides,
        user_overrides: args.overrides.len(),
        cwd: std::env::current_dir().context("the current directory")?,
        metrics_port: args.metrics_port,
        session_metrics: address.is_none(),
    };
    let trainer = create_trainer(&run_dir, request, args.detach, address.as_deref())?;
    if !trainer.start().get()? {
        bail!("the trainer actor of {} was started already", run_dir.display());
    }
    if args.detach {
        eprintln!(
            "detached: the run goes on if this driver exits; follow it again with \
             `train --attach {} --address {}`",
            trainer_actor::absolute(&run_dir).display(),
            address.as_deref().unwrap_or_default()
        );
    }
    follow(&args, &trainer, mode, &run_dir)
}

/// `--detach` needs a cluster: the embedded runtime ends with this process.
fn check_detach(args: &Args, address: Option<&str>) -> anyhow::Result<()> {
    if args.detach && address.is_none() {
        bail!(
            "--detach needs a cluster (--address, cluster.address or RTRUN_ADDRESS): the \
             embedded runtime lives in this process and ends with it; start one with \
             `rtrun head`"
        );
    }
    Ok(())
}

/// Creates the run's trainer actor, named after the run directory. An actor of an earlier run
/// in that directory that has ended is replaced. One still training is an error pointing to
/// `--attach` when it is detached; otherwise its driver may be gone without the head knowing
/// yet (a killed driver is declared gone after the heartbeat timeout), so it is waited for.
fn create_trainer(
    run_dir: &Path,
    request: RunRequest,
    detach: bool,
    address: Option<&str>,
) -> anyhow::Result<TrainerActorRef> {
    let name = trainer_actor::actor_name(run_dir);
    let namespace = trainer_actor::NAMESPACE;
    let mut options = rtrun::ActorOptions::default()
        .name(&name)
        .namespace(namespace)
        .max_concurrency(8)
        .env("RTRUN_RLHF_ROLE", "trainer:0");
    if detach {
        options = options.detached();
    }
    let earlier = || rtrun::get_actor::<TrainerActor>(&name, Some(namespace)).ok();
    if let Some(actor) = earlier() {
        let detached = rtrun::list_named_actors(true)
            .unwrap_or_default()
            .iter()
            .any(|a| a.name == name && a.namespace == namespace && a.detached);
        let ended = actor.ended().get().unwrap_or(true);
        let here = trainer_actor::absolute(run_dir);
        if detached && !ended {
            bail!(
                "a run is already training in {} (detached trainer actor `{name}`); follow it \
                 with `train --attach {} --address {}`, or stop it with `rtrun kill {name} \
                 --namespace {namespace}`",
                here.display(),
                here.display(),
                address.unwrap_or_default(),
            );
        }
        if ended {
            let _ = actor.kill();
        } else {
            eprintln!(
                "waiting for the earlier run in {} to stop (trainer actor `{name}`: its driver \
                 is still running or was lost and is not yet declared gone)",
                here.display()
            );
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while earlier().is_some() {
            if std::time::Instant::now() > deadline {
                bail!(
                    "a run is still training in {} after 60 s (trainer actor `{name}`); stop \
                     its driver, or the actor with `rtrun kill {name} --namespace {namespace}`",
                    here.display()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    TrainerActor::remote_with(options, request)
        .with_context(|| format!("creating the trainer actor of {}", run_dir.display()))
}

/// `train --attach RUN`: follows the run training in RUN on the cluster.
fn attach(args: &Args, run_dir: &Path) -> anyhow::Result<()> {
    let Some(address) = rtrun_rlhf::run::address_or_env(args.address.as_deref()) else {
        bail!(
            "--attach needs the cluster the run trains on (--address or RTRUN_ADDRESS); runs \
             on the embedded runtime end with their driver"
        );
    };
    rtrun::init_with(rtrun::Config { address: Some(address.clone()), ..Default::default() })
        .with_context(|| format!("joining the cluster at {address}"))?;
    let name = trainer_actor::actor_name(run_dir);
    let trainer =
        rtrun::get_actor::<TrainerActor>(&name, Some(trainer_actor::NAMESPACE)).map_err(|e| {
            anyhow::anyhow!(
                "no run is training in {} on the cluster at {address} (no trainer actor \
                 `{name}`: {e})",
                trainer_actor::absolute(run_dir).display()
            )
        })?;
    eprintln!("attached to the run in {}", trainer_actor::absolute(run_dir).display());
    let mode = trainer.mode().get()?.map_err(anyhow::Error::msg)?;
    follow(args, &trainer, mode, run_dir)
}

/// Follows the trainer actor's events until the run ends: notes on stderr, the progress bar,
/// the live metrics behind `--metrics-port` / `--dashboard-port`, the summary on stdout. The
/// actor is stopped once the run has ended; if it dies first, the error says how to resume.
fn follow(
    args: &Args,
    trainer: &TrainerActorRef,
    mode: Mode,
    run_dir: &Path,
) -> anyhow::Result<()> {
    let mut charts = Vec::new();
    if mode != Mode::Rl {
        charts.push(ChartSpec::new(
            "Loss",
            "loss",
            &[("train loss", "loss"), ("held-out loss", "eval/loss")],
        ));
        if mode != Mode::Sft {
            charts.push(ChartSpec::new(
                "Preference accuracy",
                "accuracy",
                &[("train", "accuracy"), ("held-out", "eval/accuracy")],
            ));
        }
    }
    let live = Arc::new(if charts.is_empty() {
        LiveMetrics::default()
    } else {
        LiveMetrics::with_charts(charts)
    });
    let _dashboard = serve_dashboard(args, &live)?;
    let mut bar: Option<RunProgress> = None;
    let mut seen = 0;
    let outcome = loop {
        let events = match trainer.events(seen, 1000).get() {
            Ok(events) => events,
            Err(e) => {
                break Err(anyhow::anyhow!(
                    "the trainer actor stopped before the run ended: {e}; the run directory {} \
                     keeps its checkpoints: run the same command again to continue from the newest \
                     (checkpoint.resume, on unless set false)",
                    trainer_actor::absolute(run_dir).display()
                ));
            }
        };
        seen += events.len();
        let mut ended = None;
        for event in events {
            match event {
                Event::Note(line) => match &bar {
                    Some(bar) => bar.println(&line),
                    None => eprintln!("{line}"),
                },
                Event::Start { total, done, fields } => {
                    let options = ProgressOptions {
                        fields: fields.iter().map(|(l, m)| ProgressField::new(l, m)).collect(),
                        start_step: done,
                        ..ProgressOptions::default()
                    };
                    live.set_total_steps(total);
                    bar = Some(RunProgress::new(total, options));
                }
                Event::Phase(name) => {
                    if let Some(bar) = &bar {
                        bar.set_phase(&name);
                    }
                }
                Event::Placed(roles) => {
                    let text = format!("placement:\n  {}", roles.join("\n  "));
                    match &bar {
                        Some(bar) => bar.println(&text),
                        None => eprintln!("{text}"),
                    }
                }
                step @ Event::Step { .. } => {
                    if let Some((metrics, phases)) = step.step() {
                        if let Some(bar) = &bar {
                            bar.step_done(&metrics, &phases);
                        }
                        live.record(&metrics, &phases);
                    }
                }
                Event::Finished { summary } => ended = Some(Ok(summary)),
                Event::Failed { error } => ended = Some(Err(anyhow::anyhow!(error))),
            }
        }
        if let Some(ended) = ended {
            break ended;
        }
    };
    if let Some(bar) = &bar {
        bar.finish();
    }
    let _ = trainer.kill();
    let summary = outcome?;
    println!("{summary}");
    rtrun::shutdown();
    Ok(())
}
/// The dashboard the driver serves while it follows the run (`--dashboard-port`): the
/// session's state and the run's live curves; dropping it stops it.
fn serve_dashboard(
    args: &Args,
    live: &Arc<LiveMetrics>,
) -> anyhow::Result<Option<rtrun::dashboard::Dashboard>> {
    let dashboard = match args.dashboard_port {
        Some(port) => {
            let dashboard = rtrun::dashboard::serve(rtrun::dashboard::DashboardOptions {
                bind: Some(std::net::SocketAddr::new(args.dashboard_host, port)),
                token: std::env::var("RTRUN_DASHBOARD_TOKEN").ok(),
                panels: vec![Arc::new(TrainPanel(live.clone()))],
            })
            .with_context(|| format!("--dashboard-port {port}"))?;
            let url = dashboard.url();
            let base = url.split('?').next().unwrap_or(&url);
            eprintln!("dashboard: {url} (the run's curves: {base}panels/0)");
            Some(dashboard)
        }
        None => None,
    };
    Ok(dashboard)
}
