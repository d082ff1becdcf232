//! The trainer's configuration: one YAML file plus `--set key=value` overrides, with OpenRLHF's
//! defaults where a key is absent, and errors that name the key and say why it is wrong.
//!
//! Every section rejects unknown keys (a typo is an error, not a silently ignored setting).
//! [`TrainConfig::validate`] checks ranges and cross-key constraints after parsing.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::data::{DataConfig, OneOrMany};
use rtrun_rlhf_algo::{AdvantageEstimator, KlEstimator, RatioLevel};

mod models;
pub mod reference;
pub(crate) mod validate;
mod yaml;

use crate::error::{Result, TrainError};
pub use models::{DeviceName, EngineSection, ModelDtype, RoleModelConfig};

/// The whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Seed of everything random in the run (data, shuffles, model init, sampling).
    pub seed: u64,
    /// Where datasets, models, checkpoints and metrics go.
    pub run_dir: PathBuf,
    /// Start afresh in a `run_dir` that holds an earlier run: its metrics, event files,
    /// summary, plot, final policy and checkpoints are removed first (the driver's
    /// `--overwrite`). Without it such a directory is refused unless it has a checkpoint to
    /// resume from.
    pub overwrite: bool,
    /// Prompts: a synthetic task or JSONL / Parquet files.
    pub data: DataConfig,
    /// The policy: a Hugging Face checkpoint, or (without `pretrain`) the tiny model below.
    pub policy: RoleModelConfig,
    /// The frozen reference model (`pretrain` defaults to the policy's).
    pub reference: RoleModelConfig,
    /// The critic (`pretrain` defaults to the policy's body with a fresh value head).
    pub critic: RoleModelConfig,
    /// The generation engines.
    pub engine: EngineSection,
    /// The architecture of the policy made locally when `policy.pretrain` is absent (a tiny
    /// Qwen2-style decoder over the synthetic task's characters).
    pub model: ModelShape,
    /// Supervised warm-up of the locally made policy (ignored with `policy.pretrain`).
    pub warmup: WarmupConfig,
    /// The embedded cluster and the placement of roles.
    pub cluster: ClusterConfig,
    /// Generation.
    pub rollout: RolloutConfig,
    /// Advantages, KL and losses.
    pub algo: AlgoConfig,
    /// Optimisation.
    pub train: TrainLoopConfig,
    /// Where rewards come from.
    pub reward: RewardConfig,
    /// Held-out evaluation.
    pub eval: EvalConfig,
    /// Checkpoints and resume.
    pub checkpoint: CheckpointConfig,
    /// What the run logs beside its metrics.
    pub logging: LoggingConfig,
    /// Tools the policy may call in multi-turn rollouts.
    pub tools: ToolsConfig,
}

/// `tools.*`: what the policy may call (verl's `multi_turn.tool_config_path`, OpenRLHF's agent
/// functions). Any tool makes rollouts multi-turn: a model turn that writes
/// `<tool_call>{"name": …, "arguments": {…}}</tool_call>` gets the answers as the next message
/// and goes on, for at most `rollout.max_turns` model turns and `rollout.max_tool_calls` calls;
/// the answers' tokens are masked out of the loss and the KL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ToolsConfig {
    /// Built-in tools by name: `calculator` (arithmetic: + - * / % ^ and parentheses).
    pub enabled: Vec<String>,
    /// An HTTP endpoint serving more tools: `GET` lists them (`{"tools": [OpenAI function
    /// schemas]}`), `POST {"name", "arguments"}` calls one (`{"content": …}` or `{"error": …}`).
    pub url: Option<String>,
    /// Seconds a tool call may take before the model reads a timeout error instead.
    pub timeout_s: f64,
    /// Longest answer the model reads, in bytes; longer ones are cut (and say so).
    pub max_output_bytes: usize,
}

impl Default for ToolsConfig {
    fn default() -> Self {
        Self { enabled: Vec::new(), url: None, timeout_s: 10.0, max_output_bytes: 2048 }
    }
}

impl ToolsConfig {
    /// Whether rollouts are multi-turn.
    pub fn any(&self) -> bool {
        !self.enabled.is_empty() || self.url.is_some()
    }
}

/// `logging.*`: what the run logs beside its metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct LoggingConfig {
    /// Samples of each step written to `samples.jsonl` in the run directory and shown on the
    /// dashboard's Training page: prompt, response, reward and label, the step's first rows
    /// (0: none; verl's `log_val_generations` for training rollouts).
    pub samples_per_step: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            seed: 42,
            run_dir: PathBuf::from("runs/default"),
            overwrite: false,
            data: DataConfig::default(),
            policy: RoleModelConfig::default(),
            reference: RoleModelConfig::default(),
            critic: RoleModelConfig::default(),
            engine: EngineSection::default(),
            model: ModelShape::default(),
            warmup: WarmupConfig::default(),
            cluster: ClusterConfig::default(),
            rollout: RolloutConfig::default(),
            algo: AlgoConfig::default(),
            train: TrainLoopConfig::default(),
            reward: RewardConfig::default(),
            eval: EvalConfig::default(),
            checkpoint: CheckpointConfig::default(),
            logging: LoggingConfig::default(),
            tools: ToolsConfig::default(),
        }
    }
}

/// Shape of the tiny policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ModelShape {
    /// Hidden size.
    pub hidden_size: i64,
    /// Decoder layers.
    pub num_layers: i64,
    /// Query heads.
    pub num_heads: i64,
    /// Key/value heads (GQA).
    pub num_kv_heads: i64,
    /// MLP width.
    pub intermediate_size: i64,
}

impl Default for ModelShape {
    fn default() -> Self {
        Self {
            hidden_size: 64,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            intermediate_size: 128,
        }
    }
}

/// Supervised warm-up on the training prompts with their labels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct WarmupConfig {
    /// Optimizer steps (0 skips the warm-up: the policy starts random).
    pub steps: u64,
    /// Sequences per step.
    pub batch_size: usize,
    /// Peak learning rate.
    pub lr: f64,
}

impl Default for WarmupConfig {
    fn default() -> Self {
        Self { steps: 60, batch_size: 64, lr: 3e-3 }
    }
}

/// The embedded cluster and where the roles go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// A running cluster's head, `host:port` (`train --address`; the `RTRUN_ADDRESS`
    /// environment variable when unset): the roles are placed on its nodes. Without it the
    /// run starts an embedded single-node runtime. On a cluster, `num_cpus` and `num_gpus`
    /// are the nodes' own (`rtrun join --num-gpus`), and every path of the config (`run_dir`,
    /// models, data) must be one every node sees at the same place (a shared filesystem).
    pub address: Option<String>,
    /// CPUs the embedded node offers (default: the machine's).
    pub num_cpus: Option<f64>,
    /// GPUs the embedded node declares (absent: the host's, from `nvidia-smi` or the NVIDIA
    /// driver, 0 on a machine without). More than the host has is an error unless
    /// `fake_gpus` is on.
    pub num_gpus: Option<f64>,
    /// Declare `num_gpus` GPUs even where the host has fewer, the missing ones fake (no device
    /// behind them): how a CPU machine runs placement specs that reserve GPUs.
    pub fake_gpus: bool,
    /// A YAML placement spec (placement/SPEC.md); without it, each role gets `replicas` below
    /// and no GPU share.
    pub placement_spec: Option<PathBuf>,
    /// Ranks per role when there is no spec.
    pub actor_replicas: usize,
    /// Reference-model ranks when there is no spec.
    pub ref_replicas: usize,
    /// Critic ranks when there is no spec.
    pub critic_replicas: usize,
    /// Reward-model ranks when there is no spec (model-based reward only).
    pub reward_replicas: usize,
    /// Engine actors when there is no spec.
    pub engine_replicas: usize,
    /// libtorch intra-op threads of each policy, reference, critic and reward-model worker:
    /// `auto` (the default) shares the machine's cores, phase by phase, among the workers
    /// computing in that phase; a number fixes it for every phase. Engines: `engine.threads`.
    pub threads_per_worker: WorkerThreads,
    /// Engines sleep while training and training state is offloaded while generating (the
    /// hybrid engine). Implied by a spec that puts `vllm_engine` in the actor's group.
    pub colocate_all: bool,
    /// Seconds the trainer waits for a rank's answer to one call (a generation batch, log-probs,
    /// a training mini-batch, a weight bucket, a checkpoint save) before it fails the step with
    /// an error naming the late role and rank. Generous: a stopped or hung worker would
    /// otherwise hang the run forever, but a slow step must not fail.
    pub call_timeout_s: f64,
    /// Seconds after which a call still unanswered is logged as a warning naming the late role
    /// and rank (then again every this many seconds, until the answer or the deadline).
    pub stall_warn_s: f64,
}

/// `algo.old_logprobs`: see [`AlgoConfig::old_logprobs`].
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum OldLogprobs {
    /// `engine` when policy and engines both run in fp32, else `policy`.
    #[default]
    Auto,
    /// A policy forward pass over every rollout.
    Policy,
    /// The engine's sampling log-probs, checked against the policy's now and then.
    Engine,
}

/// With `algo.old_logprobs: engine`, the policy still recomputes the old log-probs on the first
/// step and every this many steps, to measure their gap to the engine's.
pub const OLD_LOGPROB_CHECK_EVERY: u64 = 10;

/// The largest mean absolute gap per token between engine and policy log-probs at which the
/// engine's are used as old log-probs (fp32 on both sides measures ~1e-7; bf16 ~1e-2).
pub const OLD_LOGPROB_MAX_GAP: f64 = 1e-4;

impl AlgoConfig {
    /// Whether the run needs reference log-probs (a KL term in the loss or the reward).
    pub fn needs_reference(&self) -> bool {
        self.use_kl_loss || self.init_kl_coef > 0.0 || self.kl_target.is_some()
    }

    /// Whether the run needs a critic (GAE).
    pub fn needs_critic(&self) -> bool {
        self.advantage_estimator.needs_critic()
    }
}

impl TrainConfig {
    /// Whether the reference log-probs come from the policy ranks with their LoRA adapters off
    /// (the run needs a reference, the policy has adapters and no other reference is named).
    pub fn reference_from_policy(&self) -> bool {
        self.algo.needs_reference()
            && (self.policy.lora.is_some() || self.policy.lora_adapter.is_some())
            && self.reference.pretrain.is_none()
    }

    /// Whether the engine's sampling log-probs serve as old log-probs (`algo.old_logprobs`
    /// resolved; the dock pipeline always recomputes).
    pub fn old_logprobs_from_engine(&self) -> bool {
        let fp32 = self.policy.dtype == ModelDtype::Fp32 && self.engine.dtype == ModelDtype::Fp32;
        // A streamed sample's tokens may come from older weights: the engine's log-probs are
        // then the behaviour policy's, which the importance weight compares with the policy's.
        !self.rollout.streams()
            && self.train.pipeline == PipelineMode::Sequential
            && match self.algo.old_logprobs {
                OldLogprobs::Auto => fp32,
                OldLogprobs::Engine => true,
                OldLogprobs::Policy => false,
            }
    }
}

/// `algo.overlong_penalty`: DAPO's soft punishment of responses near the generation budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OverlongPenalty {
    /// The last tokens of the budget over which the penalty grows from 0 to `factor` (verl's
    /// `overlong_buffer.len`; DAPO used 4,096 of 20,480).
    pub buffer_len: usize,
    /// The penalty at the budget (verl's `penalty_factor`).
    #[serde(default = "one")]
    pub factor: f64,
}

fn one() -> f64 {
    1.0
}

/// `algo.dynamic_sampling`: DAPO's refill of prompt groups without a learning signal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DynamicSampling {
    /// Generation rounds a step may take at most (verl's `max_num_gen_batches`).
    pub max_gen_batches: usize,
}

impl Default for DynamicSampling {
    fn default() -> Self {
        Self { max_gen_batches: 10 }
    }
}

/// `cluster.threads_per_worker`: `auto` or a thread count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WorkerThreads {
    /// The cores shared, phase by phase, among the workers computing in that phase.
    #[default]
    Auto,
    /// This many threads in every phase.
    Fixed(i32),
}

impl Serialize for WorkerThreads {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        match self {
            WorkerThreads::Auto => serializer.serialize_str("auto"),
            WorkerThreads::Fixed(n) => serializer.serialize_i32(*n),
        }
    }
}

impl schemars::JsonSchema for WorkerThreads {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "WorkerThreads".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 1}]
        })
    }
}

impl<'de> Deserialize<'de> for WorkerThreads {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(i64),
            Word(String),
        }
        match Raw::deserialize(deserializer)
            .map_err(|_| serde::de::Error::custom("expected `auto` or a thread count"))?
        {
            Raw::Count(n) => i32::try_from(n)
                .map(WorkerThreads::Fixed)
                .map_err(|_| serde::de::Error::custom(format!("{n} threads is out of range"))),
            Raw::Word(word) if word == "auto" => Ok(WorkerThreads::Auto),
            Raw::Word(word) => Err(serde::de::Error::custom(format!(
                "expected `auto` or a thread count, found `{word}`"
            ))),
        }
    }
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            address: None,
            num_cpus: None,
            num_gpus: None,
            fake_gpus: false,
            placement_spec: None,
            actor_replicas: 1,
            ref_replicas: 1,
            critic_replicas: 1,
            reward_replicas: 1,
            engine_replicas: 1,
            threads_per_worker: WorkerThreads::Auto,
            colocate_all: false,
            call_timeout_s: 1800.0,
            stall_warn_s: 60.0,
        }
    }
}

/// Generation settings (vLLM sampling parameters and batch sizes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    /// Prompts per training step (OpenRLHF's `rollout_batch_size`).
    pub prompts_per_step: usize,
    /// Samples per prompt (OpenRLHF's `n_samples_per_prompt`).
    pub n_samples_per_prompt: usize,
    /// Sampling temperature.
    pub temperature: f32,
    /// Nucleus sampling.
    pub top_p: f32,
    /// Top-k sampling (absent: off).
    pub top_k: Option<u32>,
    /// Generated tokens at most (0: the task's longest answer plus one).
    pub max_new_tokens: usize,
    /// Weight-sync bucket size in bytes.
    pub weight_bucket_bytes: usize,
    /// How the policy's weights reach the engines.
    pub weight_sync_backend: WeightSyncBackend,
    /// `sync` (generate, then train, then sync weights) or `async` (the engines generate the
    /// next steps' samples while the policy trains; verl's fully-async trainer, TRL's
    /// `AsyncGRPOTrainer`).
    pub mode: RolloutMode,
    /// `mode: async`: a sample is trained on only if its oldest token was sampled by weights
    /// at most this many policy versions behind the policy being trained (verl's
    /// `staleness_threshold`, TRL's `max_staleness`); older ones are dropped and counted
    /// (`async/stale_dropped_groups`). At least 1; absent: 1.
    pub max_staleness: Option<u64>,
    /// `mode: sync`: a step goes on once this share of its prompt groups has finished, and the
    /// unfinished ones carry on generating into the next step (MindSpeed-RL's partial rollout,
    /// `rollout_threshold_rate`). In (0, 1]; absent: every group finishes.
    pub partial_threshold: Option<f64>,
    /// With `partial_threshold`: a group is carried into at most this many later steps, then
    /// finished in the step it would exceed it (bounding how stale its first tokens get;
    /// MindSpeed-RL's `partial_rollout_max_split`). At least 1.
    pub partial_max_carry: usize,
    /// With tools: model turns per response at most (verl's `multi_turn.max_assistant_turns`).
    pub max_turns: usize,
    /// With tools: tool calls per response at most; a turn asking for more than are left has
    /// only the first ones run, and the response ends once none are left.
    pub max_tool_calls: usize,
}

/// How generation and training alternate (`rollout.mode`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum RolloutMode {
    /// Each step generates, then trains, then sends the new weights.
    #[default]
    Sync,
    /// A rollout thread keeps the engines generating into a queue bounded by
    /// `rollout.max_staleness` while the policy trains on what is ready; new weights reach each
    /// engine between two of its steps, and requests in flight continue with them.
    Async,
}

/// The transport of the policy-to-engine weight sync.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum WeightSyncBackend {
    /// Policy rank 0 puts buckets into the object store and every engine fetches them (any
    /// device, any build).
    #[default]
    ObjectStore,
    /// An NCCL broadcast from policy rank 0 to every engine in one collective group; needs a
    /// build with the `cuda` feature and the models on CUDA, each rank on its own GPU (NCCL
    /// refuses two ranks of one group on one GPU).
    Nccl,
    /// CUDA IPC: policy rank 0 exports packed buckets of its weights and every engine maps
    /// and copies them, GPU to GPU without host staging. The path for engines colocated on
    /// the policy's GPU (a hybrid spec on one GPU), where NCCL cannot be used.
    CudaIpc,
}

impl WeightSyncBackend {
    /// The transport a sync really uses. `nccl` in a hybrid placement with one policy rank and
    /// one engine (both in the same bundle, so on one GPU) becomes `cuda_ipc`: NCCL refuses two
    /// ranks on one GPU, and OpenRLHF syncs colocated engines by CUDA IPC for the same reason.
    pub fn effective(self, hybrid: bool, actor_ranks: usize, engines: usize) -> WeightSyncBackend {
        if self == WeightSyncBackend::Nccl && hybrid && actor_ranks == 1 && engines == 1 {
            WeightSyncBackend::CudaIpc
        } else {
            self
        }
    }
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            prompts_per_step: 16,
            n_samples_per_prompt: 8,
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            max_new_tokens: 0,
            weight_bucket_bytes: 32 << 20,
            weight_sync_backend: WeightSyncBackend::ObjectStore,
            mode: RolloutMode::Sync,
            max_staleness: None,
            partial_threshold: None,
            partial_max_carry: 2,
            max_turns: 4,
            max_tool_calls: 4,
        }
    }
}

impl RolloutConfig {
    /// Whether samples may span weight versions (asynchronous or partial rollouts): the engines
    /// then stream, take weights while requests run, and the loss corrects with `algo.tis_cap`.
    pub fn streams(&self) -> bool {
        self.mode == RolloutMode::Async || self.partial_threshold.is_some_and(|t| t < 1.0)
    }

    /// The key that makes samples span weight versions (what errors about it name).
    pub fn streaming_key(&self) -> &'static str {
        match self.mode {
            RolloutMode::Async => "rollout.mode",
            RolloutMode::Sync => "rollout.partial_threshold",
        }
    }

    /// `algo.tis_cap` resolved: the explicit cap, else 2 when samples may span weight versions.
    pub fn tis_cap(&self, algo: &AlgoConfig) -> Option<f32> {
        match algo.tis_cap {
            Some(cap) => Some(cap as f32),
            None => self.streams().then_some(2.0),
        }
    }

    /// `rollout.max_staleness` in async mode (default 1).
    pub fn staleness(&self) -> u64 {
        self.max_staleness.unwrap_or(1)
    }
}

/// Advantage, KL and loss settings (OpenRLHF v0.11 names and defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AlgoConfig {
    /// `gae`, `reinforce`, `rloo`, `reinforce_baseline`, `group_norm` (GRPO), `dr_grpo`.
    pub advantage_estimator: AdvantageEstimator,
    /// Discount.
    pub gamma: f64,
    /// GAE's lambda.
    pub lambd: f64,
    /// PPO clip below 1.
    pub eps_clip_low: f64,
    /// PPO clip above 1.
    pub eps_clip_high: f64,
    /// Dual-clip PPO (Ye et al. 2020; OpenRLHF's `--dual_clip`): for negative advantages the
    /// clipped objective is bounded below by `dual_clip × advantage`, so a ratio far above 1
    /// cannot push the loss without bound. Absent: off; set: above 1.
    pub dual_clip: Option<f64>,
    /// The importance ratio of the clipped loss (verl's `policy_loss.loss_mode`): `ppo`, per
    /// token; `gspo`, per sequence (GSPO, Zheng et al. 2025: the geometric mean of the
    /// sequence's token ratios, clipped as one number). GSPO's paper clips at
    /// `eps_clip_low: 0.0003`, `eps_clip_high: 0.0004` and averages over sequences
    /// (`loss_agg_mode: seq-mean-token-mean`); set them too, the defaults stay PPO's.
    pub policy_loss: RatioLevel,
    /// DAPO's soft overlong penalty (verl's `reward_model.overlong_buffer`): a response longer
    /// than `rollout.max_new_tokens − buffer_len` tokens loses `factor × (length − (max −
    /// buffer_len)) / buffer_len` of its reward, `factor` at the budget. Absent: off.
    pub overlong_penalty: Option<OverlongPenalty>,
    /// Divide each reward, less the running mean, by the running standard deviation of every
    /// reward the run has seen (this step's included) before advantages, `(r − μ)/(σ + 1e-8)`
    /// (OpenRLHF's `--normalize_reward`, with running statistics, which checkpoints keep).
    pub normalize_reward: bool,
    /// DAPO's dynamic sampling (verl's `algorithm.filter_groups`): each step's samples are
    /// scored as they come, prompt groups whose rewards are all equal are dropped (counted as
    /// `dynamic_sampling/dropped_groups`), and fresh prompts are generated for until the step
    /// has `rollout.prompts_per_step` groups, for at most `max_gen_batches` rounds (then
    /// dropped groups fill the step: `dynamic_sampling/filled_groups`). Absent: off.
    pub dynamic_sampling: Option<DynamicSampling>,
    /// How the policy's per-token losses (PPO, entropy, KL) become one number (verl's
    /// `loss_agg_mode`): `token-mean` (the default, OpenRLHF's: over every response token of
    /// the global mini-batch), `seq-mean-token-mean`, `seq-mean-token-sum`, or
    /// `seq-mean-token-sum-norm` (Dr. GRPO: each sequence's sum over the constant
    /// `rollout.max_new_tokens`).
    pub loss_agg_mode: LossAggMode,
    /// Value clip of the critic loss.
    pub value_clip: f64,
    /// Entropy bonus coefficient (0: off).
    pub entropy_coef: f64,
    /// Initial KL coefficient β.
    pub init_kl_coef: f64,
    /// KL estimator: `k1`, `k2`, `k3`.
    pub kl_estimator: KlEstimator,
    /// KL as a loss term (GRPO style) instead of a per-token reward penalty.
    pub use_kl_loss: bool,
    /// Target KL of the adaptive controller; absent: fixed coefficient.
    pub kl_target: Option<f64>,
    /// Where the old (behaviour-policy) log-probs of the clipped ratio come from: `policy`
    /// recomputes them with a policy forward pass over the rollout (OpenRLHF); `engine` takes
    /// the engine's sampling log-probs, computed with the weights just synced, and skips that
    /// pass (verl's rollout log-probs), checking on steps 1 and 2 (the first after a weight
    /// sync) and every [`OLD_LOGPROB_CHECK_EVERY`] steps that they match the policy's (mean absolute gap below
    /// [`OLD_LOGPROB_MAX_GAP`], else the run warns and recomputes from then on); `auto` (the
    /// default) is `engine` when the policy and the engines both compute in fp32, where the gap
    /// is ~1e-7, and `policy` otherwise.
    pub old_logprobs: OldLogprobs,
    /// Truncated importance sampling (Yao et al. 2025; verl's `tis_imp_ratio_cap`): each
    /// token's policy loss is weighted by `min(π_old / π_engine, tis_cap)`, correcting for the
    /// weights that sampled it when they were not the policy's (an asynchronous or partial
    /// rollout, or an engine that computes differently). Absent: 2 when samples may span
    /// weight versions (`rollout.mode: async` or `rollout.partial_threshold`), else off.
    pub tis_cap: Option<f64>,
    /// Horizon of the adaptive controller.
    pub kl_horizon: f64,
    /// Rewards are clipped to ±this.
    pub reward_clip: f64,
}

impl Default for AlgoConfig {
    fn default() -> Self {
        Self {
            advantage_estimator: AdvantageEstimator::Gae,
            gamma: 1.0,
            lambd: 1.0,
            eps_clip_low: 0.2,
            eps_clip_high: 0.2,
            dual_clip: None,
            policy_loss: RatioLevel::Ppo,
            overlong_penalty: None,
            normalize_reward: false,
            dynamic_sampling: None,
            tis_cap: None,
            loss_agg_mode: LossAggMode::TokenMean,
            value_clip: 0.5,
            entropy_coef: 0.0,
            init_kl_coef: 0.01,
            kl_estimator: KlEstimator::K1,
            use_kl_loss: false,
            kl_target: None,
            old_logprobs: OldLogprobs::Auto,
            kl_horizon: 10_000.0,
            reward_clip: 10.0,
        }
    }
}

/// Optimisation settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TrainLoopConfig {
    /// Passes over the prompt dataset.
    pub num_episodes: usize,
    /// Stop after this many steps (absent: the episodes decide).
    pub max_steps: Option<u64>,
    /// Samples per optimizer step, over all DP ranks (OpenRLHF's `train_batch_size`).
    pub train_batch_size: usize,
    /// Samples per forward/backward on one rank (default 32, or `train_batch_size` when that
    /// is smaller; a value set larger than `train_batch_size` is an error).
    pub micro_batch_size: usize,
    /// Policy micro-batches by token budget instead of `micro_batch_size` samples (verl's
    /// `use_dynamic_bsz` with `ppo_max_token_len_per_gpu`): rows sorted longest first and
    /// packed while rows × the longest row's positions stay within this many; a longer row
    /// runs alone. A long response then costs its own positions rather than padding a
    /// micro-batch to its length. The loss does not depend on the grouping. Absent: off.
    pub micro_batch_tokens: Option<usize>,
    /// Lay each prompt out once for all the responses to it in a micro-batch of the policy and
    /// reference forwards (their responses attend it and their own tokens only, so every
    /// log-prob is what it is in the padded layout); the policy's micro-batches group the
    /// responses to one prompt. GRPO samples several responses per prompt, so this computes a
    /// prompt once instead of once per response. `false`: OpenRLHF's padded layout.
    pub share_prompt: bool,
    /// Passes over each step's experience.
    pub max_epochs: usize,
    /// Actor learning rate.
    pub actor_lr: f64,
    /// Critic learning rate.
    pub critic_lr: f64,
    /// Learning-rate warm-up steps (optimizer steps).
    pub lr_warmup_steps: u64,
    /// Learning-rate warm-up as a fraction of the run's optimizer steps (OpenRLHF's
    /// `--lr_warmup_ratio`); instead of `lr_warmup_steps`, not beside it.
    pub lr_warmup_ratio: Option<f64>,
    /// The learning rate after warm-up: `constant_with_warmup` (the default here) or
    /// `cosine_with_min_lr` (OpenRLHF's default: a cosine decay to `min_lr_ratio` × the peak
    /// over the run's optimizer steps). The default stays constant because every RL figure
    /// and test of this repository was measured with it; set `cosine_with_min_lr` (and
    /// `lr_warmup_ratio: 0.03`) for OpenRLHF's schedule.
    pub lr_scheduler: LrScheduler,
    /// `cosine_with_min_lr`'s floor as a fraction of the peak (OpenRLHF: `min_lr = 0.1 × lr`).
    pub min_lr_ratio: f64,
    /// Gradient clipping.
    pub max_grad_norm: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Steps during which only the critic trains.
    pub freezing_actor_steps: u64,
    /// What each data-parallel rank of the policy, critic, reference and reward model shards
    /// (OpenRLHF's `--zero_stage`; verl's FSDP is stage 3, and `fsdp`, `shard_grad_op`,
    /// `no_shard` are accepted): 0 nothing, 1 AdamW state, 2 also gradients, 3 also
    /// parameters (each decoder layer gathered just before it runs and freed after).
    pub zero_stage: rtrun_rlhf_shard::ZeroStage,
    /// Recompute each decoder layer of the trained roles in the backward pass instead of
    /// keeping its activations (OpenRLHF's `--gradient_checkpointing`, verl's
    /// `enable_gradient_checkpointing`).
    pub gradient_checkpointing: bool,
    /// How a step's experience is made: `sequential` (generate everything, then every role
    /// over the whole batch; the default) or `dock` (GRPO stages streaming prompt groups
    /// through a TransferDock actor, see [`crate::trainer::pipeline`]; with `rollout.mode:
    /// async` the rollout thread streams every finished group into the dock, whose reward and
    /// reference stages score it while the policy trains).
    pub pipeline: PipelineMode,
    /// `pipeline: dock`: prompt groups each stage (each rollout rank) takes per call; fewer
    /// mean earlier overlap, more mean larger engine and log-prob batches. The last call of a
    /// step may get fewer; with `rollout.mode: async` a call takes whatever groups have
    /// arrived, at most this many.
    pub dock_groups_per_batch: usize,
    /// `pipeline: dock`: the longest pause, in milliseconds, of a stage waiting for rows (its
    /// pauses double from 0.2 ms up to this); shorter means a batch is picked up sooner after
    /// it lands, at the cost of more dock calls while waiting.
    pub dock_max_poll_pause_ms: u64,
}

/// How per-token losses are aggregated (`algo.loss_agg_mode`, verl's names; `_` works for `-`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum LossAggMode {
    /// Σ over the global mini-batch's tokens / their count.
    #[default]
    #[serde(alias = "token_mean")]
    TokenMean,
    /// The mean over sequences of each sequence's token mean.
    #[serde(alias = "seq_mean_token_mean")]
    SeqMeanTokenMean,
    /// The mean over sequences of each sequence's token sum.
    #[serde(alias = "seq_mean_token_sum")]
    SeqMeanTokenSum,
    /// Σ over every token / (sequences × `rollout.max_new_tokens`): Dr. GRPO's constant.
    #[serde(alias = "seq_mean_token_sum_norm")]
    SeqMeanTokenSumNorm,
}

/// The learning rate after warm-up (`train.lr_scheduler`, OpenRLHF's `--lr_scheduler`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum LrScheduler {
    /// The peak rate from the end of warm-up on.
    #[default]
    ConstantWithWarmup,
    /// Cosine decay from the peak to `min_lr_ratio` × the peak at the last optimizer step.
    CosineWithMinLr,
}

/// How a step's experience is made (`train.pipeline`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum PipelineMode {
    /// Generate every sample, then rewards, log-probs and values over the whole batch.
    #[default]
    Sequential,
    /// Rollout → rule reward → reference log-prob → old log-prob → advantages → train as
    /// concurrent stages reading and writing only through a TransferDock actor, so later
    /// stages start on early prompt groups while generation continues. GRPO-style runs only
    /// (a group-local advantage estimator, no critic, no hybrid engine).
    Dock,
}

impl TrainLoopConfig {
    /// The sharding of the role ranks.
    pub fn shard(&self) -> rtrun_rlhf_shard::ShardConfig {
        rtrun_rlhf_shard::ShardConfig {
            stage: self.zero_stage,
            gradient_checkpointing: self.gradient_checkpointing,
        }
    }
}

impl Default for TrainLoopConfig {
    fn default() -> Self {
        Self {
            num_episodes: 1,
            max_steps: None,
            train_batch_size: 128,
            micro_batch_size: 32,
            micro_batch_tokens: None,
            share_prompt: true,
            max_epochs: 1,
            actor_lr: 1e-6,
            critic_lr: 9e-6,
            lr_warmup_steps: 0,
            lr_warmup_ratio: None,
            lr_scheduler: LrScheduler::ConstantWithWarmup,
            min_lr_ratio: 0.1,
            max_grad_norm: 1.0,
            weight_decay: 0.0,
            freezing_actor_steps: 0,
            zero_stage: rtrun_rlhf_shard::ZeroStage::Zero,
            gradient_checkpointing: false,
            pipeline: PipelineMode::Sequential,
            dock_groups_per_batch: 4,
            dock_max_poll_pause_ms: 5,
        }
    }
}

/// Where rewards come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RewardConfig {
    /// `rule` (a built-in rule checking the label), `custom` (a function registered by name),
    /// `model` (a reward-model role), `remote` (an HTTP URL), `python` (a Python function in
    /// `path`).
    pub kind: RewardKind,
    /// `kind: python`: the file defining the reward function (OpenRLHF's `--remote_rm_url
    /// reward.py`, verl's `custom_reward_function.path`).
    pub path: Option<PathBuf>,
    /// `kind: python`: the function's name; it takes OpenRLHF's `(queries, prompts, labels)`
    /// (`queries`: prompt + response texts) and returns one float per query, or a dict with
    /// `rewards`.
    pub function: String,
    /// `kind: python`: the interpreter that runs it (found on `PATH` unless a path).
    pub python: String,
    /// The rule's or custom function's registered name.
    pub name: String,
    /// The URL of a remote reward server, or a list of them that the reward tasks spread over
    /// and fail over between (`kind: remote`; OpenRLHF's `--remote_rm_url`).
    pub url: OneOrMany<String>,
    /// Seconds one request to a reward server may take.
    pub timeout_s: f64,
    /// Attempts after a failed request (connection error, timeout, 5xx), over the URLs in
    /// turn, with doubling back-off from 0.2 s.
    pub max_retries: u32,
    /// A Hugging Face directory with a reward model (`kind: model`; a `score.weight` head,
    /// OpenRLHF's `--reward_pretrain`). With a tokenizer other than the policy's, prompt and
    /// response are re-tokenized with its own.
    pub model_dir: Option<PathBuf>,
    /// Where the reward model runs.
    pub device: DeviceName,
    /// The reward model's precision.
    pub dtype: ModelDtype,
    /// Reward computations run as this many parallel tasks.
    pub parallel_tasks: usize,
    /// For `rule` / `custom`: the reward function per record `data_source` (verl's column),
    /// `{source: function}`; a record of another source, or none, gets `name`.
    pub by_source: std::collections::BTreeMap<String, String>,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self {
            kind: RewardKind::Rule,
            path: None,
            function: "reward_func".to_owned(),
            python: "python3".to_owned(),
            name: "char_match".to_owned(),
            url: OneOrMany::default(),
            timeout_s: 60.0,
            max_retries: 3,
            model_dir: None,
            device: DeviceName::default(),
            dtype: ModelDtype::Fp32,
            parallel_tasks: 1,
            by_source: Default::default(),
        }
    }
}

/// Reward sources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RewardKind {
    /// A built-in rule.
    Rule,
    /// A function registered with [`crate::reward::REWARD_FUNCTIONS`].
    Custom,
    /// A reward model.
    Model,
    /// An HTTP reward server.
    Remote,
    /// A Python function (`reward.path`, `reward.function`) in long-lived Python processes.
    Python,
}

/// Held-out evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    /// Evaluate every this many steps (0: only at the start and the end).
    pub every_steps: u64,
    /// Sampling temperature of held-out answers (0: greedy; verl's `val_kwargs.temperature`).
    pub temperature: f32,
    /// Answers per held-out prompt (verl's `val_kwargs.n`; above 1 needs a temperature): the
    /// rewards are averaged over all of them (`eval/reward`, `eval/mean@k`) and a prompt
    /// passes when any answer earns the full reward (`eval/pass@k`).
    pub n_samples: usize,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self { every_steps: 10, temperature: 0.0, n_samples: 1 }
    }
}

/// Checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Save every this many steps (0: never).
    pub every_steps: u64,
    /// Resume from the newest checkpoint in the run directory when there is one.
    pub resume: bool,
    /// Keep only this many newest checkpoints (absent: all).
    pub keep_last: Option<usize>,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self { every_steps: 0, resume: true, keep_last: None }
    }
}

/// Which config a run read, for the driver's first line: `config: grpo.yaml`, with a note
/// when the file is empty (every key then takes its default) and how many `--set` overrides
/// were applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigOrigin {
    /// The file as given.
    pub file: String,
    /// Whether the file held no settings (empty, or only comments).
    pub empty: bool,
    /// `--set` overrides applied on top.
    pub overrides: usize,
}

impl std::fmt::Display for ConfigOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "config: {}", self.file)?;
        if self.empty {
            write!(f, " (empty: running on defaults)")?;
        }
        if self.overrides > 0 {
            write!(f, " with {} --set override(s)", self.overrides)?;
        }
        Ok(())
    }
}

/// Which trainer a config is for: the YAML's top-level `mode:` (`train --mode`), `rl` when
/// absent. One driver, one config style, one run-directory layout for every trainer.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// PPO / GRPO with generation engines ([`TrainConfig`]).
    #[default]
    Rl,
    /// Supervised fine-tuning on prompt/response data ([`crate::stage::StageConfig`]).
    Sft,
    /// A reward model trained on (chosen, rejected) pairs (Bradley–Terry).
    Rm,
    /// DPO on (chosen, rejected) pairs against a frozen reference.
    Dpo,
}

impl Mode {
    /// Every mode, as the YAML spells them.
    pub const NAMES: &'static str = "`rl`, `sft`, `rm`, `dpo`";

    /// The YAML name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Rl => "rl",
            Mode::Sft => "sft",
            Mode::Rm => "rm",
            Mode::Dpo => "dpo",
        }
    }
}

/// A config file read into a tree with its overrides applied and its `mode` taken out: the
/// YAML becomes a tree first (syntax errors and duplicate keys are reported at their line
/// there), the overrides are applied to the tree (so an override of an unknown key is an error
/// as a typo in the file is), and [`ConfigTree::typed`] turns it into a config with the failing
/// key's path tracked, so a wrong type names the key (and its line in the file).
#[derive(Debug, Clone)]
pub struct ConfigTree {
    root: serde_json::Value,
    text: String,
    file: String,
    overrides: Vec<String>,
    /// Whether the file held no settings (empty, or only comments).
    pub empty: bool,
    /// The trainer the config is for.
    pub mode: Mode,
}

impl ConfigTree {
    /// Reads `path` and applies `overrides`.
    pub fn read(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
        Self::parse(&text, &path.display().to_string(), overrides)
    }

    /// Whether the file or an override sets the dotted `key` (`train.micro_batch_size`).
    pub fn sets(&self, key: &str) -> bool {
        key.split('.')
            .try_fold(&self.root, |node, part| node.as_object().and_then(|m| m.get(part)))
            .is_some()
    }

    /// Parses YAML `text` (`file` names it in errors) and applies `overrides`.
    pub fn parse(text: &str, file: &str, overrides: &[String]) -> Result<Self> {
        let tree = yaml::parse_tree(text, file)?;
        let empty = tree.is_null();
        let mut root = if empty { serde_json::Value::Object(Default::default()) } else { tree };
        if !root.is_object() {
            return Err(TrainError::ConfigFile {
                file: file.to_owned(),
                message: format!(
                    "expected a mapping of sections (`train:`, `data:`, ...), found {}",
                    yaml::kind(&root)
                ),
            });
        }
        for item in overrides {
            apply_override(&mut root, item)?;
        }
        let mode = match root.as_object_mut().and_then(|m| m.remove("mode")) {
            None => Mode::default(),
            Some(value) => serde_json::from_value::<Mode>(value.clone()).map_err(|_| {
                let at = if overrides.iter().any(|o| o.trim_start().starts_with("mode=")) {
                    "--set or --mode".to_owned()
                } else {
                    yaml::key_line(text, "mode")
                        .map_or_else(|| file.to_owned(), |line| format!("{file}:{line}"))
                };
                TrainError::config(
                    "mode",
                    format!("expected one of {}, found {value} ({at})", Mode::NAMES),
                )
            })?,
        };
        Ok(Self {
            root,
            text: text.to_owned(),
            file: file.to_owned(),
            overrides: overrides.to_vec(),
            empty,
            mode,
        })
    }

    /// An error unless the config is for `mode` (a driver handed the wrong kind of config).
    pub fn expect_mode(&self, mode: Mode) -> Result<()> {
        if self.mode == mode {
            return Ok(());
        }
        Err(TrainError::config(
            "mode",
            format!(
                "expected a `{}` config here, found `mode: {}` ({})",
                mode.name(),
                self.mode.name(),
                self.file
            ),
        ))
    }

    /// The tree as a config section struct.
    pub fn typed<T: serde::de::DeserializeOwned>(self) -> Result<T> {
        yaml::typed(self.root, &self.text, &self.file, &self.overrides)
    }

    /// What the driver prints first (`config: sft.yaml with 2 --set override(s)`); `user` is
    /// the number of overrides the user gave (the driver adds some of its own).
    pub fn origin(&self, user: usize) -> ConfigOrigin {
        ConfigOrigin { file: self.file.clone(), empty: self.empty, overrides: user }
    }
}

/// A run's config as the driver parsed, overrode and checked it, for the trainer actor, which
/// then neither reads YAML nor applies overrides again. It travels as the typed config's JSON:
/// some keys take one value or a list (read untagged), which only a self-describing format
/// carries, and the actor's arguments are bitcode, which is not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckedConfig {
    /// The trainer.
    pub mode: Mode,
    json: String,
}

impl CheckedConfig {
    /// A checked `mode: rl` config.
    pub fn rl(config: &TrainConfig) -> Result<Self> {
        Self::of(Mode::Rl, config)
    }

    /// A checked `mode: sft | rm | dpo` config.
    pub fn stage(config: &crate::stage::StageConfig) -> Result<Self> {
        Self::of(config.mode, config)
    }

    fn of(mode: Mode, config: &impl Serialize) -> Result<Self> {
        let json = serde_json::to_string(config)
            .map_err(|e| TrainError::Data(format!("encoding the checked config: {e}")))?;
        Ok(Self { mode, json })
    }

    /// The RL config; an error for another mode.
    pub fn train(&self) -> Result<TrainConfig> {
        if self.mode != Mode::Rl {
            return Err(TrainError::config(
                "mode",
                format!("expected rl, found {}", self.mode.name()),
            ));
        }
        self.decode()
    }

    /// The supervised trainers' config; an error for `mode: rl`.
    pub fn stage_config(&self) -> Result<crate::stage::StageConfig> {
        if self.mode == Mode::Rl {
            return Err(TrainError::config("mode", "expected sft, rm or dpo, found rl"));
        }
        let mut config: crate::stage::StageConfig = self.decode()?;
        config.mode = self.mode;
        Ok(config)
    }

    fn decode<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_str(&self.json)
            .map_err(|e| TrainError::Data(format!("decoding the checked config: {e}")))
    }
}

impl TrainConfig {
    /// Reads a YAML file and applies `key=value` overrides (dotted keys, YAML values).
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        Ok(Self::load_with_origin(path, overrides)?.0)
    }

    /// [`TrainConfig::load`], also saying which config ran (for the driver to print).
    pub fn load_with_origin(path: &Path, overrides: &[String]) -> Result<(Self, ConfigOrigin)> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
        let file = path.display().to_string();
        let (config, empty) = Self::parse(&text, &file, overrides)?;
        Ok((config, ConfigOrigin { file, empty, overrides: overrides.len() }))
    }

    /// Parses YAML text (`file` names it in errors), then applies overrides on the parsed
    /// tree, so an override of an unknown key is an error as a typo in the file is.
    pub fn from_yaml(text: &str, file: &str, overrides: &[String]) -> Result<Self> {
        Ok(Self::parse(text, file, overrides)?.0)
    }

    /// The config and whether the file held no settings (see [`ConfigTree`]).
    fn parse(text: &str, file: &str, overrides: &[String]) -> Result<(Self, bool)> {
        let tree = ConfigTree::parse(text, file, overrides)?;
        let empty = tree.empty;
        Ok((Self::from_tree(tree)?, empty))
    }

    /// The typed and checked config of a parsed tree (overrides applied) of `mode: rl`.
    pub fn from_tree(tree: ConfigTree) -> Result<Self> {
        tree.expect_mode(Mode::Rl)?;
        let micro_set = tree.sets("train.micro_batch_size");
        let mut config: Self = tree.typed()?;
        if !micro_set {
            // The default micro-batch shrinks to a small batch's per-rank share; one the
            // config names must fit (`validate`).
            config.train.micro_batch_size =
                config.train.micro_batch_size.min(config.train.train_batch_size.max(1));
        }
        config.validate()?;
        Ok(config)
    }

    /// Generated tokens at most per sample.
    pub fn max_new_tokens(&self) -> usize {
        match (self.rollout.max_new_tokens, self.data.synthetic_task()) {
            (0, Some(task)) => task.max_answer_tokens() + 1,
            (n, _) => n,
        }
    }

    /// The policy's Hugging Face directory: `policy.pretrain`, or the locally made initial
    /// policy in the run directory.
    pub fn policy_dir(&self) -> PathBuf {
        self.policy
            .pretrain
            .clone()
            .unwrap_or_else(|| crate::paths::RunPaths::new(&self.run_dir).initial_policy)
    }
}

/// Sets `a.b.c=value` in the config tree; the value is parsed as YAML (`3`, `true`, `[1, 2]`,
/// text).
fn apply_override(root: &mut serde_json::Value, item: &str) -> Result<()> {
    let (key, value) = item
        .split_once('=')
        .ok_or_else(|| TrainError::config(item, "expected `--set key=value`, found no `=`"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(TrainError::config(key, "expected a dotted key such as `train.actor_lr`"));
    }
    let value: serde_json::Value = serde_saphyr::from_str(value).map_err(|e| {
        TrainError::config(key, format!("expected a YAML value, found `{value}` ({e})"))
    })?;
    let mut node = root;
    let parts: Vec<&str> = key.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        let map = node.as_object_mut().ok_or_else(|| {
            TrainError::config(
                key,
                format!("expected `{}` to be a section, found a value", parts[..i].join(".")),
            )
        })?;
        if i + 1 == parts.len() {
            map.insert((*part).to_owned(), value);
            return Ok(());
        }
        node = map
            .entry((*part).to_owned())
            .or_insert_with(|| serde_json::Value::Object(Default::default()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_openrlhf_defaults() {
        let c = TrainConfig::from_yaml("", "x.yaml", &[]).unwrap();
        assert_eq!(c.algo.eps_clip_low, 0.2);
        assert_eq!(c.algo.value_clip, 0.5);
        assert_eq!(c.algo.init_kl_coef, 0.01);
        assert_eq!(c.algo.kl_estimator, KlEstimator::K1);
        assert_eq!(c.algo.advantage_estimator, AdvantageEstimator::Gae);
        assert_eq!(c.train.actor_lr, 1e-6);
        assert_eq!(c.train.critic_lr, 9e-6);
    }

    #[test]
    fn threads_per_worker_is_auto_or_a_positive_count_and_errors_name_the_key() {
        let parse = |value: &str| {
            TrainConfig::from_yaml("", "x.yaml", &[format!("cluster.threads_per_worker={value}")])
        };
        assert_eq!(TrainConfig::default().cluster.threads_per_worker, WorkerThreads::Auto);
        assert_eq!(parse("auto").unwrap().cluster.threads_per_worker, WorkerThreads::Auto);
        assert_eq!(parse("3").unwrap().cluster.threads_per_worker, WorkerThreads::Fixed(3));
        for bad in ["0", "many"] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains("threads_per_worker") || err.contains("thread count"), "{err}");
        }
        let err = parse("many").unwrap_err().to_string();
        assert!(err.contains("`many`"), "{err}");
    }

    #[test]
    fn overrides_set_nested_keys_with_yaml_values() {
        let c = TrainConfig::from_yaml(
            "train:\n  actor_lr: 0.001\n",
            "x.yaml",
            &[
                "train.actor_lr=0.002".into(),
                "algo.advantage_estimator=group_norm".into(),
                "algo.kl_target=0.1".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.train.actor_lr, 0.002);
        assert_eq!(c.algo.advantage_estimator, AdvantageEstimator::GroupNorm);
        assert_eq!(c.algo.kl_target, Some(0.1));
    }

    #[test]
    fn nccl_on_one_gpu_becomes_cuda_ipc_and_nothing_else_changes() {
        use WeightSyncBackend::*;
        assert_eq!(Nccl.effective(true, 1, 1), CudaIpc);
        assert_eq!(Nccl.effective(false, 1, 1), Nccl);
        assert_eq!(Nccl.effective(true, 8, 8), Nccl);
        assert_eq!(ObjectStore.effective(true, 1, 1), ObjectStore);
        assert_eq!(CudaIpc.effective(false, 2, 2), CudaIpc);
        let ipc =
            TrainConfig::from_yaml("rollout:\n  weight_sync_backend: cuda_ipc\n", "x.yaml", &[]);
        if cfg!(feature = "cuda") {
            // A CPU policy cannot export GPU memory.
            let message = ipc.unwrap_err().to_string();
            assert!(message.contains("policy.device"), "{message}");
        } else {
            let message = ipc.unwrap_err().to_string();
            assert!(message.contains("found cuda_ipc"), "{message}");
        }
    }

    #[test]
    fn weight_sync_backend_defaults_to_the_object_store_and_nccl_needs_cuda() {
        let c = TrainConfig::from_yaml("", "x.yaml", &[]).unwrap();
        assert_eq!(c.rollout.weight_sync_backend, WeightSyncBackend::ObjectStore);
        let nccl = TrainConfig::from_yaml("rollout:\n  weight_sync_backend: nccl\n", "x.yaml", &[]);
        if cfg!(feature = "cuda") {
            assert_eq!(nccl.unwrap().rollout.weight_sync_backend, WeightSyncBackend::Nccl);
        } else {
            let message = nccl.unwrap_err().to_string();
            assert!(message.contains("rollout.weight_sync_backend"), "{message}");
        }
    }

    #[test]
    fn streamed_rollout_keys_are_checked_together() {
        let err = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            TrainConfig::from_yaml("", "bad.yaml", &sets).unwrap_err().to_string()
        };
        let ok = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            TrainConfig::from_yaml("", "ok.yaml", &sets).unwrap()
        };
        let sync_with_bound = err(&["rollout.max_staleness=2"]);
        assert!(
            sync_with_bound.contains("rollout.max_staleness") && sync_with_bound.contains("async"),
            "{sync_with_bound}"
        );
        let zero = err(&["rollout.mode=async", "rollout.max_staleness=0"]);
        assert!(zero.contains("rollout.max_staleness") && zero.contains("found 0"), "{zero}");
        assert!(
            err(&["rollout.mode=async", "rollout.max_staleness=100000"]).contains("at most 64")
        );
        assert!(err(&["rollout.max_staleness=-1"]).contains("rollout.max_staleness"));
        assert!(err(&["rollout.mode=later"]).contains("rollout.mode"));
        for bad in ["0", "-0.5", "1.5"] {
            let e = err(&[&format!("rollout.partial_threshold={bad}")]);
            assert!(e.contains("rollout.partial_threshold") && e.contains("(0, 1]"), "{bad}: {e}");
        }
        let both = err(&["rollout.mode=async", "rollout.partial_threshold=0.8"]);
        assert!(both.contains("rollout.partial_threshold") && both.contains("async"), "{both}");
        for bad in ["0.5", ".inf", "-2"] {
            assert!(err(&[&format!("algo.tis_cap={bad}")]).contains("algo.tis_cap"), "{bad}");
        }
        // A partial rollout runs one step's groups; an async one streams into the dock.
        let dock = err(&[
            "rollout.partial_threshold=0.8",
            "train.pipeline=dock",
            "algo.advantage_estimator=group_norm",
            "train.train_batch_size=128",
        ]);
        assert!(
            dock.contains("rollout.partial_threshold") && dock.contains("sequential"),
            "{dock}"
        );
        let docked = ok(&[
            "rollout.mode=async",
            "train.pipeline=dock",
            "algo.advantage_estimator=group_norm",
            "algo.tis_cap=3",
        ]);
        assert_eq!(docked.rollout.tis_cap(&docked.algo), Some(3.0));
        let dock_groups = |c: &TrainConfig| crate::trainer::dock_layout::dock_config(c).prompts;
        assert_eq!(dock_groups(&docked), 2 * docked.rollout.prompts_per_step);
        let bound = ok(&[
            "rollout.mode=async",
            "rollout.max_staleness=3",
            "train.pipeline=dock",
            "algo.advantage_estimator=rloo",
        ]);
        assert_eq!(dock_groups(&bound), 4 * bound.rollout.prompts_per_step);
        let sync_tis =
            err(&["train.pipeline=dock", "algo.advantage_estimator=rloo", "algo.tis_cap=3"]);
        assert!(sync_tis.contains("algo.tis_cap") && sync_tis.contains("sync"), "{sync_tis}");
        let dynamic = err(&[
            "rollout.partial_threshold=0.8",
            "algo.advantage_estimator=group_norm",
            "algo.dynamic_sampling.max_gen_batches=2",
        ]);
        assert!(dynamic.contains("rollout.partial_threshold"), "{dynamic}");
        let hybrid = err(&["rollout.mode=async", "cluster.colocate_all=true"]);
        assert!(hybrid.contains("rollout.mode") && hybrid.contains("colocate_all"), "{hybrid}");
        let tail = |share: &str, min: &str, max: &str| {
            err(&[
                &format!("data.synthetic.long_tail.share={share}"),
                &format!("data.synthetic.long_tail.min_digits={min}"),
                &format!("data.synthetic.long_tail.max_digits={max}"),
            ])
        };
        assert!(tail("1.5", "10", "20").contains("data.synthetic.long_tail.share"));
        assert!(tail("0.1", "30", "20").contains("data.synthetic.long_tail.min_digits"));
        assert!(tail("0.1", "10", "600").contains("<= 512"));
        // Tools: known built-ins, a chat-template policy, one-step rollouts.
        assert!(err(&["tools.enabled=[search]"]).contains("tools.enabled"));
        let synthetic = err(&["tools.enabled=[calculator]"]);
        assert!(synthetic.contains("policy.pretrain"), "{synthetic}");
        assert!(err(&["tools.timeout_s=0"]).contains("tools.timeout_s"));
        assert!(err(&["tools.max_output_bytes=0"]).contains("tools.max_output_bytes"));
        assert!(err(&["rollout.max_turns=0"]).contains("rollout.max_turns"));
        assert!(err(&["rollout.partial_max_carry=0"]).contains("rollout.partial_max_carry"));
        // What is accepted, and what it resolves to.
        let asynchronous = ok(&["rollout.mode=async"]);
        assert!(asynchronous.rollout.streams());
        assert_eq!(asynchronous.rollout.staleness(), 1);
        assert_eq!(asynchronous.rollout.tis_cap(&asynchronous.algo), Some(2.0));
        assert!(!asynchronous.old_logprobs_from_engine(), "the engine's log-probs are behaviour");
        let partial = ok(&["rollout.partial_threshold=0.8", "algo.tis_cap=3"]);
        assert!(partial.rollout.streams());
        assert_eq!(partial.rollout.tis_cap(&partial.algo), Some(3.0));
        let whole = ok(&["rollout.partial_threshold=1"]);
        assert!(!whole.rollout.streams(), "a threshold of 1 waits for every group");
        assert_eq!(whole.rollout.tis_cap(&whole.algo), None);
    }

    #[test]
    fn bad_configs_name_the_key() {
        let err = |yaml: &str, sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            TrainConfig::from_yaml(yaml, "bad.yaml", &sets).unwrap_err().to_string()
        };
        assert!(err("train:\n  actor_lrr: 1\n", &[]).contains("actor_lrr"));
        // A slip is answered with the nearest valid name; nothing close, no guess.
        let slip = err("train:\n  actor_lrr: 1\n", &[]);
        assert!(slip.contains("did you mean `actor_lr`?"), "{slip}");
        let slip = err("", &["rollout.temperatur=1"]);
        assert!(slip.contains("rollout.temperatur") && slip.contains("`temperature`"), "{slip}");
        assert!(!err("", &["rollout.zzzz=1"]).contains("did you mean"));
        let value = err("", &["train.lr_scheduler=cosine_with_minlr"]);
        assert!(value.contains("did you mean `cosine_with_min_lr`?"), "{value}");
        assert!(err("", &["rollout.top_p=0"]).contains("rollout.top_p"));
        assert!(
            err("", &["rollout.n_samples_per_prompt=1", "algo.advantage_estimator=group_norm"])
                .contains("rollout.n_samples_per_prompt")
        );
        assert!(err("", &["train.train_batch_size=7"]).contains("train.train_batch_size"));
        assert!(err("", &["reward.name=nope"]).contains("reward.name"));
        assert!(err("", &["reward.kind=remote"]).contains("reward.url"));
        assert!(err("", &["noequals"]).contains("no `="));
        assert!(err("seed: 1\n", &["seed.x=1"]).contains("`seed` to be a section"));
        assert!(err("algo: [1, 2]\n", &[]).contains("bad.yaml"));
        assert!(err("", &["algo.kl_estimator=k9"]).contains("k9"));
        assert!(err("", &["model.num_kv_heads=3"]).contains("model.num_kv_heads"));
        assert!(
            err("data:\n  synthetic: {min_digits: 0}\n", &[]).contains("data.synthetic.min_digits")
        );
        assert!(err("", &["data.prompt_data=x.jsonl"]).contains("policy.pretrain"));
        assert!(err("", &["policy.pretrain=/nonexistent"]).contains("policy.pretrain"));
        assert!(err("", &["engine.device=gpu"]).contains("engine.device"));
        assert!(err("", &["policy.dtype=fp8"]).contains("fp8"));
        assert!(err("", &["checkpoint.keep_last=0"]).contains("checkpoint.keep_last"));
        assert!(err("", &["algo.dual_clip=1"]).contains("algo.dual_clip"));
        let mode = err("", &["algo.loss_agg_mode=seq-mean"]);
        assert!(
            mode.contains("algo.loss_agg_mode") && mode.contains("seq-mean-token-mean"),
            "{mode}"
        );
        assert!(err("", &["train.lr_warmup_ratio=1.5"]).contains("train.lr_warmup_ratio"));
        let both = err("", &["train.lr_warmup_ratio=0.1", "train.lr_warmup_steps=3"]);
        assert!(both.contains("train.lr_warmup_ratio") && both.contains("both"), "{both}");
        assert!(err("", &["train.min_lr_ratio=2"]).contains("train.min_lr_ratio"));
        assert!(err("", &["train.lr_scheduler=linear"]).contains("cosine_with_min_lr"));
        // LoRA: the policy's only, checked as OpenRLHF's flags would be.
        assert!(err("", &["reference.lora.rank=8"]).contains("reference.lora"));
        assert!(err("", &["critic.lora_adapter=/x"]).contains("critic.lora_adapter"));
        let bad = err("", &["policy.lora.rank=8", "policy.lora.target_modules=[attn]"]);
        assert!(bad.contains("policy.lora") && bad.contains("`attn`"), "{bad}");
        assert!(err("", &["policy.lora.rank=-1"]).contains("policy.lora"));
        assert!(err("", &["policy.lora.rank=8", "policy.lora.alpha=0"]).contains("alpha"));
        assert!(err("", &["policy.lora.rank=8", "policy.lora.dropout=1"]).contains("dropout"));
        assert!(err("", &["policy.lora.alpha=8"]).contains("rank"));
        // The locally made policy's projections are 64 wide: rank 65 fits none.
        let bad = err("", &["policy.lora.rank=65"]);
        assert!(bad.contains("policy.lora") && bad.contains("at most 64"), "{bad}");
        let bad = err("", &["policy.lora_adapter=/nonexistent"]);
        assert!(
            bad.contains("policy.lora_adapter") && bad.contains("adapter_config.json"),
            "{bad}"
        );
        let ipc = ["policy.lora.rank=8", "rollout.weight_sync_backend=cuda_ipc"];
        assert!(err("", &ipc).contains("rollout.weight_sync_backend"));
        if !cfg!(feature = "cuda") {
            assert!(err("", &["critic.device=cuda"]).contains("critic.device"));
        }
        assert!(err("", &["algo.gamma=1.5"]).contains("algo.gamma"));
        assert!(err("", &["train.pipeline=dock"]).contains("algo.advantage_estimator"));
        assert!(
            err(
                "",
                &[
                    "train.pipeline=dock",
                    "algo.advantage_estimator=group_norm",
                    "cluster.colocate_all=true"
                ]
            )
            .contains("cluster.colocate_all")
        );
        assert!(err("", &["train.pipeline=conveyor"]).contains("conveyor"));
        // Values that parse but would train something else than asked.
        let clip = err("", &["algo.eps_clip_low=2"]);
        assert!(clip.contains("algo.eps_clip_low") && clip.contains("[0, 1)"), "{clip}");
        // The default batch (128 samples) with a larger micro-batch.
        let micro = err("", &["train.micro_batch_size=200"]);
        assert!(micro.contains("train.micro_batch_size") && micro.contains("= 128"), "{micro}");
        // The synthetic task's budget is 8 tokens (6 digits, `<eos>`, one spare).
        let long = err("", &["algo.overlong_penalty.buffer_len=8"]);
        assert!(
            long.contains("algo.overlong_penalty.buffer_len") && long.contains("= 8"),
            "{long}"
        );
        assert!(err("", &["algo.overlong_penalty.factor=1"]).contains("buffer_len"));
        let dock =
            ["train.pipeline=dock", "algo.advantage_estimator=rloo", "algo.normalize_reward=true"];
        assert!(err("", &dock).contains("algo.normalize_reward"));
        assert!(err("", &["eval.n_samples=4"]).contains("eval.temperature"));
        // verl-style data: a template with its `{}`, a weight per file summing to 1, routes to
        // registered functions of a rule reward.
        assert!(err("", &["data.input_template=Q:"]).contains("data.input_template"));
        let probs = ["data.prompt_data=[a.jsonl, b.jsonl]", "data.prompt_probs=[0.5, 0.6]"];
        assert!(err("", &probs).contains("sum to 1"));
        let probs = ["data.prompt_data=a.jsonl", "data.prompt_probs=[0.5, 0.5]"];
        assert!(err("", &probs).contains("one weight per data.prompt_data file (1)"));
        assert!(err("", &["reward.kind=python"]).contains("reward.path"));
        let missing = err("", &["reward.kind=python", "reward.path=/nonexistent/r.py"]);
        assert!(missing.contains("reward.path") && missing.contains("/nonexistent/r.py"));
        let route = err("", &["reward.by_source.gsm8k=nope"]);
        assert!(route.contains("reward.by_source.gsm8k") && route.contains("`nope`"), "{route}");
        let dock =
            ["train.pipeline=dock", "algo.advantage_estimator=rloo", "logging.samples_per_step=2"];
        assert!(err("", &dock).contains("logging.samples_per_step"));
        // An async step on the dock holds every row: it may log samples.
        let with_async: Vec<String> =
            dock.iter().chain(&["rollout.mode=async"]).map(|s| s.to_string()).collect();
        assert!(TrainConfig::from_yaml("", "ok.yaml", &with_async).is_ok());
        assert!(err("", &["eval.n_samples=0"]).contains("eval.n_samples"));
        // The default micro-batch (32) shrinks to a small batch.
        let small = ["train.train_batch_size=8".to_owned()];
        let small = TrainConfig::from_yaml("", "small.yaml", &small).unwrap();
        assert_eq!(small.train.micro_batch_size, 8);
    }

    /// A generation budget the policy's context cannot hold is refused, naming the checkpoint's
    /// `max_position_embeddings`.
    #[test]
    fn a_generation_budget_past_the_policys_context_names_it() {
        let dir = std::env::temp_dir().join(format!("rtrun-config-ctx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut model = rtrun_rlhf_model::tiny::tiny_config(rtrun_rlhf_model::ModelFamily::Qwen2);
        model.max_position_embeddings = 64;
        model.write_to_dir(&dir).unwrap();
        let sets = |budget: usize| {
            vec![
                format!("policy.pretrain={}", dir.display()),
                "data.prompt_data=p.jsonl".to_owned(),
                format!("rollout.max_new_tokens={budget}"),
            ]
        };
        let err = TrainConfig::from_yaml("", "ctx.yaml", &sets(64)).unwrap_err().to_string();
        assert!(
            err.contains("rollout.max_new_tokens") && err.contains("max_position_embeddings 64"),
            "{err}"
        );
        let ok = TrainConfig::from_yaml("", "ctx.yaml", &sets(63));
        assert!(!ok.is_err_and(|e| e.to_string().contains("max_position_embeddings")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn wrong_types_name_the_key_the_expected_type_and_the_line() {
        let err = |yaml: &str, sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            TrainConfig::from_yaml(yaml, "bad.yaml", &sets).unwrap_err().to_string()
        };
        assert_eq!(
            err("seed: 1\ntrain:\n  actor_lr: [1, 2]\n", &[]),
            "config key `train.actor_lr`: expected a number, found a sequence (bad.yaml:3)"
        );
        assert_eq!(
            err("", &["train.actor_lr=[1, 2]"]),
            "config key `train.actor_lr`: expected a number, found a sequence (--set)"
        );
        let message = err("rollout: {n_samples_per_prompt: two}\n", &[]);
        assert!(
            message
                .starts_with("config key `rollout.n_samples_per_prompt`: expected a whole number")
                && message.ends_with("(bad.yaml:1)"),
            "{message}"
        );
        let message = err("train:\n  actor_lrr: 1\n", &[]);
        assert!(
            message.starts_with(
                "config key `train.actor_lrr`: unknown key; did you mean `actor_lr`? expected one of"
            )
                && message.ends_with("(bad.yaml:2)"),
            "{message}"
        );
        assert!(err("[1, 2]\n", &[]).contains("expected a mapping of sections"));
    }

    #[test]
    fn a_duplicate_key_is_named_with_its_line() {
        let err = TrainConfig::from_yaml(
            "seed: 1\ntrain:\n  actor_lr: 0.1\n  actor_lr: 0.2\n",
            "dup.yaml",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "dup.yaml:4:3: duplicate key `actor_lr` (a key may appear once in its section)"
        );
    }

    #[test]
    fn the_trainer_gets_the_config_the_driver_checked() {
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/rlhf");
        // As the trainer actor's constructor argument travels: bitcode.
        let roundtrip = |c: &CheckedConfig| -> CheckedConfig {
            rtrun::codec::decode(&rtrun::codec::encode(c).unwrap()).unwrap()
        };
        let mut checked = 0;
        for entry in std::fs::read_dir(&examples).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "yaml") {
                continue;
            }
            // grpo-hf.yaml names a checkpoint the walkthrough makes first.
            let Ok(config) = TrainConfig::load(&path, &["seed=11".into()]) else { continue };
            let sent = CheckedConfig::rl(&config).unwrap();
            let back = roundtrip(&sent);
            assert_eq!(back.train().unwrap(), config, "{}", path.display());
            assert!(back.stage_config().is_err());
            checked += 1;
        }
        assert!(checked >= 3, "{checked} example configs");
        // Keys read untagged (one value or a list) survive too.
        let mut config = TrainConfig::default();
        config.reward.url = crate::data::OneOrMany(vec!["http://a/".into(), "http://b/".into()]);
        let back = roundtrip(&CheckedConfig::rl(&config).unwrap());
        assert_eq!(back.train().unwrap().reward.url, config.reward.url);
    }

    #[test]
    fn an_empty_config_file_says_it_runs_on_defaults() {
        let dir = std::env::temp_dir().join(format!("rtrun-config-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text, empty) in [
            ("empty.yaml", "", true),
            ("comments.yaml", "# nothing yet\n", true),
            ("set.yaml", "seed: 3\n", false),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            let (config, origin) = TrainConfig::load_with_origin(&path, &[]).unwrap();
            assert_eq!(origin.empty, empty, "{name}");
            let line = origin.to_string();
            assert_eq!(line.contains("(empty: running on defaults)"), empty, "{line}");
            assert!(line.starts_with(&format!("config: {}", path.display())), "{line}");
            if empty {
                assert_eq!(config, TrainConfig::default());
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn dock_pipeline_is_opt_in() {
        assert_eq!(TrainConfig::default().train.pipeline, PipelineMode::Sequential);
        let sets = ["train.pipeline=dock".to_owned(), "algo.advantage_estimator=rloo".to_owned()];
        let c = TrainConfig::from_yaml("", "t.yaml", &sets).unwrap();
        assert_eq!(c.train.pipeline, PipelineMode::Dock);
    }

    #[test]
    fn shipped_examples_parse() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/rlhf");
        for name in ["grpo.yaml", "ppo.yaml"] {
            TrainConfig::load(&root.join(name), &[]).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}
