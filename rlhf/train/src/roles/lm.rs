//! The policy (`actor`) and reference (`ref`) role actors: one causal LM per DP rank.
//!
//! The reference rank only computes log-probs. A policy rank also trains: PPO clipped loss over
//! micro-batches with gradient accumulation, the gradients all-reduced (mean) across the DP ranks
//! of its group with the runtime's collective, then one AdamW step; and it serves its weights in
//! buckets for the engines.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use rtrun_rlhf_model::train::OptimizerConfig;
use rtrun_rlhf_model::{CausalLm, LoraConfig};
use rtrun_rlhf_shard::manager::Mode;
use rtrun_rlhf_shard::{GroupComm, ShardConfig, ShardStats, ShardedModel, ZeroStage};

use crate::algo::{self, ClipConfig, KlEstimator, LossAggregation};
use crate::experience::{
    ExperienceRow, Sequence, pad_rows, response_batch, shared_prompt_batch, training_order,
    unpad_rows,
};
use crate::roles::{Phase, WorkerSetup, shard_model};
use rtrun_rlhf_engine::tp::{TpLayout, reshard};
use rtrun_rlhf_engine::{WeightBucket, WeightMeta, WeightSyncGroup};

mod supervised;
mod weight_slices;
pub use supervised::SupervisedStats;

use crate::stage::losses::{PairStats, PreferenceLoss};
use crate::stage::pack::PackedRow;

/// How a policy rank computes its loss.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyLossConfig {
    /// PPO clip range.
    pub clip: ClipConfig,
    /// Entropy bonus coefficient.
    pub entropy_coef: f64,
    /// KL to the reference model as a loss term.
    pub use_kl_loss: bool,
    /// KL estimator of the loss term.
    pub kl_estimator: KlEstimator,
    /// Sequences per forward/backward.
    pub micro_batch_size: usize,
    /// Micro-batches by token budget instead of `micro_batch_size` sequences
    /// ([`crate::experience::token_budget_batches`]; `train.micro_batch_tokens`).
    #[serde(default)]
    pub micro_batch_tokens: Option<usize>,
    /// Lay each prompt out once for all the responses to it in a micro-batch
    /// ([`crate::experience::SharedPromptBatch`]; `train.share_prompt`).
    #[serde(default = "share_prompt_default")]
    pub share_prompt: bool,
    /// How per-token losses become one number (`algo.loss_agg_mode`).
    #[serde(default)]
    pub loss_agg_mode: crate::config::LossAggMode,
    /// The generation budget, `seq-mean-token-sum-norm`'s constant length.
    #[serde(default)]
    pub max_new_tokens: usize,
}

/// What a policy step's losses are normalised by: the global mini-batch (every DP rank's rows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalBatch {
    /// Response tokens.
    pub tokens: usize,
    /// Sequences.
    pub sequences: usize,
}

pub(crate) fn share_prompt_default() -> bool {
    true
}

/// Constructor argument of [`LmWorker`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LmWorkerConfig {
    /// Process setup (role name, threads, device).
    pub setup: WorkerSetup,
    /// Hugging Face directory to load.
    pub model_dir: PathBuf,
    /// Optimizer settings; `None` makes a frozen (reference) rank.
    pub optimizer: Option<OptimizerConfig>,
    /// Loss settings (policy ranks).
    pub loss: PolicyLossConfig,
    /// Also hold a frozen copy of the model as the reference (DPO ranks).
    pub with_reference: bool,
    /// ZeRO stage and activation checkpointing (`train.zero_stage`,
    /// `train.gradient_checkpointing`).
    #[serde(default)]
    pub shard: ShardConfig,
    /// LoRA adapters over the frozen model (`policy.lora`, `policy.lora_adapter`). The
    /// reference of such a rank is its model with the adapters off, not a second copy.
    #[serde(default)]
    pub lora: Option<LoraSetup>,
}

/// The adapters a trained rank starts with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraSetup {
    /// Fresh adapters' settings (`policy.lora`); unused when `adapter` is given.
    pub config: Option<LoraConfig>,
    /// A `peft` adapter directory to start from (`policy.lora_adapter`).
    pub adapter: Option<PathBuf>,
    /// Seed of fresh adapters' `A`.
    pub seed: u64,
}

impl LoraSetup {
    /// Puts the adapters on `model` (freezing its base weights).
    pub fn apply(&self, model: &mut impl rtrun_rlhf_model::lora::LoraModel) -> Result<(), String> {
        match (&self.adapter, &self.config) {
            (Some(dir), config) => {
                model
                    .load_adapter(dir)
                    .map_err(|e| format!("loading the LoRA adapter {}: {e}", dir.display()))?;
                // The directory holds no training settings peft does not keep; the config's
                // dropout applies to the continued training.
                if let Some(config) = config {
                    model.set_lora_dropout(config.dropout);
                }
                Ok(())
            }
            (None, Some(config)) => {
                model.add_lora(config, self.seed).map_err(|e| format!("adding LoRA adapters: {e}"))
            }
            (None, None) => Ok(()),
        }
    }
}

/// What one policy training call did (means over micro-batches, this rank).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyTrainStats {
    /// PPO policy loss.
    pub policy_loss: f64,
    /// Fraction of tokens whose ratio was clipped.
    pub clip_fraction: f64,
    /// Approximate KL between the new and the old policy.
    pub approx_kl: f64,
    /// KL to the reference (when computed).
    pub ref_kl: f64,
    /// Mean token entropy.
    pub entropy: f64,
    /// Gradient norm before clipping (after the all-reduce).
    pub grad_norm: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Forward/backward passes (micro-batches) of the step on this rank.
    #[serde(default)]
    pub micro_batches: f64,
}

/// A policy or reference rank.
pub struct LmWorker {
    state: std::sync::Mutex<LmWorkerState>,
}

/// The tensors and settings of a [`LmWorker`].
struct LmWorkerState {
    setup: WorkerSetup,
    /// The directory the model was loaded from (its tokenizer files go with every save).
    source_dir: PathBuf,
    model: CausalLm,
    /// The model's shards, hooks and optimizer (stage 0: the whole model and AdamW).
    sharded: ShardedModel,
    /// The frozen reference of a DPO rank, sharded as the model is (none with LoRA: the
    /// reference is then the model with its adapters off).
    reference: Option<(CausalLm, ShardedModel)>,
    /// Whether the model has LoRA adapters over a frozen base.
    lora: bool,
    /// Whether this rank trains (has an optimizer).
    trains: bool,
    loss: PolicyLossConfig,
    /// The weight-sync groups with the engines (policy rank 0 only), once joined: one group,
    /// or with tensor-parallel engines one per engine rank (`weight_sync[r]` carries rank `r`'s
    /// shards to rank `r` of every engine), in the order joined.
    weight_sync: Vec<rtrun::collective::Communicator>,
    /// CUDA IPC weight sync: the bucket plan of the sync in progress and the exported buffer
    /// of its current bucket (kept until the engines have copied it).
    ipc_plans: Vec<rtrun_rlhf_engine::weight_ipc::IpcBucketPlan>,
    ipc_buffer: Option<tch::Tensor>,
}

fn to_string_error(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl LmWorkerState {
    /// Loads the model; a config with an optimizer makes a trainable rank.
    fn create(config: LmWorkerConfig) -> Result<LmWorkerState, String> {
        config.setup.apply();
        let device = config.setup.device();
        let mut model = CausalLm::from_pretrained(&config.model_dir, device, config.setup.kind())
            .map_err(|e| format!("loading {}: {e}", config.model_dir.display()))?;
        if let Some(lora) = &config.lora {
            lora.apply(&mut model).map_err(|e| format!("{}: {e}", config.setup.role))?;
        }
        let lora = model.lora_parameters().is_some();
        let trains = config.optimizer.is_some();
        if !trains {
            model.params.set_requires_grad(false).map_err(to_string_error)?;
            if let Some(adapters) = model.lora_parameters() {
                adapters.set_requires_grad(false).map_err(to_string_error)?;
            }
        }
        let group = GroupComm::from_group_context().map_err(to_string_error)?;
        let role = &config.setup.role;
        let sharded =
            shard_model(&model, config.shard, group.clone(), config.optimizer.clone(), role)?;
        let reference = if config.with_reference && !lora {
            let frozen = CausalLm::from_pretrained(&config.model_dir, device, config.setup.kind())
                .map_err(|e| {
                    format!("loading the reference {}: {e}", config.model_dir.display())
                })?;
            frozen.params.set_requires_grad(false).map_err(to_string_error)?;
            let sharded = shard_model(&frozen, config.shard, group, None, role)?;
            Some((frozen, sharded))
        } else {
            None
        };
        Ok(LmWorkerState {
            setup: config.setup,
            source_dir: config.model_dir,
            model,
            sharded,
            reference,
            lora,
            trains,
            loss: config.loss,
            weight_sync: Vec::new(),
            ipc_plans: Vec::new(),
            ipc_buffer: None,
        })
    }

    /// Log-probs of every response token, one vector per sequence (no gradients).
    pub fn log_probs(&self, sequences: Vec<Sequence>) -> Result<Vec<Vec<f32>>, String> {
        self.setup.enter(Phase::Experience);
        self.log_probs_impl(&sequences).map_err(to_string_error)
    }

    /// The reference's log-probs of every response token: this rank's model with its LoRA
    /// adapters off, which is the base model (no gradients).
    pub fn reference_log_probs(&self, sequences: Vec<Sequence>) -> Result<Vec<Vec<f32>>, String> {
        if !self.lora {
            return Err(format!(
                "{}: reference_log_probs needs LoRA adapters (the reference is the model with \
                 them off)",
                self.setup.role
            ));
        }
        self.setup.enter(Phase::Experience);
        let _base = BaseOnly::new(&self.model);
        self.log_probs_impl(&sequences).map_err(to_string_error)
    }

    /// One optimizer step on this rank's share of a global mini-batch of `global_tokens`
    /// response tokens (every rank of the group must be called with its share, since the
    /// gradients are all-reduced).
    pub fn train(
        &mut self,
        rows: Vec<ExperienceRow>,
        kl_coef: f64,
        global: GlobalBatch,
    ) -> Result<PolicyTrainStats, String> {
        self.setup.enter(Phase::Train);
        self.train_impl(&rows, kl_coef, global).map_err(to_string_error)
    }

    /// The weights (Hugging Face names, f32) in buckets of at most `bucket_bytes`, each put
    /// into the object store by this rank; engines resolve the references themselves, so the
    /// bytes go from this worker to each engine without passing through the driver.
    pub fn weight_buckets(
        &self,
        bucket_bytes: usize,
    ) -> Result<Vec<rtrun::ObjectRef<WeightBucket>>, String> {
        // f32 as trained: the engines' weights must equal the policy's bit for bit (the run
        // logs the engine/policy log-prob gap every step). At stage 0 the parameters are
        // views of the sharding manager's buffers: a bucket is one read of one slice.
        let slices = match self.lora {
            // Only the adapted projections change: they travel, merged.
            true => None,
            false => {
                self.sharded.param_buckets(bucket_bytes.max(1) as u64).map_err(to_string_error)?
            }
        };
        let buckets = match slices {
            None if self.lora => {
                let tensors = self.sync_tensors().map_err(to_string_error)?;
                WeightBucket::split(tensors.into_iter().map(Ok), bucket_bytes, None)
                    .map_err(to_string_error)?
            }
            Some(slices) => slices
                .iter()
                .map(weight_slices::bucket_from_slice)
                .collect::<Result<Vec<_>, String>>()?,
            None => WeightBucket::split_model(&self.model, bucket_bytes, None)
                .map_err(to_string_error)?,
        };
        buckets.iter().map(|b| rtrun::put(b).map_err(to_string_error)).collect()
    }

    /// An address and a free port for the weight-sync rendezvous, which this rank hosts as
    /// rank 0: its node's IP (the engines may be on other nodes).
    pub fn weight_sync_endpoint(&self) -> Result<(String, u16), String> {
        let addr = rtrun::context().map_err(to_string_error)?.node_ip.to_string();
        let listener = std::net::TcpListener::bind((addr.as_str(), 0))
            .map_err(|e| format!("finding a free port on {addr}: {e}"))?;
        let port = listener.local_addr().map_err(to_string_error)?.port();
        Ok((addr, port))
    }

    /// Joins the weight-sync group as its rank 0.
    pub fn join_weight_sync(&mut self, group: WeightSyncGroup) -> Result<(), String> {
        self.weight_sync.push(group.join().map_err(to_string_error)?);
        Ok(())
    }

    /// Name, shape and dtype of every tensor a sync sends (every parameter; with LoRA the
    /// adapted projections), in broadcast order.
    pub fn weight_metadata(&self) -> Result<Vec<WeightMeta>, String> {
        match self.lora {
            true => {
                let tensors = self.sync_tensors().map_err(to_string_error)?;
                rtrun_rlhf_engine::weight_sync::metas_of(&tensors).map_err(to_string_error)
            }
            false => WeightMeta::of_model(&self.model).map_err(to_string_error),
        }
    }

    /// What a weight sync sends: every parameter, or with LoRA only the projections the
    /// adapters change, merged (`W + scale B A`), with the unadapted members of a q/k/v or
    /// gate/up group one of them is in (engines of several ranks receive those packed).
    fn sync_tensors(&self) -> crate::Result<Vec<(String, Tensor)>> {
        let all = self.model.named_parameters();
        if !self.lora {
            return Ok(all.map(|(n, t)| (n.to_owned(), t.shallow_clone())).collect());
        }
        let merged: std::collections::HashMap<String, Tensor> =
            self.model.merged_projections()?.into_iter().collect();
        let group = |name: &str| {
            let target = reshard::engine_param(name);
            target.packed.map(|_| target.name)
        };
        let groups: std::collections::HashSet<String> =
            merged.keys().filter_map(|n| group(n)).collect();
        Ok(all
            .filter_map(|(name, tensor)| match merged.get(name) {
                Some(value) => Some((name.to_owned(), value.shallow_clone())),
                None => group(name)
                    .filter(|g| groups.contains(g))
                    .map(|_| (name.to_owned(), tensor.shallow_clone())),
            })
            .collect())
    }

    /// The weights for engines of `tp` ranks: every engine rank's own buckets of at most
    /// `bucket_bytes` (its shard in the engine layout, q/k/v and gate/up packed, see
    /// [`rtrun_rlhf_engine::tp::reshard`]), put into the object store by this rank, with the
    /// bytes each rank receives and the time the resharding took. With `tp` 1 the one rank's
    /// buckets are [`LmWorkerState::weight_buckets`]'.
    pub fn engine_weight_buckets(
        &self,
        bucket_bytes: usize,
        tp: usize,
    ) -> Result<EngineBuckets, String> {
        let started = std::time::Instant::now();
        if tp <= 1 {
            let by_rank = vec![self.weight_buckets(bucket_bytes)?];
            let bytes = match self.lora {
                true => self
                    .sync_tensors()
                    .map_err(to_string_error)?
                    .iter()
                    .map(|(_, t)| tensor_bytes(t))
                    .sum(),
                false => self.model.named_parameters().map(|(_, t)| tensor_bytes(t)).sum(),
            };
            let seconds = started.elapsed().as_secs_f64();
            return Ok(EngineBuckets {
                by_rank,
                bytes_by_rank: vec![bytes],
                reshard_seconds: seconds,
            });
        }
        let layout = TpLayout::new(self.model.config(), tp).map_err(to_string_error)?;
        let tensors = self.sync_tensors().map_err(to_string_error)?;
        let params: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let buckets = tch::no_grad(|| reshard::engine_buckets(&layout, &params, bucket_bytes))
            .map_err(to_string_error)?;
        let reshard_seconds = started.elapsed().as_secs_f64();
        let bytes_by_rank =
            buckets.iter().map(|rank| rank.iter().map(|b| b.num_bytes() as u64).sum()).collect();
        let by_rank = buckets
            .iter()
            .map(|rank| rank.iter().map(|b| rtrun::put(b).map_err(to_string_error)).collect())
            .collect::<Result<_, String>>()?;
        Ok(EngineBuckets { by_rank, bytes_by_rank, reshard_seconds })
    }

    /// Broadcasts the weights to the weight-sync group in buckets of about `bucket_bytes`
    /// (the engines call `receive_weights` at the same time). Returns the bytes sent.
    pub fn broadcast_weights(&mut self, bucket_bytes: usize) -> Result<usize, String> {
        let tensors = match self.lora {
            true => Some(self.sync_tensors().map_err(to_string_error)?),
            false => None,
        };
        let comm =
            self.weight_sync.first_mut().ok_or("broadcast_weights needs join_weight_sync first")?;
        match tensors {
            Some(tensors) => {
                rtrun_rlhf_engine::weight_sync::send_tensors(comm, &tensors, bucket_bytes)
            }
            None => rtrun_rlhf_engine::weight_sync::send_weights(comm, &self.model, bucket_bytes),
        }
        .map_err(to_string_error)
    }

    /// Rank `rank` of engines of `tp` ranks: its shard in the engine layout
    /// ([`rtrun_rlhf_engine::tp::reshard::engine_tensors`]), with names, from this rank's
    /// whole weights.
    fn engine_tensors(
        &self,
        tp: usize,
        rank: usize,
    ) -> Result<Vec<(String, Tensor)>, rtrun_rlhf_engine::EngineError> {
        let layout = TpLayout::new(self.model.config(), tp)?;
        let tensors = self
            .sync_tensors()
            .map_err(|e| rtrun_rlhf_engine::EngineError::InvalidArgument(e.to_string()))?;
        let params = tensors.iter().map(|(n, t)| (n.as_str(), t));
        tch::no_grad(|| reshard::engine_tensors(&layout, rank, params))
    }

    /// The metadata of every engine rank's shard, for engines of `tp` ranks (`result[r]` is
    /// what rank `r` of every engine receives).
    pub fn engine_weight_metadata(&self, tp: usize) -> Result<Vec<Vec<WeightMeta>>, String> {
        (0..tp)
            .map(|rank| {
                let tensors = self.engine_tensors(tp, rank).map_err(to_string_error)?;
                rtrun_rlhf_engine::weight_sync::metas_of(&tensors).map_err(to_string_error)
            })
            .collect()
    }

    /// Broadcasts engine rank `rank`'s shard (engines of `tp` ranks) over the weight-sync group
    /// joined for that rank (rank `rank` of every engine calls `receive_weights` with its
    /// metadata at the same time). Returns the bytes sent.
    pub fn broadcast_engine_weights(
        &mut self,
        bucket_bytes: usize,
        tp: usize,
        rank: usize,
    ) -> Result<usize, String> {
        let tensors = self.engine_tensors(tp, rank).map_err(to_string_error)?;
        let joined = self.weight_sync.len();
        let comm = self.weight_sync.get_mut(rank).ok_or_else(|| {
            format!(
                "broadcast_engine_weights for engine rank {rank} needs its group, {joined} joined"
            )
        })?;
        rtrun_rlhf_engine::weight_sync::send_tensors(comm, &tensors, bucket_bytes)
            .map_err(to_string_error)
    }

    /// Starts a CUDA IPC weight sync: plans the parameters into buckets of about
    /// `bucket_bytes` and returns how many there are.
    pub fn plan_ipc_weights(&mut self, bucket_bytes: usize) -> Result<usize, String> {
        if self.lora {
            return Err("a CUDA IPC weight sync sends the whole model; with LoRA use \
                        rollout.weight_sync_backend nccl or object_store"
                .into());
        }
        let metas = WeightMeta::of_model(&self.model).map_err(to_string_error)?;
        self.ipc_buffer = None;
        self.ipc_plans = rtrun_rlhf_engine::weight_ipc::plan_buckets(&metas, bucket_bytes)
            .map_err(to_string_error)?;
        Ok(self.ipc_plans.len())
    }

    /// Packs and exports bucket `index` of the planned sync (the previous bucket's buffer is
    /// released: the engines have copied it).
    pub fn export_ipc_bucket(
        &mut self,
        index: usize,
    ) -> Result<rtrun_rlhf_engine::IpcWeightBucket, String> {
        self.ipc_buffer = None;
        let plan = self.ipc_plans.get(index).ok_or_else(|| {
            format!("bucket {index} of a {}-bucket IPC weight sync", self.ipc_plans.len())
        })?;
        let (buffer, bucket) = rtrun_rlhf_engine::weight_ipc::export_bucket(&self.model, plan)
            .map_err(to_string_error)?;
        self.ipc_buffer = Some(buffer);
        Ok(bucket)
    }

    /// Ends the CUDA IPC weight sync: releases the last buffer and gives its memory back.
    pub fn finish_ipc_weights(&mut self) -> Result<(), String> {
        self.ipc_buffer = None;
        self.ipc_plans.clear();
        rtrun_rlhf_model::cuda::empty_cache().map_err(to_string_error)
    }

    /// The CUDA caching allocator's statistics of this rank's device (`None` on the CPU).
    pub fn cuda_memory(&self, reset_peak: bool) -> Option<rtrun_rlhf_model::cuda::CudaMemory> {
        rtrun_rlhf_model::cuda::memory_on(self.setup.device(), reset_peak)
    }

    /// Saves a training checkpoint into `dir`. Every rank of the group is called: at stage 0
    /// rank 0 writes the model (Hugging Face layout, with the tokenizer files of the directory
    /// it was loaded from) and the optimizer state, the others nothing (they hold the same);
    /// at stages 1-3 every rank writes its shards ([`rtrun_rlhf_shard::checkpoint`]). A frozen
    /// rank exports its model.
    pub fn save_checkpoint(&mut self, dir: PathBuf) -> Result<(), String> {
        if !self.trains {
            return self.export(dir);
        }
        let rank = self.sharded.rank_and_world().0;
        let base = self.source_dir.display().to_string();
        let lora = self.lora;
        let saved = match self.sharded.whole_optimizer() {
            Some(_) if rank != 0 => Ok(()),
            // The adapters and their optimizer state: the base comes from `pretrain` again.
            Some(opt) if lora => self
                .model
                .save_adapter(&dir, &base)
                .and_then(|()| opt.save(&dir.join(rtrun_rlhf_model::train::OPTIMIZER_FILE)))
                .map_err(to_string_error),
            Some(opt) => rtrun_rlhf_model::train::save_training_checkpoint(
                &dir,
                &self.model,
                opt,
                &Default::default(),
            )
            .and_then(|()| copy_tokenizer_files(&self.source_dir, &dir, self.model.config()))
            .map_err(to_string_error),
            None => self.sharded.save_sharded(&dir).map_err(to_string_error),
        };
        saved.map_err(|e| format!("saving {}: {e}", dir.display()))
    }

    /// Saves the model as a Hugging Face directory that `transformers` and `policy.pretrain`
    /// load: config, safetensors, tokenizer files and generation config. Every rank of the
    /// group is called: at stage 3 they gather the model together, then rank 0 writes it.
    /// With LoRA the weights are merged, and the adapters also go into `dir/adapter` as a
    /// `peft` directory (`PeftModel.from_pretrained(base, dir/adapter)`).
    pub fn export(&self, dir: PathBuf) -> Result<(), String> {
        let rank = self.sharded.rank_and_world().0;
        self.sharded.gather_all().map_err(to_string_error)?;
        let written = if rank == 0 {
            let base = self.source_dir.display().to_string();
            self.model
                .save_pretrained(&dir, &Default::default())
                .and_then(|()| copy_tokenizer_files(&self.source_dir, &dir, self.model.config()))
                .and_then(|()| match self.lora {
                    true => self.model.save_adapter(&dir.join(ADAPTER_DIR), &base),
                    false => Ok(()),
                })
                .map_err(|e| format!("saving {}: {e}", dir.display()))
        } else {
            Ok(())
        };
        let released = self.sharded.release_all().map_err(to_string_error);
        written.and(released)
    }

    /// Loads what [`LmWorker::save_checkpoint`] saved (sharded saves on any number of ranks),
    /// and refuses weights that are not finite.
    pub fn load_checkpoint(&mut self, dir: PathBuf) -> Result<(), String> {
        let loaded = self.load_checkpoint_files(&dir).and_then(|()| {
            if !self.trains {
                return Ok(());
            }
            // Every rank looks at the whole model (stage 3 gathers it, as a weight sync does).
            self.sharded.gather_all().map_err(to_string_error)?;
            let adapters = self.model.lora_parameters().map(|p| p.named()).into_iter().flatten();
            let finite = super::require_finite(self.model.named_parameters().chain(adapters));
            let released = self.sharded.release_all().map_err(to_string_error);
            finite.and(released)
        });
        loaded.map_err(|e| format!("loading {}: {e}", dir.display()))
    }

    fn load_checkpoint_files(&mut self, dir: &Path) -> Result<(), String> {
        let sharded_save = rtrun_rlhf_shard::checkpoint::is_sharded_checkpoint(dir);
        let stage = self.sharded.config().stage;
        if self.trains && !sharded_save {
            super::check_adapter_save(dir, self.lora, "policy.lora")?;
        }
        match (self.trains, sharded_save, stage) {
            (true, true, ZeroStage::Zero) => Err(format!(
                "it is a sharded (zero_stage >= 1) save; resume it with train.zero_stage 1, 2 or \
                 3, not {stage}"
            )),
            (true, true, _) => self.sharded.load_sharded(dir).map_err(to_string_error),
            (true, false, ZeroStage::Zero) => {
                let params = &self.model.params;
                let lora = self.lora;
                match self.sharded.whole_optimizer() {
                    Some(opt) if lora => self
                        .model
                        .load_adapter_weights(dir)
                        .and_then(|()| opt.load(&dir.join(rtrun_rlhf_model::train::OPTIMIZER_FILE)))
                        .map_err(to_string_error),
                    Some(opt) => {
                        rtrun_rlhf_model::train::load_training_checkpoint(dir, params, opt)
                            .map_err(to_string_error)
                    }
                    None => Err("a trained rank without an optimizer".into()),
                }
                // The loaded moments are new tensors: the manager's stale buffers go.
                .and_then(|()| self.sharded.relayout().map(drop).map_err(to_string_error))
            }
            (true, false, _) => Err(format!(
                "it holds no sharded save ({} is missing): a zero_stage 0 save resumes with \
                 train.zero_stage 0, not {stage}",
                rtrun_rlhf_shard::checkpoint::MANIFEST_FILE
            )),
            (false, _, _) => {
                let device = self.model.params.device();
                CausalLm::from_pretrained(dir, device, self.setup.kind())
                    .map_err(to_string_error)
                    .and_then(|loaded| {
                        self.sharded
                            .overwrite_whole(|| {
                                for (name, value) in loaded.named_parameters() {
                                    self.model.params.copy_into(name, value)?;
                                }
                                Ok(())
                            })
                            .map_err(to_string_error)
                    })
            }
        }
    }

    /// Gathers the whole model on every rank (stage 3; nothing below) for a weight sync that
    /// reads it on rank 0. Every rank of the group is called.
    pub fn gather_weights(&self) -> Result<(), String> {
        self.sharded.gather_all().map_err(to_string_error)
    }

    /// Frees what [`LmWorker::gather_weights`] gathered.
    pub fn release_weights(&self) -> Result<(), String> {
        self.sharded.release_all().map_err(to_string_error)
    }

    /// Tensor bytes of parameters, gradients and optimizer state, held now and the most held
    /// since the last call with `reset_peak` (measured at every gather, reduction and step),
    /// and the time in collectives.
    pub fn shard_stats(&self, reset_peak: bool) -> ShardStats {
        self.sharded.stats(reset_peak)
    }

    /// Moves parameters, gradients and optimizer state to host memory (hybrid engine: while
    /// the engines generate). At stage 0 this is the sharding manager's `Infer` mode, a copy
    /// into separate host buffers on a CPU rank too; at stages 1-3 a CPU rank's tensors stay
    /// put (they already live in host memory).
    pub fn offload(&mut self) -> Result<(), String> {
        self.setup.offloaded = true;
        self.move_to(Mode::Infer).map_err(to_string_error)?;
        // The moved tensors' GPU memory is in libtorch's cache until given back.
        rtrun_rlhf_model::cuda::empty_cache().map_err(to_string_error)
    }

    /// Brings parameters and optimizer state back to the training device.
    pub fn onload(&mut self) -> Result<(), String> {
        self.setup.offloaded = false;
        self.move_to(Mode::Train).map_err(to_string_error)
    }

    /// Brings the parameters back for forward passes only (the sharding manager's `Forward`
    /// mode: gradients and AdamW state stay in host buffers until `train`).
    pub fn prepare_forward(&mut self) -> Result<(), String> {
        self.setup.offloaded = false;
        self.move_to(Mode::Forward).map_err(to_string_error)
    }

    /// Whether training state is offloaded now.
    pub fn is_offloaded(&self) -> bool {
        self.setup.offloaded
    }
}
#[rtrun::actor(pub)]
impl LmWorker {
    /// Loads the model; a config with an optimizer makes a trainable rank.
    pub fn new(config: LmWorkerConfig) -> Result<Self, String> {
        LmWorkerState::create(config).map(|state| LmWorker { state: std::sync::Mutex::new(state) })
    }

    /// Log-probs of every response token, one vector per sequence (no gradients).
    pub fn log_probs(&self, sequences: Vec<Sequence>) -> Result<Vec<Vec<f32>>, String> {
        self.state().log_probs(sequences)
    }

    /// Log-probs of every response token under the reference: the model with its LoRA
    /// adapters off (LoRA ranks only).
    pub fn reference_log_probs(&self, sequences: Vec<Sequence>) -> Result<Vec<Vec<f32>>, String> {
        self.state().reference_log_probs(sequences)
    }

    /// One supervised (SFT) optimizer step on this rank's micro-batches of packed rows, of a
    /// global batch of `global_tokens` response tokens (every rank of the group is called with
    /// its share: gradients are all-reduced).
    pub fn supervised_step(
        &mut self,
        batches: Vec<Vec<PackedRow>>,
        global_tokens: usize,
    ) -> Result<SupervisedStats, String> {
        self.state().supervised_step(&batches, global_tokens).map_err(to_string_error)
    }

    /// The summed NLL and count of the response tokens of `batches` (held-out loss).
    pub fn supervised_eval(&self, batches: Vec<Vec<PackedRow>>) -> Result<(f64, usize), String> {
        self.state().supervised_eval(&batches).map_err(to_string_error)
    }

    /// One DPO optimizer step on this rank's micro-batches of (chosen, rejected) rows, of a
    /// global batch of `global_pairs` pairs (every rank is called with its share).
    pub fn preference_step(
        &mut self,
        batches: Vec<Vec<PackedRow>>,
        global_pairs: usize,
        loss: PreferenceLoss,
    ) -> Result<PairStats, String> {
        self.state().preference_step(&batches, global_pairs, loss).map_err(to_string_error)
    }

    /// DPO sums over held-out pairs.
    pub fn preference_eval(
        &self,
        batches: Vec<Vec<PackedRow>>,
        loss: PreferenceLoss,
    ) -> Result<PairStats, String> {
        self.state().preference_eval(&batches, loss).map_err(to_string_error)
    }

    /// One optimizer step on this rank's share of the `global` mini-batch (every rank of the
    /// group must be called with its share: gradients are all-reduced).
    pub fn train(
        &mut self,
        rows: Vec<ExperienceRow>,
        kl_coef: f64,
        global: GlobalBatch,
    ) -> Result<PolicyTrainStats, String> {
        self.state().train(rows, kl_coef, global)
    }

    /// The weights in buckets of at most `bucket_bytes`, put into the object store by this rank.
    pub fn weight_buckets(
        &self,
        bucket_bytes: usize,
    ) -> Result<Vec<rtrun::ObjectRef<WeightBucket>>, String> {
        self.state().weight_buckets(bucket_bytes)
    }

    /// Every engine rank's own weight buckets for engines of `tp` ranks: `by_rank[r]` is rank
    /// `r`'s shard in the engine layout, put into the object store by this rank, with the bytes
    /// each rank receives and the resharding time.
    pub fn engine_weight_buckets(
        &self,
        bucket_bytes: usize,
        tp: usize,
    ) -> Result<EngineBuckets, String> {
        self.state().engine_weight_buckets(bucket_bytes, tp)
    }

    /// A free rendezvous endpoint for the weight-sync group this rank hosts.
    pub fn weight_sync_endpoint(&self) -> Result<(String, u16), String> {
        self.state().weight_sync_endpoint()
    }

    /// Joins the weight-sync group with the engines as its rank 0.
    pub fn join_weight_sync(&mut self, group: WeightSyncGroup) -> Result<(), String> {
        self.state().join_weight_sync(group)
    }

    /// The metadata of every engine rank's shard for engines of `tp` ranks.
    pub fn engine_weight_metadata(&self, tp: usize) -> Result<Vec<Vec<WeightMeta>>, String> {
        self.state().engine_weight_metadata(tp)
    }

    /// Broadcasts engine rank `rank`'s shard over the group joined for it.
    pub fn broadcast_engine_weights(
        &mut self,
        bucket_bytes: usize,
        tp: usize,
        rank: usize,
    ) -> Result<usize, String> {
        self.state().broadcast_engine_weights(bucket_bytes, tp, rank)
    }

    /// Name, shape and dtype of every parameter, in broadcast order.
    pub fn weight_metadata(&self) -> Result<Vec<WeightMeta>, String> {
        self.state().weight_metadata()
    }

    /// Broadcasts the weights to the engines of the weight-sync group.
    pub fn broadcast_weights(&mut self, bucket_bytes: usize) -> Result<usize, String> {
        self.state().broadcast_weights(bucket_bytes)
    }

    /// Starts a CUDA IPC weight sync; returns the number of buckets.
    pub fn plan_ipc_weights(&mut self, bucket_bytes: usize) -> Result<usize, String> {
        self.state().plan_ipc_weights(bucket_bytes)
    }

    /// Exports bucket `index` of the CUDA IPC weight sync for the engines to copy.
    pub fn export_ipc_bucket(
        &mut self,
        index: usize,
    ) -> Result<rtrun_rlhf_engine::IpcWeightBucket, String> {
        self.state().export_ipc_bucket(index)
    }

    /// Ends the CUDA IPC weight sync.
    pub fn finish_ipc_weights(&mut self) -> Result<(), String> {
        self.state().finish_ipc_weights()
    }

    /// The CUDA caching allocator's statistics of this rank's device (`None` on the CPU).
    pub fn cuda_memory(
        &self,
        reset_peak: bool,
    ) -> Result<Option<rtrun_rlhf_model::cuda::CudaMemory>, String> {
        Ok(self.state().cuda_memory(reset_peak))
    }

    /// Saves the model and, for a policy rank, the optimizer state.
    pub fn save_checkpoint(&self, dir: PathBuf) -> Result<(), String> {
        self.state().save_checkpoint(dir)
    }

    /// Loads what `save_checkpoint` saved.
    pub fn load_checkpoint(&mut self, dir: PathBuf) -> Result<(), String> {
        self.state().load_checkpoint(dir)
    }

    /// Saves the model alone as a Hugging Face directory (weights, config, tokenizer files).
    pub fn export(&self, dir: PathBuf) -> Result<(), String> {
        self.state().export(dir)
    }

    /// Gathers the whole model on every rank (stage 3) before a weight sync or export that
    /// reads it on rank 0; nothing below stage 3. Every rank is called.
    pub fn gather_weights(&self) -> Result<(), String> {
        self.state().gather_weights()
    }

    /// Frees what `gather_weights` gathered.
    pub fn release_weights(&self) -> Result<(), String> {
        self.state().release_weights()
    }

    /// Tensor bytes of parameters, gradients and optimizer state (now, and the peak since the
    /// last call with `reset_peak`) and the time spent in collectives.
    pub fn shard_stats(&self, reset_peak: bool) -> Result<ShardStats, String> {
        Ok(self.state().shard_stats(reset_peak))
    }

    /// Offloads training state to host memory (hybrid engine, while the engines generate).
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

    /// Whether training state is offloaded now.
    pub fn is_offloaded(&self) -> bool {
        self.state().is_offloaded()
    }
}

/// Copies the tokenizer files of `from` into `to` (nothing when they are the same directory),
/// and writes a `generation_config.json` with the model's EOS / BOS / PAD ids when
/// `from` has none, so the directory generates and stops as the source did.
pub(crate) fn copy_tokenizer_files(
    from: &std::path::Path,
    to: &std::path::Path,
    config: &rtrun_rlhf_model::ModelConfig,
) -> rtrun_rlhf_model::Result<()> {
    use rtrun_rlhf_model::ModelError;
    use rtrun_rlhf_model::tokenizer::{GENERATION_CONFIG_FILE, TOKENIZER_FILES};
    let io = |path: &std::path::Path, e| ModelError::Io { path: path.to_path_buf(), source: e };
    if from != to {
        for name in TOKENIZER_FILES {
            let source = from.join(name);
            if source.is_file() {
                std::fs::copy(&source, to.join(name)).map_err(|e| io(&source, e))?;
            }
        }
    }
    let generation = to.join(GENERATION_CONFIG_FILE);
    if !generation.exists() {
        let json = serde_json::json!({
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
        });
        std::fs::write(&generation, json.to_string()).map_err(|e| io(&generation, e))?;
    }
    Ok(())
}

/// Tensors are `Send` but not `Sync`, and the runtime shares an actor between its executor
/// threads, so the state sits behind a mutex (uncontended: the runtime runs one call at a time
/// unless `max_concurrency` says otherwise).
impl LmWorker {
    fn state(&self) -> std::sync::MutexGuard<'_, LmWorkerState> {
        // A panic inside a call cannot leave the tensors half-updated in a way the next call
        // would not report, so a poisoned lock is taken over.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl LmWorkerState {
    /// Puts parameters, gradients and optimizer state where `mode` wants them: at stage 0
    /// through the sharding manager ([`ShardedModel::transition`]; a frozen rank moves its
    /// parameters only); at stages 1-3 a CPU rank has nothing to move (its state already
    /// lives in host memory) and a GPU rank is refused.
    fn move_to(&mut self, mode: Mode) -> crate::Result<()> {
        if self.sharded.config().stage != ZeroStage::Zero {
            if self.setup.device() == Device::Cpu {
                return Ok(());
            }
            return Err(crate::TrainError::role(
                &self.setup.role,
                "offloading a GPU rank's training state is not supported with train.zero_stage \
                 >= 1 yet; use zero_stage 0 with offload, or sharding without it",
            ));
        }
        let report = self.sharded.transition(mode)?;
        tracing::debug!(
            role = %self.setup.role,
            %mode,
            to_host = report.to_host.total(),
            to_device = report.to_device.total(),
            "moved the training state"
        );
        Ok(())
    }

    fn log_probs_impl(&self, sequences: &[Sequence]) -> crate::Result<Vec<Vec<f32>>> {
        let refs: Vec<&Sequence> = sequences.iter().collect();
        let chunks = self.micro_batches(&refs);
        let passes = self.sharded.balance(chunks.len(), false)?;
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); sequences.len()];
        tch::no_grad(|| -> crate::Result<()> {
            let device = self.model.params.device();
            for chunk in &chunks {
                let refs: Vec<&Sequence> = chunk.iter().map(|&i| &sequences[i]).collect();
                let log_probs = if self.loss.share_prompt {
                    shared_prompt_batch(&refs, device)?.response_log_probs(&self.model)?
                } else {
                    self.model.response_log_probs(&response_batch(&refs, device)?)?
                };
                self.model.backbone.release_parameters()?;
                let lengths: Vec<usize> = refs.iter().map(|s| s.response_ids.len()).collect();
                for (&i, row) in chunk.iter().zip(unpad_rows(&log_probs, &lengths)?) {
                    out[i] = row;
                }
            }
            Ok(())
        })?;
        for _ in chunks.len()..passes {
            self.sharded.idle_forward()?;
        }
        Ok(out)
    }

    /// The micro-batches of `sequences`, as indices: by token budget with
    /// `micro_batch_tokens`, else `micro_batch_size` at a time in order.
    fn micro_batches(&self, sequences: &[&Sequence]) -> Vec<Vec<usize>> {
        match self.loss.micro_batch_tokens {
            Some(budget) => {
                crate::experience::token_budget_batches(sequences, self.loss.share_prompt, budget)
            }
            None => {
                let indices: Vec<usize> = (0..sequences.len()).collect();
                indices.chunks(self.loss.micro_batch_size.max(1)).map(<[usize]>::to_vec).collect()
            }
        }
    }

    fn train_impl(
        &mut self,
        rows: &[ExperienceRow],
        kl_coef: f64,
        global: GlobalBatch,
    ) -> crate::Result<PolicyTrainStats> {
        // Hybrid engine: the experience passes ran in `Forward` (gradients and AdamW state
        // still in host buffers); training needs them back.
        if self.sharded.mode().is_some_and(|mode| mode != Mode::Train) {
            self.sharded.transition(Mode::Train)?;
        }
        let role = self.setup.role.clone();
        if !self.trains {
            return Err(crate::TrainError::role(&role, "this rank is frozen (no optimizer)"));
        }
        let device = self.model.params.device();
        let dp_size = rtrun::context()?.group.map(|g| g.world_size).unwrap_or(1);
        let aggregation = loss_aggregation(&self.loss, global, dp_size);
        let clip = self.loss.clip.clone();
        self.sharded.zero_grad()?;
        let local_tokens: usize = rows.iter().map(|r| r.sequence.response_ids.len()).sum();
        let mut stats = PolicyTrainStats::default();
        // The loss sums over micro-batches, so which rows share one is free: with shared
        // prompts, the responses to one prompt go together and the prompt is computed once.
        let rows = training_order(rows, self.loss.share_prompt);
        let sequences: Vec<&Sequence> = rows.iter().map(|r| &r.sequence).collect();
        let chunks: Vec<Vec<&ExperienceRow>> = self
            .micro_batches(&sequences)
            .into_iter()
            .map(|chunk| chunk.into_iter().map(|i| rows[i]).collect())
            .collect();
        let passes = self.sharded.balance(chunks.len(), true)?;
        stats.micro_batches = chunks.len() as f64;
        for chunk in &chunks {
            let sequences: Vec<&Sequence> = chunk.iter().map(|r| &r.sequence).collect();
            let (logits, response_ids, action_mask) = if self.loss.share_prompt {
                let batch = shared_prompt_batch(&sequences, device)?;
                (batch.response_logits(&self.model)?, batch.response_ids, batch.action_mask)
            } else {
                let batch = response_batch(&sequences, device)?;
                let logits = self.model.response_logits(&batch)?;
                (logits, batch.response_ids()?, batch.action_mask)
            };
            let width = action_mask.size()[1];
            let column = |f: fn(&ExperienceRow) -> &[f32]| -> crate::Result<Tensor> {
                let rows: Vec<&[f32]> = chunk.iter().map(|r| f(r)).collect();
                pad_rows(&rows, width, device)
            };
            let old_log_probs = column(|r| &r.old_log_probs)?;
            let advantages = column(|r| &r.advantages)?;
            let mask = action_mask.f_to_kind(Kind::Float)?;
            let log_probs = rtrun_rlhf_model::logprobs::token_log_probs(&logits, &response_ids)?
                .f_mul(&mask)?;
            let is_weights = match chunk.iter().any(|r| !r.is_weights.is_empty()) {
                true => Some(column(|r| &r.is_weights)?),
                false => None,
            };
            let out = algo::policy_loss_weighted(
                &log_probs,
                &old_log_probs,
                &advantages,
                &mask,
                is_weights.as_ref(),
                &clip,
                aggregation,
            )?;
            let chunk_tokens: usize = chunk.iter().map(|r| r.sequence.response_ids.len()).sum();
            let share = chunk_tokens as f64 / local_tokens.max(1) as f64;
            let mut loss = out.loss.shallow_clone();
            if self.loss.entropy_coef > 0.0 {
                let entropy = algo::masked_entropy(&logits, &mask, aggregation)?;
                loss = loss.f_sub(&entropy.f_mul_scalar(self.loss.entropy_coef)?)?;
                let mean =
                    algo::masked_entropy(&logits.f_detach()?, &mask, LossAggregation::TokenMean)?;
                stats.entropy += mean.f_double_value(&[])? * share;
            }
            if self.loss.use_kl_loss {
                let ref_log_probs = column(|r| &r.ref_log_probs)?;
                let kl = algo::kl_loss(
                    &log_probs,
                    &ref_log_probs,
                    &mask,
                    self.loss.kl_estimator,
                    aggregation,
                )?;
                loss = loss.f_add(&kl.f_mul_scalar(kl_coef)?)?;
                let mean = algo::kl_loss(
                    &log_probs.f_detach()?,
                    &ref_log_probs,
                    &mask,
                    self.loss.kl_estimator,
                    LossAggregation::TokenMean,
                )?;
                stats.ref_kl += mean.f_double_value(&[])? * share;
            }
            stats.policy_loss += out.loss.f_double_value(&[])?;
            stats.clip_fraction += out.clip_fraction.f_double_value(&[])? * share;
            stats.approx_kl += out.approx_kl.f_double_value(&[])? * share;
            self.model.backward(&loss)?;
        }
        for _ in chunks.len()..passes {
            self.sharded.idle_training_pass()?;
        }
        let step =
            self.sharded.step().map_err(|e| crate::TrainError::role(&role, e.to_string()))?;
        stats.grad_norm = step.grad_norm;
        stats.lr = step.lr;
        Ok(stats)
    }
}

/// A weight sync's buckets for tensor-parallel engines: `by_rank[r]` goes to rank `r` of every
/// engine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineBuckets {
    /// Each engine rank's buckets, in the object store.
    pub by_rank: Vec<Vec<rtrun::ObjectRef<WeightBucket>>>,
    /// Bytes each engine rank receives.
    pub bytes_by_rank: Vec<u64>,
    /// Seconds the policy spent resharding (and splitting into buckets).
    pub reshard_seconds: f64,
}

/// Switches a model's LoRA adapters off while it lives (the model is then its base model),
/// and on again when dropped, on every path out.
pub(crate) struct BaseOnly<'a>(&'a CausalLm);

impl<'a> BaseOnly<'a> {
    pub(crate) fn new(model: &'a CausalLm) -> Self {
        model.set_adapters_enabled(false);
        Self(model)
    }
}

impl Drop for BaseOnly<'_> {
    fn drop(&mut self) {
        self.0.set_adapters_enabled(true);
    }
}

/// The subdirectory of an exported LoRA policy that holds its `peft` adapter.
pub const ADAPTER_DIR: &str = "adapter";

/// Bytes of a tensor's elements.
fn tensor_bytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// How the policy loss of a micro-batch is normalised over the global mini-batch: its sum
/// divided by the global count (times `dp_size`, undone by the gradient mean); OpenRLHF's
/// token mean by default (`algo.loss_agg_mode`).
fn loss_aggregation(
    loss: &PolicyLossConfig,
    global: GlobalBatch,
    dp_size: usize,
) -> LossAggregation {
    use crate::config::LossAggMode;
    let sequences = global.sequences.max(1) as f64;
    match loss.loss_agg_mode {
        LossAggMode::TokenMean => LossAggregation::GlobalTokenMean {
            batch_num_tokens: global.tokens.max(1) as f64,
            dp_size,
        },
        LossAggMode::SeqMeanTokenMean => {
            LossAggregation::GlobalSequenceMean { global_batch_size: sequences, dp_size }
        }
        LossAggMode::SeqMeanTokenSum => {
            LossAggregation::GlobalSequenceSum { global_batch_size: sequences, dp_size }
        }
        LossAggMode::SeqMeanTokenSumNorm => LossAggregation::GlobalConstant {
            global_batch_size: sequences,
            norm_len: loss.max_new_tokens.max(1) as f64,
            dp_size,
        },
    }
}
