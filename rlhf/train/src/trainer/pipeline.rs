//! `train.pipeline: dock`: one GRPO step's make-experience and training as TransferDock stages.
//!
//! The driver writes the step's prompts into the run's [`DockActor`](rtrun_rlhf_dock::DockActor)
//! (rows = prompts × samples, prompt-major, as the sequential mode orders its batch), then runs
//! one thread per stage rank, each looping in [`run_stage`] and reading and writing only
//! through the dock:
//!
//! - `rollout` (one rank per engine): prompts → responses + the engine's log-probs,
//!   `train.dock_groups_per_batch` prompt groups per call (as every stage but training), with
//!   the sequential mode's requests and seeds ([`stages::generation_requests`]);
//! - `reward`: prompts + responses → rm_scores ([`stages::rewards`]: rule, custom, remote,
//!   Python or model);
//! - `ref_log_prob` (when the run has a reference) and `old_log_prob`: per-token log-probs from
//!   the reference and policy ranks ([`stages::start_log_probs`]);
//! - `compute_advantage`: everything above → advantages + returns, by the same
//!   [`stages::assemble`] as the sequential mode, a few whole prompt groups at a time (exact for
//!   group-local estimators, the only ones this mode accepts);
//! - `actor_train`: every row → [`stages::train`].
//!
//! So reward and log-prob stages start on the first groups while the engines still generate
//! the rest. Training asks for every row at once: the policy ranks compute the old log-probs,
//! so updating them before the last group's old log-probs are in would make those off-policy,
//! and taking the rows together keeps the mini-batch shuffle of the sequential mode.
//!
//! The stages' timelines become a [`PipelineSummary`] in the step's metrics (`pipeline/…`) and
//! a chart in the log. Each stage's rows are checked to be every row of the step exactly once.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use rtrun_rlhf_dock::pipeline::{StageSpan, now_us};
use rtrun_rlhf_dock::{
    ColumnValues, DockCallError, ExperienceBatch as DockBatch, ExperienceStore, PackedBatch,
    PackedNamedColumn, PipelineSummary, PollConfig, RemoteDock, StageSpec, StageTimeline,
    StageWorkError, run_stage,
};
use rtrun_rlhf_engine::{EngineActorRef, SamplingParams};
use rtrun_rlhf_telemetry::StepMetrics;

use crate::error::{Result, TrainError};
use crate::experience::{ExperienceRow, Sequence};
use crate::prompts::PromptRecord;
use crate::trainer::ProgressObserver;
use crate::trainer::calls;
use crate::trainer::dock_layout::{
    ADVANTAGES, ENGINE_LOG_PROBS, OLD_LOG_PROB, PROMPTS, REF_LOG_PROB, RESPONSES, RETURNS,
    RM_SCORES, STAGES, VERSIONS,
};
use crate::trainer::stages::{
    self, ExperienceSettings, ExperienceStats, Known, LogProbs, RoleResults, TrainStats,
};
use crate::trainer::stream::{self, AsyncRollout, Finished, StreamedGroup, VersionStats};
use crate::trainer::{Trainer, telemetry_error};

/// What a stage reports when it stopped because another one failed.
const STOPPED: &str = "stopped because another stage of the step failed";

/// What a dock step produced.
pub struct DockStep {
    /// The experience aggregates, over every row.
    pub stats: ExperienceStats,
    /// Rows trained on.
    pub rows: usize,
    /// What training did.
    pub train: TrainStats,
    /// Every stage rank's timeline.
    pub timelines: Vec<StageTimeline>,
}

/// The dock with a stop switch: once a stage fails, every other stage's next get fails too,
/// so the step ends with the first error instead of waiting for the stall timeout.
///
/// With `done` (an async step's stream of groups, which has no last row), a get takes whatever
/// groups are ready ([`RemoteDock::get_available`]), and a stage has consumed everything once
/// the step sets `done`.
struct StepDock<'a> {
    dock: &'a RemoteDock,
    failed: &'a AtomicBool,
    done: Option<&'a AtomicBool>,
}

impl ExperienceStore for StepDock<'_> {
    fn put(&self, batch: PackedBatch) -> std::result::Result<(), DockCallError> {
        self.dock.put_experience(batch)
    }

    fn get(
        &self,
        consumer: &str,
        columns: &[String],
        count: usize,
    ) -> std::result::Result<Option<PackedBatch>, DockCallError> {
        if self.failed.load(Ordering::SeqCst) {
            return Err(DockCallError::Runtime(rtrun::Error::Invalid(STOPPED.to_owned())));
        }
        match self.done {
            None => self.dock.get_experience(consumer, columns, count, None),
            Some(done) if done.load(Ordering::SeqCst) => Ok(None),
            Some(_) => self.dock.get_available(consumer, columns, count),
        }
    }

    fn all_consumed(&self, consumer: &str) -> std::result::Result<bool, DockCallError> {
        match self.done {
            None => self.dock.all_consumed(consumer),
            Some(done) => Ok(done.load(Ordering::SeqCst)),
        }
    }
}

/// A stage's batch with its rows in ascending order (prompt groups contiguous, samples in
/// order, as `assemble` expects), remembering where each came from so outputs go back in the
/// order the dock handed the rows out.
struct SortedBatch {
    rows: Vec<usize>,
    order: Vec<usize>,
    data: DockBatch,
}

impl SortedBatch {
    fn new(batch: &PackedBatch) -> Result<Self> {
        let data = batch.unpack().map_err(|e| TrainError::Data(format!("dock batch: {e}")))?;
        let mut order: Vec<usize> = (0..batch.rows.len()).collect();
        order.sort_by_key(|&i| batch.rows.get(i).copied());
        let rows = order.iter().filter_map(|&i| batch.rows.get(i).copied()).collect();
        Ok(Self { rows, order, data })
    }

    fn sorted<T: Clone>(&self, name: &str, values: &[T]) -> Result<Vec<T>> {
        if values.len() != self.order.len() {
            return Err(TrainError::Data(format!(
                "dock column `{name}`: expected {} rows, found {}",
                self.order.len(),
                values.len()
            )));
        }
        Ok(self.order.iter().filter_map(|&i| values.get(i).cloned()).collect())
    }

    fn token_ids(&self, name: &str) -> Result<Vec<Vec<u32>>> {
        let Some(ColumnValues::TokenIds(rows)) = self.data.column(name) else {
            return Err(TrainError::Data(format!("dock column `{name}`: expected token ids")));
        };
        self.sorted(name, rows)?
            .into_iter()
            .map(|row| {
                row.into_iter()
                    .map(|id| {
                        u32::try_from(id).map_err(|_| {
                            TrainError::Data(format!(
                                "dock column `{name}`: expected token ids in 0..2^32, found {id}"
                            ))
                        })
                    })
                    .collect()
            })
            .collect()
    }

    fn floats(&self, name: &str) -> Result<Vec<Vec<f32>>> {
        let Some(ColumnValues::Floats(rows)) = self.data.column(name) else {
            return Err(TrainError::Data(format!("dock column `{name}`: expected float rows")));
        };
        self.sorted(name, rows)
    }

    fn scalars(&self, name: &str) -> Result<Vec<f32>> {
        let Some(ColumnValues::Scalars(values)) = self.data.column(name) else {
            return Err(TrainError::Data(format!("dock column `{name}`: expected scalars")));
        };
        self.sorted(name, values)
    }

    fn sequences(&self) -> Result<Vec<Sequence>> {
        let prompts = self.token_ids(PROMPTS)?;
        let responses = self.token_ids(RESPONSES)?;
        Ok(prompts
            .into_iter()
            .zip(responses)
            .map(|(prompt_ids, response_ids)| Sequence::new(prompt_ids, response_ids))
            .collect())
    }

    /// Values given in sorted order, put back into the dock's order.
    fn unsort<T: Clone + Default>(&self, values: Vec<T>) -> Vec<T> {
        let mut out = vec![T::default(); values.len()];
        for (&slot, value) in self.order.iter().zip(values) {
            if let Some(place) = out.get_mut(slot) {
                *place = value;
            }
        }
        out
    }

    fn floats_out(&self, name: &str, values: Vec<Vec<f32>>) -> PackedNamedColumn {
        PackedNamedColumn::new(name, &ColumnValues::Floats(self.unsort(values)))
    }
}

/// A stage's work on one batch.
type Work<'a> = Box<dyn FnMut(&PackedBatch) -> Result<Vec<PackedNamedColumn>> + Send + 'a>;

fn work_error(e: TrainError) -> StageWorkError {
    e.to_string().into()
}

/// Runs one step in dock mode.
pub fn run_step(
    trainer: &Trainer,
    records: &[PromptRecord],
    prompt_ids: &[Vec<u32>],
    params: &SamplingParams,
    seed_base: u64,
    step: u64,
    kl_coef: f64,
) -> Result<DockStep> {
    let dock = run_dock(trainer)?;
    if trainer.roles.placements.hybrid() {
        return Err(TrainError::config(
            "train.pipeline",
            "expected separate engines for `dock` (stages generate and compute log-probs at the same time), found a hybrid engine placement",
        ));
    }
    let n = trainer.config.rollout.n_samples_per_prompt;
    let total = records.len() * n;
    let dock_error = |e: DockCallError| TrainError::role("dock", e);
    dock.clear(None).map_err(dock_error)?;
    let prompts: Vec<Vec<i64>> = prompt_ids
        .iter()
        .flat_map(|ids| std::iter::repeat_n(ids.iter().map(|&t| i64::from(t)).collect(), n))
        .collect();
    dock.put_experience(PackedBatch {
        rows: (0..total).collect(),
        columns: vec![PackedNamedColumn::new(PROMPTS, &ColumnValues::TokenIds(prompts))],
    })
    .map_err(dock_error)?;

    let (has_ref, poll) = (has_reference(trainer), poll_config(trainer));
    let failed = AtomicBool::new(false);
    let store = StepDock { dock, failed: &failed, done: None };
    let ctx = StepContext {
        trainer,
        records: Records::Step(records),
        n,
        has_ref,
        step,
        kl_coef,
        stats_parts: Mutex::new(Vec::new()),
        trained: Mutex::new(None),
    };
    let stages = stage_list(&ctx, params, seed_base, poll);
    let (_, results) = run_concurrently(&store, stages, || Ok(()));
    let timelines = timelines_or_error(results, Ok(()))?;
    check_every_row_once(&timelines, total)?;
    let StepContext { trained, stats_parts, .. } = ctx;
    let (train, rows) = trained
        .into_inner()
        .ok()
        .flatten()
        .ok_or_else(|| TrainError::role("pipeline", "the training stage never ran"))?;
    let parts = stats_parts.into_inner().unwrap_or_default();
    Ok(DockStep { stats: combine_stats(&parts), rows, train, timelines })
}

/// The run's dock actor.
fn run_dock(trainer: &Trainer) -> Result<&RemoteDock> {
    let missing = "train.pipeline is `dock` but no dock actor was created";
    trainer.roles.dock.as_ref().ok_or_else(|| TrainError::role("dock", missing))
}

/// Whether the run's loss or reward needs the reference's log-probs and some role gives them.
fn has_reference(trainer: &Trainer) -> bool {
    let roles = &trainer.roles;
    trainer.config.algo.needs_reference()
        && (roles.reference.is_some() || roles.reference_from_policy)
}

/// How the stages poll the dock: `train.dock_max_poll_pause_ms` at most between two gets.
fn poll_config(trainer: &Trainer) -> PollConfig {
    let pause = trainer.config.train.dock_max_poll_pause_ms;
    PollConfig { max_backoff: std::time::Duration::from_millis(pause), ..PollConfig::default() }
}

/// What a step of `rollout.mode: async` on the dock produced.
pub struct AsyncDockStep {
    /// The experience trained on, prompt group by group.
    pub batch: stages::ExperienceBatch,
    /// Each row's prompt.
    pub records: Vec<PromptRecord>,
    /// What training did.
    pub train: TrainStats,
    /// How old the samples were.
    pub versions: VersionStats,
    /// The rollout thread's polls, the stages' ranks, make-experience and training.
    pub timelines: Vec<StageTimeline>,
}

/// One step of `rollout.mode: async` with `train.pipeline: dock` over the groups in `slots`.
///
/// The rollout thread keeps writing finished groups into the dock ([`super::stream`]); during
/// the step the `reward` and `ref_log_prob` stages score whatever groups have arrived, those of
/// this step and of the next ones, while this thread waits for its own groups to be scored,
/// then recomputes their old log-probs with the policy it is about to update (the groups may
/// be a version older), computes the advantages and trains. Its slots are then cleared and
/// freed for the rollout. The rollout thread's polls since the last step join the timelines,
/// so the chart shows generation beside the stages and training.
pub fn run_async_step(
    trainer: &Trainer,
    rollout: &AsyncRollout,
    slots: &[usize],
    step: u64,
    kl_coef: f64,
) -> Result<AsyncDockStep> {
    let dock = run_dock(trainer)?;
    let n = trainer.config.rollout.n_samples_per_prompt;
    let (has_ref, poll) = (has_reference(trainer), poll_config(trainer));
    let (failed, done) = (AtomicBool::new(false), AtomicBool::new(false));
    let store = StepDock { dock, failed: &failed, done: Some(&done) };
    let ctx = StepContext {
        trainer,
        records: Records::Slots(rollout),
        n,
        has_ref,
        step,
        kl_coef,
        stats_parts: Mutex::new(Vec::new()),
        trained: Mutex::new(None),
    };
    let batch_rows = trainer.config.train.dock_groups_per_batch * n;
    let spec = |name: &str, output: &str| {
        StageSpec::new(name, &[PROMPTS, RESPONSES], &[output], batch_rows).with_poll(poll)
    };
    let shared = &ctx;
    let mut stages: Vec<(StageSpec, Work<'_>)> =
        vec![(spec("reward", RM_SCORES), Box::new(|b: &PackedBatch| shared.reward(b)))];
    if has_ref {
        let work = move |b: &PackedBatch| log_probs(trainer, LogProbs::Reference, REF_LOG_PROB, b);
        stages.push((spec("ref_log_prob", REF_LOG_PROB), Box::new(work)));
    }
    let rows: Vec<usize> = slots.iter().flat_map(|slot| slot * n..(slot + 1) * n).collect();
    let mut columns = vec![PROMPTS, RESPONSES, ENGINE_LOG_PROBS, VERSIONS, RM_SCORES];
    if has_ref {
        columns.push(REF_LOG_PROB);
    }
    let columns: Vec<String> = columns.into_iter().map(str::to_owned).collect();
    let dock_error = |e: DockCallError| TrainError::role("dock", e);

    let (out, results) = run_concurrently(&store, stages, || {
        let batch = wait_for_rows(&store, &columns, &rows, poll)?;
        let input = SortedBatch::new(&batch)?;
        let records = ctx.records_of(&input.rows)?;
        let (prompts, responses) = (input.token_ids(PROMPTS)?, input.token_ids(RESPONSES)?);
        let (engine, versions) = (input.floats(ENGINE_LOG_PROBS)?, input.token_ids(VERSIONS)?);
        let mut groups: Vec<StreamedGroup> = Vec::new();
        for (i, record) in records.into_iter().enumerate() {
            if i % n == 0 {
                groups.push(StreamedGroup {
                    record,
                    prompt_ids: prompts.get(i).cloned().unwrap_or_default(),
                    responses: Vec::new(),
                    engine_log_probs: Vec::new(),
                    versions: Vec::new(),
                });
            }
            if let Some(group) = groups.last_mut() {
                group.responses.push(responses.get(i).cloned().unwrap_or_default());
                group.engine_log_probs.push(engine.get(i).cloned().unwrap_or_default());
                let tags = versions.get(i).map(Vec::as_slice).unwrap_or_default();
                group.versions.push(tags.iter().map(|&v| u64::from(v)).collect());
            }
        }
        let (samples, versions) = stream::into_rollout(groups, step - 1);
        let known = Known {
            rewards: Some(input.scalars(RM_SCORES)?),
            ref_log_probs: if has_ref { Some(input.floats(REF_LOG_PROB)?) } else { None },
        };
        let started_us = now_us();
        let record_refs: Vec<&PromptRecord> = samples.records.iter().collect();
        let settings = ExperienceSettings { kl_coef, recompute_old: true };
        let batch = stages::make_experience(
            trainer,
            &record_refs,
            samples.sequences,
            &samples.engine_log_probs,
            settings,
            known,
        )?;
        let experienced_us = now_us();
        let train = stages::train(trainer, &batch.rows, step, kl_coef)?;
        let trained_us = now_us();
        dock.clear(Some(rows.clone())).map_err(dock_error)?;
        rollout.free_slots(slots);
        let spans = [(started_us, experienced_us), (experienced_us, trained_us)];
        Ok((batch, samples.records, train, versions, spans))
    });
    let (result, main) = match out {
        Ok(done) => (Some(done), Ok(())),
        Err(e) => (None, Err(e)),
    };
    let mut timelines = timelines_or_error(results, main)?;
    let (batch, records, train, versions, spans) =
        result.ok_or_else(|| TrainError::role("pipeline", "the async step never trained"))?;
    let [experience, training] = spans;
    let span = |(started_us, finished_us): (u64, u64), rows: &[usize]| StageSpan {
        rows: rows.to_vec(),
        requested_us: started_us,
        started_us,
        finished_us,
    };
    let timeline = |consumer: &str, spans: Vec<StageSpan>| StageTimeline {
        consumer: consumer.to_owned(),
        rank: 0,
        started_us: spans.first().map_or(0, |s| s.started_us),
        finished_us: spans.last().map_or(0, |s| s.finished_us),
        spans,
        empty_polls: 0,
    };
    let polls = rollout.take_polls().into_iter().map(|p| span(p, &[])).collect();
    timelines.insert(0, timeline("rollout", polls));
    timelines.push(timeline("old_log_prob", vec![span(experience, &rows)]));
    timelines.push(timeline("actor_train", vec![span(training, &rows)]));
    Ok(AsyncDockStep { batch, records, train, versions, timelines })
}

impl Trainer {
    /// A step of `rollout.mode: async` with `train.pipeline: dock`: the step's groups are
    /// slots of the dock, scored there by its stages while they waited
    /// ([`run_async_step`]).
    pub(super) fn docked_async_step(
        &mut self,
        step: u64,
        params: SamplingParams,
        kl_coef: f64,
        progress: &mut dyn ProgressObserver,
    ) -> Result<(stages::ExperienceStats, usize, stages::TrainStats)> {
        progress.phase("generate");
        let taken = self.take_async(step, params)?;
        let dock = run_dock(self)?;
        if !taken.dropped_slots.is_empty() {
            // No stage runs between two steps: the dropped groups' rows are nobody's.
            let n = self.config.rollout.n_samples_per_prompt;
            let rows = taken.dropped_slots.iter().flat_map(|s| s * n..(s + 1) * n).collect();
            dock.clear(Some(rows)).map_err(|e| TrainError::role("dock", e))?;
            if let Some(rollouter) = &self.rollouter {
                rollouter.free_slots(&taken.dropped_slots);
            }
        }
        let slots = taken
            .groups
            .iter()
            .map(|finished| match finished {
                Finished::Docked { slot, .. } => Ok(*slot),
                Finished::Group(_) => Err(TrainError::role(
                    "pipeline",
                    "a step on the dock was handed a group outside it",
                )),
            })
            .collect::<Result<Vec<usize>>>()?;
        progress.phase("pipeline");
        let out = self.timed("pipeline", |t| match &t.rollouter {
            Some(rollouter) => run_async_step(t, rollouter, &slots, step, kl_coef),
            None => Err(TrainError::Data("the rollout thread is gone".into())),
        });
        let mut out = match out {
            Ok(out) => out,
            Err(e) => {
                // The rollout thread's own failure (a dead engine) names the cause.
                if let Some(rollouter) = self.rollouter.take() {
                    rollouter.stop()?;
                }
                return Err(e);
            }
        };
        self.stop_async_if_last(step)?;
        self.pipeline_timelines = std::mem::take(&mut out.timelines);
        self.push_metrics(out.versions.metrics());
        self.gap_measured = true;
        if let Some(moments) = out.batch.reward_moments.take() {
            self.state.reward_moments = moments;
        }
        self.log_samples(step, &out.records, &out.batch, progress)?;
        self.record_gpu_memory("train")?;
        Ok((out.batch.stats, out.batch.rows.len(), out.train))
    }
}

/// Waits until `rows` are ready in `columns` and takes them as the training stage, or fails
/// once a stage has failed or nothing arrived within the stall timeout.
fn wait_for_rows(
    store: &StepDock<'_>,
    columns: &[String],
    rows: &[usize],
    poll: PollConfig,
) -> Result<PackedBatch> {
    let started = std::time::Instant::now();
    let mut backoff = poll.initial_backoff;
    loop {
        if store.failed.load(Ordering::SeqCst) {
            return Err(TrainError::role("pipeline", format!("`actor_train`: {STOPPED}")));
        }
        let batch = store
            .dock
            .get_experience("actor_train", columns, rows.len(), Some(rows.to_vec()))
            .map_err(|e| TrainError::role("dock", e))?;
        if let Some(batch) = batch {
            return Ok(batch);
        }
        if started.elapsed() > poll.stall_timeout {
            return Err(TrainError::role(
                "pipeline",
                format!(
                    "`actor_train` waited {:?} for its {} rows to be scored",
                    poll.stall_timeout,
                    rows.len()
                ),
            ));
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(poll.max_backoff);
    }
}

/// The step's stage ranks, each with what it reads and writes and the work it does: a rollout
/// rank per engine, then reward, reference and old log-probs, advantages and training.
fn stage_list<'a>(
    ctx: &'a StepContext<'a>,
    params: &'a SamplingParams,
    seed_base: u64,
    poll: PollConfig,
) -> Vec<(StageSpec, Work<'a>)> {
    let (trainer, n, has_ref) = (ctx.trainer, ctx.n, ctx.has_ref);
    let spec = |consumer: &str, inputs: &[&str], outputs: &[&str], rows: usize| {
        StageSpec::new(consumer, inputs, outputs, rows).with_poll(poll)
    };
    let batch_rows = trainer.config.train.dock_groups_per_batch * n;
    let total = ctx.records.groups() * n;
    let mut adv_inputs = vec![PROMPTS, RESPONSES, ENGINE_LOG_PROBS, RM_SCORES, OLD_LOG_PROB];
    let mut train_inputs = vec![PROMPTS, RESPONSES, OLD_LOG_PROB, ADVANTAGES, RETURNS];
    if has_ref {
        adv_inputs.push(REF_LOG_PROB);
        train_inputs.push(REF_LOG_PROB);
    }

    let shared = ctx;
    let mut stages: Vec<(StageSpec, Work<'_>)> = Vec::new();
    for (rank, engine) in trainer.roles.engines.iter().enumerate() {
        let spec =
            spec("rollout", &[PROMPTS], &[RESPONSES, ENGINE_LOG_PROBS], batch_rows).with_rank(rank);
        let work = move |batch: &PackedBatch| {
            rollout(trainer, (rank, engine), batch, params, seed_base, n)
        };
        stages.push((spec, Box::new(work)));
    }
    let spec_of = |name, outputs: &[&str]| spec(name, &[PROMPTS, RESPONSES], outputs, batch_rows);
    stages.push((spec_of("reward", &[RM_SCORES]), Box::new(|b: &PackedBatch| shared.reward(b))));
    if has_ref {
        let work = move |b: &PackedBatch| log_probs(trainer, LogProbs::Reference, REF_LOG_PROB, b);
        stages.push((spec_of("ref_log_prob", &[REF_LOG_PROB]), Box::new(work)));
    }
    let work = move |b: &PackedBatch| log_probs(trainer, LogProbs::Old, OLD_LOG_PROB, b);
    stages.push((spec_of("old_log_prob", &[OLD_LOG_PROB]), Box::new(work)));
    let adv_spec = spec("compute_advantage", &adv_inputs, &[ADVANTAGES, RETURNS], batch_rows);
    stages.push((adv_spec, Box::new(|b: &PackedBatch| shared.advantages(b))));
    let train_spec = spec("actor_train", &train_inputs, &[], total);
    stages.push((train_spec, Box::new(|b: &PackedBatch| shared.train(b))));

    stages
}

/// What the stages of one step share: the trainer, the step's prompts and where the
/// advantage and training stages leave their aggregates for the step's metrics.
struct StepContext<'a> {
    trainer: &'a Trainer,
    records: Records<'a>,
    n: usize,
    has_ref: bool,
    step: u64,
    kl_coef: f64,
    stats_parts: Mutex<Vec<(ExperienceStats, usize, usize)>>,
    trained: Mutex<Option<(TrainStats, usize)>>,
}

/// Where a dock row's prompt is: the step's prompts (group `row / n`), or the async rollout's
/// slot table.
enum Records<'a> {
    Step(&'a [PromptRecord]),
    Slots(&'a AsyncRollout),
}

impl Records<'_> {
    /// The step's prompt groups (0 for slots, which outlive a step).
    fn groups(&self) -> usize {
        match self {
            Records::Step(records) => records.len(),
            Records::Slots(_) => 0,
        }
    }
}

impl StepContext<'_> {
    fn records_of(&self, rows: &[usize]) -> Result<Vec<PromptRecord>> {
        rows.iter()
            .map(|&row| {
                let group = row / self.n;
                let record = match &self.records {
                    Records::Step(records) => records.get(group).cloned(),
                    Records::Slots(rollout) => rollout.slot_record(group),
                };
                record.ok_or_else(|| match &self.records {
                    Records::Step(records) => TrainError::Data(format!(
                        "dock row {row} is beyond the step's {} rows",
                        records.len() * self.n
                    )),
                    Records::Slots(_) => {
                        TrainError::Data(format!("dock row {row}: its slot {group} holds no group"))
                    }
                })
            })
            .collect()
    }

    /// `reward`: the run's reward of each sample.
    fn reward(&self, batch: &PackedBatch) -> Result<Vec<PackedNamedColumn>> {
        let input = SortedBatch::new(batch)?;
        let sequences = input.sequences()?;
        let records = self.records_of(&input.rows)?;
        let records: Vec<&PromptRecord> = records.iter().collect();
        let scores =
            stages::rewards(self.trainer, &records, &sequences)?.get(&self.trainer.watch)?;
        self.trainer.log_reward_extras(&scores);
        let scores = ColumnValues::Scalars(input.unsort(scores.rewards));
        Ok(vec![PackedNamedColumn::new(RM_SCORES, &scores)])
    }

    /// `compute_advantage`: the sequential mode's `assemble` over the batch's whole groups.
    fn advantages(&self, batch: &PackedBatch) -> Result<Vec<PackedNamedColumn>> {
        let input = SortedBatch::new(batch)?;
        let sequences = input.sequences()?;
        let tokens = sequences.iter().map(|s| s.response_ids.len()).sum();
        let results = RoleResults {
            scalar_rewards: input.scalars(RM_SCORES)?,
            old_log_probs: input.floats(OLD_LOG_PROB)?,
            ref_log_probs: if self.has_ref { Some(input.floats(REF_LOG_PROB)?) } else { None },
            values: None,
        };
        let built = stages::assemble(
            self.trainer,
            sequences,
            &input.floats(ENGINE_LOG_PROBS)?,
            results,
            self.kl_coef,
        )?;
        let count = built.rows.len();
        self.stats_parts
            .lock()
            .map_err(|_| TrainError::Data("a stage thread panicked".to_owned()))?
            .push((built.stats, count, tokens));
        let (advantages, returns) =
            built.rows.into_iter().map(|r| (r.advantages, r.returns)).unzip();
        Ok(vec![input.floats_out(ADVANTAGES, advantages), input.floats_out(RETURNS, returns)])
    }

    /// `actor_train`: the sequential mode's training over every row of the step.
    fn train(&self, batch: &PackedBatch) -> Result<Vec<PackedNamedColumn>> {
        let input = SortedBatch::new(batch)?;
        let old = input.floats(OLD_LOG_PROB)?;
        let reference = if self.has_ref { Some(input.floats(REF_LOG_PROB)?) } else { None };
        let advantages = input.floats(ADVANTAGES)?;
        let returns = input.floats(RETURNS)?;
        let rows: Vec<ExperienceRow> = input
            .sequences()?
            .into_iter()
            .enumerate()
            .map(|(i, sequence)| ExperienceRow {
                sequence,
                old_log_probs: old.get(i).cloned().unwrap_or_default(),
                ref_log_probs: reference
                    .as_ref()
                    .and_then(|r| r.get(i).cloned())
                    .unwrap_or_default(),
                values: Vec::new(),
                advantages: advantages.get(i).cloned().unwrap_or_default(),
                returns: returns.get(i).cloned().unwrap_or_default(),
                is_weights: Vec::new(),
            })
            .collect();
        let stats = stages::train(self.trainer, &rows, self.step, self.kl_coef)?;
        *self
            .trained
            .lock()
            .map_err(|_| TrainError::Data("a stage thread panicked".to_owned()))? =
            Some((stats, rows.len()));
        Ok(Vec::new())
    }
}

/// `ref_log_prob` / `old_log_prob`: per-token log-probs from the ranks that answer `which`.
fn log_probs(
    trainer: &Trainer,
    which: LogProbs,
    column: &str,
    batch: &PackedBatch,
) -> Result<Vec<PackedNamedColumn>> {
    let input = SortedBatch::new(batch)?;
    let calls = stages::start_log_probs(trainer, which, input.sequences()?).ok_or_else(|| {
        TrainError::role("pipeline", format!("`{column}` is a stage but the run has no reference"))
    })?;
    Ok(vec![input.floats_out(column, trainer.watch.gather("log_probs", calls)?)])
}

/// Runs every stage rank on its own thread, and `main` on this one, until all return; a
/// failing one flips the stop switch so the others end too. Once `main` returns, an async
/// step's stages are done (they finish the batch they hold).
fn run_concurrently<T>(
    store: &StepDock<'_>,
    stages: Vec<(StageSpec, Work<'_>)>,
    main: impl FnOnce() -> Result<T>,
) -> (Result<T>, Vec<std::result::Result<StageTimeline, String>>) {
    std::thread::scope(|scope| {
        let handles: Vec<_> = stages
            .into_iter()
            .map(|(spec, mut work)| {
                scope.spawn(move || {
                    let out = run_stage(store, &spec, |batch| work(batch).map_err(work_error))
                        .map_err(|e| e.to_string());
                    if out.is_err() {
                        store.failed.store(true, Ordering::SeqCst);
                    }
                    out
                })
            })
            .collect();
        let out = main();
        if out.is_err() {
            store.failed.store(true, Ordering::SeqCst);
        }
        if let Some(done) = store.done {
            done.store(true, Ordering::SeqCst);
        }
        let results = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a stage thread panicked".to_owned())))
            .collect();
        (out, results)
    })
}

/// The stages' timelines, or the step's error (`main`'s among the stages').
fn timelines_or_error(
    results: Vec<std::result::Result<StageTimeline, String>>,
    main: Result<()>,
) -> Result<Vec<StageTimeline>> {
    let mut timelines = Vec::new();
    let mut errors = Vec::new();
    if let Err(e) = main {
        errors.push(e.to_string());
    }
    for result in results {
        match result {
            Ok(timeline) => timelines.push(timeline),
            Err(e) => errors.push(e),
        }
    }
    match errors.is_empty() {
        true => Ok(timelines),
        false => Err(root_error(errors)),
    }
}

/// The step's error: the stages that failed first, not the ones they stopped.
fn root_error(errors: Vec<String>) -> TrainError {
    let (stopped, mut roots): (Vec<String>, Vec<String>) =
        errors.into_iter().partition(|e| e.contains(STOPPED));
    if roots.is_empty() {
        roots = stopped.clone();
    }
    let mut message = roots.join("; ");
    if !stopped.is_empty() {
        message.push_str(&format!(" ({} other stage ranks stopped)", stopped.len()));
    }
    TrainError::role("pipeline", message)
}

/// Generates a batch's prompt groups on one engine: one request of `n` samples per prompt,
/// seeded by the prompt's index in the step as the sequential mode seeds it.
fn rollout(
    trainer: &Trainer,
    (rank, engine): (usize, &EngineActorRef),
    batch: &PackedBatch,
    params: &SamplingParams,
    seed_base: u64,
    n: usize,
) -> Result<Vec<PackedNamedColumn>> {
    let input = SortedBatch::new(batch)?;
    let prompts = input.token_ids(PROMPTS)?;
    let mut groups: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
    for (row, ids) in input.rows.iter().zip(prompts) {
        groups.entry(row / n).or_insert(ids);
    }
    let indexed = groups.iter().map(|(&prompt, ids)| (prompt, ids.as_slice()));
    let requests = stages::generation_requests(indexed, params, seed_base);
    let call = calls::actor_call("vllm_engine", rank, engine, engine.generate(requests));
    let outputs = trainer.watch.gather("generate", vec![call])?;
    let outputs = stages::check_outputs(outputs, groups.len(), n)?;
    let by_prompt: BTreeMap<usize, _> = groups.keys().copied().zip(&outputs).collect();
    let mut responses = Vec::with_capacity(input.rows.len());
    let mut log_probs = Vec::with_capacity(input.rows.len());
    for row in &input.rows {
        let sample =
            by_prompt.get(&(row / n)).and_then(|o| o.samples.get(row % n)).ok_or_else(|| {
                TrainError::role(
                    "vllm_engine",
                    format!("no sample {} of prompt {}", row % n, row / n),
                )
            })?;
        responses.push(sample.token_ids.iter().map(|&t| i64::from(t)).collect());
        log_probs.push(sample.log_probs.clone());
    }
    Ok(vec![
        PackedNamedColumn::new(RESPONSES, &ColumnValues::TokenIds(input.unsort(responses))),
        input.floats_out(ENGINE_LOG_PROBS, log_probs),
    ])
}

/// Every stage's ranks together received each of the step's rows exactly once.
fn check_every_row_once(timelines: &[StageTimeline], total: usize) -> Result<()> {
    for stage in STAGES {
        let mut seen = vec![0usize; total];
        let mut ran = false;
        for timeline in timelines.iter().filter(|t| t.consumer == stage) {
            ran = true;
            for &row in timeline.spans.iter().flat_map(|s| &s.rows) {
                match seen.get_mut(row) {
                    Some(count) => *count += 1,
                    None => {
                        return Err(TrainError::role(
                            "pipeline",
                            format!("stage `{stage}` received row {row} of a {total}-row step"),
                        ));
                    }
                }
            }
        }
        if let Some((row, count)) = seen.iter().enumerate().find(|(_, c)| ran && **c != 1) {
            return Err(TrainError::role(
                "pipeline",
                format!("stage `{stage}` received row {row} {count} times, expected once"),
            ));
        }
    }
    Ok(())
}

/// The aggregates of the whole step from those of its groups: each mean weighted by what it
/// averages over (samples or response tokens), as `assemble` computes them over one batch.
fn combine_stats(parts: &[(ExperienceStats, usize, usize)]) -> ExperienceStats {
    let count = parts.iter().map(|p| p.1).sum::<usize>().max(1) as f64;
    let tokens = parts.iter().map(|p| p.2).sum::<usize>().max(1) as f64;
    let per_sample = |f: fn(&ExperienceStats) -> f64| {
        parts.iter().map(|(s, c, _)| f(s) * *c as f64).sum::<f64>() / count
    };
    let per_token = |f: fn(&ExperienceStats) -> f64| {
        parts.iter().map(|(s, _, t)| f(s) * (*t).max(1) as f64).sum::<f64>() / tokens
    };
    ExperienceStats {
        reward: per_sample(|s| s.reward),
        accuracy: per_sample(|s| s.accuracy),
        response_length: per_sample(|s| s.response_length),
        total_length: per_sample(|s| s.total_length),
        token_return: per_sample(|s| s.token_return),
        kl: per_token(|s| s.kl),
        advantage_abs: per_token(|s| s.advantage_abs),
        engine_logprob_gap: per_token(|s| s.engine_logprob_gap),
        overlong_penalty: per_sample(|s| s.overlong_penalty),
    }
}

/// The step's stage timelines as metrics (`pipeline/makespan_s`, `pipeline/concurrency`, and
/// per stage `pipeline/<stage>/{start_s,end_s,busy_s,rows}`) and a chart in the log.
pub fn record_summary(
    step: u64,
    timelines: &[StageTimeline],
    metrics: &mut StepMetrics,
) -> Result<()> {
    let summary = PipelineSummary::new(timelines);
    let s = |us: u64| us as f64 / 1e6;
    metrics.set("pipeline/makespan_s", s(summary.makespan_us)).map_err(telemetry_error)?;
    metrics.set("pipeline/busy_s", s(summary.busy_us)).map_err(telemetry_error)?;
    metrics.set("pipeline/concurrency", summary.concurrency()).map_err(telemetry_error)?;
    for stage in &summary.stages {
        let name = &stage.consumer;
        for (key, value) in [
            ("start_s", s(stage.first_start_us)),
            ("end_s", s(stage.last_end_us)),
            ("busy_s", s(stage.busy_us)),
            ("rows", stage.rows as f64),
        ] {
            metrics.set(format!("pipeline/{name}/{key}"), value).map_err(telemetry_error)?;
        }
    }
    tracing::info!(
        step,
        concurrency = summary.concurrency(),
        "dock pipeline stages:\n{}",
        summary.chart(60)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeline(consumer: &str, batches: &[&[usize]]) -> StageTimeline {
        StageTimeline {
            consumer: consumer.to_owned(),
            rank: 0,
            started_us: 0,
            finished_us: 0,
            spans: batches
                .iter()
                .map(|rows| StageSpan {
                    rows: rows.to_vec(),
                    requested_us: 0,
                    started_us: 0,
                    finished_us: 0,
                })
                .collect(),
            empty_polls: 0,
        }
    }

    #[test]
    fn every_row_once_per_stage_is_checked() {
        let all: Vec<StageTimeline> =
            STAGES.iter().map(|s| timeline(s, &[&[0, 1], &[2, 3]])).collect();
        check_every_row_once(&all, 4).unwrap();
        let mut twice = all.clone();
        twice.push(timeline("reward", &[&[2, 3]]));
        let error = check_every_row_once(&twice, 4).unwrap_err().to_string();
        assert!(error.contains("stage `reward` received row 2 2 times"), "{error}");
        let mut missing = all.clone();
        missing[0] = timeline("rollout", &[&[0, 1]]);
        let error = check_every_row_once(&missing, 4).unwrap_err().to_string();
        assert!(error.contains("stage `rollout` received row 2 0 times"), "{error}");
        let mut beyond = all;
        beyond[1] = timeline("reward", &[&[0, 1], &[2, 9]]);
        let error = check_every_row_once(&beyond, 4).unwrap_err().to_string();
        assert!(error.contains("row 9 of a 4-row step"), "{error}");
    }

    #[test]
    fn combined_stats_weigh_samples_and_tokens() {
        let part = |value: f64| ExperienceStats {
            reward: value,
            accuracy: value,
            kl: value,
            response_length: value,
            total_length: value,
            token_return: value,
            advantage_abs: value,
            engine_logprob_gap: value,
            overlong_penalty: value,
        };
        // 2 samples with 6 tokens at 1.0, 6 samples with 2 tokens at 3.0.
        let combined = combine_stats(&[(part(1.0), 2, 6), (part(3.0), 6, 2)]);
        assert!((combined.reward - 2.5).abs() < 1e-12);
        assert!((combined.response_length - 2.5).abs() < 1e-12);
        assert!((combined.total_length - 2.5).abs() < 1e-12);
        assert!((combined.kl - 1.5).abs() < 1e-12);
        assert!((combined.engine_logprob_gap - 1.5).abs() < 1e-12);
        assert!((combined.overlong_penalty - 2.5).abs() < 1e-12);
        assert_eq!(combine_stats(&[]), ExperienceStats::default());
    }

    #[test]
    fn root_error_names_the_failing_stage_first() {
        let error = root_error(vec![
            format!("stage `reward` rank 0: {STOPPED}"),
            "stage `ref_log_prob` rank 0 failed on rows 0..: boom".to_owned(),
        ])
        .to_string();
        assert!(
            error.contains("`ref_log_prob` rank 0 failed on rows 0..: boom (1 other"),
            "{error}"
        );
    }
}
