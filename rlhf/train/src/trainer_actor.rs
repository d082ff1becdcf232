//! The trainer actor: a whole run of the `train` driver — checks, data, the warmed-up or
//! pretrained model, the role groups and engines, `fit()`, the curve PNG and `summary.md` —
//! hosted by an rtrun actor rather than the driver process (the design card's "central trainer
//! actor that runs fit()", as OpenRLHF's remote PPO trainer).
//!
//! The driver creates it (named after the run directory, so `train --attach RUN` finds it),
//! calls [`TrainerActor::start`], and follows its [`Event`]s with
//! [`TrainerActor::events`] (a long poll from an index, so any number of drivers can follow the
//! same run from its beginning). The role groups, engines and placement groups are created
//! by the actor's worker, so they are owned by it: they end with it, and with their driver
//! unless the actor was created detached. Everything the run writes lands on the trainer's node.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use rtrun_rlhf_telemetry::live::LiveMetrics;
use rtrun_rlhf_telemetry::{
    EvalRow, ProgressField, RunSummary, StepMetrics, StepPhases, jsonl, reward_curve,
};

use crate::config::{CheckedConfig, Mode};
use crate::trainer::checkpoint::{self, ResumePoint};
use crate::trainer::{ProgressObserver, RunPaths};

/// The namespace trainer actors are named in.
pub const NAMESPACE: &str = "rtrun-train";

/// The name of the trainer actor of the run in `run_dir` (made absolute against the current
/// directory), which is how `train --attach RUN` finds it.
pub fn actor_name(run_dir: &Path) -> String {
    format!("train:{}", absolute(run_dir).display())
}

/// `path` made absolute against the current directory, without touching the filesystem.
pub fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// What the driver hands the trainer actor: the config as the driver checked it, and the driver's
/// working directory (relative paths in the config resolve against it on the trainer's node).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRequest {
    /// The config file as the user named it (for messages and the summary's title).
    pub config_file: String,
    /// The config as the driver parsed, overrode and checked it.
    pub config: CheckedConfig,
    /// Every override, `--overwrite`, `--mode` and `--address` included.
    pub overrides: Vec<String>,
    /// How many of them the user gave with `--set`.
    pub user_overrides: usize,
    /// The driver's working directory.
    pub cwd: PathBuf,
    /// `--metrics-port`: Prometheus metrics served from the trainer's process (the calls to
    /// the roles are made there) while the run goes.
    pub metrics_port: Option<u16>,
    /// Whether that endpoint also serves the session's runtime (control plane, the node's
    /// store): on the embedded runtime, which has no `rtrun head --metrics-port` of its own.
    pub session_metrics: bool,
}

/// One thing the run reports to its drivers, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// A line for the driver's stderr.
    Note(String),
    /// The progress bar's total steps, steps already done (a resumed run) and fields
    /// (label, metric).
    Start {
        /// Steps of the whole run.
        total: u64,
        /// Steps done before this run started.
        done: u64,
        /// `(label, metric)` shown live.
        fields: Vec<(String, String)>,
    },
    /// A phase of the current step started.
    Phase(String),
    /// The roles were placed: one line per role.
    Placed(Vec<String>),
    /// A step finished: its metrics as a `metrics.jsonl` line and its phase seconds.
    Step {
        /// The step's metrics, one JSON object.
        metrics: String,
        /// `(phase, seconds)` in the order the phases ran.
        phases: Vec<(String, f64)>,
    },
    /// The run finished: its summary as text (also in `summary.md`).
    Finished {
        /// The summary and where the outputs are.
        summary: String,
    },
    /// The run failed.
    Failed {
        /// The error and its causes.
        error: String,
    },
}

impl Event {
    /// Whether the run ended with this event.
    pub fn ends_the_run(&self) -> bool {
        matches!(self, Event::Finished { .. } | Event::Failed { .. })
    }

    /// A [`Event::Step`] back as metrics and phases.
    pub fn step(&self) -> Option<(StepMetrics, StepPhases)> {
        let Event::Step { metrics, phases } = self else { return None };
        let metrics: StepMetrics = serde_json::from_str(metrics).ok()?;
        let phases = StepPhases {
            phases: phases
                .iter()
                .map(|(name, seconds)| (name.clone(), Duration::from_secs_f64(seconds.max(0.0))))
                .collect(),
        };
        Some((metrics, phases))
    }
}

/// The events of a run so far, and a condition variable for those waiting for more.
#[derive(Default)]
struct EventLog {
    events: Mutex<Vec<Event>>,
    grew: Condvar,
}

impl EventLog {
    fn push(&self, event: Event) {
        if let Ok(mut events) = self.events.lock() {
            events.push(event);
        }
        self.grew.notify_all();
    }

    fn since(&self, since: usize, wait: Duration) -> Vec<Event> {
        let Ok(events) = self.events.lock() else { return Vec::new() };
        let (events, _) = self
            .grew
            .wait_timeout_while(events, wait, |events| events.len() <= since)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        events.get(since..).map(<[Event]>::to_vec).unwrap_or_default()
    }
}

/// The run's progress as events, and the newest step for the metrics endpoint: the
/// [`ProgressObserver`] `fit()` reports to.
/// The run's event log, its live metrics, and the effective config still to be written (at
/// the first step, so a run that fails before it changes nothing in its directory).
struct Reporter(Arc<EventLog>, Arc<LiveMetrics>, Option<(PathBuf, String)>);

impl Reporter {
    fn note(&self, line: impl Into<String>) {
        self.0.push(Event::Note(line.into()));
    }

    /// The checkpoint the run resumes from (`resume`: the config's `checkpoint.resume`), checked
    /// against its checksums, said as a note with the newer ones skipped and why.
    fn resuming(&self, paths: &RunPaths, resume: bool) -> crate::Result<Option<ResumePoint>> {
        let point = checkpoint::resume_from(resume, &paths.checkpoints)?;
        if let Some(point) = &point {
            for reason in &point.skipped {
                self.note(format!("skipping a checkpoint: {reason}"));
            }
            let checked = if point.checked { "" } else { " (no checksums to check)" };
            self.note(format!("resuming from {}{checked}", point.dir.display()));
        }
        Ok(point)
    }

    fn start(&self, total: u64, done: u64, shown: &[ProgressField]) {
        self.1.set_total_steps(total);
        let fields = shown.iter().map(|f| (f.label.clone(), f.metric.clone())).collect();
        self.0.push(Event::Start { total, done, fields });
    }
}

impl ProgressObserver for Reporter {
    fn phase(&mut self, name: &str) {
        self.0.push(Event::Phase(name.to_owned()));
    }

    fn step_done(&mut self, metrics: &StepMetrics, phases: &StepPhases) {
        if let Some((path, text)) = self.2.take()
            && let Err(e) = std::fs::write(&path, text)
        {
            self.note(format!("could not write the effective config {}: {e}", path.display()));
        }
        self.1.record(metrics, phases);
        let metrics = serde_json::to_string(metrics).unwrap_or_else(|_| "{}".into());
        let phases = phases.phases.iter().map(|(n, d)| (n.clone(), d.as_secs_f64())).collect();
        self.0.push(Event::Step { metrics, phases });
    }

    fn samples(&mut self, rows: &[rtrun_rlhf_telemetry::samples::SampleRow]) {
        self.1.record_samples(rows);
    }

    fn placed(&mut self, roles: &[String]) {
        self.0.push(Event::Placed(roles.to_vec()));
    }
}

/// The actor hosting one run.
pub struct TrainerActor {
    request: RunRequest,
    log: Arc<EventLog>,
    started: AtomicBool,
}

#[rtrun::actor(pub)]
impl TrainerActor {
    /// Takes the run; works in the driver's directory when this node has it. The run's
    /// warnings (late ranks, retries) go to this worker's stderr, which reaches the driver's
    /// terminal (embedded) or the node's log files and the driver's stream (cluster).
    pub fn new(request: RunRequest) -> Self {
        let filter =
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
        if request.cwd.is_dir()
            && let Err(e) = std::env::set_current_dir(&request.cwd)
        {
            tracing::warn!(cwd = %request.cwd.display(), "trainer actor: {e}");
        }
        TrainerActor {
            request,
            log: Arc::new(EventLog::default()),
            started: AtomicBool::new(false),
        }
    }

    /// Starts the run on a thread of its own; `false` when it was started already.
    pub fn start(&self) -> bool {
        if self.started.swap(true, Ordering::SeqCst) {
            return false;
        }
        let log = self.log.clone();
        let request = self.request.clone();
        let spawned = std::thread::Builder::new().name("fit".into()).spawn(move || {
            let mut reporter = Reporter(log.clone(), Arc::new(LiveMetrics::default()), None);
            // A panic must end the run for its drivers too, not leave them waiting.
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run(&request, &mut reporter)
            }));
            log.push(ended(outcome));
        });
        if let Err(e) = spawned {
            self.log.push(Event::Failed { error: format!("cannot start the run's thread: {e}") });
        }
        true
    }

    /// The events from index `since` on, waiting up to `wait_ms` for one when there are none.
    pub fn events(&self, since: usize, wait_ms: u64) -> Vec<Event> {
        self.log.since(since, Duration::from_millis(wait_ms))
    }

    /// The run's trainer (`mode:`), for a driver that attaches.
    pub fn mode(&self) -> Result<Mode, String> {
        Ok(self.request.config.mode)
    }

    /// Whether the run ended (finished or failed).
    pub fn ended(&self) -> bool {
        self.log.events.lock().is_ok_and(|events| events.last().is_some_and(Event::ends_the_run))
    }
}

/// The last event of a run: its summary, its error, or the panic that ended it.
fn ended(outcome: std::thread::Result<anyhow::Result<String>>) -> Event {
    match outcome {
        Ok(Ok(summary)) => Event::Finished { summary },
        Ok(Err(e)) => Event::Failed { error: format!("{e:#}") },
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "a panic".to_owned());
            Event::Failed { error: format!("the trainer panicked: {what}") }
        }
    }
}

/// The whole run as the actor performs it; returns the summary text.
fn run(request: &RunRequest, reporter: &mut Reporter) -> anyhow::Result<String> {
    let _metrics = match request.metrics_port {
        Some(port) => {
            let bind = std::net::SocketAddr::from(([0, 0, 0, 0], port));
            let live = reporter.1.clone();
            let mut sources: Vec<rtrun::metrics::MetricsSource> =
                vec![Arc::new(move |r| live.register(r))];
            if request.session_metrics {
                sources.push(rtrun::metrics::session_source());
            }
            let server = rtrun::metrics::serve(bind, sources)
                .with_context(|| format!("--metrics-port {port}"))?;
            reporter.note(format!("metrics: http://{}/metrics", server.address()));
            Some(server)
        }
        None => None,
    };
    match request.config.mode {
        Mode::Rl => run_rl(request, reporter),
        Mode::Sft | Mode::Rm | Mode::Dpo => run_stage(request, reporter),
    }
}

/// The name of the effective config in a run directory.
pub const EFFECTIVE_CONFIG: &str = "config.yaml";

/// The run's effective config (the file with its overrides applied, every key) and where it
/// goes, `root/config.yaml`, each key under its doc: `train --config` on it runs the same
/// config.
fn effective_config(
    root: &Path,
    mode: Mode,
    values: serde_json::Value,
    request: &RunRequest,
) -> (PathBuf, String) {
    let header = format!(
        "The effective config of the run in {}: {} with {} override(s){}, every key.",
        root.display(),
        request.config_file,
        request.overrides.len(),
        if request.overrides.is_empty() {
            String::new()
        } else {
            format!(" ({})", request.overrides.join(", "))
        }
    );
    let text = crate::config::reference::commented_yaml(mode, &values, &header);
    (root.join(EFFECTIVE_CONFIG), text)
}

/// Writes `summary.md` into `root`; the summary as text with where the metrics and `plot` are.
fn finish(root: &Path, summary: &RunSummary, plot: &str) -> anyhow::Result<String> {
    std::fs::write(root.join("summary.md"), summary.to_markdown()).context("writing summary.md")?;
    Ok(format!(
        "{}\nmetrics: {} (TensorBoard event files beside it), plot: {}",
        summary.to_text(),
        root.join("metrics.jsonl").display(),
        root.join(plot).display()
    ))
}

/// ` (3 training and 1 held-out dropped: longer than KEY = LIMIT)`, or nothing when none were.
fn dropped((train, eval): (usize, usize), key: &str, limit: usize) -> String {
    if train + eval == 0 {
        return String::new();
    }
    format!(" ({train} training and {eval} held-out dropped: longer than {key} = {limit})")
}

/// Steps already recorded in the run directory's `metrics.jsonl` when resuming.
fn steps_done(resuming_from: Option<&ResumePoint>) -> u64 {
    resuming_from.map_or(0, |point| point.step)
}

/// What a rerun of a finished run says, when `resuming` is at or past the run's `total` steps:
/// nothing is trained and nothing in the run directory is written (its summary, metrics, event
/// files and final model stay the finished run's).
fn already_finished(root: &Path, resuming: Option<&ResumePoint>, total: u64) -> Option<String> {
    let point = resuming.filter(|point| point.step >= total)?;
    Some(format!(
        "the run in {} has already finished: its checkpoint {} is at step {} and this run has \
         {total} steps; nothing was trained or changed (its summary: {}). Raise \
         train.max_steps or train.num_episodes to train on, or set overwrite: true to start \
         over.",
        root.display(),
        point.dir.display(),
        point.step,
        root.join("summary.md").display()
    ))
}

/// The trainers beside RL (`mode: sft | rm | dpo`).
fn run_stage(request: &RunRequest, reporter: &mut Reporter) -> anyhow::Result<String> {
    use crate::stage::{StageConfig, trainer};
    let config: StageConfig = request.config.stage_config()?;
    let started = Instant::now();
    let mode = config.mode;
    let pairs = mode != Mode::Sft;
    let paths = RunPaths::new(&absolute(&config.run_dir));
    reporter.note(format!("run directory: {}{}", paths.root.display(), where_this_runs()));
    let samples = trainer::prepare(&config)?;
    reporter.note(format!(
        "model: {}\n{}: {} training, {} held-out{}",
        config.model.pretrain.as_deref().unwrap_or(Path::new("")).display(),
        if pairs { "preference pairs" } else { "samples" },
        samples.train.len(),
        samples.eval.len(),
        dropped(samples.dropped_too_long, "data.max_len", config.data.max_len),
    ));
    let resuming = reporter.resuming(&paths, config.checkpoint.resume)?;
    let total = trainer::total_steps(&config, samples.train.len());
    if let Some(said) = already_finished(&paths.root, resuming.as_ref(), total) {
        return Ok(said);
    }
    reporter.2 = Some(effective_config(&paths.root, mode, serde_json::to_value(&config)?, request));
    let mut shown = vec![ProgressField::new("loss", "loss")];
    if pairs {
        shown.push(ProgressField::new("acc", "accuracy"));
        shown.push(ProgressField::new("margin", "reward/margin"));
        shown.push(ProgressField::new("eval acc", "eval/accuracy"));
    } else {
        shown.push(ProgressField::new("eval", "eval/loss"));
    }
    shown.push(ProgressField::new("tok/s", "tokens_per_s"));
    reporter.start(total, steps_done(resuming.as_ref()), &shown);
    let (trainer, report) = trainer::run_prepared(&config, samples, resuming.as_ref(), reporter)?;
    trainer.kill();
    reporter.note(format!("final model (Hugging Face format): {}", report.exported.display()));
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
    let rows: &[(&str, &str)] = if pairs {
        &[
            ("accuracy", "accuracy (chosen above rejected)"),
            ("reward/margin", "reward margin (chosen - rejected)"),
            ("loss", "loss"),
        ]
    } else {
        &[("loss", "loss (nats per response token)")]
    };
    let mut held_out: Vec<EvalRow> = rows
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
            request.config_file,
            mode.name(),
            config.cluster.replicas
        ),
        steps: report.steps,
        resumed_from: resuming.as_ref().map(|point| point.step),
        wall_time: started.elapsed(),
        held_out_prompts: report.samples.1,
        held_out,
        phases: trainer.timer.totals().to_vec(),
    };
    finish(&paths.root, &summary, "loss.png")
}

/// PPO / GRPO (`mode: rl`).
fn run_rl(request: &RunRequest, reporter: &mut Reporter) -> anyhow::Result<String> {
    use crate::run::{InitialPolicy, preflight, prepare, run_prepared};
    let config = request.config.train()?;
    let started = Instant::now();
    let title = format!(
        "{} ({}, {:?} reward `{}`)",
        request.config_file,
        config.algo.advantage_estimator,
        config.reward.kind,
        config.reward.name
    );
    let paths = RunPaths::new(&absolute(&config.run_dir));
    reporter.note(format!("run directory: {}{}", paths.root.display(), where_this_runs()));
    // Everything checkable before the warm-up: placement spec, GPUs, files, the run directory.
    let placements = preflight(&config, &paths)?;
    let prepared = prepare(&config, &paths)?;
    reporter.note(match &prepared.initial {
        InitialPolicy::Made(w) => format!(
            "warm-up: {} supervised steps, token loss {:.3} -> {:.3}",
            w.steps, w.first_loss, w.last_loss
        ),
        InitialPolicy::Reused => "warm-up: reusing the initial policy of the run directory".into(),
        InitialPolicy::Pretrained(dir) => format!("policy: {}", dir.display()),
    });
    reporter.note(format!(
        "prompts: {} training, {} held-out{}",
        prepared.train_prompts(),
        prepared.eval_prompts(),
        dropped(prepared.dropped_too_long, "data.max_prompt_len", config.data.max_prompt_len),
    ));
    let resuming = reporter.resuming(&paths, config.checkpoint.resume)?;
    let total = {
        let per_episode =
            (prepared.train_prompts() / config.rollout.prompts_per_step).max(1) as u64;
        let total = per_episode * config.train.num_episodes as u64;
        config.train.max_steps.map_or(total, |m| m.min(total))
    };
    if let Some(said) = already_finished(&paths.root, resuming.as_ref(), total) {
        return Ok(said);
    }
    reporter.2 =
        Some(effective_config(&paths.root, Mode::Rl, serde_json::to_value(&config)?, request));
    let shown = [
        ProgressField::new("reward", "reward"),
        ProgressField::new("acc", "accuracy"),
        ProgressField::new("kl", "kl"),
        ProgressField::new("eval", "eval/reward"),
    ];
    reporter.start(total, steps_done(resuming.as_ref()), &shown);
    let held_out_prompts = prepared.eval_prompts();
    let (trainer, report) =
        run_prepared(&config, prepared, placements, resuming.as_ref(), reporter)?;
    trainer.roles.kill();
    if let Some(dir) = &report.exported {
        reporter.note(format!("final policy (Hugging Face format): {}", dir.display()));
    }
    let records =
        jsonl::read_jsonl(&paths.root.join("metrics.jsonl")).context("reading metrics.jsonl")?;
    let chart =
        reward_curve(&records, &[("train reward", "reward"), ("held-out reward", "eval/reward")]);
    chart.write_png(&paths.root.join("reward.png")).context("writing reward.png")?;
    let summary = RunSummary {
        title,
        steps: report.steps,
        resumed_from: resuming.as_ref().map(|point| point.step),
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
    finish(&paths.root, &summary, "reward.png")
}

/// ` (on node NAME)` when this process runs on a cluster's node other than the head's, else
/// nothing (the driver's machine).
fn where_this_runs() -> String {
    let Ok(context) = rtrun::context() else { return String::new() };
    let names = crate::placement_map::node_names();
    match names.get(&context.node_id.to_string()) {
        Some(name) if names.len() > 1 => format!(" (on node {name})"),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drivers follow the log from any index and learn how the run ended, a panic included.
    #[test]
    fn the_event_log_replays_from_any_index_and_every_ending_ends_the_run() {
        let log = EventLog::default();
        log.push(Event::Note("a".into()));
        log.push(Event::Phase("generate".into()));
        assert_eq!(log.since(0, Duration::ZERO).len(), 2);
        assert_eq!(log.since(1, Duration::ZERO), vec![Event::Phase("generate".into())]);
        assert!(log.since(2, Duration::from_millis(10)).is_empty());

        let finished = ended(Ok(Ok("summary".into())));
        assert_eq!(finished, Event::Finished { summary: "summary".into() });
        let failed = ended(Ok(Err(anyhow::anyhow!("inner").context("outer"))));
        assert_eq!(failed, Event::Failed { error: "outer: inner".into() });
        let panicked = ended(std::panic::catch_unwind(|| -> anyhow::Result<String> {
            panic!("index {} out of range", 7)
        }));
        assert_eq!(
            panicked,
            Event::Failed { error: "the trainer panicked: index 7 out of range".into() }
        );
        assert!([finished, failed, panicked].iter().all(Event::ends_the_run));
        assert!(!Event::Note("a".into()).ends_the_run());
    }

    #[test]
    fn step_events_carry_metrics_and_phases_back() {
        let mut reporter =
            Reporter(Arc::new(EventLog::default()), Arc::new(LiveMetrics::default()), None);
        let mut metrics = StepMetrics::new(3);
        metrics.set("reward", 0.5).unwrap();
        let phases = StepPhases { phases: vec![("train".into(), Duration::from_millis(250))] };
        reporter.step_done(&metrics, &phases);
        let events = reporter.0.since(0, Duration::ZERO);
        let (back, back_phases) = events[0].step().expect("a step event");
        assert_eq!(back, metrics);
        assert_eq!(back_phases, phases);
        assert_eq!(actor_name(Path::new("/runs/a")), "train:/runs/a");
    }
}
