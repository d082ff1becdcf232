//! Pipeline stages on the dock: a stage is a consumer that reads its input columns, does its
//! work and writes its output columns, only ever through the dock, until it has consumed every
//! row. Stages run concurrently (threads, or actors in their own processes), so a later stage
//! starts on the first finished prompt groups while earlier stages still work on the rest —
//! rollout → rule reward → reference log-prob → old log-prob → advantages → train.
//!
//! [`run_stage`] is the loop every stage (and every DP rank of a stage) runs; it records a
//! [`StageTimeline`] of when each batch was worked on, and [`PipelineSummary`] turns the
//! timelines of a run into per-stage spans, overlap and a text chart.
//!
//! Timestamps are microseconds of the system clock since the Unix epoch, so timelines recorded
//! by stage processes on one node line up with each other and with the driver's.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::actor::{DockCallError, RemoteDock};
use crate::dock::{PackedBatch, PackedNamedColumn, TransferDock};
use crate::index::RowRequest;

/// Where a stage reads and writes: the in-process [`TransferDock`] or a [`RemoteDock`] actor.
pub trait ExperienceStore {
    /// Writes a batch's columns at its rows and marks them ready.
    fn put(&self, batch: PackedBatch) -> Result<(), DockCallError>;
    /// Takes `count` rows that are ready in `columns` and not yet consumed by `consumer`, in
    /// whole prompt groups; `None` when not enough are ready.
    fn get(
        &self,
        consumer: &str,
        columns: &[String],
        count: usize,
    ) -> Result<Option<PackedBatch>, DockCallError>;
    /// Whether `consumer` has received every row.
    fn all_consumed(&self, consumer: &str) -> Result<bool, DockCallError>;
}

impl ExperienceStore for TransferDock {
    fn put(&self, batch: PackedBatch) -> Result<(), DockCallError> {
        Ok(self.put_experience_packed(&batch.rows, &batch.columns)?)
    }

    fn get(
        &self,
        consumer: &str,
        columns: &[String],
        count: usize,
    ) -> Result<Option<PackedBatch>, DockCallError> {
        Ok(self.get_experience_packed(consumer, columns, RowRequest::Count(count))?)
    }

    fn all_consumed(&self, consumer: &str) -> Result<bool, DockCallError> {
        Ok(TransferDock::all_consumed(self, consumer)?)
    }
}

impl ExperienceStore for RemoteDock {
    fn put(&self, batch: PackedBatch) -> Result<(), DockCallError> {
        self.put_experience(batch)
    }

    fn get(
        &self,
        consumer: &str,
        columns: &[String],
        count: usize,
    ) -> Result<Option<PackedBatch>, DockCallError> {
        self.get_experience(consumer, columns, count, None)
    }

    fn all_consumed(&self, consumer: &str) -> Result<bool, DockCallError> {
        RemoteDock::all_consumed(self, consumer)
    }
}

/// How a stage waits for rows. Every field has a default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PollConfig {
    /// The first pause after an empty get; doubled after each further empty get. Default
    /// 200 µs.
    pub initial_backoff: Duration,
    /// The longest pause between gets. Default 20 ms.
    pub max_backoff: Duration,
    /// How long a stage may go without receiving rows before it gives up with
    /// [`StageError::Stalled`] (an upstream stage died, or the dock can never serve the
    /// request). Default 600 s.
    pub stall_timeout: Duration,
}

impl Default for PollConfig {
    fn default() -> Self {
        Self {
            initial_backoff: Duration::from_micros(200),
            max_backoff: Duration::from_millis(20),
            stall_timeout: Duration::from_secs(600),
        }
    }
}

/// One stage (or one DP rank of a stage): which consumer it is, what it reads and writes, and
/// how many rows it takes at a time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSpec {
    /// The dock consumer this stage reads as; the ranks of one stage share it.
    pub consumer: String,
    /// This rank's index within the stage (for the timeline only).
    pub rank: usize,
    /// Columns read; a row is handed out once it is ready in all of them.
    pub inputs: Vec<String>,
    /// Columns written, exactly these for every batch (none for a sink such as training).
    pub outputs: Vec<String>,
    /// Rows per get, a positive multiple of the samples per prompt.
    pub batch_rows: usize,
    /// How to wait for rows.
    pub poll: PollConfig,
}

impl StageSpec {
    /// Rank 0 of a stage with the default polling.
    pub fn new(
        consumer: impl Into<String>,
        inputs: &[&str],
        outputs: &[&str],
        batch_rows: usize,
    ) -> Self {
        Self {
            consumer: consumer.into(),
            rank: 0,
            inputs: inputs.iter().map(|s| (*s).to_owned()).collect(),
            outputs: outputs.iter().map(|s| (*s).to_owned()).collect(),
            batch_rows,
            poll: PollConfig::default(),
        }
    }

    /// The same stage as rank `rank`.
    pub fn with_rank(mut self, rank: usize) -> Self {
        self.rank = rank;
        self
    }

    /// Replaces the polling policy.
    pub fn with_poll(mut self, poll: PollConfig) -> Self {
        self.poll = poll;
        self
    }
}

/// One batch a stage worked on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSpan {
    /// The dock rows of the batch.
    pub rows: Vec<usize>,
    /// When the get that returned the batch was issued (µs since the Unix epoch).
    pub requested_us: u64,
    /// When the work on it started, right after the get returned.
    pub started_us: u64,
    /// When its outputs were in the dock.
    pub finished_us: u64,
}

/// What one stage rank did and when.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageTimeline {
    /// The consumer.
    pub consumer: String,
    /// The rank.
    pub rank: usize,
    /// When [`run_stage`] started (µs since the Unix epoch).
    pub started_us: u64,
    /// When it returned.
    pub finished_us: u64,
    /// The batches, in order.
    pub spans: Vec<StageSpan>,
    /// Gets that found too few rows ready.
    pub empty_polls: u64,
}

impl StageTimeline {
    /// Microseconds spent working (sum of the spans).
    pub fn busy_us(&self) -> u64 {
        self.spans.iter().map(|s| s.finished_us.saturating_sub(s.started_us)).sum()
    }

    /// Rows processed.
    pub fn rows(&self) -> usize {
        self.spans.iter().map(|s| s.rows.len()).sum()
    }
}

/// An error that a stage's work function returns.
pub type StageWorkError = Box<dyn std::error::Error + Send + Sync>;

/// Why a stage stopped before consuming every row.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// A call to the dock failed.
    #[error("stage `{consumer}` rank {rank}: {source}")]
    Dock {
        /// The stage.
        consumer: String,
        /// The rank.
        rank: usize,
        /// The dock's error.
        source: DockCallError,
    },
    /// The stage's work failed on a batch.
    #[error("stage `{consumer}` rank {rank} failed on rows {first_row}..: {source}")]
    Work {
        /// The stage.
        consumer: String,
        /// The rank.
        rank: usize,
        /// The first row of the batch.
        first_row: usize,
        /// The work's error.
        source: StageWorkError,
    },
    /// The work returned other columns than the stage declares.
    #[error("stage `{consumer}` declares outputs [{expected}], its work returned [{found}]")]
    WrongOutputs {
        /// The stage.
        consumer: String,
        /// The declared output columns.
        expected: String,
        /// The returned columns.
        found: String,
    },
    /// No rows arrived for longer than the stall timeout.
    #[error(
        "stage `{consumer}` rank {rank} received no rows for {waited:?} \
         (an upstream stage stopped, or no request of {batch_rows} rows can be served)"
    )]
    Stalled {
        /// The stage.
        consumer: String,
        /// The rank.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// Its rows per get.
        batch_rows: usize,
    },
}

/// Microseconds since the Unix epoch (0 if the clock is before it).
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Runs one stage rank until its consumer has received every row: get `batch_rows` rows of
/// the input columns, call `work`, put the returned output columns back at the same rows.
/// An empty get backs off (see [`PollConfig`]); a get that returns rows resets the back-off.
///
/// `work` must return exactly the declared output columns, each with one value per row of the
/// batch (the dock checks the counts and kinds on put).
pub fn run_stage<S, W>(
    store: &S,
    spec: &StageSpec,
    mut work: W,
) -> Result<StageTimeline, StageError>
where
    S: ExperienceStore + ?Sized,
    W: FnMut(&PackedBatch) -> Result<Vec<PackedNamedColumn>, StageWorkError>,
{
    let dock_error =
        |source| StageError::Dock { consumer: spec.consumer.clone(), rank: spec.rank, source };
    let mut timeline = StageTimeline {
        consumer: spec.consumer.clone(),
        rank: spec.rank,
        started_us: now_us(),
        finished_us: 0,
        spans: Vec::new(),
        empty_polls: 0,
    };
    let mut backoff = spec.poll.initial_backoff;
    let mut last_progress = std::time::Instant::now();
    loop {
        let requested_us = now_us();
        let batch = store.get(&spec.consumer, &spec.inputs, spec.batch_rows).map_err(dock_error)?;
        let Some(batch) = batch else {
            if store.all_consumed(&spec.consumer).map_err(dock_error)? {
                break;
            }
            timeline.empty_polls += 1;
            let waited = last_progress.elapsed();
            if waited > spec.poll.stall_timeout {
                return Err(StageError::Stalled {
                    consumer: spec.consumer.clone(),
                    rank: spec.rank,
                    waited,
                    batch_rows: spec.batch_rows,
                });
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(spec.poll.max_backoff);
            continue;
        };
        let started_us = now_us();
        let outputs = work(&batch).map_err(|source| StageError::Work {
            consumer: spec.consumer.clone(),
            rank: spec.rank,
            first_row: batch.rows.first().copied().unwrap_or(0),
            source,
        })?;
        check_outputs(spec, &outputs)?;
        if !outputs.is_empty() {
            store
                .put(PackedBatch { rows: batch.rows.clone(), columns: outputs })
                .map_err(dock_error)?;
        }
        timeline.spans.push(StageSpan {
            rows: batch.rows,
            requested_us,
            started_us,
            finished_us: now_us(),
        });
        backoff = spec.poll.initial_backoff;
        last_progress = std::time::Instant::now();
    }
    timeline.finished_us = now_us();
    Ok(timeline)
}

fn check_outputs(spec: &StageSpec, outputs: &[PackedNamedColumn]) -> Result<(), StageError> {
    let mut expected: Vec<&str> = spec.outputs.iter().map(String::as_str).collect();
    let mut found: Vec<&str> = outputs.iter().map(|c| c.name.as_str()).collect();
    expected.sort_unstable();
    found.sort_unstable();
    if expected == found {
        return Ok(());
    }
    Err(StageError::WrongOutputs {
        consumer: spec.consumer.clone(),
        expected: expected.join(", "),
        found: found.join(", "),
    })
}

/// One stage's extent in a run, over all its ranks, relative to the run's start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageExtent {
    /// The consumer.
    pub consumer: String,
    /// Start of its first batch (µs after the run's first batch started).
    pub first_start_us: u64,
    /// End of its first batch: when its first output was in the dock (µs after the run's
    /// first batch started).
    pub first_end_us: u64,
    /// End of its last batch (µs after the run's first batch started).
    pub last_end_us: u64,
    /// Time spent working, summed over ranks and batches.
    pub busy_us: u64,
    /// Batches processed.
    pub batches: usize,
    /// Rows processed.
    pub rows: usize,
}

/// Per-stage extents and the overlap of one pipeline run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineSummary {
    /// The stages, in the order their first timelines were given.
    pub stages: Vec<StageExtent>,
    /// From the first batch's start to the last batch's end, µs.
    pub makespan_us: u64,
    /// The sum of every stage's busy time, µs: the makespan of running the same work strictly
    /// one batch at a time.
    pub busy_us: u64,
}

impl PipelineSummary {
    /// Summarises the timelines of one run (any number of ranks per stage).
    pub fn new(timelines: &[StageTimeline]) -> Self {
        let spans = || timelines.iter().flat_map(|t| &t.spans);
        let origin = spans().map(|s| s.started_us).min().unwrap_or(0);
        let end = spans().map(|s| s.finished_us).max().unwrap_or(origin);
        let mut stages: Vec<StageExtent> = Vec::new();
        for timeline in timelines {
            let index = match stages.iter().position(|s| s.consumer == timeline.consumer) {
                Some(index) => index,
                None => {
                    stages.push(StageExtent {
                        consumer: timeline.consumer.clone(),
                        first_start_us: u64::MAX,
                        first_end_us: u64::MAX,
                        last_end_us: 0,
                        busy_us: 0,
                        batches: 0,
                        rows: 0,
                    });
                    stages.len() - 1
                }
            };
            let Some(stage) = stages.get_mut(index) else { continue };
            for span in &timeline.spans {
                stage.first_start_us =
                    stage.first_start_us.min(span.started_us.saturating_sub(origin));
                stage.first_end_us =
                    stage.first_end_us.min(span.finished_us.saturating_sub(origin));
                stage.last_end_us = stage.last_end_us.max(span.finished_us.saturating_sub(origin));
            }
            stage.busy_us += timeline.busy_us();
            stage.batches += timeline.spans.len();
            stage.rows += timeline.rows();
        }
        for stage in &mut stages {
            if stage.batches == 0 {
                stage.first_start_us = 0;
                stage.first_end_us = 0;
            }
        }
        let busy_us = stages.iter().map(|s| s.busy_us).sum();
        Self { stages, makespan_us: end.saturating_sub(origin), busy_us }
    }

    /// Average number of stage batches in progress at once: busy time over makespan (1.0 for
    /// a run where nothing overlapped).
    pub fn concurrency(&self) -> f64 {
        if self.makespan_us == 0 {
            return 0.0;
        }
        self.busy_us as f64 / self.makespan_us as f64
    }

    /// For each stage after the first: how long it was already working before the previous
    /// stage finished its last batch, µs (0 when it only started afterwards).
    pub fn head_starts_us(&self) -> Vec<(String, u64)> {
        self.stages
            .windows(2)
            .map(|pair| {
                let (previous, stage) = (&pair[0], &pair[1]);
                (stage.consumer.clone(), previous.last_end_us.saturating_sub(stage.first_start_us))
            })
            .collect()
    }

    /// A text chart, one line per stage, `width` characters across the makespan.
    pub fn chart(&self, width: usize) -> String {
        let width = width.max(10);
        let name_width = self.stages.iter().map(|s| s.consumer.len()).max().unwrap_or(0);
        let scale = self.makespan_us.max(1) as f64 / width as f64;
        let mut out = String::new();
        for stage in &self.stages {
            let from = ((stage.first_start_us as f64 / scale) as usize).min(width - 1);
            let to = ((stage.last_end_us as f64 / scale).ceil() as usize).clamp(from + 1, width);
            let bar: String =
                (0..width).map(|i| if (from..to).contains(&i) { '#' } else { '.' }).collect();
            out.push_str(&format!(
                "{:name_width$} |{bar}| {:>7.1} .. {:>7.1} ms, first out {:>7.1} ms, busy {:>7.1} ms, {} batches\n",
                stage.consumer,
                stage.first_start_us as f64 / 1e3,
                stage.last_end_us as f64 / 1e3,
                stage.first_end_us as f64 / 1e3,
                stage.busy_us as f64 / 1e3,
                stage.batches,
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::column::{ColumnKind, ColumnValues, PackedColumn};
    use crate::config::{DockConfig, SampleOrder, SamplingConfig};

    fn dock() -> TransferDock {
        TransferDock::new(
            DockConfig::new(4, 2)
                .with_column("prompts", ColumnKind::TokenIds)
                .with_column("lengths", ColumnKind::Scalars)
                .with_consumer("measure")
                .with_consumer("sink")
                .with_sampling(SamplingConfig {
                    order: SampleOrder::Ascending,
                    ..SamplingConfig::default()
                }),
        )
        .unwrap()
    }

    fn fast_poll() -> PollConfig {
        PollConfig { stall_timeout: Duration::from_millis(50), ..PollConfig::default() }
    }

    fn measure(batch: &PackedBatch) -> Result<Vec<PackedNamedColumn>, StageWorkError> {
        let Some(PackedColumn::TokenIds(prompts)) = batch.column("prompts") else {
            return Err("expected token-id prompts".into());
        };
        let lengths = prompts.lengths.iter().map(|l| *l as f32).collect();
        Ok(vec![PackedNamedColumn::new("lengths", &ColumnValues::Scalars(lengths))])
    }

    #[test]
    fn stages_run_to_completion_through_the_dock() {
        let dock = dock();
        let prompts: Vec<Vec<i64>> = (0..8).map(|row| vec![7; 1 + row]).collect();
        let rows: Vec<usize> = (0..8).collect();
        dock.put_experience(&rows, vec![("prompts", ColumnValues::TokenIds(prompts))]).unwrap();
        let spec = StageSpec::new("measure", &["prompts"], &["lengths"], 4);
        let timeline = run_stage(&dock, &spec, measure).unwrap();
        assert_eq!(timeline.rows(), 8);
        assert_eq!(timeline.spans.len(), 2);
        let mut seen = Vec::new();
        let sink = StageSpec::new("sink", &["lengths"], &[], 2);
        let sink_timeline = run_stage(&dock, &sink, |batch| {
            let Some(PackedColumn::Scalars(lengths)) = batch.column("lengths") else {
                return Err("expected scalars".into());
            };
            seen.extend(batch.rows.iter().zip(lengths).map(|(r, l)| (*r, *l)));
            Ok(Vec::new())
        })
        .unwrap();
        seen.sort_by_key(|(row, _)| *row);
        assert_eq!(seen, (0..8).map(|row| (row, 1.0 + row as f32)).collect::<Vec<_>>());
        let summary = PipelineSummary::new(&[timeline, sink_timeline]);
        assert_eq!(summary.stages.len(), 2);
        assert_eq!(summary.stages[1].rows, 8);
        assert!(summary.chart(20).lines().count() == 2);
    }

    #[test]
    fn a_stage_without_input_stalls_with_an_error() {
        let dock = dock();
        let spec = StageSpec::new("measure", &["prompts"], &["lengths"], 2).with_poll(fast_poll());
        let error = run_stage(&dock, &spec, measure).unwrap_err();
        assert!(matches!(error, StageError::Stalled { .. }), "{error}");
    }

    #[test]
    fn wrong_outputs_and_work_errors_are_reported() {
        let dock = dock();
        dock.put_experience(&[0, 1], vec![("prompts", ColumnValues::TokenIds(vec![vec![1]; 2]))])
            .unwrap();
        let spec = StageSpec::new("measure", &["prompts"], &["other"], 2).with_poll(fast_poll());
        let error = run_stage(&dock, &spec, measure).unwrap_err();
        assert_eq!(
            error.to_string(),
            "stage `measure` declares outputs [other], its work returned [lengths]"
        );
        dock.put_experience(&[2, 3], vec![("prompts", ColumnValues::TokenIds(vec![vec![1]; 2]))])
            .unwrap();
        let spec = StageSpec::new("measure", &["prompts"], &["lengths"], 2).with_poll(fast_poll());
        let error = run_stage(&dock, &spec, |_| Err("boom".into())).unwrap_err();
        assert_eq!(error.to_string(), "stage `measure` rank 0 failed on rows 2..: boom");
    }

    #[test]
    fn concurrent_stages_overlap_and_hand_every_row_once() {
        let dock = std::sync::Arc::new(dock());
        let producer = {
            let dock = dock.clone();
            std::thread::spawn(move || {
                for group in 0..4 {
                    let rows = [2 * group, 2 * group + 1];
                    let values = ColumnValues::TokenIds(vec![vec![1; group + 1]; 2]);
                    dock.put_experience(&rows, vec![("prompts", values)]).unwrap();
                }
            })
        };
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let dock = dock.clone();
                std::thread::spawn(move || {
                    let spec =
                        StageSpec::new("measure", &["prompts"], &["lengths"], 2).with_rank(rank);
                    run_stage(&*dock, &spec, measure).unwrap()
                })
            })
            .collect();
        producer.join().unwrap();
        let timelines: Vec<StageTimeline> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
        let mut rows: Vec<usize> =
            timelines.iter().flat_map(|t| t.spans.iter().flat_map(|s| s.rows.clone())).collect();
        rows.sort_unstable();
        assert_eq!(rows, (0..8).collect::<Vec<_>>());
        assert_eq!(dock.ready_rows("lengths").unwrap(), 8);
    }

    #[test]
    fn summary_measures_overlap() {
        let span = |rows: usize, start: u64, end: u64| StageSpan {
            rows: vec![0; rows],
            requested_us: start,
            started_us: start,
            finished_us: end,
        };
        let timeline = |consumer: &str, spans| StageTimeline {
            consumer: consumer.into(),
            rank: 0,
            started_us: 0,
            finished_us: 0,
            spans,
            empty_polls: 0,
        };
        let summary = PipelineSummary::new(&[
            timeline("a", vec![span(2, 1000, 1100), span(2, 1100, 1200)]),
            timeline("b", vec![span(2, 1100, 1150), span(2, 1200, 1300)]),
        ]);
        assert_eq!(summary.makespan_us, 300);
        assert_eq!(summary.busy_us, 350);
        assert!((summary.concurrency() - 350.0 / 300.0).abs() < 1e-9);
        assert_eq!(summary.head_starts_us(), vec![("b".to_owned(), 100)]);
        assert_eq!(summary.stages[1].first_start_us, 100);
        assert_eq!(summary.stages[1].first_end_us, 150);
    }
}
