//! Per-step scalar metrics and the sinks that record them: [`StepMetrics`] is what the trainer
//! produces each step, [`MetricsSink`] is anything that records it, and [`MetricsWriter`] is the
//! run directory's sink (a JSONL file plus a TensorBoard event file).

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TelemetryError, io_error};
use crate::jsonl::JsonlWriter;
use crate::tensorboard::{EventFileWriter, event_files_in};

/// Keys every JSONL record has; metric names may not use them.
pub const RESERVED_NAMES: [&str; 2] = ["step", "wall_time"];

/// The named scalars of one step, in insertion order, with the step and the wall time.
///
/// Serializable (e.g. returned by a trainer actor through the runtime); deserializing checks the
/// names as [`StepMetrics::set`] does and rejects duplicates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "UncheckedStepMetrics")]
pub struct StepMetrics {
    step: u64,
    wall_time: f64,
    scalars: Vec<(String, f64)>,
}

impl StepMetrics {
    /// Metrics of `step`, stamped with the current wall time.
    pub fn new(step: u64) -> Self {
        Self::with_wall_time(step, unix_time_now())
    }

    /// Metrics of `step` stamped with `wall_time` (seconds since the Unix epoch).
    pub fn with_wall_time(step: u64, wall_time: f64) -> Self {
        Self { step, wall_time, scalars: Vec::new() }
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Seconds since the Unix epoch when the step's metrics were taken.
    pub fn wall_time(&self) -> f64 {
        self.wall_time
    }

    /// The scalars in insertion order.
    pub fn scalars(&self) -> &[(String, f64)] {
        &self.scalars
    }

    /// The value of `name`, if set.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.scalars.iter().find(|(existing, _)| existing == name).map(|&(_, value)| value)
    }

    /// Sets `name` to `value`, replacing an earlier value of the same name (its position is
    /// kept). Names must be non-empty and not one of [`RESERVED_NAMES`]; `/` groups names in
    /// TensorBoard (`reward/mean`, `time/generate`). Non-finite values are kept as they are.
    pub fn set(&mut self, name: impl Into<String>, value: f64) -> Result<&mut Self> {
        let name = name.into();
        validate_name(&name)?;
        match self.scalars.iter_mut().find(|(existing, _)| *existing == name) {
            Some(slot) => slot.1 = value,
            None => self.scalars.push((name, value)),
        }
        Ok(self)
    }

    /// Sets every `(name, value)` of `scalars` under `prefix` (e.g. `"time/"`).
    pub fn extend_prefixed<N: AsRef<str>>(
        &mut self,
        prefix: &str,
        scalars: impl IntoIterator<Item = (N, f64)>,
    ) -> Result<&mut Self> {
        for (name, value) in scalars {
            self.set(format!("{prefix}{}", name.as_ref()), value)?;
        }
        Ok(self)
    }
}

/// The serialized form of [`StepMetrics`], validated by `TryFrom` when deserializing.
#[derive(Deserialize)]
struct UncheckedStepMetrics {
    step: u64,
    wall_time: f64,
    scalars: Vec<(String, f64)>,
}

impl TryFrom<UncheckedStepMetrics> for StepMetrics {
    type Error = TelemetryError;

    fn try_from(unchecked: UncheckedStepMetrics) -> Result<Self> {
        let mut metrics = StepMetrics::with_wall_time(unchecked.step, unchecked.wall_time);
        for (name, value) in unchecked.scalars {
            if metrics.get(&name).is_some() {
                return Err(TelemetryError::InvalidMetricName { name, reason: "recorded twice" });
            }
            metrics.set(name, value)?;
        }
        Ok(metrics)
    }
}

fn validate_name(name: &str) -> Result<()> {
    let reason = if name.is_empty() {
        "names must not be empty"
    } else if RESERVED_NAMES.contains(&name) {
        "`step` and `wall_time` are the record's own keys"
    } else if name.chars().any(char::is_control) {
        "names must not contain control characters"
    } else {
        return Ok(());
    };
    Err(TelemetryError::InvalidMetricName { name: name.to_owned(), reason })
}

/// Seconds since the Unix epoch, as TensorBoard's `wall_time` (0 if the clock is before 1970).
pub fn unix_time_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|elapsed| elapsed.as_secs_f64()).unwrap_or(0.0)
}

/// Something that records each step's metrics.
pub trait MetricsSink {
    /// Records one step. Implementations that write files make the record durable against a
    /// crash of the process (not of the machine) before returning.
    fn record(&mut self, metrics: &StepMetrics) -> Result<()>;
}

/// Keeps the records in memory (tests, and drivers that plot at the end).
impl MetricsSink for Vec<StepMetrics> {
    fn record(&mut self, metrics: &StepMetrics) -> Result<()> {
        self.push(metrics.clone());
        Ok(())
    }
}

impl<S: MetricsSink + ?Sized> MetricsSink for &mut S {
    fn record(&mut self, metrics: &StepMetrics) -> Result<()> {
        (**self).record(metrics)
    }
}

/// How a writer treats files a previous run left in its directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartMode {
    /// A fresh run: fail with [`TelemetryError::AlreadyExists`] if the JSONL file or any event
    /// file exists.
    New,
    /// A fresh run replacing an old one: truncate the JSONL file, delete old event files.
    Overwrite,
    /// Continue a run from a checkpoint taken before `next_step`: keep the JSONL records of
    /// earlier steps (dropping later ones and a torn last line), and start a new event file with
    /// a session start at `next_step` so TensorBoard drops the stale events.
    Resume {
        /// The first step the resumed run will record.
        next_step: u64,
    },
}

/// Options of [`MetricsWriter`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsWriterOptions {
    /// Name of the JSONL file in the run directory. Default `metrics.jsonl`.
    pub jsonl_file_name: String,
    /// Whether to write TensorBoard event files. Default `true`.
    pub tensorboard: bool,
}

impl Default for MetricsWriterOptions {
    fn default() -> Self {
        Self { jsonl_file_name: "metrics.jsonl".to_owned(), tensorboard: true }
    }
}

/// The sink of a run directory: each step goes to the JSONL file (one object per line) and to
/// a TensorBoard event file, both flushed before [`MetricsSink::record`] returns.
///
/// Nothing in the directory changes before the first record: a run that fails before it has a
/// step to record (a resume whose checkpoint turns out bad, a run with nothing left to do)
/// leaves the previous run's metrics and event files as they were. Only [`StartMode::New`]'s
/// check that there is no earlier run is made at once.
pub struct MetricsWriter {
    dir: PathBuf,
    mode: StartMode,
    options: MetricsWriterOptions,
    open: Option<OpenFiles>,
}

/// The files of a writer that has recorded.
struct OpenFiles {
    jsonl: JsonlWriter,
    tensorboard: Option<EventFileWriter>,
}

impl MetricsWriter {
    /// Opens the sink in `dir` (created if missing) with default options.
    pub fn create(dir: &Path, mode: StartMode) -> Result<Self> {
        Self::with_options(dir, mode, &MetricsWriterOptions::default())
    }

    /// Opens the sink in `dir` (created if missing).
    pub fn with_options(
        dir: &Path,
        mode: StartMode,
        options: &MetricsWriterOptions,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io_error("create directory", dir))?;
        if mode == StartMode::New {
            let jsonl_path = dir.join(&options.jsonl_file_name);
            if jsonl_path.exists() {
                return Err(TelemetryError::AlreadyExists { path: jsonl_path });
            }
            if options.tensorboard
                && let Some(path) = event_files_in(dir)?.into_iter().next()
            {
                return Err(TelemetryError::AlreadyExists { path });
            }
        }
        Ok(Self { dir: dir.to_owned(), mode, options: options.clone(), open: None })
    }

    /// The files, opened as `mode` says at the first record.
    fn files(&mut self) -> Result<&mut OpenFiles> {
        if self.open.is_none() {
            let (dir, mode) = (&self.dir, self.mode);
            let old_event_files =
                if self.options.tensorboard { event_files_in(dir)? } else { Vec::new() };
            match mode {
                StartMode::New => {
                    if let Some(path) = old_event_files.first() {
                        return Err(TelemetryError::AlreadyExists { path: path.clone() });
                    }
                }
                StartMode::Overwrite => {
                    for path in &old_event_files {
                        std::fs::remove_file(path).map_err(io_error("remove", path))?;
                    }
                }
                StartMode::Resume { .. } => {}
            }
            let jsonl = JsonlWriter::create(&self.jsonl_path(), mode)?;
            let tensorboard = if self.options.tensorboard {
                let now = unix_time_now();
                let mut writer = EventFileWriter::create(dir, now)?;
                if let StartMode::Resume { next_step } = mode {
                    writer.write_session_start(next_step, now)?;
                    writer.flush()?;
                }
                Some(writer)
            } else {
                None
            };
            self.open = Some(OpenFiles { jsonl, tensorboard });
        }
        Ok(self.open.as_mut().expect("opened above"))
    }

    /// The JSONL file.
    pub fn jsonl_path(&self) -> PathBuf {
        self.dir.join(&self.options.jsonl_file_name)
    }

    /// The event file this writer appends to, once it recorded, if TensorBoard output is on.
    pub fn event_file_path(&self) -> Option<PathBuf> {
        self.open.as_ref()?.tensorboard.as_ref().map(|writer| writer.path().to_owned())
    }
}

/// A metric's TensorBoard tag, as OpenRLHF's trainers tag theirs: held-out metrics keep their
/// `eval/` name, every other one goes under `train/` (`reward` → `train/reward`), so boards
/// built for OpenRLHF runs find them. `metrics.jsonl` keeps the plain names.
pub fn tensorboard_tag(name: &str) -> String {
    if name.starts_with("eval/") || name.starts_with("train/") {
        name.to_owned()
    } else {
        format!("train/{name}")
    }
}

impl MetricsSink for MetricsWriter {
    fn record(&mut self, metrics: &StepMetrics) -> Result<()> {
        let files = self.files()?;
        files.jsonl.record(metrics)?;
        if let Some(writer) = &mut files.tensorboard {
            let tags: Vec<(String, f64)> = metrics
                .scalars()
                .iter()
                .map(|(name, value)| (tensorboard_tag(name), *value))
                .collect();
            let scalars = tags.iter().map(|(tag, value)| (tag.as_str(), *value));
            writer.write_scalars(metrics.step(), metrics.wall_time(), scalars)?;
            writer.flush()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensorboard_tags_follow_openrlhfs_train_and_eval_groups() {
        assert_eq!(tensorboard_tag("reward"), "train/reward");
        assert_eq!(tensorboard_tag("pipeline/concurrency"), "train/pipeline/concurrency");
        assert_eq!(tensorboard_tag("eval/reward"), "eval/reward");
        assert_eq!(tensorboard_tag("train/x"), "train/x");
    }

    #[test]
    fn set_validates_and_replaces() {
        let mut metrics = StepMetrics::with_wall_time(4, 10.0);
        metrics.set("reward/mean", 0.5).unwrap().set("kl", 0.1).unwrap();
        metrics.set("reward/mean", 0.7).unwrap();
        assert_eq!(metrics.scalars(), [("reward/mean".to_owned(), 0.7), ("kl".to_owned(), 0.1)]);
        assert_eq!(metrics.get("kl"), Some(0.1));
        assert_eq!(metrics.get("missing"), None);
        for bad in ["", "step", "wall_time", "a\nb"] {
            let error = metrics.set(bad, 1.0).unwrap_err();
            assert!(matches!(error, TelemetryError::InvalidMetricName { .. }), "{bad:?}");
        }
        metrics.extend_prefixed("time/", [("generate", 1.5), ("train", 2.5)]).unwrap();
        assert_eq!(metrics.get("time/train"), Some(2.5));
    }

    #[test]
    fn serde_round_trip_validates_names() {
        let mut metrics = StepMetrics::with_wall_time(3, 1.5);
        metrics.set("reward", 0.25).unwrap().set("kl", 0.5).unwrap();
        let json = serde_json::to_string(&metrics).unwrap();
        assert_eq!(json, r#"{"step":3,"wall_time":1.5,"scalars":[["reward",0.25],["kl",0.5]]}"#);
        assert_eq!(serde_json::from_str::<StepMetrics>(&json).unwrap(), metrics);
        for bad in [
            r#"{"step":3,"wall_time":1.5,"scalars":[["step",0.25]]}"#,
            r#"{"step":3,"wall_time":1.5,"scalars":[["kl",0.25],["kl",0.5]]}"#,
        ] {
            assert!(serde_json::from_str::<StepMetrics>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn vec_sink_keeps_records() {
        let mut sink = Vec::new();
        let metrics = StepMetrics::with_wall_time(1, 2.0);
        sink.record(&metrics).unwrap();
        assert_eq!(sink, vec![metrics]);
    }
}
