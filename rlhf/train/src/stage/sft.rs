//! Supervised fine-tuning (`train --mode sft`): a data-parallel group of policy ranks
//! ([`LmWorker`]) on the runtime; the driver shuffles each epoch (seeded), splits every global
//! batch over the ranks by tokens, packs and cuts it into micro-batches, and each rank takes one
//! optimizer step with the gradients all-reduced. Held-out loss at the start, every
//! `eval.every_steps` and at the end; checkpoints (every rank's weights and AdamW state from
//! rank 0, plus the step) that a killed run resumes from identically; the trained model
//! exported as a Hugging Face directory.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use rtrun::ActorGroup;
use rtrun_rlhf_model::train::{OptimizerConfig, ScheduleConfig};
use rtrun_rlhf_telemetry::{MetricsSink, MetricsWriter, PhaseTimer, StartMode, StepMetrics};

use crate::config::WorkerThreads;
use crate::error::{Result, TrainError};
use crate::rng::SplitMix64;
use crate::roles::lm::{LmWorker, LmWorkerConfig, LmWorkerRef, PolicyLossConfig};
use crate::roles::{ThreadPlan, WorkerSetup};
use crate::stage::config::StageConfig;
use crate::stage::data::{LoadedSamples, load_samples};
use crate::stage::pack::{Sample, loss_tokens, rank_batches};
use crate::tokenizer::HfTokenizer;
use crate::trainer::calls::{self, CallWatch};
use crate::trainer::checkpoint::{STATE_FILE, newest, prune};
use crate::trainer::{ProgressObserver, RunPaths, telemetry_error};

/// The role name of the SFT ranks (in messages and `rtrun list actors`).
const ROLE: &str = "sft";

/// What a checkpoint records besides the weights and optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SftState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Training samples of the run (a checkpoint of another dataset is refused).
    pub samples: usize,
    /// Held-out loss before training.
    pub baseline_eval_loss: Option<f64>,
}

/// What a finished run did.
#[derive(Debug, Clone, PartialEq)]
pub struct SftReport {
    /// Steps of the run (resumed ones included).
    pub steps: u64,
    /// Held-out loss before the first step.
    pub baseline_eval_loss: f64,
    /// Held-out loss after the last.
    pub final_eval_loss: f64,
    /// The trained model (Hugging Face directory).
    pub exported: PathBuf,
    /// Training and held-out samples, and those dropped for `data.max_len`.
    pub samples: (usize, usize, (usize, usize)),
    /// Phase totals of the run.
    pub phases: Vec<rtrun_rlhf_telemetry::phase::PhaseTotal>,
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
    let samples = load_samples(&config.data, &tokenizer, config.seed)?;
    if samples.train.len() < config.train.batch_size {
        return Err(TrainError::config(
            "train.batch_size",
            format!(
                "expected at most the {} training samples (one full batch per step), found {}",
                samples.train.len(),
                config.train.batch_size
            ),
        ));
    }
    Ok(samples)
}

/// The runtime of the run: the cluster at `cluster.address` (or `RTRUN_ADDRESS`), else an
/// embedded single node.
fn start_runtime(config: &StageConfig) -> Result<()> {
    let address = config.cluster.address.clone().or_else(|| {
        std::env::var(rtrun::cluster::ADDRESS_ENV).ok().filter(|a| !a.trim().is_empty())
    });
    let runtime = match &address {
        Some(address) => rtrun::Config { address: Some(address.clone()), ..Default::default() },
        None => rtrun::Config {
            num_cpus: config.cluster.num_cpus,
            num_gpus: Some(config.cluster.num_gpus),
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

/// The DP ranks, each loading `model.pretrain` with its optimizer.
fn create_ranks(config: &StageConfig, total: u64) -> Result<ActorGroup<LmWorker>> {
    let replicas = config.cluster.replicas;
    let threads = match config.cluster.threads_per_worker {
        WorkerThreads::Fixed(n) => ThreadPlan::Fixed(n),
        WorkerThreads::Auto => {
            ThreadPlan::Shared { experience: replicas as u32, train: replicas as u32 }
        }
    };
    let t = &config.train;
    let worker = LmWorkerConfig {
        setup: WorkerSetup::on(ROLE, threads, &config.model.device, config.model.dtype),
        model_dir: config.model.pretrain.clone().unwrap_or_default(),
        optimizer: Some(OptimizerConfig {
            schedule: ScheduleConfig {
                peak_lr: t.lr,
                warmup_steps: (t.lr_warmup_ratio * total as f64).ceil() as u64,
                total_steps: total.max(1),
                min_lr_ratio: t.min_lr_ratio,
            },
            weight_decay: t.weight_decay,
            max_grad_norm: t.max_grad_norm,
            ..OptimizerConfig::default()
        }),
        loss: PolicyLossConfig {
            clip: Default::default(),
            entropy_coef: 0.0,
            use_kl_loss: false,
            kl_estimator: Default::default(),
            micro_batch_size: t.micro_batch_size,
        },
    };
    let gpus = if config.model.device.is_cuda() { 1.0 } else { 0.0 };
    Ok(ActorGroup::create(ROLE, replicas, Default::default(), |_, options| {
        LmWorker::remote_with(options.num_gpus(gpus), worker.clone())
    })?)
}

/// A supervised trainer over created ranks.
pub struct SftTrainer {
    config: StageConfig,
    paths: RunPaths,
    train: Vec<Sample>,
    eval: Vec<Sample>,
    ranks: ActorGroup<LmWorker>,
    watch: CallWatch,
    /// The resumable state.
    pub state: SftState,
    /// Phase timings.
    pub timer: PhaseTimer,
}

impl SftTrainer {
    /// Steps of the run.
    pub fn total_steps(&self) -> u64 {
        total_steps(&self.config, self.train.len())
    }

    fn rank0(&self) -> Result<&LmWorkerRef> {
        self.ranks.members().first().ok_or_else(|| TrainError::role(ROLE, "the group is empty"))
    }

    /// The global batch of `step` (1-based).
    fn batch(&self, step: u64) -> Vec<Sample> {
        let per_epoch = (self.train.len() / self.config.train.batch_size).max(1) as u64;
        let (epoch, index) = ((step - 1) / per_epoch, ((step - 1) % per_epoch) as usize);
        let order = epoch_order(self.train.len(), self.config.seed, epoch);
        let size = self.config.train.batch_size;
        order[index * size..(index + 1) * size].iter().map(|&i| self.train[i].clone()).collect()
    }

    /// The rank shares of `samples`.
    fn shares(&self, samples: Vec<Sample>) -> Vec<Vec<Vec<crate::stage::pack::PackedRow>>> {
        rank_batches(
            samples,
            self.ranks.members().len(),
            self.config.data.max_len,
            self.config.train.packing,
            self.config.train.micro_batch_size,
        )
    }

    /// Mean NLL per response token over the held-out samples.
    pub fn evaluate(&self) -> Result<f64> {
        let shares = self.shares(self.eval.clone());
        let calls = calls::each_with(ROLE, self.ranks.members(), shares, |m, share| {
            m.supervised_eval(share)
        });
        let answers = self.watch.wait("supervised_eval", calls)?;
        let (nll, tokens) = answers.iter().fold((0.0, 0), |(n, t), (a, b)| (n + a, t + b));
        Ok(nll / tokens.max(1) as f64)
    }

    /// [`SftTrainer::evaluate`] as phase `eval` of the current step.
    fn timed_eval(&mut self) -> Result<f64> {
        let phase = self.timer.start("eval");
        let loss = self.evaluate();
        self.timer.stop(phase);
        loss
    }

    /// One optimizer step: the step's metrics.
    fn train_step(&mut self, step: u64) -> Result<StepMetrics> {
        let samples = self.batch(step);
        let all_tokens: usize = samples.iter().map(|s| s.ids.len()).sum();
        let shares = self.shares(samples);
        let global = shares.iter().map(|s| loss_tokens(s)).sum::<usize>();
        let started = Instant::now();
        let phase = self.timer.start("train");
        let calls = calls::each_with(ROLE, self.ranks.members(), shares, |m, share| {
            m.supervised_step(share, global)
        });
        let answers = self.watch.wait("supervised_step", calls)?;
        self.timer.stop(phase);
        let seconds = started.elapsed().as_secs_f64();
        let (nll, tokens) =
            answers.iter().fold((0.0, 0), |(n, t), a| (n + a.nll_sum, t + a.tokens));
        let first = answers.first().copied().unwrap_or_default();
        let per_epoch = (self.train.len() / self.config.train.batch_size).max(1) as u64;
        let mut metrics = StepMetrics::new(step);
        let set =
            |m: &mut StepMetrics, k: &str, v: f64| m.set(k, v).map(|_| ()).map_err(telemetry_error);
        set(&mut metrics, "loss", nll / tokens.max(1) as f64)?;
        set(&mut metrics, "grad_norm", first.grad_norm)?;
        set(&mut metrics, "lr", first.lr)?;
        set(&mut metrics, "epoch", ((step - 1) / per_epoch) as f64)?;
        set(&mut metrics, "tokens", all_tokens as f64)?;
        set(&mut metrics, "response_tokens", tokens as f64)?;
        set(&mut metrics, "tokens_per_s", all_tokens as f64 / seconds.max(1e-9))?;
        Ok(metrics)
    }

    /// Saves weights + optimizer state (rank 0: the ranks hold equal replicas) and the state.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let dir = self.paths.checkpoints.join(format!("step_{:06}", self.state.step));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| TrainError::io(&dir, e))?;
        }
        std::fs::create_dir_all(&dir).map_err(|e| TrainError::io(&dir, e))?;
        let rank0 = self.rank0()?;
        let save = rank0.save_checkpoint(dir.join("model"));
        self.watch.wait_one("save_checkpoint", calls::actor_call(ROLE, 0, rank0, save))?;
        let state =
            serde_json::to_vec_pretty(&self.state).map_err(|e| TrainError::Data(e.to_string()))?;
        let tmp = dir.join(format!("{STATE_FILE}.tmp"));
        std::fs::write(&tmp, state).map_err(|e| TrainError::io(&tmp, e))?;
        std::fs::rename(&tmp, dir.join(STATE_FILE)).map_err(|e| TrainError::io(&dir, e))?;
        if let Some(keep) = self.config.checkpoint.keep_last {
            prune(&self.paths.checkpoints, keep)?;
        }
        Ok(dir)
    }

    /// Restores the newest checkpoint into every rank.
    fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let path = dir.join(STATE_FILE);
        let text = std::fs::read(&path).map_err(|e| TrainError::io(&path, e))?;
        let state: SftState = serde_json::from_slice(&text).map_err(|e| {
            TrainError::Data(format!(
                "{}: expected an SFT trainer state, found {e}",
                path.display()
            ))
        })?;
        if state.samples != self.train.len() {
            return Err(TrainError::Data(format!(
                "{}: the checkpoint was taken over {} training samples, this run has {}",
                path.display(),
                state.samples,
                self.train.len()
            )));
        }
        let model = dir.join("model");
        let loads = calls::each(ROLE, self.ranks.members(), |m| m.load_checkpoint(model.clone()));
        self.watch.wait("load_checkpoint", loads)?;
        self.state = state;
        Ok(())
    }

    /// Runs the remaining steps into `sink`, then exports the model.
    pub fn fit(
        &mut self,
        sink: &mut dyn MetricsSink,
        progress: &mut dyn ProgressObserver,
    ) -> Result<SftReport> {
        let total = self.total_steps();
        let baseline = match self.state.baseline_eval_loss {
            Some(loss) => loss,
            None => {
                progress.phase("eval");
                let loss = self.timed_eval()?;
                let _ = self.timer.finish_step();
                let mut metrics = StepMetrics::new(0);
                metrics.set("eval/loss", loss).map_err(telemetry_error)?;
                sink.record(&metrics).map_err(telemetry_error)?;
                self.state.baseline_eval_loss = Some(loss);
                loss
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
                let loss = self.timed_eval()?;
                metrics.set("eval/loss", loss).map_err(telemetry_error)?;
                last_eval = Some(loss);
            }
            let phases = self.timer.finish_step();
            metrics.extend_prefixed("time/", phases.seconds()).map_err(telemetry_error)?;
            sink.record(&metrics).map_err(telemetry_error)?;
            progress.step_done(&metrics, &phases);
            self.state.step = step;
            let every = self.config.checkpoint.every_steps;
            if every > 0 && step.is_multiple_of(every) {
                progress.phase("checkpoint");
                self.save_checkpoint()?;
            }
        }
        let final_eval_loss = match last_eval {
            Some(loss) => loss,
            None => self.evaluate()?,
        };
        progress.phase("export");
        let exported = self.export(&self.paths.final_policy)?;
        Ok(SftReport {
            steps: self.state.step,
            baseline_eval_loss: baseline,
            final_eval_loss,
            exported,
            samples: (self.train.len(), self.eval.len(), (0, 0)),
            phases: self.timer.totals().to_vec(),
        })
    }

    /// Writes rank 0's model to `dir` as a Hugging Face directory (beside it, then renamed).
    pub fn export(&self, dir: &Path) -> Result<PathBuf> {
        let rank0 = self.rank0()?;
        let tmp = dir.with_extension("tmp");
        for d in [&tmp, &dir.to_path_buf()] {
            if d.exists() {
                std::fs::remove_dir_all(d).map_err(|e| TrainError::io(d, e))?;
            }
        }
        let call = calls::actor_call(ROLE, 0, rank0, rank0.export(tmp.clone()));
        self.watch.wait_one("export", call)?;
        std::fs::rename(&tmp, dir).map_err(|e| TrainError::io(dir, e))?;
        Ok(dir.to_path_buf())
    }

    /// Stops the ranks.
    pub fn kill(&self) {
        let _ = self.ranks.kill();
    }
}

/// The whole run after [`prepare`]: runtime, ranks, resume, fit, export. The trainer is
/// returned for its timings; its ranks are stopped on failure.
pub fn run_prepared(
    config: &StageConfig,
    samples: LoadedSamples,
    progress: &mut dyn ProgressObserver,
) -> Result<(SftTrainer, SftReport)> {
    let paths = RunPaths::new(&config.run_dir);
    let LoadedSamples { train, eval, dropped_too_long } = samples;
    let total = total_steps(config, train.len());
    start_runtime(config)?;
    let ranks = create_ranks(config, total)?;
    progress.placed(&[format!(
        "{ROLE}: {} rank(s) on {}",
        config.cluster.replicas, config.model.device.0
    )]);
    let mut trainer = SftTrainer {
        state: SftState { step: 0, samples: train.len(), baseline_eval_loss: None },
        config: config.clone(),
        paths: paths.clone(),
        train,
        eval,
        ranks,
        watch: CallWatch::from_config(&config.cluster.as_cluster()),
        timer: PhaseTimer::new(),
    };
    let outcome = (|| {
        let resume = match newest(&paths.checkpoints)? {
            Some(dir) if config.checkpoint.resume => {
                trainer.load_checkpoint(&dir)?;
                StartMode::Resume { next_step: trainer.state.step + 1 }
            }
            _ => StartMode::Overwrite,
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
