//! Streamed rollouts: prompt groups that span weight versions.
//!
//! [`RolloutStream`] drives the engines through their streaming calls
//! ([`stream_add`](rtrun_rlhf_engine::EngineActor::stream_add) and
//! [`stream_step`](rtrun_rlhf_engine::EngineActor::stream_step)): groups are queued on the
//! engine with the fewest in flight, and each poll runs every busy engine for a few steps and
//! returns the groups that finished. Groups still running stay in their engine across polls,
//! so weights sent between two polls apply to their remaining tokens; every token carries the
//! version that sampled it.
//!
//! Two uses:
//! - `rollout.partial_threshold` (sync mode): the step polls until that share of its groups has
//!   finished and trains on those; the rest carry on into the next step
//!   ([`Trainer::partial_rollout`](super::Trainer)).
//! - `rollout.mode: async`: [`AsyncRollout`] runs a stream on its own thread while the trainer
//!   takes finished groups whose oldest token is at most `max_staleness` versions behind the
//!   policy it trains. The thread queues a group only while the groups queued so far number
//!   fewer than `(version + max_staleness + 1) × prompts_per_step` (AReaL's rule; `version` is
//!   the engines' weight version, dropped groups not counted): taken in order, group `g` trains
//!   the policy of version `g / prompts_per_step`, at most `max_staleness` after the version
//!   that was current when it was queued, so no compute goes to samples that would be too
//!   stale, and the engines never run more than `max_staleness` steps ahead. The weight sync
//!   holds [`AsyncRollout::gate`], which the rollout thread holds around each poll, so an
//!   engine takes new weights between two of its steps and never samples from half-updated
//!   weights.
//!
//! With `train.pipeline: dock` the async thread writes each finished group into the run's
//! TransferDock instead ([`DockSink`]): one slot of `n` rows per group, with its prompt,
//! responses, the engine's log-probs and every token's version. The dock has
//! `(max_staleness + 1) × prompts_per_step` slots, as many finished groups as the rule above
//! lets exist at once (groups the trainer holds included); a slot is freed once its group is
//! trained on or dropped. The queue then holds the slots ([`Finished::Docked`]), and the dock's
//! stages score the groups while they wait ([`super::pipeline::run_async_step`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rtrun_rlhf_dock::pipeline::now_us;
use rtrun_rlhf_dock::{ColumnValues, PackedBatch, PackedNamedColumn, RemoteDock};
use rtrun_rlhf_engine::{EngineActorRef, GenerationRequest, SamplingParams, StreamPoll};

use crate::error::{Result, TrainError};
use crate::experience::Sequence;
use crate::prompts::{PromptLoader, PromptRecord};
use crate::rng::mix_seed;
use crate::tokenizer::PromptTokenizer;
use crate::trainer::CallWatch;
use crate::trainer::calls;
use crate::trainer::dock_layout::{ENGINE_LOG_PROBS, PROMPTS, RESPONSES, VERSIONS};
use crate::trainer::rollout::Rollout;

/// Engine steps per poll: short enough that a weight sync waits little for the gate, long
/// enough that the call's round trip is small beside the steps.
pub const STEPS_PER_POLL: u32 = 8;

/// The engines' role name.
const ENGINE: &str = "vllm_engine";

/// A finished prompt group.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamedGroup {
    /// The prompt.
    pub record: PromptRecord,
    /// Its token ids.
    pub prompt_ids: Vec<u32>,
    /// `n` responses.
    pub responses: Vec<Vec<u32>>,
    /// The engine's log-prob of each response token.
    pub engine_log_probs: Vec<Vec<f32>>,
    /// The weight version that sampled each response token.
    pub versions: Vec<Vec<u64>>,
}

impl StreamedGroup {
    /// The oldest weight version of any of its tokens (`None` without tokens).
    pub fn oldest_version(&self) -> Option<u64> {
        self.versions.iter().flatten().copied().min()
    }

    /// The newest weight version of any of its tokens.
    pub fn newest_version(&self) -> Option<u64> {
        self.versions.iter().flatten().copied().max()
    }
}

/// A finished group waiting for the trainer.
#[derive(Debug)]
pub enum Finished {
    /// Its samples, in the driver's queue.
    Group(StreamedGroup),
    /// Written to the dock: its rows are `slot × n .. (slot + 1) × n`.
    Docked {
        /// The dock slot.
        slot: usize,
        /// The oldest weight version of its tokens.
        oldest: Option<u64>,
    },
}

impl Finished {
    fn oldest_version(&self) -> Option<u64> {
        match self {
            Finished::Group(group) => group.oldest_version(),
            Finished::Docked { oldest, .. } => *oldest,
        }
    }
}

/// Where `rollout.mode: async` with `train.pipeline: dock` leaves finished groups: the run's
/// dock, a slot of `samples` rows per group (see the module doc).
#[derive(Debug)]
pub struct DockSink {
    /// The run's dock.
    pub dock: RemoteDock,
    /// Rows per group (`n`).
    pub samples: usize,
    /// Groups the dock holds.
    pub slots: usize,
}

/// A group queued on an engine.
#[derive(Debug)]
struct Pending {
    record: PromptRecord,
    prompt_ids: Vec<u32>,
    engine: usize,
    /// The step that queued it.
    step: u64,
}

/// The engines as a stream of prompt groups (see the module doc).
#[derive(Debug)]
pub struct RolloutStream {
    engines: Vec<EngineActorRef>,
    watch: CallWatch,
    params: SamplingParams,
    pending: HashMap<u64, Pending>,
    per_engine: Vec<usize>,
    next_tag: u64,
}

impl RolloutStream {
    /// A stream over `engines` sampling with `params` (its `n` samples per group).
    pub fn new(engines: Vec<EngineActorRef>, watch: CallWatch, params: SamplingParams) -> Self {
        let per_engine = vec![0; engines.len()];
        Self { engines, watch, params, pending: HashMap::new(), per_engine, next_tag: 0 }
    }

    /// Groups queued or running.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The step that queued the oldest group in flight.
    pub fn oldest_step(&self) -> Option<u64> {
        self.pending.values().map(|p| p.step).min()
    }

    /// Queues `groups` (prompt, its ids, its sampling seed) for step `step`, each on the engine
    /// with the fewest groups in flight.
    pub fn submit(&mut self, groups: Vec<(PromptRecord, Vec<u32>, u64)>, step: u64) -> Result<()> {
        if self.engines.is_empty() {
            return Err(TrainError::role(ENGINE, "the rollout has no engine"));
        }
        let mut batches: Vec<Vec<(u64, GenerationRequest)>> = vec![Vec::new(); self.engines.len()];
        for (record, prompt_ids, seed) in groups {
            let engine =
                (0..self.per_engine.len()).min_by_key(|&e| self.per_engine[e]).unwrap_or(0);
            let tag = self.next_tag;
            self.next_tag += 1;
            let params = SamplingParams { seed: Some(seed), ..self.params.clone() };
            batches[engine].push((tag, GenerationRequest::new(prompt_ids.clone(), params)));
            self.per_engine[engine] += 1;
            self.pending.insert(tag, Pending { record, prompt_ids, engine, step });
        }
        let adds = calls::each_with(ENGINE, &self.engines, batches, |e, batch| e.stream_add(batch));
        self.watch.wait("stream_add", adds).map(drop)
    }

    /// Runs up to `steps` steps on every engine with groups in flight, at once, and returns
    /// the groups that finished.
    pub fn poll(&mut self, steps: u32) -> Result<Vec<StreamedGroup>> {
        let busy: Vec<usize> =
            (0..self.engines.len()).filter(|&e| self.per_engine[e] > 0).collect();
        let polls = busy
            .iter()
            .map(|&e| {
                let engine = &self.engines[e];
                calls::actor_call(ENGINE, e, engine, engine.stream_step(steps))
            })
            .collect();
        let answers: Vec<StreamPoll> = self.watch.wait("stream_step", polls)?;
        let mut finished = Vec::new();
        for (&engine, answer) in busy.iter().zip(answers) {
            for (tag, output) in answer.finished {
                let Some(pending) = self.pending.remove(&tag) else {
                    return Err(TrainError::role(
                        ENGINE,
                        format!("engine {engine} returned request {tag}, which it was not given"),
                    ));
                };
                self.per_engine[pending.engine] -= 1;
                if output.samples.len() != self.params.n as usize {
                    return Err(TrainError::role(
                        ENGINE,
                        format!(
                            "expected {} samples for a prompt, found {} from engine {engine}",
                            self.params.n,
                            output.samples.len()
                        ),
                    ));
                }
                let mut group = StreamedGroup {
                    record: pending.record,
                    prompt_ids: pending.prompt_ids,
                    responses: Vec::new(),
                    engine_log_probs: Vec::new(),
                    versions: Vec::new(),
                };
                for sample in output.samples {
                    group.responses.push(sample.token_ids);
                    group.engine_log_probs.push(sample.log_probs);
                    group.versions.push(sample.weight_versions);
                }
                finished.push(group);
            }
        }
        Ok(finished)
    }

    /// Drops every group in flight (the engines abort them).
    pub fn abort(&mut self) -> Result<()> {
        let aborts = calls::each(ENGINE, &self.engines, |e| e.stream_abort());
        self.pending.clear();
        self.per_engine.iter_mut().for_each(|n| *n = 0);
        self.watch.wait("stream_abort", aborts).map(drop)
    }
}

/// `count` prompts from `loader`, encoded, each with its sampling seed (from the run's seed and
/// the prompt's position in the loader, so a group's samples do not depend on timing).
pub fn draw_groups(
    loader: &mut PromptLoader,
    count: usize,
    data: &[PromptRecord],
    tokenizer: &dyn PromptTokenizer,
    seed: u64,
) -> Result<Vec<(PromptRecord, Vec<u32>, u64)>> {
    let first = loader.consumed as u64;
    loader
        .next_batch(count)
        .into_iter()
        .enumerate()
        .map(|(i, index)| {
            let record = data
                .get(index)
                .cloned()
                .ok_or_else(|| TrainError::Data(format!("prompt {index} is out of range")))?;
            let ids = tokenizer.encode_prompt(&record.prompt)?;
            Ok((record, ids, mix_seed(seed, 1 << 48 | (first + i as u64))))
        })
        .collect()
}

/// The groups as a step's rollout (prompt-major), and their version figures.
pub fn into_rollout(groups: Vec<StreamedGroup>, policy_version: u64) -> (Rollout, VersionStats) {
    let mut stats = VersionStats { groups: groups.len(), ..VersionStats::default() };
    let mut rollout = Rollout {
        records: Vec::new(),
        sequences: Vec::new(),
        engine_log_probs: Vec::new(),
        rewards: None,
    };
    let (mut staleness_sum, mut tokens) = (0u64, 0u64);
    for group in groups {
        if let Some(oldest) = group.oldest_version() {
            stats.oldest = Some(stats.oldest.map_or(oldest, |o: u64| o.min(oldest)));
            stats.max_staleness = stats.max_staleness.max(policy_version.saturating_sub(oldest));
        }
        if group.oldest_version() != group.newest_version() {
            stats.mixed_groups += 1;
        }
        for v in group.versions.iter().flatten() {
            staleness_sum += policy_version.saturating_sub(*v);
            tokens += 1;
        }
        for (response, log_probs) in group.responses.into_iter().zip(group.engine_log_probs) {
            rollout.records.push(group.record.clone());
            rollout.sequences.push(Sequence::new(group.prompt_ids.clone(), response));
            rollout.engine_log_probs.push(log_probs);
        }
    }
    stats.mean_token_staleness = staleness_sum as f64 / tokens.max(1) as f64;
    (rollout, stats)
}

/// How old a step's samples were.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct VersionStats {
    /// Prompt groups trained on.
    pub groups: usize,
    /// The oldest version of any token trained on.
    pub oldest: Option<u64>,
    /// The most versions any token lagged the policy trained.
    pub max_staleness: u64,
    /// The mean lag over tokens.
    pub mean_token_staleness: f64,
    /// Groups whose tokens came from more than one version.
    pub mixed_groups: usize,
}

impl VersionStats {
    /// The step's `rollout/…` metrics.
    pub fn metrics(&self) -> Vec<(String, f64)> {
        let mut out = vec![
            ("rollout/groups".to_owned(), self.groups as f64),
            ("rollout/max_staleness".to_owned(), self.max_staleness as f64),
            ("rollout/mean_token_staleness".to_owned(), self.mean_token_staleness),
            ("rollout/mixed_version_groups".to_owned(), self.mixed_groups as f64),
        ];
        if let Some(oldest) = self.oldest {
            out.push(("rollout/oldest_version".to_owned(), oldest as f64));
        }
        out
    }
}

/// What the rollout thread and the trainer share.
#[derive(Debug)]
struct Queue {
    ready: VecDeque<Finished>,
    /// Groups queued or running on the engines.
    in_flight: usize,
    /// The engines' weight version.
    version: u64,
    /// Groups queued since version 0 (as if the run had started at 0 when it resumed).
    submitted: u64,
    /// Groups dropped as too stale.
    dropped: u64,
    /// `prompts_per_step`.
    per_step: u64,
    /// `max_staleness`.
    staleness: u64,
    loader: PromptLoader,
    /// The rollout thread's failure, reported by the next take.
    error: Option<TrainError>,
    stop: bool,
    /// Seconds the rollout thread spent in polls since the trainer last asked.
    generate_s: f64,
    /// Groups that finished since the trainer last asked.
    finished: u64,
    /// The rollout thread's polls since the trainer last asked for them: (start, end), µs
    /// since the Unix epoch (the dock pipeline's timeline clock).
    polls: Vec<(u64, u64)>,
    /// With a dock: the free slots, and the prompt of each slot in use.
    free_slots: Vec<usize>,
    slot_records: Vec<Option<PromptRecord>>,
}

impl Queue {
    /// An empty queue at version 0 with `slots` free dock slots.
    fn new(loader: PromptLoader, per_step: usize, staleness: u64, slots: usize) -> Self {
        Self {
            ready: VecDeque::new(),
            in_flight: 0,
            version: 0,
            submitted: 0,
            dropped: 0,
            per_step: per_step as u64,
            staleness,
            loader,
            error: None,
            stop: false,
            generate_s: 0.0,
            finished: 0,
            polls: Vec::new(),
            // Lowest slot first.
            free_slots: (0..slots).rev().collect(),
            slot_records: vec![None; slots],
        }
    }

    /// Groups the thread may queue now (the module doc's rule).
    fn room(&self) -> usize {
        let allowed = (self.version + self.staleness + 1) * self.per_step + self.dropped;
        allowed.saturating_sub(self.submitted) as usize
    }
}

#[derive(Debug)]
struct Shared {
    queue: Mutex<Queue>,
    changed: Condvar,
    gate: Mutex<()>,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// `rollout.mode: async`: a thread that keeps the engines generating (see the module doc).
#[derive(Debug)]
pub struct AsyncRollout {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// What the rollout thread needs.
pub struct AsyncSetup {
    /// The engines' stream.
    pub stream: RolloutStream,
    /// Where prompts come from (its position moves as groups are queued).
    pub loader: PromptLoader,
    /// The training prompts.
    pub data: Arc<Vec<PromptRecord>>,
    /// The policy's tokenizer.
    pub tokenizer: Arc<dyn PromptTokenizer>,
    /// The run's seed.
    pub seed: u64,
    /// The engines' weight version at the start.
    pub version: u64,
    /// Groups per step.
    pub per_step: usize,
    /// `rollout.max_staleness`.
    pub staleness: u64,
    /// With `train.pipeline: dock`, the dock finished groups go to.
    pub dock: Option<DockSink>,
}

/// What the trainer takes for a step.
#[derive(Debug)]
pub struct AsyncBatch {
    /// The groups, in the order they finished.
    pub groups: Vec<Finished>,
    /// Groups dropped as too stale while taking them.
    pub stale_dropped: usize,
    /// The dock slots of the dropped groups: the caller clears their rows, then frees them
    /// ([`AsyncRollout::free_slots`]).
    pub dropped_slots: Vec<usize>,
    /// Seconds the rollout thread polled since the last take.
    pub generate_s: f64,
    /// Seconds the trainer waited for the groups.
    pub wait_s: f64,
}

impl AsyncRollout {
    /// Starts the rollout thread.
    pub fn start(setup: AsyncSetup) -> Result<Self> {
        let slots = setup.dock.as_ref().map_or(0, |d| d.slots);
        let queue = Queue::new(setup.loader.clone(), setup.per_step, setup.staleness, slots);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                version: setup.version,
                submitted: setup.version * setup.per_step as u64,
                ..queue
            }),
            changed: Condvar::new(),
            gate: Mutex::new(()),
        });
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("rtrun-rollout".into())
            .spawn(move || rollout_thread(&thread_shared, setup))
            .map_err(|e| TrainError::Data(format!("starting the rollout thread: {e}")))?;
        Ok(Self { shared, thread: Some(thread) })
    }

    /// The gate a weight sync holds so that no engine steps while its weights change.
    pub fn gate(&self) -> MutexGuard<'_, ()> {
        self.shared.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The engines now sample with weights of `version` (called under the gate, after the
    /// sync): the thread may queue the groups that version allows.
    pub fn set_version(&self, version: u64) {
        self.shared.queue().version = version;
        self.shared.changed.notify_all();
    }

    /// The loader's position: prompts queued so far (in-flight ones included).
    pub fn loader(&self) -> PromptLoader {
        self.shared.queue().loader.clone()
    }

    /// Waits for `count` finished groups whose oldest token is at least `oldest_allowed`,
    /// dropping older ones; fails with the rollout thread's error.
    pub fn take(&self, count: usize, oldest_allowed: u64) -> Result<AsyncBatch> {
        let started = Instant::now();
        let mut queue = self.shared.queue();
        let (mut stale_dropped, mut dropped_slots) = (0, Vec::new());
        loop {
            let before = queue.ready.len();
            let (kept, stale): (VecDeque<Finished>, VecDeque<Finished>) = queue
                .ready
                .drain(..)
                .partition(|g| g.oldest_version().is_none_or(|v| v >= oldest_allowed));
            queue.ready = kept;
            stale_dropped += stale.len();
            queue.dropped += stale.len() as u64;
            dropped_slots.extend(stale.iter().filter_map(|g| match g {
                Finished::Docked { slot, .. } => Some(*slot),
                Finished::Group(_) => None,
            }));
            if before != queue.ready.len() {
                self.shared.changed.notify_all();
            }
            if queue.ready.len() >= count {
                let groups: Vec<Finished> = queue.ready.drain(..count).collect();
                let generate_s = std::mem::take(&mut queue.generate_s);
                queue.finished = 0;
                self.shared.changed.notify_all();
                let wait_s = started.elapsed().as_secs_f64();
                return Ok(AsyncBatch { groups, stale_dropped, dropped_slots, generate_s, wait_s });
            }
            if let Some(error) = queue.error.take() {
                return Err(error);
            }
            if queue.stop {
                return Err(TrainError::Data("the rollout thread has stopped".into()));
            }
            queue = self
                .shared
                .changed
                .wait_timeout(queue, Duration::from_millis(200))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Gives dock slots back once their rows are cleared: the thread may write groups there.
    pub fn free_slots(&self, slots: &[usize]) {
        let mut queue = self.shared.queue();
        for &slot in slots {
            // A slot in use holds its group's prompt: freeing one twice frees it once.
            if queue.slot_records.get_mut(slot).and_then(Option::take).is_some() {
                queue.free_slots.push(slot);
            }
        }
        self.shared.changed.notify_all();
    }

    /// The rollout thread's polls since the last call: (start, end), µs since the Unix epoch.
    pub fn take_polls(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.shared.queue().polls)
    }

    /// The prompt of the group in dock slot `slot`.
    pub fn slot_record(&self, slot: usize) -> Option<PromptRecord> {
        self.shared.queue().slot_records.get(slot).cloned().flatten()
    }

    /// Stops the thread (the engines abort what is in flight) and returns the loader.
    pub fn stop(mut self) -> Result<PromptLoader> {
        self.halt();
        let mut queue = self.shared.queue();
        match queue.error.take() {
            Some(error) => Err(error),
            None => Ok(queue.loader.clone()),
        }
    }

    fn halt(&mut self) {
        self.shared.queue().stop = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the rollout thread panicked");
        }
    }
}

impl Drop for AsyncRollout {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The rollout thread: tops the engines up to capacity, polls them, queues what finished
/// (with a dock: writes it to a free slot first; groups wait in `backlog` for one).
fn rollout_thread(shared: &Shared, setup: AsyncSetup) {
    let AsyncSetup { mut stream, data, tokenizer, seed, dock, .. } = setup;
    let mut backlog: VecDeque<StreamedGroup> = VecDeque::new();
    let result = (|| -> Result<()> {
        loop {
            let groups = {
                let mut queue = shared.queue();
                loop {
                    if queue.stop {
                        return Ok(());
                    }
                    let can_dock = !backlog.is_empty() && !queue.free_slots.is_empty();
                    if queue.room() > 0 || queue.in_flight > 0 || can_dock {
                        break;
                    }
                    queue = shared
                        .changed
                        .wait(queue)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                let room = queue.room();
                let groups = draw_groups(&mut queue.loader, room, &data, tokenizer.as_ref(), seed)?;
                queue.in_flight += groups.len();
                queue.submitted += groups.len() as u64;
                groups
            };
            if !groups.is_empty() {
                let version = shared.queue().version;
                stream.submit(groups, version)?;
            }
            let mut finished = Vec::new();
            if stream.in_flight() > 0 {
                let started = Instant::now();
                let start_us = now_us();
                finished = {
                    let _gate =
                        shared.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    stream.poll(STEPS_PER_POLL)?
                };
                let mut queue = shared.queue();
                queue.generate_s += started.elapsed().as_secs_f64();
                queue.polls.push((start_us, now_us()));
                queue.in_flight -= finished.len();
                queue.finished += finished.len() as u64;
            }
            let ready: Vec<Finished> = match &dock {
                None => finished.into_iter().map(Finished::Group).collect(),
                Some(sink) => {
                    backlog.extend(finished);
                    write_to_dock(shared, sink, &mut backlog)?
                }
            };
            if !ready.is_empty() {
                shared.queue().ready.extend(ready);
                shared.changed.notify_all();
            }
        }
    })();
    if let Err(error) = stream.abort() {
        tracing::debug!(%error, "aborting the streamed requests");
    }
    let mut queue = shared.queue();
    if let Err(error) = result {
        queue.error = Some(error);
    }
    queue.stop = true;
    shared.changed.notify_all();
}

/// Writes as many of `backlog`'s groups as there are free slots into the dock, in one put, and
/// returns them as queue entries (a group is queued only once its rows are in the dock).
fn write_to_dock(
    shared: &Shared,
    sink: &DockSink,
    backlog: &mut VecDeque<StreamedGroup>,
) -> Result<Vec<Finished>> {
    let placed: Vec<(usize, StreamedGroup)> = {
        let mut queue = shared.queue();
        let count = backlog.len().min(queue.free_slots.len());
        let mut placed = Vec::with_capacity(count);
        for group in backlog.drain(..count) {
            let Some(slot) = queue.free_slots.pop() else { break };
            if let Some(record) = queue.slot_records.get_mut(slot) {
                *record = Some(group.record.clone());
            }
            placed.push((slot, group));
        }
        placed
    };
    if placed.is_empty() {
        return Ok(Vec::new());
    }
    let ids = |tokens: &[u32]| tokens.iter().map(|&t| i64::from(t)).collect::<Vec<i64>>();
    let (mut rows, mut prompts, mut responses, mut log_probs, mut versions) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (slot, group) in &placed {
        for (i, response) in group.responses.iter().enumerate() {
            rows.push(slot * sink.samples + i);
            prompts.push(ids(&group.prompt_ids));
            responses.push(ids(response));
            log_probs.push(group.engine_log_probs.get(i).cloned().unwrap_or_default());
            let tags = group.versions.get(i).map(Vec::as_slice).unwrap_or_default();
            versions.push(tags.iter().map(|&v| v as i64).collect());
        }
    }
    let batch = PackedBatch {
        rows,
        columns: vec![
            PackedNamedColumn::new(PROMPTS, &ColumnValues::TokenIds(prompts)),
            PackedNamedColumn::new(RESPONSES, &ColumnValues::TokenIds(responses)),
            PackedNamedColumn::new(ENGINE_LOG_PROBS, &ColumnValues::Floats(log_probs)),
            PackedNamedColumn::new(VERSIONS, &ColumnValues::TokenIds(versions)),
        ],
    };
    sink.dock.put_experience(batch).map_err(|e| TrainError::role("dock", e))?;
    Ok(placed
        .into_iter()
        .map(|(slot, group)| Finished::Docked { slot, oldest: group.oldest_version() })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(versions: &[&[u64]]) -> StreamedGroup {
        StreamedGroup {
            record: PromptRecord { prompt: "1+1=".into(), label: "2".into(), ..Default::default() },
            prompt_ids: vec![5, 6],
            responses: versions.iter().map(|v| vec![7; v.len()]).collect(),
            engine_log_probs: versions.iter().map(|v| vec![-0.5; v.len()]).collect(),
            versions: versions.iter().map(|v| v.to_vec()).collect(),
        }
    }

    /// An `AsyncRollout` over a queue with no thread, with `slots` dock slots.
    fn queue_only(slots: usize, staleness: u64) -> AsyncRollout {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::new(PromptLoader::new(4, 1), 2, staleness, slots)),
            changed: Condvar::new(),
            gate: Mutex::new(()),
        });
        AsyncRollout { shared, thread: None }
    }

    #[test]
    fn a_take_drops_stale_docked_groups_and_hands_back_their_slots_to_free() {
        let rollout = queue_only(4, 1);
        {
            let mut queue = rollout.shared.queue();
            // Slots 0-3 hold groups with oldest versions 3, 5, 6 and 4.
            for (slot, oldest) in [(0, 3), (1, 5), (2, 6), (3, 4)] {
                queue.free_slots.retain(|&s| s != slot);
                queue.slot_records[slot] =
                    Some(PromptRecord { prompt: format!("p{slot}"), ..Default::default() });
                queue.ready.push_back(Finished::Docked { slot, oldest: Some(oldest) });
            }
            queue.submitted = 4;
        }
        assert_eq!(rollout.slot_record(2).unwrap().prompt, "p2");
        // Policy 6 with a bound of 1: versions 3 and 4 are too old.
        let taken = rollout.take(2, 5).unwrap();
        let slots: Vec<usize> = taken
            .groups
            .iter()
            .map(|g| match g {
                Finished::Docked { slot, .. } => *slot,
                Finished::Group(_) => panic!("a docked queue handed out a group"),
            })
            .collect();
        assert_eq!(slots, [1, 2], "the fresh groups, in the order they finished");
        assert_eq!((taken.stale_dropped, taken.dropped_slots.clone()), (2, vec![0, 3]));
        // Dropped groups count against the submission rule as if never queued.
        assert_eq!(rollout.shared.queue().dropped, 2);
        // Until freed, a slot keeps its prompt (the stages may still read it) and is not free.
        assert!(rollout.shared.queue().free_slots.is_empty());
        rollout.free_slots(&taken.dropped_slots);
        rollout.free_slots(&slots);
        let queue = rollout.shared.queue();
        let mut free = queue.free_slots.clone();
        free.sort_unstable();
        assert_eq!(free, [0, 1, 2, 3]);
        assert!(queue.slot_records.iter().all(Option::is_none));
        drop(queue);
        assert_eq!(rollout.slot_record(2), None);
        // A slot out of range, or freed twice, is ignored rather than corrupting the list.
        rollout.free_slots(&[9, 2]);
        assert_eq!(rollout.shared.queue().free_slots.len(), 4);
    }

    #[test]
    fn a_groups_age_is_its_oldest_token() {
        let g = group(&[&[3, 3, 4], &[4, 4], &[]]);
        assert_eq!((g.oldest_version(), g.newest_version()), (Some(3), Some(4)));
        assert_eq!(group(&[&[], &[]]).oldest_version(), None);
    }

    #[test]
    fn a_rollout_of_groups_counts_how_stale_its_tokens_are() {
        // Policy version 5: tokens of versions 3, 3, 4, 4, 4 and 5, 5 lag 2, 2, 1, 1, 1, 0, 0.
        let (rollout, stats) =
            into_rollout(vec![group(&[&[3, 3, 4], &[4, 4]]), group(&[&[5], &[5]])], 5);
        assert_eq!(rollout.sequences.len(), 4);
        assert_eq!(rollout.records.len(), 4);
        assert_eq!(rollout.sequences[0].response_ids.len(), 3);
        assert_eq!(stats.oldest, Some(3));
        assert_eq!(stats.max_staleness, 2);
        assert!((stats.mean_token_staleness - 7.0 / 7.0).abs() < 1e-12);
        assert_eq!(stats.mixed_groups, 1);
        assert_eq!(stats.groups, 2);
    }
}
