//! The training driver: `train --config X.yaml [--mode rl|sft] [--set key=value]…
//! [--overwrite] [--address A]`. The config's `mode:` (or `--mode`) picks the trainer: PPO /
//! GRPO (`rl`, the default), supervised fine-tuning (`sft`), a reward model (`rm`) or DPO
//! (`dpo`).
//!
//! Runs on the embedded single-node runtime, or on a cluster with `--address`; prints a
//! progress bar with the live metrics (reward and KL, or loss) and phase timings; leaves
//! `metrics.jsonl`, TensorBoard event files, a curve PNG (`reward.png` / `loss.png`) and
//! `summary.md` in the run directory, and the trained model in `final_policy/`; prints the
//! summary (baseline vs final held-out results and per-phase timings) at the end.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;

use rtrun_rlhf::TrainConfig;
use rtrun_rlhf::config::{ConfigTree, Mode};
use rtrun_rlhf::trainer::ProgressObserver;
use rtrun_rlhf_telemetry::live::{ChartSpec, LiveMetrics};
use rtrun_rlhf_telemetry::{
    EvalRow, ProgressField, ProgressOptions, RunProgress, RunSummary, StepMetrics, StepPhases,
    jsonl, reward_curve,
};

/// Command line of the driver.
#[derive(Debug, Parser)]
#[command(name = "train", about = "PPO / GRPO and supervised fine-tuning on rtrun")]
struct Args {
    /// The YAML config.
    #[arg(long)]
    config: PathBuf,
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
    /// Serves Prometheus metrics at http://0.0.0.0:PORT/metrics while the run goes: the
    /// newest step's metrics, phase times and tokens/s, and the session's runtime (nodes,
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

/// The telemetry progress bar behind the trainer's observer, and the live metrics beside it.
struct Bar(RunProgress, Arc<LiveMetrics>);

impl ProgressObserver for Bar {
    fn phase(&mut self, name: &str) {
        self.0.set_phase(name);
    }

    fn step_done(&mut self, metrics: &StepMetrics, phases: &StepPhases) {
        self.0.step_done(metrics, phases);
        self.1.record(metrics, phases);
    }

    fn placed(&mut self, roles: &[String]) {
        self.0.println(&format!("placement:\n  {}", roles.join("\n  ")));
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
    match ConfigTree::read(&args.config, &overrides)?.mode {
        Mode::Rl => run_rl(&args, &overrides),
        Mode::Sft | Mode::Rm | Mode::Dpo => run_stage(&args, &overrides),
    }
}

/// The metrics endpoint and the dashboard a run serves while it goes (`--metrics-port`,
/// `--dashboard-port`); dropping them stops them.
fn serve_live(
    args: &Args,
    live: &Arc<LiveMetrics>,
) -> anyhow::Result<(Option<rtrun::metrics::MetricsServer>, Option<rtrun::dashboard::Dashboard>)> {
    let metrics = match args.metrics_port {
        Some(port) => {
            let bind = std::net::SocketAddr::from(([0, 0, 0, 0], port));
            let source = live.clone();
            let server = rtrun::metrics::serve(bind, vec![Arc::new(move |r| source.register(r))])
                .with_context(|| format!("--metrics-port {port}"))?;
            eprintln!("metrics: http://{}/metrics", server.address());
            Some(server)
        }
        None => None,
    };
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
    Ok((metrics, dashboard))
}

/// Writes `summary.md` into the run directory `root` and prints the summary and where the
/// metrics and the `plot` are.
fn finish(root: &std::path::Path, summary: &RunSummary, plot: &str) -> anyhow::Result<()> {
    std::fs::write(root.join("summary.md"), summary.to_markdown()).context("writing summary.md")?;
    println!("{}", summary.to_text());
    println!(
        "metrics: {} (TensorBoard event files beside it), plot: {}",
        root.join("metrics.jsonl").display(),
        root.join(plot).display()
    );
    Ok(())
}

/// The trainers beside RL (`mode: sft | rm | dpo`).
fn run_stage(args: &Args, overrides: &[String]) -> anyhow::Result<()> {
    use rtrun_rlhf::stage::{StageConfig, trainer};
    let (config, origin) =
        StageConfig::load_with_origin(&args.config, overrides, args.overrides.len())?;
    eprintln!("{origin}");
    let started = Instant::now();
    let mode = config.mode;
    let pairs = mode != Mode::Sft;
    let paths = rtrun_rlhf::trainer::RunPaths::new(&config.run_dir);
    eprintln!("run directory: {}", paths.root.display());
    let mut charts = vec![ChartSpec::new(
        "Loss",
        "loss",
        &[("train loss", "loss"), ("held-out loss", "eval/loss")],
    )];
    if pairs {
        charts.push(ChartSpec::new(
            "Preference accuracy",
            "accuracy",
            &[("train", "accuracy"), ("held-out", "eval/accuracy")],
        ));
    }
    let live = Arc::new(LiveMetrics::with_charts(charts));
    let _servers = serve_live(args, &live)?;
    let samples = trainer::prepare(&config)?;
    let (dropped_train, dropped_eval) = samples.dropped_too_long;
    eprintln!(
        "model: {}\n{}: {} training, {} held-out{}",
        config.model.pretrain.as_deref().unwrap_or(std::path::Path::new("")).display(),
        if pairs { "preference pairs" } else { "samples" },
        samples.train.len(),
        samples.eval.len(),
        if dropped_train + dropped_eval > 0 {
            format!(
                " ({dropped_train} training and {dropped_eval} held-out dropped: longer than data.max_len = {})",
                config.data.max_len
            )
        } else {
            String::new()
        }
    );
    if config.checkpoint.resume
        && let Some(dir) = rtrun_rlhf::trainer::checkpoint::newest(&paths.checkpoints)?
    {
        eprintln!("resuming from {}", dir.display());
    }
    let total = trainer::total_steps(&config, samples.train.len());
    let mut fields = vec![ProgressField::new("loss", "loss")];
    if pairs {
        fields.push(ProgressField::new("acc", "accuracy"));
        fields.push(ProgressField::new("margin", "reward/margin"));
        fields.push(ProgressField::new("eval acc", "eval/accuracy"));
    } else {
        fields.push(ProgressField::new("eval", "eval/loss"));
    }
    fields.push(ProgressField::new("tok/s", "tokens_per_s"));
    let progress =
        RunProgress::new(total, ProgressOptions { fields, ..ProgressOptions::default() });
    live.set_total_steps(total);
    let mut bar = Bar(progress, live);
    let (trainer, report) = trainer::run_prepared(&config, samples, &mut bar)?;
    bar.0.finish();
    eprintln!("final model (Hugging Face format): {}", report.exported.display());
    let records =
        jsonl::read_jsonl(&paths.root.join("metrics.jsonl")).context("reading metrics.jsonl")?;
    let mut chart =
        reward_curve(&records, &[("train loss", "loss"), ("held-out loss", "eval/loss")]);
    chart.title = format!("{} loss", mode.name().to_uppercase());
    chart.y_label = if pairs { "loss".into() } else { "loss (nats / token)".into() };
    chart.write_png(&paths.root.join("loss.png")).context("writing loss.png")?;
    let tokens: f64 = records.iter().filter_map(|r| r.get("tokens")).sum();
    let train_seconds: f64 = records.iter().filter_map(|r| r.get("time/train")).sum();
    let value =
        |eval: &[(String, f64)], key: &str| eval.iter().find(|(k, _)| k == key).map(|(_, v)| *v);
    let shown: &[(&str, &str)] = if pairs {
        &[
            ("accuracy", "accuracy (chosen above rejected)"),
            ("reward/margin", "reward margin (chosen - rejected)"),
            ("loss", "loss"),
        ]
    } else {
        &[("loss", "loss (nats per response token)")]
    };
    let mut held_out: Vec<EvalRow> = shown
        .iter()
        .map(|(key, label)| EvalRow {
            metric: (*label).into(),
            baseline: value(&report.baseline, key),
            final_value: value(&report.final_eval, key),
        })
        .collect();
    held_out.push(EvalRow {
        metric: "training tokens per second".into(),
        baseline: None,
        final_value: Some(tokens / train_seconds.max(1e-9)),
    });
    let summary = RunSummary {
        title: format!(
            "{} ({}, {} rank(s))",
            args.config.display(),
            mode.name(),
            config.cluster.replicas
        ),
        steps: report.steps,
        wall_time: started.elapsed(),
        held_out_prompts: report.samples.1,
        held_out,
        phases: trainer.timer.totals().to_vec(),
    };
    finish(&paths.root, &summary, "loss.png")?;
    trainer.kill();
    rtrun::shutdown();
    Ok(())
}

/// PPO / GRPO (`mode: rl`).
fn run_rl(args: &Args, overrides: &[String]) -> anyhow::Result<()> {
    let (config, mut origin) = TrainConfig::load_with_origin(&args.config, overrides)?;
    // `--overwrite` travels as an override; the line counts the user's own.
    origin.overrides = args.overrides.len();
    eprintln!("{origin}");
    let started = Instant::now();
    let title = format!(
        "{} ({}, {:?} reward `{}`)",
        args.config.display(),
        config.algo.advantage_estimator,
        config.reward.kind,
        config.reward.name
    );
    let paths = rtrun_rlhf::trainer::RunPaths::new(&config.run_dir);
    eprintln!("run directory: {}", paths.root.display());
    let live = Arc::new(LiveMetrics::default());
    let _servers = serve_live(args, &live)?;
    // Everything checkable before the warm-up: placement spec, GPUs, files, the run directory.
    let placements = rtrun_rlhf::run::preflight(&config, &paths)?;
    let prepared = rtrun_rlhf::run::prepare(&config, &paths)?;
    match &prepared.initial {
        rtrun_rlhf::run::InitialPolicy::Made(w) => eprintln!(
            "warm-up: {} supervised steps, token loss {:.3} -> {:.3}",
            w.steps, w.first_loss, w.last_loss
        ),
        rtrun_rlhf::run::InitialPolicy::Reused => {
            eprintln!("warm-up: reusing the initial policy of the run directory")
        }
        rtrun_rlhf::run::InitialPolicy::Pretrained(dir) => {
            eprintln!("policy: {}", dir.display())
        }
    }
    let (dropped_train, dropped_eval) = prepared.dropped_too_long;
    eprintln!(
        "prompts: {} training, {} held-out{}",
        prepared.train_prompts(),
        prepared.eval_prompts(),
        if dropped_train + dropped_eval > 0 {
            format!(
                " ({dropped_train} training and {dropped_eval} held-out dropped: longer than data.max_prompt_len = {})",
                config.data.max_prompt_len
            )
        } else {
            String::new()
        }
    );
    if config.checkpoint.resume
        && let Some(dir) = rtrun_rlhf::trainer::checkpoint::newest(&paths.checkpoints)?
    {
        eprintln!("resuming from {}", dir.display());
    }
    let total = {
        let per_episode =
            (prepared.train_prompts() / config.rollout.prompts_per_step).max(1) as u64;
        let total = per_episode * config.train.num_episodes as u64;
        config.train.max_steps.map_or(total, |m| m.min(total))
    };
    let progress = RunProgress::new(
        total,
        ProgressOptions {
            fields: vec![
                ProgressField::new("reward", "reward"),
                ProgressField::new("acc", "accuracy"),
                ProgressField::new("kl", "kl"),
                ProgressField::new("eval", "eval/reward"),
            ],
            ..ProgressOptions::default()
        },
    );
    live.set_total_steps(total);
    let mut bar = Bar(progress, live);
    let held_out_prompts = prepared.eval_prompts();
    let (trainer, report) = rtrun_rlhf::run::run_prepared(&config, prepared, placements, &mut bar)?;
    bar.0.finish();
    if let Some(dir) = &report.exported {
        eprintln!("final policy (Hugging Face format): {}", dir.display());
    }

    let records =
        jsonl::read_jsonl(&paths.root.join("metrics.jsonl")).context("reading metrics.jsonl")?;
    let chart =
        reward_curve(&records, &[("train reward", "reward"), ("held-out reward", "eval/reward")]);
    chart.write_png(&paths.root.join("reward.png")).context("writing reward.png")?;
    let summary = RunSummary {
        title,
        steps: report.steps,
        wall_time: started.elapsed(),
        held_out_prompts,
        held_out: vec![
            EvalRow {
                metric: "mean reward".into(),
                baseline: Some(report.baseline.mean_reward),
                final_value: Some(report.final_result.mean_reward),
            },
            EvalRow {
                metric: "full-reward accuracy".into(),
                baseline: Some(report.baseline.accuracy),
                final_value: Some(report.final_result.accuracy),
            },
        ],
        phases: trainer.timer.totals().to_vec(),
    };
    finish(&paths.root, &summary, "reward.png")?;
    trainer.roles.kill();
    rtrun::shutdown();
    Ok(())
}
