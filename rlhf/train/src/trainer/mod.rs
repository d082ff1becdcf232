//! The trainer: OpenRLHF's `PPOTrainer.fit()` as a single controller in the driver process.
//!
//! Each step: engines generate `n` samples per prompt → rewards, reference log-probs, old
//! log-probs and critic values are computed in parallel by their role groups → advantages
//! (GAE / REINFORCE++ / GRPO / RLOO ...) → the policy and the critic train concurrently over
//! mini-batches and epochs, their DP ranks all-reducing gradients → the new weights go to every
//! engine in buckets, then the prefix caches are reset. In the hybrid-engine mode, engines sleep
//! while training and training state is offloaded while generating.
//!
//! The controller runs in the driver (as OpenRLHF's and verl's do) rather than in an actor:
//! it owns no tensors that matter, and keeping it in the driver means every role handle, the
//! metrics files and the progress bar live in one process.

pub mod agent;
pub mod calls;
pub mod checkpoint;
pub mod dock_layout;
pub mod pipeline;
pub mod roles;
pub mod rollout;
pub mod stages;
pub mod stream;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use rtrun_rlhf_dock::StageTimeline;
use rtrun_rlhf_engine::{GenerationOutput, SamplingParams};
use rtrun_rlhf_telemetry::samples::{SampleRow, SamplesWriter};
use rtrun_rlhf_telemetry::{MetricsSink, PhaseTimer, StepMetrics, StepPhases};

use crate::algo::KlController;
use crate::config::{
    OLD_LOGPROB_CHECK_EVERY, OLD_LOGPROB_MAX_GAP, PipelineMode, TrainConfig, WeightSyncBackend,
};
use crate::error::{Result, TrainError};
use crate::prompts::{PromptLoader, PromptRecord};
use crate::rng::mix_seed;
use crate::tokenizer::{HfTokenizer, PromptTokenizer, run_tokenizer};

pub use calls::CallWatch;
pub use roles::Roles;

pub use crate::paths::RunPaths;

/// Held-out results.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalResult {
    /// Mean reward of the held-out answers (all `eval.n_samples` of each prompt).
    pub mean_reward: f64,
    /// Fraction of answers with full reward (≥ 1: exactly right for the built-in rules).
    pub accuracy: f64,
    /// Mean response length in tokens.
    pub response_length: f64,
    /// Fraction of prompts with at least one full-reward answer among their `eval.n_samples`.
    #[serde(default)]
    pub pass_at_k: f64,
    /// Answers per prompt (`eval.n_samples`).
    #[serde(default)]
    pub samples_per_prompt: usize,
}

/// What the trainer carries from step to step (and what a checkpoint restores).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Steps completed.
    pub step: u64,
    /// Dataloader position (OpenRLHF's `consumed_samples`, as prompts).
    pub loader: PromptLoader,
    /// The KL coefficient and its controller.
    pub kl: KlController,
    /// Held-out results before the first step.
    pub baseline: Option<EvalResult>,
    /// Every reward seen so far, as moments (`algo.normalize_reward`).
    #[serde(default)]
    pub reward_moments: rtrun_rlhf_algo::RunningMoments,
}

/// Receives live progress (the driver's progress bar).
pub trait ProgressObserver {
    /// A phase started.
    fn phase(&mut self, _name: &str) {}
    /// A step finished.
    fn step_done(&mut self, _metrics: &StepMetrics, _phases: &StepPhases) {}
    /// The roles were placed: one line per role, each rank's node and GPUs.
    fn placed(&mut self, _roles: &[String]) {}
    /// A step's logged samples (`logging.samples_per_step`).
    fn samples(&mut self, _rows: &[SampleRow]) {}
}

/// Progress nobody watches.
#[derive(Debug, Default)]
pub struct NoProgress;

impl ProgressObserver for NoProgress {}

/// The end of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct FitReport {
    /// Steps completed.
    pub steps: u64,
    /// Held-out results before the first step.
    pub baseline: EvalResult,
    /// Held-out results after the last step.
    pub final_result: EvalResult,
    /// Where the trained policy was exported (Hugging Face format).
    pub exported: Option<PathBuf>,
}

/// A run: config, data, roles and state.
pub struct Trainer {
    /// The config.
    pub config: TrainConfig,
    /// The run directory's files.
    pub paths: RunPaths,
    train_data: Arc<Vec<PromptRecord>>,
    eval_data: Vec<PromptRecord>,
    /// The role groups and engines.
    pub roles: Roles,
    /// The policy's tokenizer: prompts to ids, responses to text, EOS ids.
    pub tokenizer: Arc<dyn PromptTokenizer>,
    /// The reward model's own tokenizer when it differs from the policy's (sequences are
    /// re-tokenized for it).
    pub reward_tokenizer: Option<Arc<dyn PromptTokenizer>>,
    /// The state.
    pub state: TrainerState,
    /// Phase timings.
    pub timer: PhaseTimer,
    /// `train.pipeline: dock`: every stage rank's timeline of the last step.
    pub pipeline_timelines: Vec<StageTimeline>,
    /// `rollout.weight_sync_backend: nccl`: the weight metadata once the group is formed.
    /// (per engine rank with tensor-parallel engines).
    weight_sync_metas: std::sync::OnceLock<Vec<Vec<rtrun_rlhf_engine::WeightMeta>>>,
    /// Figures of this step's phases added to its metrics: GPU memory (`record_gpu_memory`)
    /// and the weight sync's bytes per engine rank and resharding time.
    phase_metrics: std::sync::Mutex<Vec<(String, f64)>>,
    /// Whether the switch from `nccl` to CUDA IPC on one GPU was reported.
    ipc_noted: std::sync::atomic::AtomicBool,
    /// Deadlines of the calls to role ranks and engines.
    pub watch: CallWatch,
    /// `algo.old_logprobs` resolved: the engine's log-probs are the old log-probs (until a
    /// check finds them too far from the policy's).
    old_logprobs_from_engine: bool,
    /// Whether this step measured `engine_logprob_gap` (it does unless the engine's log-probs
    /// were used unchecked).
    gap_measured: bool,
    /// `samples.jsonl` (`logging.samples_per_step`).
    samples: SamplesWriter,
    /// `rollout.partial_threshold`: the engines' stream, with the groups carried to the next
    /// step.
    stream: Option<stream::RolloutStream>,
    /// `rollout.mode: async`: the rollout thread, from the first step to the last.
    rollouter: Option<stream::AsyncRollout>,
    /// `tools.*`: the tools of multi-turn rollouts.
    tools: Option<agent::RunTools>,
}

impl Trainer {
    /// A trainer over prepared data and created roles, resumed from the checkpoint `resume`
    /// when there is one ([`checkpoint::resume_from`] chooses and checks it).
    pub fn new(
        config: TrainConfig,
        paths: RunPaths,
        train_data: Vec<PromptRecord>,
        eval_data: Vec<PromptRecord>,
        roles: Roles,
        resume: Option<&Path>,
    ) -> Result<Self> {
        if config.rollout.streams() && roles.placements.hybrid() {
            return Err(TrainError::config(
                config.rollout.streaming_key(),
                "expected engines that are not colocated with the policy (the placement spec \
                 colocates all roles): colocated engines sleep while the policy trains, and a \
                 sleeping engine cannot keep requests running",
            ));
        }
        let state = TrainerState {
            step: 0,
            loader: PromptLoader::new(train_data.len(), config.seed),
            kl: config.algo.kl_controller()?,
            baseline: None,
            reward_moments: Default::default(),
        };
        let tokenizer = run_tokenizer(&config)?;
        let reward_tokenizer = reward_tokenizer(&config)?;
        let watch = CallWatch::from_config(&config.cluster);
        let old_logprobs_from_engine = config.old_logprobs_from_engine();
        let samples = SamplesWriter::new(&paths.root);
        let tools = match config.tools.any() {
            true => {
                let toolbox = crate::tools::from_config(&config.tools)?;
                Some(agent::RunTools { schemas: toolbox.schemas(), toolbox })
            }
            false => None,
        };
        let mut trainer = Trainer {
            config,
            paths,
            train_data: Arc::new(train_data),
            eval_data,
            roles,
            tokenizer,
            reward_tokenizer,
            state,
            timer: PhaseTimer::new(),
            pipeline_timelines: Vec::new(),
            weight_sync_metas: std::sync::OnceLock::new(),
            phase_metrics: std::sync::Mutex::new(Vec::new()),
            ipc_noted: std::sync::atomic::AtomicBool::new(false),
            old_logprobs_from_engine,
            gap_measured: true,
            samples,
            watch,
            stream: None,
            rollouter: None,
            tools,
        };
        if let Some(dir) = resume {
            trainer.load_checkpoint(dir)?;
        }
        Ok(trainer)
    }

    /// Total steps of the run: episodes × prompts / prompts per step, capped by `max_steps`.
    pub fn total_steps(&self) -> u64 {
        let per_episode =
            (self.train_data.len() / self.config.rollout.prompts_per_step).max(1) as u64;
        let total = per_episode * self.config.train.num_episodes as u64;
        self.config.train.max_steps.map_or(total, |m| m.min(total))
    }

    /// Runs the remaining steps, recording metrics into `sink`; evaluates on the held-out
    /// prompts before the first step, every `eval.every_steps` and after the last.
    pub fn fit(
        &mut self,
        sink: &mut dyn MetricsSink,
        progress: &mut dyn ProgressObserver,
    ) -> Result<FitReport> {
        let total = self.total_steps();
        if self.state.baseline.is_none() {
            progress.phase("eval");
            let baseline = self.timed("eval", |t| t.evaluate())?;
            let _ = self.timer.finish_step();
            let mut metrics = StepMetrics::new(0);
            set_eval(&mut metrics, &baseline)?;
            sink.record(&metrics).map_err(telemetry_error)?;
            self.state.baseline = Some(baseline);
        }
        let mut last_eval = None;
        while self.state.step < total {
            let step = self.state.step + 1;
            let mut metrics = self.train_step(step, progress)?;
            let every = self.config.eval.every_steps;
            if step == total || (every > 0 && step.is_multiple_of(every)) {
                progress.phase("eval");
                let result = self.timed("eval", |t| t.evaluate())?;
                set_eval(&mut metrics, &result)?;
                last_eval = Some(result);
            }
            let phases = self.timer.finish_step();
            metrics.extend_prefixed("time/", phases.seconds()).map_err(telemetry_error)?;
            sink.record(&metrics).map_err(telemetry_error)?;
            progress.step_done(&metrics, &phases);
            self.state.step = step;
            let every = self.config.checkpoint.every_steps;
            // The last step is saved too: a rerun of the finished run then says so instead of
            // training the steps after the last multiple again.
            if every > 0 && (step.is_multiple_of(every) || step == total) {
                progress.phase("checkpoint");
                self.save_checkpoint()?;
            }
        }
        let final_result = match last_eval {
            Some(r) => r,
            None => self.evaluate()?,
        };
        progress.phase("export");
        let exported = self.export_policy(&self.paths.final_policy)?;
        Ok(FitReport {
            steps: self.state.step,
            baseline: self.state.baseline.unwrap_or_default(),
            final_result,
            exported: Some(exported),
        })
    }

    /// Policy rank 0: the replica that saves, exports and sends weights (DP ranks are equal).
    fn policy_rank0(&self) -> Result<&crate::roles::lm::LmWorkerRef> {
        self.roles
            .actor
            .members()
            .first()
            .ok_or_else(|| TrainError::role("actor", "the group is empty"))
    }

    /// Writes the policy (rank 0's replica) to `dir` as a Hugging Face directory: config,
    /// safetensors, tokenizer files and generation config. Written beside `dir` and renamed, so a
    /// directory at `dir` is always complete.
    pub fn export_policy(&self, dir: &Path) -> Result<PathBuf> {
        checkpoint::export_atomically(dir, |tmp| {
            // Every rank is called (at zero_stage 3 they gather the model for rank 0 to write).
            let exports =
                calls::each("actor", self.roles.actor.members(), |a| a.export(tmp.clone()));
            self.watch.wait("export", exports).map(|_| ())
        })
    }

    /// Runs `sync` (calls that read the whole policy on rank 0) with the policy gathered on
    /// every rank when it is sharded at zero_stage 3, and released after.
    fn with_whole_policy<T>(&self, sync: impl FnOnce() -> Result<T>) -> Result<T> {
        if self.config.train.zero_stage != rtrun_rlhf_shard::ZeroStage::Three {
            return sync();
        }
        let members = self.roles.actor.members();
        self.watch.wait("gather_weights", calls::each("actor", members, |a| a.gather_weights()))?;
        let result = sync();
        let released = self
            .watch
            .wait("release_weights", calls::each("actor", members, |a| a.release_weights()));
        let out = result?;
        released?;
        Ok(out)
    }

    /// Runs `body` as phase `name` of the current step.
    fn timed<T>(&mut self, name: &str, body: impl FnOnce(&Self) -> T) -> T {
        let started = self.timer.start(name);
        let out = body(self);
        self.timer.stop(started);
        out
    }

    /// Generates `params.n` samples for each prompt on the engines (prompts split across
    /// engines in contiguous chunks), with per-prompt seeds derived from `seed_base`.
    fn generate(
        &self,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
        seed_base: u64,
    ) -> Result<Vec<GenerationOutput>> {
        let indexed = prompts.iter().map(Vec::as_slice).enumerate();
        let requests = stages::generation_requests(indexed, params, seed_base);
        self.generate_requests(requests, params.n as usize)
    }

    /// Runs `requests` (of `samples` samples each) on the engines, split in contiguous chunks;
    /// the outputs in the requests' order.
    fn generate_requests(
        &self,
        requests: Vec<rtrun_rlhf_engine::GenerationRequest>,
        samples: usize,
    ) -> Result<Vec<GenerationOutput>> {
        let count = requests.len();
        let engines = &self.roles.engines;
        let chunks = rtrun::split_batch(requests, engines.len());
        let outputs = self
            .watch
            .gather("generate", calls::each_with(ENGINE, engines, chunks, |e, c| e.generate(c)))?;
        stages::check_outputs(outputs, count, samples)
    }

    /// The sampling parameters of training rollouts.
    fn rollout_params(&self) -> SamplingParams {
        let r = &self.config.rollout;
        SamplingParams {
            n: r.n_samples_per_prompt as u32,
            temperature: r.temperature,
            top_p: r.top_p,
            top_k: r.top_k,
            max_tokens: self.config.max_new_tokens() as u32,
            stop_token_ids: self.tokenizer.eos_token_ids(),
            ..SamplingParams::default()
        }
    }

    /// Greedy answers to every held-out prompt, scored with the run's reward.
    pub fn evaluate(&self) -> Result<EvalResult> {
        self.wake_engines()?;
        let prompts = self
            .eval_data
            .iter()
            .map(|r| self.tokenizer.encode_prompt(&r.prompt))
            .collect::<Result<Vec<_>>>()?;
        let k = self.config.eval.n_samples.max(1);
        let params = SamplingParams {
            n: k as u32,
            temperature: self.config.eval.temperature,
            max_tokens: self.config.max_new_tokens() as u32,
            stop_token_ids: self.tokenizer.eos_token_ids(),
            ..SamplingParams::default()
        };
        let seed = mix_seed(self.config.seed, u64::MAX);
        // With tools the held-out answers call them too, as the trained policy will; their
        // figures are not the step's.
        let (groups, _) = self.sample_groups(&self.eval_data, &prompts, &params, seed)?;
        let mut sequences = Vec::with_capacity(prompts.len() * k);
        let mut records: Vec<&PromptRecord> = Vec::with_capacity(prompts.len() * k);
        for group in &groups {
            for i in 0..group.responses.len() {
                sequences.push(group.sequence(i));
                records.push(&group.record);
            }
        }
        let rewards = stages::rewards(self, &records, &sequences)?.get(&self.watch)?.rewards;
        self.sleep_engines_if_hybrid()?;
        // Length in the model's own tokens (a tool's answers are not its response).
        let lengths: Vec<usize> = sequences
            .iter()
            .map(|s| (0..s.response_ids.len()).filter(|&i| s.counts(i)).count())
            .collect();
        Ok(eval_result(&rewards, &lengths, k))
    }

    /// Hybrid engine: brings the engines back (weights, then KV cache) and offloads training
    /// state before generation.
    fn wake_engines(&self) -> Result<()> {
        if !self.roles.placements.hybrid() {
            return Ok(());
        }
        let watch = &self.watch;
        watch.wait("offload", calls::each("actor", self.roles.actor.members(), |a| a.offload()))?;
        if let Some(critic) = &self.roles.critic {
            watch.wait("offload", calls::each("critic", critic.members(), |c| c.offload()))?;
        }
        let engines = &self.roles.engines;
        watch.wait("wake_up", calls::each(ENGINE, engines, |e| e.wake_up(Vec::new())))?;
        Ok(())
    }

    /// Hybrid engine: engines release their memory and the trained roles' parameters come back
    /// for the experience passes (the sharding manager's `Forward` mode); their gradients and
    /// AdamW state follow when they train.
    fn sleep_engines_if_hybrid(&self) -> Result<()> {
        if !self.roles.placements.hybrid() {
            return Ok(());
        }
        let watch = &self.watch;
        watch.wait("sleep", calls::each(ENGINE, &self.roles.engines, |e| e.sleep(1)))?;
        let actor = self.roles.actor.members();
        watch.wait("prepare_forward", calls::each("actor", actor, |a| a.prepare_forward()))?;
        if let Some(critic) = &self.roles.critic {
            let forward = calls::each("critic", critic.members(), |c| c.prepare_forward());
            watch.wait("prepare_forward", forward)?;
        }
        Ok(())
    }

    /// One training step; returns its metrics (phase times are added by the caller).
    fn train_step(
        &mut self,
        step: u64,
        progress: &mut dyn ProgressObserver,
    ) -> Result<StepMetrics> {
        let params = self.rollout_params();
        let seed_base = mix_seed(self.config.seed, step);
        let kl_coef = self.state.kl.value();
        let docked = self.config.train.pipeline == PipelineMode::Dock;
        let (stats, rows, train_stats) = if self.config.rollout.streams() && docked {
            self.docked_async_step(step, params, kl_coef, progress)?
        } else if self.config.rollout.streams() {
            let rollout = self.streamed_rollout(step, params, progress)?;
            self.experience_and_train(rollout, step, kl_coef, progress)?
        } else if docked {
            let (records, prompt_ids) = self.next_prompts()?;
            progress.phase("pipeline");
            let out = self.timed("pipeline", |t| {
                pipeline::run_step(t, &records, &prompt_ids, &params, seed_base, step, kl_coef)
            })?;
            self.pipeline_timelines = out.timelines;
            (out.stats, out.rows, out.train)
        } else {
            let (records, prompt_ids) = self.next_prompts()?;
            self.sequential_step(
                &records,
                &prompt_ids,
                &params,
                seed_base,
                step,
                kl_coef,
                progress,
            )?
        };
        self.state.kl.update(stats.kl, rows as u64);

        progress.phase("sync");
        // The rollout thread polls the engines under the gate: holding it, the sync changes
        // no engine's weights while it steps.
        let rollouter = self.rollouter.take();
        let gate = rollouter.as_ref().map(|r| r.gate());
        let synced = (|| -> Result<()> {
            if train_stats.actor_trained {
                self.timed("sync", |t| t.sync_weights())?;
            }
            if self.config.rollout.streams() {
                // Version `step` is the policy this step trained (the same weights as the last
                // version's when the policy was frozen).
                self.set_engine_version(step)?;
                if let Some(rollouter) = &rollouter {
                    rollouter.set_version(step);
                }
            }
            Ok(())
        })();
        drop(gate);
        self.rollouter = rollouter;
        synced?;

        let mut metrics = StepMetrics::new(step);
        let s = &stats;
        let t = &train_stats;
        for (name, value) in [
            ("reward", s.reward),
            ("accuracy", s.accuracy),
            ("kl", s.kl),
            ("kl_coef", kl_coef),
            ("response_length", s.response_length),
            ("total_length", s.total_length),
            ("return", s.token_return),
            ("advantage_abs", s.advantage_abs),
            ("policy_loss", t.policy.policy_loss),
            ("ppo_clip_ratio", t.policy.clip_fraction),
            ("ppo_kl", t.policy.approx_kl),
            ("entropy", t.policy.entropy),
            ("actor_grad_norm", t.policy.grad_norm),
            ("actor_lr", t.policy.lr),
            ("actor_micro_batches", t.policy.micro_batches),
            ("critic_loss", t.critic.value_loss),
            ("critic_grad_norm", t.critic.grad_norm),
        ] {
            metrics.set(name, value).map_err(telemetry_error)?;
        }
        if self.gap_measured {
            metrics.set("engine_logprob_gap", s.engine_logprob_gap).map_err(telemetry_error)?;
        }
        if self.config.algo.overlong_penalty.is_some() {
            metrics.set("overlong_penalty", s.overlong_penalty).map_err(telemetry_error)?;
        }
        if self.config.algo.normalize_reward {
            let moments = &self.state.reward_moments;
            metrics.set("reward_norm/mean", moments.mean).map_err(telemetry_error)?;
            metrics.set("reward_norm/std", moments.std()).map_err(telemetry_error)?;
        }
        metrics
            .set("consumed_prompts", self.state.loader.consumed as f64)
            .map_err(telemetry_error)?;
        let generated = rows as f64 * s.response_length;
        metrics
            .set(rtrun_rlhf_telemetry::live::GENERATED_TOKENS, generated)
            .map_err(telemetry_error)?;
        for (name, value) in
            self.phase_metrics.lock().map(|mut m| std::mem::take(&mut *m)).unwrap_or_default()
        {
            metrics.set(&name, value).map_err(telemetry_error)?;
        }
        if self.config.train.pipeline == PipelineMode::Dock {
            pipeline::record_summary(step, &self.pipeline_timelines, &mut metrics)?;
        }
        Ok(metrics)
    }

    /// The step's prompts from the loader, and their ids.
    fn next_prompts(&mut self) -> Result<(Vec<PromptRecord>, Vec<Vec<u32>>)> {
        let indices = self.state.loader.next_batch(self.config.rollout.prompts_per_step);
        let records: Vec<PromptRecord> =
            indices.iter().map(|&i| self.train_data[i].clone()).collect();
        let prompt_ids = records
            .iter()
            .map(|r| self.tokenizer.encode_prompt(&r.prompt))
            .collect::<Result<Vec<_>>>()?;
        Ok((records, prompt_ids))
    }

    /// Generation, then make-experience over the whole batch, then training: the step of
    /// `train.pipeline: sequential`.
    #[allow(clippy::too_many_arguments)]
    fn sequential_step(
        &mut self,
        records: &[PromptRecord],
        prompt_ids: &[Vec<u32>],
        params: &SamplingParams,
        seed_base: u64,
        step: u64,
        kl_coef: f64,
        progress: &mut dyn ProgressObserver,
    ) -> Result<(stages::ExperienceStats, usize, stages::TrainStats)> {
        let rollout = self.rollout(records, prompt_ids, params, seed_base, progress)?;
        self.experience_and_train(rollout, step, kl_coef, progress)
    }

    /// Make-experience over a rollout, then training.
    fn experience_and_train(
        &mut self,
        rollout: rollout::Rollout,
        step: u64,
        kl_coef: f64,
        progress: &mut dyn ProgressObserver,
    ) -> Result<(stages::ExperienceStats, usize, stages::TrainStats)> {
        let sample_records: Vec<&PromptRecord> = rollout.records.iter().collect();
        let engine_log_probs = rollout.engine_log_probs;

        progress.phase("experience");
        // The policy recomputes the old log-probs unless the engine's serve; then it still does
        // on steps 1 and 2 (the first after a weight sync) and every OLD_LOGPROB_CHECK_EVERY
        // steps, to check the two agree (a schedule of the step alone, so a resumed run does
        // what an uninterrupted one does).
        let recompute = !self.old_logprobs_from_engine
            || step <= 2
            || step.is_multiple_of(OLD_LOGPROB_CHECK_EVERY);
        let batch = self.timed("experience", |t| {
            stages::make_experience(
                t,
                &sample_records,
                rollout.sequences,
                &engine_log_probs,
                stages::ExperienceSettings { kl_coef, recompute_old: recompute },
                stages::Known { rewards: rollout.rewards, ref_log_probs: None },
            )
        })?;
        self.gap_measured = recompute;
        if let Some(moments) = batch.reward_moments {
            self.state.reward_moments = moments;
        }
        if self.old_logprobs_from_engine && recompute {
            let gap = batch.stats.engine_logprob_gap;
            if gap.is_nan() || gap > OLD_LOGPROB_MAX_GAP {
                tracing::warn!(
                    step,
                    gap,
                    "algo.old_logprobs: the engine's log-probs differ from the policy's by {gap:.3e} \
                     per token (more than {OLD_LOGPROB_MAX_GAP:e}); the policy recomputes them from now on"
                );
                self.old_logprobs_from_engine = false;
            }
        }

        self.log_samples(step, &rollout.records, &batch, progress)?;
        progress.phase("train");
        let train_stats = self.timed("train", |t| stages::train(t, &batch.rows, step, kl_coef))?;
        self.record_gpu_memory("train")?;
        Ok((batch.stats, batch.rows.len(), train_stats))
    }

    /// Adds the means of a reward source's `extra_logs` to the step's metrics
    /// (`reward_extra/<name>`; with several batches in a step, the last one's).
    pub(crate) fn log_reward_extras(&self, answer: &crate::reward::RewardAnswer) {
        let Ok(mut metrics) = self.phase_metrics.lock() else { return };
        for (name, values) in &answer.extra_logs {
            let mean =
                values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len().max(1) as f64;
            let name = format!("reward_extra/{name}");
            metrics.retain(|(n, _)| *n != name);
            metrics.push((name, mean));
        }
    }

    /// Writes the first `logging.samples_per_step` samples of `batch` to `samples.jsonl` and
    /// hands them to the progress observer (the dashboard).
    fn log_samples(
        &mut self,
        step: u64,
        records: &[PromptRecord],
        batch: &stages::ExperienceBatch,
        progress: &mut dyn ProgressObserver,
    ) -> Result<()> {
        let k = self.config.logging.samples_per_step;
        if k == 0 {
            return Ok(());
        }
        let rows: Vec<SampleRow> = batch
            .rows
            .iter()
            .zip(records)
            .zip(&batch.rewards)
            .take(k)
            .map(|((row, record), &reward)| SampleRow {
                step,
                prompt: record.prompt.clone(),
                response: crate::tokenizer::response_text(self.tokenizer.as_ref(), &row.sequence),
                reward: f64::from(reward),
                label: record.label.clone(),
            })
            .collect();
        self.samples.write(&rows).map_err(telemetry_error)?;
        progress.samples(&rows);
        Ok(())
    }

    /// On a GPU run, the CUDA memory of policy rank 0 and engine 0 at the end of `phase`:
    /// `gpu/<phase>_<role>_peak_mib` (most allocated during the phase) and
    /// `gpu/<phase>_<role>_reserved_mib` (held from the driver now: near zero for a role that
    /// sleeps or is offloaded during the phase), added to the step's metrics.
    fn record_gpu_memory(&self, phase: &str) -> Result<()> {
        if !(self.config.policy.device.is_cuda() || self.config.engine.device.is_cuda()) {
            return Ok(());
        }
        let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
        let mut found = Vec::new();
        let policy = self.policy_rank0()?;
        let memory = self.watch.wait_one(
            "cuda_memory",
            calls::actor_call("actor", 0, policy, policy.cuda_memory(true)),
        )?;
        found.push(("actor", memory));
        if let Some(engine) = self.roles.engines.first() {
            let memory = self.watch.wait_one(
                "cuda_memory",
                calls::actor_call(ENGINE, 0, engine, engine.cuda_memory(true)),
            )?;
            found.push(("engine", memory));
        }
        if let Ok(mut metrics) = self.phase_metrics.lock() {
            for (role, memory) in found {
                if let Some(m) = memory {
                    metrics.push((format!("gpu/{phase}_{role}_peak_mib"), mib(m.peak_allocated)));
                    metrics.push((format!("gpu/{phase}_{role}_reserved_mib"), mib(m.reserved)));
                }
            }
        }
        Ok(())
    }

    /// Sends the policy's weights to every engine over `rollout.weight_sync_backend` (the
    /// transport it really takes, see [`WeightSyncBackend::effective`]); each transport resets
    /// the engines' prefix caches. With the hybrid engine the engines' weights are woken
    /// first and the engines put back to sleep after (OpenRLHF's order: weights, sync, reset,
    /// then the KV cache at the next generation).
    pub fn sync_weights(&self) -> Result<()> {
        let hybrid = self.roles.placements.hybrid();
        let backend = self.config.rollout.weight_sync_backend.effective(
            hybrid,
            self.roles.actor.members().len(),
            self.roles.engines.len(),
        );
        if backend != self.config.rollout.weight_sync_backend
            && !self.ipc_noted.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                "rollout.weight_sync_backend: nccl with the policy and its engine on one GPU \
                 (hybrid placement): syncing weights by CUDA IPC, since NCCL cannot put two \
                 ranks on one GPU"
            );
        }
        let (watch, engines) = (&self.watch, &self.roles.engines);
        if hybrid {
            let wakes = calls::each(ENGINE, engines, |e| e.wake_up(vec!["weights".to_owned()]));
            watch.wait("wake_up", wakes)?;
        }
        self.with_whole_policy(|| match backend {
            WeightSyncBackend::ObjectStore => self.send_weights_object_store(),
            WeightSyncBackend::Nccl => self.send_weights_collective(),
            WeightSyncBackend::CudaIpc => self.send_weights_ipc(),
        })?;
        if hybrid {
            watch.wait("sleep", calls::each(ENGINE, engines, |e| e.sleep(1)))?;
        }
        Ok(())
    }

    /// `rollout.weight_sync_backend: object_store`: policy rank 0 puts buckets into the object
    /// store, every engine copies them in, then the engines reset their prefix caches.
    fn send_weights_object_store(&self) -> Result<()> {
        let source = self.policy_rank0()?;
        let watch = &self.watch;
        let bucket_bytes = self.config.rollout.weight_bucket_bytes;
        let tp = self.config.engine.tensor_parallel_size;
        let buckets = watch.wait_one(
            "engine_weight_buckets",
            calls::actor_call("actor", 0, source, source.engine_weight_buckets(bucket_bytes, tp)),
        )?;
        // Rank r of every engine takes rank r's buckets, one bucket at a time.
        for (rank, rank_buckets) in buckets.by_rank.iter().enumerate() {
            let members: Vec<_> =
                self.roles.engine_ranks.iter().filter_map(|ranks| ranks.get(rank)).collect();
            for bucket in rank_buckets {
                let updates = members
                    .iter()
                    .enumerate()
                    .map(|(engine, m)| {
                        self.engine_rank_call(engine, rank, m, m.update_weights(bucket))
                    })
                    .collect();
                watch.wait("update_weights", updates)?;
            }
        }
        let engines = &self.roles.engines;
        watch
            .wait("reset_prefix_cache", calls::each(ENGINE, engines, |e| e.reset_prefix_cache()))?;
        for rank in &buckets.by_rank {
            rtrun::free(rank)?;
        }
        self.record_sync(&buckets.bytes_by_rank, Some(buckets.reshard_seconds));
        Ok(())
    }

    /// A call to rank `rank` of engine `engine`, named with that rank and its node when it is
    /// not the engine's rank 0.
    fn engine_rank_call<T>(
        &self,
        engine: usize,
        rank: usize,
        member: &rtrun_rlhf_engine::EngineActorRef,
        answer: calls::Answer<T>,
    ) -> calls::RankCall<T> {
        let call = calls::actor_call(ENGINE, engine, member, answer);
        match self.roles.engine_rank_nodes.get(engine).and_then(|nodes| nodes.get(rank)) {
            Some(node) if rank > 0 => call.on_shard(rank, node),
            _ => call,
        }
    }

    /// The weight sync's figures in this step's metrics: `weight_sync/bytes_per_rank` (the
    /// most any engine rank received; each rank gets only its shard), `weight_sync/bytes_rank{r}`
    /// per rank of a tensor-parallel engine, and `time/sync_reshard` (the object-store path: the
    /// policy's resharding and bucketing).
    fn record_sync(&self, bytes_by_rank: &[u64], reshard_seconds: Option<f64>) {
        let Ok(mut metrics) = self.phase_metrics.lock() else { return };
        let most = bytes_by_rank.iter().copied().max().unwrap_or(0);
        metrics.push(("weight_sync/bytes_per_rank".to_owned(), most as f64));
        if bytes_by_rank.len() > 1 {
            for (rank, bytes) in bytes_by_rank.iter().enumerate() {
                metrics.push((format!("weight_sync/bytes_rank{rank}"), *bytes as f64));
            }
        }
        if let Some(seconds) = reshard_seconds {
            metrics.push(("time/sync_reshard".to_owned(), seconds));
        }
    }

    /// `rollout.weight_sync_backend: cuda_ipc`: policy rank 0 exports one packed bucket at a
    /// time and every engine maps and copies it in place (and resets its prefix cache); the
    /// next export releases the bucket before, so the sync holds at most one bucket of extra
    /// GPU memory.
    fn send_weights_ipc(&self) -> Result<()> {
        let source = self.policy_rank0()?;
        let (watch, engines) = (&self.watch, &self.roles.engines);
        let bucket_bytes = self.config.rollout.weight_bucket_bytes;
        let buckets = watch.wait_one(
            "plan_ipc_weights",
            calls::actor_call("actor", 0, source, source.plan_ipc_weights(bucket_bytes)),
        )?;
        for index in 0..buckets {
            let bucket = watch.wait_one(
                "export_ipc_bucket",
                calls::actor_call("actor", 0, source, source.export_ipc_bucket(index)),
            )?;
            let receives = calls::each(ENGINE, engines, |e| e.receive_ipc_bucket(bucket.clone()));
            watch.wait("receive_ipc_bucket", receives)?;
        }
        watch.wait_one(
            "finish_ipc_weights",
            calls::actor_call("actor", 0, source, source.finish_ipc_weights()),
        )?;
        Ok(())
    }

    /// `rollout.weight_sync_backend: nccl`: policy rank 0 broadcasts its weights to every
    /// engine over the weight-sync group (formed on the first call), in place, then the engines
    /// reset their prefix caches (part of `receive_weights`).
    fn send_weights_collective(&self) -> Result<()> {
        let source = self.policy_rank0()?;
        let tp = self.config.engine.tensor_parallel_size;
        let metas = match self.weight_sync_metas.get() {
            Some(metas) => metas,
            None => self.join_weight_sync_groups(tp)?,
        };
        let watch = &self.watch;
        let bucket_bytes = self.config.rollout.weight_bucket_bytes;
        // One engine rank at a time: policy rank 0 broadcasts rank r's shard over rank r's
        // group while rank r of every engine receives it.
        let mut bytes_by_rank = Vec::with_capacity(metas.len());
        for (rank, rank_metas) in metas.iter().enumerate() {
            let send = match tp {
                1 => source.broadcast_weights(bucket_bytes),
                _ => source.broadcast_engine_weights(bucket_bytes, tp, rank),
            };
            let send = calls::actor_call("actor", 0, source, send);
            let members: Vec<_> =
                self.roles.engine_ranks.iter().filter_map(|ranks| ranks.get(rank)).collect();
            let receives = members
                .iter()
                .enumerate()
                .map(|(engine, m)| {
                    let receive = m.receive_weights(rank_metas.clone(), bucket_bytes);
                    self.engine_rank_call(engine, rank, m, receive)
                })
                .collect();
            bytes_by_rank.push(watch.wait_one("broadcast_weights", send)? as u64);
            watch.wait("receive_weights", receives)?;
        }
        if tp > 1 {
            // Rank 0's receive resets the prefix cache of a whole engine; with tensor
            // parallelism every rank has received its shard only now.
            let engines = &self.roles.engines;
            watch.wait(
                "reset_prefix_cache",
                calls::each(ENGINE, engines, |e| e.reset_prefix_cache()),
            )?;
        }
        // The resharding happens inside each broadcast, not timed apart.
        self.record_sync(&bytes_by_rank, None);
        Ok(())
    }

    /// Forms the weight-sync groups (the first `nccl` sync): one of policy rank 0 and every
    /// engine, or with engines of `tp` ranks one per engine rank (policy rank 0 and rank r of
    /// every engine). Returns what each group's receivers are sent.
    fn join_weight_sync_groups(
        &self,
        tp: usize,
    ) -> Result<&Vec<Vec<rtrun_rlhf_engine::WeightMeta>>> {
        let source = self.policy_rank0()?;
        let engines = self.roles.engine_ranks.len();
        for rank in 0..tp {
            let (addr, port) = self.watch.wait_one(
                "weight_sync_endpoint",
                calls::actor_call("actor", 0, source, source.weight_sync_endpoint()),
            )?;
            let group = |member| rtrun_rlhf_engine::WeightSyncGroup {
                group_name: match tp {
                    1 => "rlhf-weight-sync".to_owned(),
                    _ => format!("rlhf-weight-sync-rank{rank}"),
                },
                rank: member,
                world_size: engines + 1,
                master_addr: addr.clone(),
                master_port: port,
                backend: rtrun::collective::Backend::Nccl,
            };
            let policy = calls::actor_call("actor", 0, source, source.join_weight_sync(group(0)));
            let members: Vec<_> =
                self.roles.engine_ranks.iter().filter_map(|ranks| ranks.get(rank)).collect();
            let joins = members
                .iter()
                .enumerate()
                .map(|(engine, m)| {
                    let join = m.join_weight_sync(group(engine + 1));
                    self.engine_rank_call(engine, rank, m, join)
                })
                .collect();
            self.watch.wait_one("join_weight_sync", policy)?;
            self.watch.wait("join_weight_sync", joins)?;
        }
        let metas = match tp {
            1 => vec![self.watch.wait_one(
                "weight_metadata",
                calls::actor_call("actor", 0, source, source.weight_metadata()),
            )?],
            _ => self.watch.wait_one(
                "engine_weight_metadata",
                calls::actor_call("actor", 0, source, source.engine_weight_metadata(tp)),
            )?,
        };
        Ok(self.weight_sync_metas.get_or_init(|| metas))
    }
}

/// The reward model's tokenizer when it has one and it is not the policy's (compared by the
/// contents of `tokenizer.json`).
fn reward_tokenizer(config: &TrainConfig) -> Result<Option<Arc<dyn PromptTokenizer>>> {
    let Some(dir) = config
        .reward
        .model_dir
        .as_ref()
        .filter(|_| config.reward.kind == crate::config::RewardKind::Model)
    else {
        return Ok(None);
    };
    let file = rtrun_rlhf_model::tokenizer::TOKENIZER_FILE;
    let Ok(reward_vocab) = std::fs::read(dir.join(file)) else {
        return Ok(None);
    };
    let policy_vocab = std::fs::read(config.policy_dir().join(file)).ok();
    if policy_vocab.as_deref() == Some(reward_vocab.as_slice()) {
        return Ok(None);
    }
    let tokenizer = HfTokenizer::from_dir(dir, config.data.apply_chat_template)
        .map_err(|e| TrainError::config("reward.model_dir", e.to_string()))?;
    Ok(Some(Arc::new(tokenizer)))
}

/// The engines' role name.
const ENGINE: &str = "vllm_engine";

fn set_eval(metrics: &mut StepMetrics, result: &EvalResult) -> Result<()> {
    let set = |metrics: &mut StepMetrics, name: &str, value| -> Result<()> {
        metrics.set(name, value).map_err(telemetry_error)?;
        Ok(())
    };
    set(metrics, "eval/reward", result.mean_reward)?;
    set(metrics, "eval/accuracy", result.accuracy)?;
    set(metrics, "eval/response_length", result.response_length)?;
    let k = result.samples_per_prompt;
    if k > 1 {
        set(metrics, &format!("eval/mean@{k}"), result.mean_reward)?;
        set(metrics, &format!("eval/pass@{k}"), result.pass_at_k)?;
    }
    Ok(())
}

/// Held-out results of `rewards` and response `lengths`, `k` consecutive answers per prompt.
fn eval_result(rewards: &[f32], lengths: &[usize], k: usize) -> EvalResult {
    let n = rewards.len().max(1) as f64;
    let prompts = rewards.chunks(k.max(1));
    let passed = prompts.clone().filter(|answers| stages::full_reward_count(answers) > 0);
    EvalResult {
        mean_reward: rewards.iter().map(|&r| f64::from(r)).sum::<f64>() / n,
        accuracy: stages::full_reward_count(rewards) as f64 / n,
        response_length: lengths.iter().sum::<usize>() as f64 / n,
        pass_at_k: passed.count() as f64 / prompts.len().max(1) as f64,
        samples_per_prompt: k,
    }
}

/// Telemetry errors as trainer errors.
pub fn telemetry_error(e: rtrun_rlhf_telemetry::TelemetryError) -> TrainError {
    TrainError::Data(format!("metrics: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_out_results_by_hand() {
        // Two prompts, three answers each: prompt 0 scores 1, 0, 0 (passes), prompt 1 scores
        // 0.5, 0.5, 0 (no full reward). Mean reward 2/6, accuracy 1/6, pass@3 1/2.
        let rewards = [1.0, 0.0, 0.0, 0.5, 0.5, 0.0];
        let result = eval_result(&rewards, &[2, 4, 6, 2, 2, 2], 3);
        assert!((result.mean_reward - 2.0 / 6.0).abs() < 1e-12);
        assert!((result.accuracy - 1.0 / 6.0).abs() < 1e-12);
        assert!((result.pass_at_k - 0.5).abs() < 1e-12);
        assert!((result.response_length - 3.0).abs() < 1e-12);
        let mut metrics = StepMetrics::new(1);
        set_eval(&mut metrics, &result).unwrap();
        assert_eq!(metrics.get("eval/pass@3"), Some(0.5));
        assert_eq!(metrics.get("eval/mean@3"), Some(2.0 / 6.0));
        // One greedy answer: no @k metrics, pass@1 is the accuracy.
        let greedy = eval_result(&[1.0, 0.0], &[1, 1], 1);
        assert_eq!(greedy.pass_at_k, greedy.accuracy);
        let mut metrics = StepMetrics::new(1);
        set_eval(&mut metrics, &greedy).unwrap();
        assert_eq!(metrics.get("eval/pass@1"), None);
    }
}
