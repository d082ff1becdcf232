//! The critic role (values per response token, trained with the clipped value loss) and the
//! reward-model role (a scalar at the last real token), both on the scalar-head model.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

use rtrun_rlhf_model::ScalarHeadModel;
use rtrun_rlhf_model::train::OptimizerConfig;
use rtrun_rlhf_shard::manager::Mode;
use rtrun_rlhf_shard::{GroupComm, ShardConfig, ShardedModel, ZeroStage};

use crate::algo::{self, LossAggregation};
use crate::experience::{
    ExperienceRow, Sequence, pad_rows, response_batch, shared_prompt_batch, training_order,
    unpad_rows,
};
use crate::roles::{Phase, WorkerSetup, shard_scalar_head};
use crate::stage::losses::{PairStats, PreferenceLoss, pair_sums, preference_losses};
use crate::stage::pack::{PackedRow, row_tensors};

/// Constructor argument of [`CriticWorker`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CriticWorkerConfig {
    /// Process setup.
    pub setup: WorkerSetup,
    /// A causal-LM or scalar-head checkpoint (a fresh head is drawn when it has none).
    pub model_dir: PathBuf,
    /// Optimizer settings.
    pub optimizer: OptimizerConfig,
    /// Value clip.
    pub value_clip: f64,
    /// Sequences per forward/backward.
    pub micro_batch_size: usize,
    /// Lay each prompt out once per micro-batch (`train.share_prompt`).
    #[serde(default = "crate::roles::lm::share_prompt_default")]
    pub share_prompt: bool,
    /// Seed of a fresh head.
    pub seed: u64,
    /// ZeRO stage and activation checkpointing.
    #[serde(default)]
    pub shard: ShardConfig,
    /// LoRA adapters on the trunk, the score head trained whole (`model.lora` of `--mode
    /// rm`).
    #[serde(default)]
    pub lora: Option<crate::roles::lm::LoraSetup>,
}

/// What one critic training call did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CriticTrainStats {
    /// Clipped value loss.
    pub value_loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate.
    pub lr: f64,
}

/// A critic rank.
pub struct CriticWorker {
    state: std::sync::Mutex<CriticWorkerState>,
}

/// The tensors and settings of a [`CriticWorker`].
struct CriticWorkerState {
    setup: WorkerSetup,
    /// The directory the model was loaded from (its tokenizer files go with an export).
    source_dir: PathBuf,
    model: ScalarHeadModel,
    /// The model's shards, hooks and optimizer.
    sharded: ShardedModel,
    value_clip: f64,
    micro_batch_size: usize,
    share_prompt: bool,
    /// Whether the trunk has LoRA adapters over frozen weights.
    lora: bool,
}

fn to_string_error(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl CriticWorkerState {
    /// Loads the critic.
    fn create(config: CriticWorkerConfig) -> Result<CriticWorkerState, String> {
        config.setup.apply();
        let mut model = ScalarHeadModel::from_pretrained(
            &config.model_dir,
            config.setup.device(),
            config.setup.kind(),
            config.seed,
        )
        .map_err(|e| format!("loading {}: {e}", config.model_dir.display()))?;
        if let Some(lora) = &config.lora {
            lora.apply(&mut model).map_err(|e| format!("{}: {e}", config.setup.role))?;
        }
        let lora = model.lora.is_some();
        let group = GroupComm::from_group_context().map_err(to_string_error)?;
        let sharded = shard_scalar_head(
            &model,
            config.shard,
            group,
            Some(config.optimizer),
            &config.setup.role,
        )?;
        Ok(CriticWorkerState {
            setup: config.setup,
            source_dir: config.model_dir,
            model,
            sharded,
            value_clip: config.value_clip,
            micro_batch_size: config.micro_batch_size.max(1),
            share_prompt: config.share_prompt,
            lora,
        })
    }

    /// Values of the states before each response token.
    pub fn values(&self, sequences: Vec<Sequence>) -> Result<Vec<Vec<f32>>, String> {
        self.setup.enter(Phase::Experience);
        let run = || -> crate::Result<Vec<Vec<f32>>> {
            let mut out = Vec::with_capacity(sequences.len());
            let chunks: Vec<&[Sequence]> = sequences.chunks(self.micro_batch_size).collect();
            let passes = self.sharded.balance(chunks.len(), false)?;
            tch::no_grad(|| -> crate::Result<()> {
                let device = self.model.params.device();
                for chunk in &chunks {
                    let refs: Vec<&Sequence> = chunk.iter().collect();
                    let values = if self.share_prompt {
                        shared_prompt_batch(&refs, device)?.action_values(&self.model)?
                    } else {
                        self.model.action_values(&response_batch(&refs, device)?)?
                    };
                    self.model.backbone.release_parameters()?;
                    let lengths: Vec<usize> = chunk.iter().map(|s| s.response_ids.len()).collect();
                    out.extend(unpad_rows(&values, &lengths)?);
                }
                Ok(())
            })?;
            for _ in chunks.len()..passes {
                self.sharded.idle_forward()?;
            }
            Ok(out)
        };
        run().map_err(to_string_error)
    }

    /// One optimizer step of the clipped value loss on this rank's share of a mini-batch.
    pub fn train(
        &mut self,
        rows: Vec<ExperienceRow>,
        global_tokens: usize,
    ) -> Result<CriticTrainStats, String> {
        self.setup.enter(Phase::Train);
        self.train_impl(&rows, global_tokens).map_err(to_string_error)
    }

    /// Saves the critic and its optimizer state: at stage 0 rank 0 writes the model and the
    /// optimizer (the other ranks nothing), at stages 1-3 every rank its shards. Every rank of
    /// the group is called.
    pub fn save_checkpoint(&mut self, dir: PathBuf) -> Result<(), String> {
        let rank = self.sharded.rank_and_world().0;
        let base = self.source_dir.display().to_string();
        let lora = self.lora;
        let saved = match self.sharded.whole_optimizer() {
            Some(_) if rank != 0 => Ok(()),
            // The adapters, the score head and their optimizer state.
            Some(opt) if lora => self
                .model
                .save_adapter(&dir, &base)
                .and_then(|()| opt.save(&dir.join(rtrun_rlhf_model::train::OPTIMIZER_FILE)))
                .map_err(to_string_error),
            Some(opt) => self
                .model
                .save_pretrained(&dir, &Default::default())
                .and_then(|()| opt.save(&dir.join(rtrun_rlhf_model::train::OPTIMIZER_FILE)))
                .map_err(to_string_error),
            None => self.sharded.save_sharded(&dir).map_err(to_string_error),
        };
        saved.map_err(|e| format!("saving {}: {e}", dir.display()))
    }

    /// Loads what [`CriticWorker::save_checkpoint`] saved.
    pub fn load_checkpoint(&mut self, dir: PathBuf) -> Result<(), String> {
        let stage = self.sharded.config().stage;
        let sharded_save = rtrun_rlhf_shard::checkpoint::is_sharded_checkpoint(&dir);
        let loaded = match (sharded_save, stage) {
            (true, ZeroStage::Zero) => Err(format!(
                "it is a sharded (zero_stage >= 1) save; resume it with train.zero_stage 1, 2 or \
                 3, not {stage}"
            )),
            (true, _) => self.sharded.load_sharded(&dir).map_err(to_string_error),
            (false, ZeroStage::Zero) => self.load_whole(&dir).map_err(to_string_error),
            (false, _) => Err(format!(
                "it holds no sharded save ({} is missing): a zero_stage 0 save resumes with \
                 train.zero_stage 0, not {stage}",
                rtrun_rlhf_shard::checkpoint::MANIFEST_FILE
            )),
        };
        loaded.map_err(|e| format!("loading {}: {e}", dir.display()))
    }

    /// Loads a stage-0 save (the model and `optimizer.safetensors`; with LoRA the adapter
    /// directory instead of the model).
    fn load_whole(&mut self, dir: &std::path::Path) -> rtrun_rlhf_model::Result<()> {
        crate::roles::check_adapter_save(dir, self.lora, "model.lora")
            .map_err(rtrun_rlhf_model::ModelError::Config)?;
        if self.lora {
            self.model.load_adapter_weights(dir)?;
            if let Some(opt) = self.sharded.whole_optimizer() {
                opt.load(&dir.join(rtrun_rlhf_model::train::OPTIMIZER_FILE))?;
            }
            self.sharded.relayout()?;
            return Ok(());
        }
        let loaded = ScalarHeadModel::from_pretrained(
            dir,
            self.model.params.device(),
            self.setup.kind(),
            0,
        )?;
        tch::no_grad(|| -> rtrun_rlhf_model::Result<()> {
            for (name, value) in loaded.named_parameters() {
                self.model.params.copy_into(name, value)?;
            }
            Ok(())
        })?;
        if let Some(opt) = self.sharded.whole_optimizer() {
            opt.load(&dir.join(rtrun_rlhf_model::train::OPTIMIZER_FILE))?;
        }
        // The loaded moments are new tensors: the sharding manager's stale buffers go.
        self.sharded.relayout()?;
        Ok(())
    }

    /// Moves parameters, gradients and AdamW state to host memory while the engines generate
    /// (see [`crate::roles::lm::LmWorker::offload`]): at stage 0 the sharding manager's
    /// `Infer` mode, a copy into separate host buffers on a CPU rank too.
    pub fn offload(&mut self) -> Result<(), String> {
        self.setup.offloaded = true;
        self.move_to(Mode::Infer)?;
        rtrun_rlhf_model::cuda::empty_cache().map_err(to_string_error)
    }

    /// Brings training state back to the training device.
    pub fn onload(&mut self) -> Result<(), String> {
        self.setup.offloaded = false;
        self.move_to(Mode::Train)
    }

    /// Brings the parameters back for forward passes only (gradients and AdamW state stay in
    /// host buffers until `train`).
    pub fn prepare_forward(&mut self) -> Result<(), String> {
        self.setup.offloaded = false;
        self.move_to(Mode::Forward)
    }

    /// As the policy's: stage 0 through the sharding manager; at stages 1-3 a CPU rank has
    /// nothing to move and a GPU rank is refused.
    fn move_to(&mut self, mode: Mode) -> Result<(), String> {
        if self.sharded.config().stage != ZeroStage::Zero {
            if self.setup.device() == Device::Cpu {
                return Ok(());
            }
            return Err("offloading a GPU rank's training state is not supported with \
                        train.zero_stage >= 1 yet"
                .into());
        }
        self.sharded.transition(mode).map(drop).map_err(to_string_error)
    }
}
#[rtrun::actor(pub)]
impl CriticWorker {
    /// Loads the critic.
    pub fn new(config: CriticWorkerConfig) -> Result<Self, String> {
        CriticWorkerState::create(config)
            .map(|state| CriticWorker { state: std::sync::Mutex::new(state) })
    }

    /// One reward-model optimizer step (Bradley–Terry) on this rank's micro-batches of
    /// (chosen, rejected) rows, of a global batch of `global_pairs` pairs (every rank is called
    /// with its share: gradients are all-reduced).
    pub fn preference_step(
        &mut self,
        batches: Vec<Vec<PackedRow>>,
        global_pairs: usize,
        loss: PreferenceLoss,
    ) -> Result<PairStats, String> {
        bradley_terry(loss)?;
        self.state().preference_step(&batches, global_pairs).map_err(to_string_error)
    }

    /// Reward-model sums over held-out pairs.
    pub fn preference_eval(
        &self,
        batches: Vec<Vec<PackedRow>>,
        loss: PreferenceLoss,
    ) -> Result<PairStats, String> {
        bradley_terry(loss)?;
        self.state().preference_eval(&batches).map_err(to_string_error)
    }

    /// Saves the model as a Hugging Face `*ForSequenceClassification` directory with the
    /// tokenizer files of the directory it was loaded from.
    pub fn export(&self, dir: PathBuf) -> Result<(), String> {
        self.state().export(dir)
    }

    /// Values of the states before each response token.
    pub fn values(&self, sequences: Vec<Sequence>) -> Result<Vec<Vec<f32>>, String> {
        self.state().values(sequences)
    }

    /// One optimizer step of the clipped value loss on this rank's share of a mini-batch.
    pub fn train(
        &mut self,
        rows: Vec<ExperienceRow>,
        global_tokens: usize,
    ) -> Result<CriticTrainStats, String> {
        self.state().train(rows, global_tokens)
    }

    /// Saves the critic and its optimizer state (every rank of the group is called).
    pub fn save_checkpoint(&self, dir: PathBuf) -> Result<(), String> {
        self.state().save_checkpoint(dir)
    }

    /// Loads what `save_checkpoint` saved.
    pub fn load_checkpoint(&mut self, dir: PathBuf) -> Result<(), String> {
        self.state().load_checkpoint(dir)
    }

    /// Offloads training state to host memory (a no-op move on CPU).
    pub fn offload(&mut self) -> Result<(), String> {
        self.state().offload()
    }

    /// Brings training state back to the training device.
    pub fn onload(&mut self) -> Result<(), String> {
        self.state().onload()
    }

    /// Brings the parameters back for forward passes only (the hybrid engine's experience
    /// phase); `train` brings the rest.
    pub fn prepare_forward(&mut self) -> Result<(), String> {
        self.state().prepare_forward()
    }
}

/// Tensors are `Send` but not `Sync`, and the runtime shares an actor between its executor
/// threads, so the state sits behind a mutex (uncontended: the runtime runs one call at a time
/// unless `max_concurrency` says otherwise).
impl CriticWorker {
    fn state(&self) -> std::sync::MutexGuard<'_, CriticWorkerState> {
        // A panic inside a call cannot leave the tensors half-updated in a way the next call
        // would not report, so a poisoned lock is taken over.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A scalar-head rank trains a reward model with the Bradley–Terry loss only.
fn bradley_terry(loss: PreferenceLoss) -> Result<(), String> {
    match loss {
        PreferenceLoss::BradleyTerry => Ok(()),
        other => Err(format!("a reward-model rank trains with Bradley–Terry, asked for {other:?}")),
    }
}

impl CriticWorkerState {
    /// Finishes the gradients over the rank's group (all-reduce or the shards' reductions),
    /// then one AdamW step.
    fn reduce_and_step(&mut self) -> crate::Result<rtrun_rlhf_model::train::StepStats> {
        self.sharded.step().map_err(|e| crate::TrainError::role(&self.setup.role, e.to_string()))
    }

    /// Bradley–Terry on the pairs of `rows`: the score at each sample's last token (its EOS),
    /// per-pair losses (with the graph) and the micro-batch's sums.
    fn pair_losses(&self, rows: &[PackedRow]) -> crate::Result<(tch::Tensor, PairStats)> {
        let t = row_tensors(rows, self.model.params.device())?;
        let last = t.at_last_tokens(&t.hidden(&self.model.backbone)?)?;
        let scores = self.model.score.forward(&last)?.f_squeeze_dim(-1)?.f_to_kind(Kind::Float)?;
        let pairs = scores.f_view([-1, 2])?;
        let (chosen, rejected) = (pairs.f_select(1, 0)?, pairs.f_select(1, 1)?);
        let (losses, c, r) = preference_losses(&chosen, &rejected, PreferenceLoss::BradleyTerry)?;
        let mut sums = pair_sums(&losses.f_detach()?, &c, &r)?;
        sums.tokens = rows.iter().map(PackedRow::len).sum();
        Ok((losses, sums))
    }

    fn preference_step(
        &mut self,
        batches: &[Vec<PackedRow>],
        global_pairs: usize,
    ) -> crate::Result<PairStats> {
        self.setup.enter(Phase::Train);
        let dp_size = rtrun::context()?.group.map(|g| g.world_size).unwrap_or(1);
        self.sharded.zero_grad()?;
        let passes = self.sharded.balance(batches.len(), true)?;
        let scale = dp_size as f64 / global_pairs.max(1) as f64;
        let mut stats = PairStats::default();
        for rows in batches {
            let (losses, sums) = self.pair_losses(rows)?;
            stats = stats.plus(&sums);
            self.model.backward(&losses.f_sum(Kind::Float)?.f_mul_scalar(scale)?)?;
        }
        for _ in batches.len()..passes {
            self.sharded.idle_training_pass()?;
        }
        let step = self.reduce_and_step()?;
        stats.grad_norm = step.grad_norm;
        stats.lr = step.lr;
        Ok(stats)
    }

    fn preference_eval(&self, batches: &[Vec<PackedRow>]) -> crate::Result<PairStats> {
        self.setup.enter(Phase::Experience);
        let passes = self.sharded.balance(batches.len(), false)?;
        let stats = tch::no_grad(|| -> crate::Result<PairStats> {
            let mut stats = PairStats::default();
            for rows in batches {
                stats = stats.plus(&self.pair_losses(rows)?.1);
                self.model.backbone.release_parameters()?;
            }
            Ok(stats)
        })?;
        for _ in batches.len()..passes {
            self.sharded.idle_forward()?;
        }
        Ok(stats)
    }

    /// Every rank of the group is called: at stage 3 they gather the model, rank 0 writes it.
    fn export(&self, dir: PathBuf) -> Result<(), String> {
        let rank = self.sharded.rank_and_world().0;
        self.sharded.gather_all().map_err(to_string_error)?;
        let written = if rank == 0 {
            let base = self.source_dir.display().to_string();
            self.model
                .save_pretrained(&dir, &Default::default())
                .and_then(|()| {
                    crate::roles::lm::copy_tokenizer_files(
                        &self.source_dir,
                        &dir,
                        self.model.config(),
                    )
                })
                .and_then(|()| match self.lora {
                    true => {
                        self.model.save_adapter(&dir.join(crate::roles::lm::ADAPTER_DIR), &base)
                    }
                    false => Ok(()),
                })
                .map_err(|e| format!("saving {}: {e}", dir.display()))
        } else {
            Ok(())
        };
        written.and(self.sharded.release_all().map_err(to_string_error))
    }

    fn train_impl(
        &mut self,
        rows: &[ExperienceRow],
        global_tokens: usize,
    ) -> crate::Result<CriticTrainStats> {
        // Hybrid engine: the experience passes ran in `Forward` (gradients and AdamW state
        // still in host buffers); training needs them back.
        if self.sharded.mode().is_some_and(|mode| mode != Mode::Train) {
            self.sharded.transition(Mode::Train)?;
        }
        let device = self.model.params.device();
        let dp_size = rtrun::context()?.group.map(|g| g.world_size).unwrap_or(1);
        let aggregation = LossAggregation::GlobalTokenMean {
            batch_num_tokens: global_tokens.max(1) as f64,
            dp_size,
        };
        self.sharded.zero_grad()?;
        let mut stats = CriticTrainStats::default();
        // As the policy's: the responses to one prompt share micro-batches, which leaves the
        // summed loss as it is.
        let rows = training_order(rows, self.share_prompt);
        let chunks: Vec<&[&ExperienceRow]> = rows.chunks(self.micro_batch_size).collect();
        let passes = self.sharded.balance(chunks.len(), true)?;
        for &chunk in &chunks {
            let sequences: Vec<&Sequence> = chunk.iter().map(|r| &r.sequence).collect();
            let (values, action_mask) = if self.share_prompt {
                let batch = shared_prompt_batch(&sequences, device)?;
                (batch.action_values(&self.model)?, batch.action_mask)
            } else {
                let batch = response_batch(&sequences, device)?;
                (self.model.action_values(&batch)?, batch.action_mask)
            };
            let width = action_mask.size()[1];
            let column = |f: fn(&ExperienceRow) -> &[f32]| -> crate::Result<tch::Tensor> {
                let rows: Vec<&[f32]> = chunk.iter().map(|r| f(r)).collect();
                pad_rows(&rows, width, device)
            };
            let old_values = column(|r| &r.values)?;
            let returns = column(|r| &r.returns)?;
            let mask = action_mask.f_to_kind(Kind::Float)?;
            let loss = algo::value_loss(
                &values,
                &old_values,
                &returns,
                &mask,
                Some(self.value_clip),
                aggregation,
            )?;
            stats.value_loss += loss.f_double_value(&[])?;
            self.model.backward(&loss)?;
        }
        for _ in chunks.len()..passes {
            self.sharded.idle_training_pass()?;
        }
        let step = self.reduce_and_step()?;
        stats.grad_norm = step.grad_norm;
        stats.lr = step.lr;
        Ok(stats)
    }
}

/// Constructor argument of [`RewardModelWorker`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RewardModelConfig {
    /// Process setup.
    pub setup: WorkerSetup,
    /// A scalar-head checkpoint.
    pub model_dir: PathBuf,
    /// Sequences per forward.
    pub micro_batch_size: usize,
    /// ZeRO stage (a reward model rank at stage 3 holds 1/N of the parameters).
    #[serde(default)]
    pub shard: ShardConfig,
}

/// A reward-model rank (OpenRLHF's model-based reward).
pub struct RewardModelWorker {
    state: std::sync::Mutex<RewardModelWorkerState>,
}

/// The tensors and settings of a [`RewardModelWorker`].
struct RewardModelWorkerState {
    model: ScalarHeadModel,
    sharded: ShardedModel,
    micro_batch_size: usize,
}

impl RewardModelWorkerState {
    /// Loads the reward model.
    fn create(config: RewardModelConfig) -> Result<RewardModelWorkerState, String> {
        config.setup.apply();
        let model = ScalarHeadModel::from_pretrained(
            &config.model_dir,
            config.setup.device(),
            config.setup.kind(),
            0,
        )
        .map_err(|e| format!("loading {}: {e}", config.model_dir.display()))?;
        model.params.set_requires_grad(false).map_err(to_string_error)?;
        let group = GroupComm::from_group_context().map_err(to_string_error)?;
        let shard = ShardConfig { gradient_checkpointing: false, ..config.shard };
        let sharded = shard_scalar_head(&model, shard, group, None, &config.setup.role)?;
        Ok(RewardModelWorkerState {
            model,
            sharded,
            micro_batch_size: config.micro_batch_size.max(1),
        })
    }

    /// The score of each full sequence (read at its last real token).
    pub fn rewards(&self, sequences: Vec<Sequence>) -> Result<Vec<f32>, String> {
        let run = || -> crate::Result<Vec<f32>> {
            let mut out = Vec::with_capacity(sequences.len());
            let chunks: Vec<&[Sequence]> = sequences.chunks(self.micro_batch_size).collect();
            let passes = self.sharded.balance(chunks.len(), false)?;
            tch::no_grad(|| -> crate::Result<()> {
                for chunk in &chunks {
                    let refs: Vec<&Sequence> = chunk.iter().collect();
                    let batch = response_batch(&refs, self.model.params.device())?;
                    let scores = self.model.rewards(&batch.input_ids, &batch.attention_mask)?;
                    self.model.backbone.release_parameters()?;
                    out.extend(Vec::<f32>::try_from(
                        scores.f_to_kind(Kind::Float)?.f_to_device(tch::Device::Cpu)?,
                    )?);
                }
                Ok(())
            })?;
            for _ in chunks.len()..passes {
                self.sharded.idle_forward()?;
            }
            Ok(out)
        };
        run().map_err(to_string_error)
    }
}

#[rtrun::actor(pub)]
impl RewardModelWorker {
    /// Loads the reward model.
    pub fn new(config: RewardModelConfig) -> Result<Self, String> {
        RewardModelWorkerState::create(config)
            .map(|state| RewardModelWorker { state: std::sync::Mutex::new(state) })
    }

    /// The score of each full sequence (read at its last real token).
    pub fn rewards(&self, sequences: Vec<Sequence>) -> Result<Vec<f32>, String> {
        self.state().rewards(sequences)
    }
}

/// Tensors are `Send` but not `Sync`, and the runtime shares an actor between its executor
/// threads, so the state sits behind a mutex (uncontended: the runtime runs one call at a time
/// unless `max_concurrency` says otherwise).
impl RewardModelWorker {
    fn state(&self) -> std::sync::MutexGuard<'_, RewardModelWorkerState> {
        // A panic inside a call cannot leave the tensors half-updated in a way the next call
        // would not report, so a poisoned lock is taken over.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
