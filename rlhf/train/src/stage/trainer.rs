//! The trainers beside RL on the runtime: a data-parallel group of ranks — policy ranks
//! ([`LmWorker`]) for SFT and DPO (a DPO rank also holds the frozen reference), scalar-head ranks
//! ([`CriticWorker`]) for a reward model. The driver shuffles each epoch (seeded), splits every
//! global batch of units (samples, or (chosen, rejected) pairs) over the ranks by tokens, packs
//! and cuts it into micro-batches, and each rank takes one optimizer step with the gradients
//! all-reduced. Held-out metrics at the start, every `eval.every_steps` and at the end;
//! checkpoints (rank 0's weights and AdamW state plus the step) that a killed run resumes from
//! identically; the trained model exported as a Hugging Face directory (`final_policy/`, or
//! `final_reward_model/` as a `*ForSequenceClassification` checkpoint).

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use rtrun::ActorGroup;
use rtrun::colocation::SpecDeployment;
use rtrun_rlhf_model::train::{OptimizerConfig, ScheduleConfig};
use rtrun_rlhf_telemetry::{MetricsSink, MetricsWriter, PhaseTimer, StartMode, StepMetrics};

use crate::config::{Mode, WorkerThreads};
use crate::error::{Result, TrainError};
use crate::rng::SplitMix64;
use crate::roles::critic::{CriticWorker, CriticWorkerConfig};
use crate::roles::lm::{LmWorker, LmWorkerConfig, PolicyLossConfig};
use crate::roles::{ThreadPlan, WorkerSetup};
use crate::stage::config::StageConfig;
use crate::stage::data::{LoadedSamples, load_samples};
use crate::stage::losses::{PairStats, PreferenceLoss};
use crate::stage::pack::{PackedRow, Unit, loss_tokens, rank_batches};
use crate::tokenizer::HfTokenizer;
use crate::trainer::calls::{self, CallWatch};
use crate::trainer::checkpoint::{
    ResumePoint, STATE_FILE, export_atomically, prune, read_state, step_dir, write_checksums,
    write_state,
};
use crate::trainer::{ProgressObserver, RunPaths, telemetry_error};

use crate::stage::config::role_name as role;

/// Named held-out results (`loss`, and for pairs `accuracy`, `reward/margin`, ...).
pub type EvalMetrics = Vec<(String, f64)>;

/// What a checkpoint records besides the weights and optimizer state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Training units of the run (a checkpoint of another dataset is refused).
    pub samples: usize,
    /// Held-out results before training.
    pub baseline: Option<EvalMetrics>,
}

/// What a finished run did.
#[derive(Debug, Clone, PartialEq)]
pub struct StageReport {
    /// Steps of the run (resumed ones included).
    pub steps: u64,
    /// Held-out results before the first step.
    pub baseline: EvalMetrics,
    /// Held-out results after the last.
    pub final_eval: EvalMetrics,
    /// The trained model (Hugging Face directory).
    pub exported: PathBuf,
    /// Training and held-out units, and those dropped for `data.max_len`.
    pub samples: (usize, usize, (usize, usize)),
    /// Phase totals of the run.
    pub phases: Vec<rtrun_rlhf_telemetry::phase::PhaseTotal>,
}

/// The directory a mode's trained model is exported to.
pub fn export_dir(config: &StageConfig) -> PathBuf {
    let paths = RunPaths::new(&config.run_dir);
    match config.mode {
        Mode::Rm => paths.root.join("final_reward_model"),
        _ => paths.final_policy,
    }
}

/// The ranks of a run.
enum Ranks {
    /// Policy ranks (SFT, DPO).
    Lm(ActorGroup<LmWorker>),
    /// Scalar-head ranks (reward model).
    Scalar(ActorGroup<CriticWorker>),
}

/// The steps of a run: epochs × full batches, capped by `train.max_steps`.
pub fn total_steps(config: &StageConfig, samples: usize) -> u64 {
    let per_epoch = (samples / config.train.batch_size) as u64;
    let total = per_epoch * config.train.epochs as u64;
    config.train.max_steps.map_or(total, |m| m.min(total))
}

/// The order of the training samples in epoch `epoch` (a seeded shuffle).
fn epoch_order(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    let mut rng = SplitMix64::new(seed ^ 0x5F7_0000 ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    order
}

/// The run directory checks and the dataset, before any runtime work.
pub fn prepare(config: &StageConfig) -> Result<LoadedSamples> {
    let paths = RunPaths::new(&config.run_dir);
    crate::run::check_run_dir_with(config.overwrite, config.checkpoint.resume, &paths)?;
    let dir = config.model.pretrain.as_deref().unwrap_or(Path::new(""));
    let tokenizer = HfTokenizer::from_dir(dir, config.data.apply_chat_template)?;
    let samples = load_samples(&config.data, &tokenizer, config.seed, config.mode)?;
    if samples.train.len() < config.train.batch_size {
        return Err(TrainError::config(
            "train.batch_size",
            format!(
                "expected at most the {} training {} (one full batch per step), found {}",
                samples.train.len(),
                if config.mode == Mode::Sft { "samples" } else { "pairs" },
                config.train.batch_size
            ),
        ));
    }
    Ok(samples)
}

/// The runtime of the run: the cluster at `cluster.address` (or `RTRUN_ADDRESS`), else an
/// embedded single node.
pub fn start_runtime(config: &StageConfig) -> Result<()> {
    let address = crate::run::address_or_env(config.cluster.address.as_deref());
    let runtime = match &address {
        Some(address) => rtrun::Config { address: Some(address.clone()), ..Default::default() },
        None => rtrun::Config {
            num_cpus: config.cluster.num_cpus,
            num_gpus: Some(crate::run::embedded_gpus(
                config.cluster.num_gpus,
                config.cluster.fake_gpus,
            )?),
            ..Default::default()
        },
    };
    rtrun::init_with(runtime).map_err(|e| match address {
        Some(address) => TrainError::config(
            "cluster.address",
            format!("cannot join the cluster at {address}: {e}"),
        ),
        None => TrainError::Runtime(e),
    })
}

/// The DP ranks, each loading `model.pretrain` with its optimizer (and, for DPO, a frozen copy
/// as the reference; for a reward model, a fresh score head when the checkpoint has none).
fn create_ranks(
    config: &StageConfig,
    total: u64,
    deployment: Option<&SpecDeployment>,
) -> Result<Ranks> {
    let replicas = config.cluster.replicas;
    let role = role(config.mode);
    let threads = match config.cluster.threads_per_worker {
        WorkerThreads::Fixed(n) => ThreadPlan::Fixed(n),
        WorkerThreads::Auto => {
            ThreadPlan::Shared { experience: replicas as u32, train: replicas as u32 }
        }
    };
    let t = &config.train;
    let optimizer = OptimizerConfig {
        schedule: ScheduleConfig {
            peak_lr: t.lr,
            warmup_steps: (t.lr_warmup_ratio * total as f64).ceil() as u64,
            total_steps: total.max(1),
            min_lr_ratio: t.min_lr_ratio,
        },
        weight_decay: t.weight_decay,
        max_grad_norm: t.max_grad_norm,
        ..OptimizerConfig::default()
    };
    let setup = WorkerSetup::on(role, threads, &config.model.device, config.model.dtype);
    let model_dir = config.model.pretrain.clone().unwrap_or_default();
    let gpus = if config.model.device.is_cuda() { 1.0 } else { 0.0 };
    if config.mode == Mode::Rm {
        let worker = CriticWorkerConfig {
            setup,
            model_dir,
            optimizer,
            value_clip: 0.0,
            micro_batch_size: t.micro_batch_size,
            share_prompt: t.share_prompt,
            seed: config.seed,
            shard: t.shard(),
            lora: config.model.lora_setup(config.seed),
        };
        return Ok(Ranks::Scalar(ActorGroup::create(
            role,
            replicas,
            Default::default(),
            |r, o| CriticWorker::remote_with(placed(o, role, r, gpus, deployment)?, worker.clone()),
        )?));
    }
    let worker = LmWorkerConfig {
        setup,
        model_dir,
        optimizer: Some(optimizer),
        loss: PolicyLossConfig {
            clip: Default::default(),
            entropy_coef: 0.0,
            use_kl_loss: false,
            kl_estimator: Default::default(),
            micro_batch_size: t.micro_batch_size,
            share_prompt: t.share_prompt,
            ..Default::default()
        },
        with_reference: config.mode == Mode::Dpo,
        shard: t.shard(),
        lora: config.model.lora_setup(config.seed),
    };
    Ok(Ranks::Lm(ActorGroup::create(role, replicas, Default::default(), |r, o| {
        LmWorker::remote_with(placed(o, role, r, gpus, deployment)?, worker.clone())
    })?))
}

/// A rank's options: its worker process marked `RTRUN_RLHF_ROLE=<role>:<rank>`, as the RL
/// roles' are (for operators' `ps e`, and for tests that signal one rank); in its bundle of the
/// deployed placement spec, or asking for `gpus` GPUs without one.
fn placed(
    options: rtrun::ActorOptions,
    role: &str,
    rank: usize,
    gpus: f64,
    deployment: Option<&SpecDeployment>,
) -> rtrun::Result<rtrun::ActorOptions> {
    let options = options.env("RTRUN_RLHF_ROLE", &format!("{role}:{rank}"));
    match deployment {
        Some(d) => d.role(role).and_then(|r| r.options_for(rank, options)),
        None => Ok(options.num_gpus(gpus)),
    }
}

/// A trainer over created ranks.
pub struct StageTrainer {
    config: StageConfig,
    paths: RunPaths,
    train: Vec<Unit>,
    eval: Vec<Unit>,
    ranks: Ranks,
    /// The placement spec's groups, when the config names one.
    deployment: Option<SpecDeployment>,
    watch: CallWatch,
    /// The current epoch's shuffled order of the training units (`(epoch, order)`), drawn
    /// once per epoch rather than every step.
    order: Option<(u64, Vec<usize>)>,
    /// The resumable state.
    pub state: StageState,
    /// Phase timings.
    pub timer: PhaseTimer,
}

/// Calls every rank of `ranks` with its own share, whichever worker type they are.
macro_rules! each_rank {
    ($ranks:expr, $role:expr, $args:expr, |$m:ident, $a:ident| $call:expr) => {
        match $ranks {
            Ranks::Lm(g) => calls::each_with($role, g.members(), $args, |$m, $a| $call),
            Ranks::Scalar(g) => calls::each_with($role, g.members(), $args, |$m, $a| $call),
        }
    };
}

impl StageTrainer {
    /// Steps of the run.
    pub fn total_steps(&self) -> u64 {
        total_steps(&self.config, self.train.len())
    }

    fn role(&self) -> &'static str {
        role(self.config.mode)
    }

    fn world(&self) -> usize {
        match &self.ranks {
            Ranks::Lm(g) => g.members().len(),
            Ranks::Scalar(g) => g.members().len(),
        }
    }

    /// The global batch of `step` (1-based).
    fn batch(&mut self, step: u64) -> Vec<Unit> {
        let per_epoch = (self.train.len() / self.config.train.batch_size).max(1) as u64;
        let (epoch, index) = ((step - 1) / per_epoch, ((step - 1) % per_epoch) as usize);
        if self.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.order = Some((epoch, epoch_order(self.train.len(), self.config.seed, epoch)));
        }
        let order = self.order.as_ref().map_or(&[][..], |(_, o)| o.as_slice());
        let size = self.config.train.batch_size;
        order[index * size..(index + 1) * size].iter().map(|&i| self.train[i].clone()).collect()
    }

    /// The rank shares of `units`.
    fn shares(&self, units: Vec<Unit>) -> Vec<Vec<Vec<PackedRow>>> {
        rank_batches(
            units,
            self.world(),
            self.config.data.max_len,
            self.config.train.packing,
            self.config.train.share_prompt,
            self.config.train.micro_batch_size,
        )
    }

    /// The held-out results: the mean NLL per response token (SFT), or the pairs' mean loss,
    /// accuracy, rewards and margin.
    pub fn evaluate(&self) -> Result<EvalMetrics> {
        let shares = self.shares(self.eval.clone());
        let role = self.role();
        let pairs = match (&self.ranks, self.config.preference_loss()) {
            (Ranks::Lm(g), None) => {
                let calls =
                    calls::each_with(role, g.members(), shares, |m, s| m.supervised_eval(s));
                let answers = self.watch.wait("supervised_eval", calls)?;
                let (nll, tokens) = answers.iter().fold((0.0, 0), |(n, t), (a, b)| (n + a, t + b));
                return Ok(vec![("loss".into(), nll / tokens.max(1) as f64)]);
            }
            (ranks, loss) => {
                let loss = loss.unwrap_or(PreferenceLoss::BradleyTerry);
                let calls = each_rank!(ranks, role, shares, |m, s| m.preference_eval(s, loss));
                self.watch.wait("preference_eval", calls)?
            }
        };
        let sums = pairs.iter().fold(PairStats::default(), |a, b| a.plus(b));
        Ok(sums.means().into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }

    /// [`StageTrainer::evaluate`] as phase `eval` of the current step.
    fn timed_eval(&mut self) -> Result<EvalMetrics> {
        let phase = self.timer.start("eval");
        let result = self.evaluate();
        self.timer.stop(phase);
        result
    }

    /// One optimizer step: the step's metrics.
    fn train_step(&mut self, step: u64) -> Result<StepMetrics> {
        let units = self.batch(step);
        let pairs = units.len();
        let all_tokens: usize = units.iter().flatten().map(|s| s.ids.len()).sum();
        let shares = self.shares(units);
        let role = self.role();
        let started = Instant::now();
        let phase = self.timer.start("train");
        let mut values: Vec<(String, f64)> = Vec::new();
        let (grad_norm, lr) = match (&self.ranks, self.config.preference_loss()) {
            (Ranks::Lm(g), None) => {
                let global = shares.iter().map(|s| loss_tokens(s)).sum::<usize>();
                let calls = calls::each_with(role, g.members(), shares, |m, share| {
                    m.supervised_step(share, global)
                });
                let answers = self.watch.wait("supervised_step", calls)?;
                let (nll, tokens) =
                    answers.iter().fold((0.0, 0), |(n, t), a| (n + a.nll_sum, t + a.tokens));
                values.push(("loss".into(), nll / tokens.max(1) as f64));
                values.push(("response_tokens".into(), tokens as f64));
                let first = answers.first().copied().unwrap_or_default();
                (first.grad_norm, first.lr)
            }
            (ranks, loss) => {
                let loss = loss.unwrap_or(PreferenceLoss::BradleyTerry);
                let calls =
                    each_rank!(ranks, role, shares, |m, s| m.preference_step(s, pairs, loss));
                let answers = self.watch.wait("preference_step", calls)?;
                let sums = answers.iter().fold(PairStats::default(), |a, b| a.plus(b));
                values.extend(sums.means().into_iter().map(|(k, v)| (k.to_owned(), v)));
                let first = answers.first().copied().unwrap_or_default();
                (first.grad_norm, first.lr)
            }
        };
        self.timer.stop(phase);
        let seconds = started.elapsed().as_secs_f64();
        let per_epoch = (self.train.len() / self.config.train.batch_size).max(1) as u64;
        let mut metrics = StepMetrics::new(step);
        values.push(("grad_norm".into(), grad_norm));
        values.push(("lr".into(), lr));
        values.push(("epoch".into(), ((step - 1) / per_epoch) as f64));
        values.push(("tokens".into(), all_tokens as f64));
        values.push(("tokens_per_s".into(), all_tokens as f64 / seconds.max(1e-9)));
        for (k, v) in values {
            metrics.set(k, v).map_err(telemetry_error)?;
        }
        Ok(metrics)
    }

    /// Saves weights + optimizer state (rank 0: the ranks hold equal replicas) and the state.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let dir = step_dir(&self.paths.checkpoints, self.state.step)?;
        let model = dir.join("model");
        // Every rank is called: at zero_stage 0 rank 0 writes (the replicas are equal) and the
        // others return at once; at stages 1-3 each writes its shards.
        let dirs = vec![model; self.world()];
        let saves = each_rank!(&self.ranks, self.role(), dirs, |m, d| m.save_checkpoint(d));
        self.watch.wait("save_checkpoint", saves)?;
        write_checksums(&dir)?;
        write_state(&dir, &self.state)?;
        if let Some(keep) = self.config.checkpoint.keep_last {
            prune(&self.paths.checkpoints, keep)?;
        }
        Ok(dir)
    }

    /// Restores the newest checkpoint into every rank.
    fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let path = dir.join(STATE_FILE);
        let state: StageState = read_state(dir)?;
        if state.samples != self.train.len() {
            return Err(TrainError::Data(format!(
                "{}: the checkpoint was taken over {} training records, this run has {}",
                path.display(),
                state.samples,
                self.train.len()
            )));
        }
        let model = dir.join("model");
        let dirs = vec![model; self.world()];
        let loads = each_rank!(&self.ranks, self.role(), dirs, |m, d| m.load_checkpoint(d));
        self.watch.wait("load_checkpoint", loads)?;
        self.state = state;
        Ok(())
    }

    /// Runs the remaining steps into `sink`, then exports the model.
    pub fn fit(
        &mut self,
        sink: &mut dyn MetricsSink,
        progress: &mut dyn ProgressObserver,
    ) -> Result<StageReport> {
        let total = self.total_steps();
        let record_eval = |metrics: &mut StepMetrics, eval: &EvalMetrics| -> Result<()> {
            for (k, v) in eval {
                metrics.set(format!("eval/{k}"), *v).map_err(telemetry_error)?;
            }
            Ok(())
        };
        let baseline = match &self.state.baseline {
            Some(baseline) => baseline.clone(),
            None => {
                progress.phase("eval");
                let baseline = self.timed_eval()?;
                let _ = self.timer.finish_step();
                let mut metrics = StepMetrics::new(0);
                record_eval(&mut metrics, &baseline)?;
                sink.record(&metrics).map_err(telemetry_error)?;
                self.state.baseline = Some(baseline.clone());
                baseline
            }
        };
        let mut last_eval = None;
        while self.state.step < total {
            let step = self.state.step + 1;
            progress.phase("train");
            let mut metrics = self.train_step(step)?;
            let every = self.config.eval.every_steps;
            if step == total || (every > 0 && step.is_multiple_of(every)) {
                progress.phase("eval");
                let eval = self.timed_eval()?;
                record_eval(&mut metrics, &eval)?;
                last_eval = Some(eval);
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
        let final_eval = match last_eval {
            Some(eval) => eval,
            None => self.evaluate()?,
        };
        progress.phase("export");
        let exported = self.export(&export_dir(&self.config))?;
        Ok(StageReport {
            steps: self.state.step,
            baseline,
            final_eval,
            exported,
            samples: (self.train.len(), self.eval.len(), (0, 0)),
            phases: self.timer.totals().to_vec(),
        })
    }

    /// Writes rank 0's model to `dir` as a Hugging Face directory (beside it, then renamed).
    /// Every rank is called: at zero_stage 3 they gather the model for rank 0 to write.
    pub fn export(&self, dir: &Path) -> Result<PathBuf> {
        export_atomically(dir, |tmp| {
            let dirs = vec![tmp; self.world()];
            let call = each_rank!(&self.ranks, self.role(), dirs, |m, d| m.export(d));
            self.watch.wait("export", call).map(|_| ())
        })
    }

    /// Stops the ranks.
    pub fn kill(&self) {
        let _ = match &self.ranks {
            Ranks::Lm(g) => g.kill(),
            Ranks::Scalar(g) => g.kill(),
        };
        if let Some(deployment) = &self.deployment {
            let _ = deployment.remove();
        }
    }
}

/// The whole run after [`prepare`]: runtime, ranks, resume (from `resume`, the checkpoint
/// [`crate::trainer::checkpoint::resume_from`] chose), fit, export. The trainer is returned for
/// its timings; its ranks are stopped on failure.
pub fn run_prepared(
    config: &StageConfig,
    samples: LoadedSamples,
    resume: Option<&ResumePoint>,
    progress: &mut dyn ProgressObserver,
) -> Result<(StageTrainer, StageReport)> {
    let paths = RunPaths::new(&config.run_dir);
    let LoadedSamples { train, eval, dropped_too_long } = samples;
    let total = total_steps(config, train.len());
    start_runtime(config)?;
    let deployment = match &config.cluster.placement_spec {
        Some(path) => Some(crate::placement_map::deploy(&crate::placement_map::read_spec(path)?)?),
        None => None,
    };
    let ranks = create_ranks(config, total, deployment.as_ref())?;
    let placed = match &deployment {
        Some(d) => {
            let names = crate::placement_map::node_names();
            crate::placement_map::describe(d, |id| {
                names.get(id).cloned().unwrap_or_else(|| id.to_owned())
            })
        }
        None => vec![format!(
            "{}: {} rank(s) on {}",
            role(config.mode),
            config.cluster.replicas,
            config.model.device.0
        )],
    };
    progress.placed(&placed);
    let mut trainer = StageTrainer {
        state: StageState { step: 0, samples: train.len(), baseline: None },
        config: config.clone(),
        paths: paths.clone(),
        train,
        eval,
        ranks,
        deployment,
        watch: CallWatch::from_config(&config.cluster.as_cluster()),
        order: None,
        timer: PhaseTimer::new(),
    };
    let outcome = (|| {
        let resume = match resume {
            Some(point) => {
                trainer.load_checkpoint(&point.dir)?;
                StartMode::Resume { next_step: trainer.state.step + 1 }
            }
            None => StartMode::Overwrite,
        };
        let mut writer = MetricsWriter::create(&paths.root, resume).map_err(telemetry_error)?;
        trainer.fit(&mut writer, progress)
    })();
    match outcome {
        Ok(mut report) => {
            report.samples.2 = dropped_too_long;
            Ok((trainer, report))
        }
        Err(e) => {
            trainer.kill();
            Err(e)
        }
    }
}
