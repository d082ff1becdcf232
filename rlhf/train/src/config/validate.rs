//! The range and cross-key checks of a parsed [`TrainConfig`], one function per section (the
//! model sections' are in `models.rs`); every error names its key and says what was expected.

use rtrun_rlhf_algo::AdvantageEstimator;
use rtrun_rlhf_shard::ZeroStage;

use super::{
    AlgoConfig, CheckpointConfig, ClusterConfig, ModelShape, PipelineMode, RewardKind, RolloutMode,
    TrainConfig, WarmupConfig, WeightSyncBackend, WorkerThreads,
};
use crate::demo::task::TaskConfig;
use crate::error::{Result, TrainError};

/// The largest `rollout.max_staleness`.
pub const MAX_STALENESS: u64 = 64;

/// `value` is at least 1 (an error naming `key` otherwise).
pub(crate) fn positive(key: &str, value: usize) -> Result<()> {
    if value == 0 { Err(TrainError::config(key, "expected at least 1, found 0")) } else { Ok(()) }
}

/// Every `(key, value)` is a finite number ≥ 0.
fn non_negative(values: &[(&str, f64)]) -> Result<()> {
    match values.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
        Some((key, value)) => {
            Err(TrainError::config(key, format!("expected a finite number >= 0, found {value}")))
        }
        None => Ok(()),
    }
}

/// `value` is in `[0, 1]`.
fn unit_interval(key: &str, value: f64) -> Result<()> {
    if (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(TrainError::config(key, format!("expected a number in [0, 1], found {value}")))
    }
}

impl TrainConfig {
    /// Checks ranges and cross-key constraints after parsing, section by section.
    pub fn validate(&self) -> Result<()> {
        self.data.validate()?;
        if let Some(task) = &self.data.synthetic {
            validate_task(task)?;
        }
        self.validate_models()?;
        self.validate_engine()?;
        self.checkpoint.validate()?;
        self.model.validate()?;
        self.warmup.validate()?;
        self.cluster.validate()?;
        self.validate_rollout()?;
        self.validate_weight_sync()?;
        self.algo.validate(self.rollout.n_samples_per_prompt)?;
        self.validate_train()?;
        self.validate_dock()?;
        self.validate_eval()?;
        self.validate_reward()?;
        self.validate_tools()
    }

    /// `tools.*` and the multi-turn limits.
    fn validate_tools(&self) -> Result<()> {
        let t = &self.tools;
        for name in &t.enabled {
            if !crate::tools::BUILT_IN.contains(&name.as_str()) {
                return Err(TrainError::config(
                    "tools.enabled",
                    format!(
                        "expected built-in tools of {:?} (others come from tools.url), found `{name}`",
                        crate::tools::BUILT_IN
                    ),
                ));
            }
        }
        if !(t.timeout_s.is_finite() && t.timeout_s > 0.0) {
            return Err(TrainError::config(
                "tools.timeout_s",
                format!("expected a finite number of seconds > 0, found {}", t.timeout_s),
            ));
        }
        positive("tools.max_output_bytes", t.max_output_bytes)?;
        positive("rollout.max_turns", self.rollout.max_turns)?;
        if !t.any() {
            return Ok(());
        }
        if self.policy.pretrain.is_none() || !self.data.apply_chat_template {
            return Err(TrainError::config(
                "tools",
                "expected a policy checkpoint (policy.pretrain) with data.apply_chat_template: \
                 true (tool calls and answers are turns of its chat template), found neither",
            ));
        }
        let what = "multi-turn tool rollouts";
        if self.train.pipeline != PipelineMode::Sequential {
            return Err(TrainError::config(
                "tools",
                format!("expected train.pipeline `sequential` for {what}, found `dock`"),
            ));
        }
        if self.rollout.streams() {
            return Err(TrainError::config(
                "tools",
                format!(
                    "expected rollout.mode: sync without rollout.partial_threshold for {what} \
                     (a conversation's turns are generated within one step)"
                ),
            ));
        }
        if self.algo.dynamic_sampling.is_some() {
            return Err(TrainError::config(
                "tools",
                format!("expected algo.dynamic_sampling off for {what}"),
            ));
        }
        Ok(())
    }

    /// `engine.*`: sequences and cache above 0.
    fn validate_engine(&self) -> Result<()> {
        positive("engine.max_num_seqs", self.engine.max_num_seqs)?;
        if self.engine.kv_cache_bytes == 0 {
            return Err(TrainError::config(
                "engine.kv_cache_bytes",
                "expected at least 1, found 0",
            ));
        }
        Ok(())
    }

    /// `rollout.*` sizes and sampling.
    fn validate_rollout(&self) -> Result<()> {
        let r = &self.rollout;
        positive("rollout.prompts_per_step", r.prompts_per_step)?;
        positive("rollout.n_samples_per_prompt", r.n_samples_per_prompt)?;
        positive("rollout.weight_bucket_bytes", r.weight_bucket_bytes)?;
        if let Some(penalty) = &self.algo.overlong_penalty
            && penalty.buffer_len >= self.max_new_tokens()
        {
            return Err(TrainError::config(
                "algo.overlong_penalty.buffer_len",
                format!(
                    "expected fewer tokens than the generation budget rollout.max_new_tokens \
                     = {}, found {}",
                    self.max_new_tokens(),
                    penalty.buffer_len
                ),
            ));
        }
        if !(r.temperature.is_finite() && r.temperature >= 0.0) {
            return Err(TrainError::config(
                "rollout.temperature",
                format!("expected a finite number >= 0, found {}", r.temperature),
            ));
        }
        if !(r.top_p > 0.0 && r.top_p <= 1.0) {
            return Err(TrainError::config(
                "rollout.top_p",
                format!("expected a number in (0, 1], found {}", r.top_p),
            ));
        }
        self.validate_streaming()
    }

    /// `rollout.mode`, `max_staleness`, `partial_threshold` and `algo.tis_cap` together, and
    /// against what a streamed rollout cannot do yet.
    fn validate_streaming(&self) -> Result<()> {
        let r = &self.rollout;
        let asynchronous = r.mode == RolloutMode::Async;
        match (r.mode, r.max_staleness) {
            (RolloutMode::Sync, Some(k)) => {
                return Err(TrainError::config(
                    "rollout.max_staleness",
                    format!(
                        "expected it only with rollout.mode: async (a sync step trains on samples \
                         of the weights it just sent), found {k} with mode sync"
                    ),
                ));
            }
            (RolloutMode::Async, Some(0)) => {
                return Err(TrainError::config(
                    "rollout.max_staleness",
                    "expected at least 1 (0 allows no sample generated while the policy \
                     trains: that is rollout.mode: sync), found 0",
                ));
            }
            (RolloutMode::Async, Some(k)) if k > MAX_STALENESS => {
                return Err(TrainError::config(
                    "rollout.max_staleness",
                    format!(
                        "expected at most {MAX_STALENESS} (the rollout queue holds max_staleness \
                         steps of samples), found {k}"
                    ),
                ));
            }
            _ => {}
        }
        positive("rollout.partial_max_carry", r.partial_max_carry)?;
        if let Some(threshold) = r.partial_threshold {
            if asynchronous {
                return Err(TrainError::config(
                    "rollout.partial_threshold",
                    "expected it only with rollout.mode: sync (an async rollout already streams \
                     every group to whichever step is ready for it), found it with mode async",
                ));
            }
            if !(threshold > 0.0 && threshold <= 1.0) {
                return Err(TrainError::config(
                    "rollout.partial_threshold",
                    format!(
                        "expected a share of the step's prompt groups in (0, 1], found {threshold}"
                    ),
                ));
            }
        }
        if let Some(cap) = self.algo.tis_cap
            && !(cap.is_finite() && cap >= 1.0)
        {
            return Err(TrainError::config(
                "algo.tis_cap",
                format!(
                    "expected a finite number >= 1 (the largest weight π_old / π_engine may give \
                     a token), found {cap}"
                ),
            ));
        }
        if self.algo.tis_cap.is_some()
            && self.train.pipeline != PipelineMode::Sequential
            && !asynchronous
        {
            return Err(TrainError::config(
                "algo.tis_cap",
                "expected it absent for train.pipeline `dock` in sync mode (its training stage \
                 reads no engine log-probs), found it set",
            ));
        }
        if !r.streams() {
            return Ok(());
        }
        let key = r.streaming_key();
        let what = if asynchronous { "an async rollout" } else { "a partial rollout" };
        if self.train.pipeline != PipelineMode::Sequential && !asynchronous {
            return Err(TrainError::config(
                key,
                format!(
                    "expected train.pipeline `sequential` for {what} (the dock pipeline's stages \
                     run one step's fixed set of prompt groups; rollout.mode `async` streams \
                     into the dock), found `dock`"
                ),
            ));
        }
        if self.algo.dynamic_sampling.is_some() {
            return Err(TrainError::config(
                key,
                format!(
                    "expected algo.dynamic_sampling off for {what} (dynamic sampling refills one \
                     step's groups synchronously), found it on"
                ),
            ));
        }
        if self.cluster.colocate_all {
            return Err(TrainError::config(
                key,
                format!(
                    "expected cluster.colocate_all false for {what}: colocated engines sleep \
                     while the policy trains, and a sleeping engine cannot keep requests running"
                ),
            ));
        }
        Ok(())
    }

    /// `rollout.weight_sync_backend` against the build, the engine and the policy.
    fn validate_weight_sync(&self) -> Result<()> {
        const KEY: &str = "rollout.weight_sync_backend";
        let name = match self.rollout.weight_sync_backend {
            WeightSyncBackend::ObjectStore => return Ok(()),
            WeightSyncBackend::Nccl => "nccl",
            WeightSyncBackend::CudaIpc => "cuda_ipc",
        };
        let ipc = self.rollout.weight_sync_backend == WeightSyncBackend::CudaIpc;
        if ipc && self.engine.tensor_parallel_size > 1 {
            return Err(TrainError::config(
                KEY,
                format!(
                    "cuda_ipc maps one GPU's memory into one engine process, found \
                     engine.tensor_parallel_size {} (use nccl or object_store)",
                    self.engine.tensor_parallel_size
                ),
            ));
        }
        if ipc && (self.policy.lora.is_some() || self.policy.lora_adapter.is_some()) {
            return Err(TrainError::config(
                KEY,
                "cuda_ipc sends the whole model in place; with policy.lora only the merged \
                 projections travel: use nccl or object_store",
            ));
        }
        if !cfg!(feature = "cuda") {
            return Err(TrainError::config(
                KEY,
                format!(
                    "expected object_store in a build without the `cuda` feature, found {name} \
                     (rebuild with `--features cuda`)"
                ),
            ));
        }
        if ipc && !(self.policy.device.is_cuda() && self.engine.device.is_cuda()) {
            return Err(TrainError::config(
                KEY,
                format!(
                    "{name} maps GPU memory: expected policy.device and engine.device on cuda, \
                     found {} and {}",
                    self.policy.device.0, self.engine.device.0
                ),
            ));
        }
        Ok(())
    }

    /// `train.*`: rates, sizes, the learning-rate schedule and how the batch divides.
    fn validate_train(&self) -> Result<()> {
        let t = &self.train;
        non_negative(&[
            ("train.actor_lr", t.actor_lr),
            ("train.critic_lr", t.critic_lr),
            ("train.max_grad_norm", t.max_grad_norm),
            ("train.weight_decay", t.weight_decay),
        ])?;
        if let Some(ratio) = t.lr_warmup_ratio {
            unit_interval("train.lr_warmup_ratio", ratio)?;
            if t.lr_warmup_steps > 0 {
                return Err(TrainError::config(
                    "train.lr_warmup_ratio",
                    format!(
                        "expected either it or train.lr_warmup_steps, found both ({ratio} and {})",
                        t.lr_warmup_steps
                    ),
                ));
            }
        }
        unit_interval("train.min_lr_ratio", t.min_lr_ratio)?;
        positive("train.num_episodes", t.num_episodes)?;
        positive("train.micro_batch_size", t.micro_batch_size)?;
        if let Some(tokens) = t.micro_batch_tokens {
            positive("train.micro_batch_tokens", tokens)?;
        }
        positive("train.max_epochs", t.max_epochs)?;
        positive("train.dock_groups_per_batch", t.dock_groups_per_batch)?;
        if t.dock_max_poll_pause_ms == 0 {
            return Err(TrainError::config(
                "train.dock_max_poll_pause_ms",
                "expected at least 1, found 0",
            ));
        }
        let samples = self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt;
        if t.train_batch_size == 0 || !samples.is_multiple_of(t.train_batch_size) {
            return Err(TrainError::config(
                "train.train_batch_size",
                format!(
                    "expected a divisor of rollout.prompts_per_step × n_samples_per_prompt = \
                     {samples}, found {}",
                    t.train_batch_size
                ),
            ));
        }
        // Larger than a rank's share of the batch is harmless (one micro-batch per rank; a
        // config kept the same over a sweep of rank counts reaches it); larger than the whole
        // batch is a slip.
        if t.micro_batch_size > t.train_batch_size {
            return Err(TrainError::config(
                "train.micro_batch_size",
                format!(
                    "expected at most train.train_batch_size = {} (the samples of one optimizer \
                     step), found {}",
                    t.train_batch_size, t.micro_batch_size
                ),
            ));
        }
        Ok(())
    }

    /// `eval.*`: answers per prompt and how they are drawn.
    fn validate_eval(&self) -> Result<()> {
        let e = &self.eval;
        positive("eval.n_samples", e.n_samples)?;
        if !(e.temperature.is_finite() && e.temperature >= 0.0) {
            return Err(TrainError::config(
                "eval.temperature",
                format!("expected a finite number >= 0, found {}", e.temperature),
            ));
        }
        if e.n_samples > 1 && e.temperature == 0.0 {
            return Err(TrainError::config(
                "eval.n_samples",
                format!(
                    "expected 1 with eval.temperature 0 (greedy answers are all the same), found \
                     {}; set eval.temperature too (verl uses 1.0)",
                    e.n_samples
                ),
            ));
        }
        Ok(())
    }

    /// `train.pipeline: dock` against the ZeRO stage, the estimator and colocation.
    fn validate_dock(&self) -> Result<()> {
        if self.train.pipeline != PipelineMode::Dock {
            return Ok(());
        }
        if self.train.zero_stage == ZeroStage::Three {
            return Err(TrainError::config(
                "train.zero_stage",
                "expected 0, 1 or 2 with train.pipeline `dock`, found 3: dock stages call the \
                 policy ranks from several threads (old log-probs and training), and at stage 3 \
                 every forward gathers parameters across the ranks, which must then run their \
                 passes in one order; use train.pipeline `sequential` for stage 3",
            ));
        }
        let estimator = self.algo.advantage_estimator;
        let group_local = matches!(
            estimator,
            AdvantageEstimator::GroupNorm | AdvantageEstimator::Rloo | AdvantageEstimator::DrGrpo
        );
        if !group_local {
            return Err(TrainError::config(
                "algo.advantage_estimator",
                format!(
                    "expected a group-local estimator (group_norm, rloo or dr_grpo) for \
                     train.pipeline `dock`, whose stages compute advantages one prompt group at \
                     a time, found `{estimator}`"
                ),
            ));
        }
        if self.logging.samples_per_step > 0 && self.rollout.mode != RolloutMode::Async {
            return Err(TrainError::config(
                "logging.samples_per_step",
                "expected 0 for train.pipeline `dock` in sync mode (its rows never meet in one \
                 place before training; use train.pipeline `sequential` or rollout.mode \
                 `async`), found more",
            ));
        }
        if self.algo.dynamic_sampling.is_some() {
            return Err(TrainError::config(
                "algo.dynamic_sampling",
                "expected it off for train.pipeline `dock`, whose stages stream a fixed set of \
                 prompt groups (use train.pipeline `sequential`), found it on",
            ));
        }
        if self.algo.normalize_reward {
            return Err(TrainError::config(
                "algo.normalize_reward",
                "expected false for train.pipeline `dock`, whose groups stream into advantages \
                 before the step's last reward is in (the running statistics take the whole \
                 step), found true",
            ));
        }
        if self.cluster.colocate_all {
            return Err(TrainError::config(
                "cluster.colocate_all",
                "expected false for train.pipeline `dock` (its stages run generation and \
                 log-probs at the same time, which a hybrid engine cannot), found true",
            ));
        }
        Ok(())
    }

    /// `reward.*`: what each kind needs, and a label key where the reward reads labels.
    fn validate_reward(&self) -> Result<()> {
        let reward = &self.reward;
        let function = crate::reward::find_reward_function(&reward.name);
        let rule = matches!(reward.kind, RewardKind::Rule | RewardKind::Custom);
        match reward.kind {
            RewardKind::Remote if reward.url.is_empty() => {
                return Err(TrainError::config(
                    "reward.url",
                    "expected a URL for reward.kind `remote`, found none",
                ));
            }
            RewardKind::Python => match &reward.path {
                None => {
                    return Err(TrainError::config(
                        "reward.path",
                        "expected a Python file defining the reward function for reward.kind \
                         `python`, found none",
                    ));
                }
                Some(path) if !path.is_file() => {
                    return Err(TrainError::config(
                        "reward.path",
                        format!(
                            "expected an existing Python file, found no file at {}",
                            path.display()
                        ),
                    ));
                }
                Some(_) => {}
            },
            RewardKind::Model if reward.model_dir.is_none() => {
                return Err(TrainError::config(
                    "reward.model_dir",
                    "expected a reward-model directory for reward.kind `model`, found none",
                ));
            }
            _ if rule && function.is_none() => {
                return Err(TrainError::config(
                    "reward.name",
                    format!(
                        "expected one of the registered reward functions {:?}, found `{}`",
                        crate::reward::reward_function_names(),
                        reward.name
                    ),
                ));
            }
            _ => {}
        }
        for (source, name) in &reward.by_source {
            if !rule {
                return Err(TrainError::config(
                    "reward.by_source",
                    format!(
                        "expected reward.kind `rule` or `custom` (routes name reward functions), \
                         found `{:?}`",
                        reward.kind
                    ),
                ));
            }
            if crate::reward::find_reward_function(name).is_none() {
                return Err(TrainError::config(
                    &format!("reward.by_source.{source}"),
                    format!(
                        "expected one of the registered reward functions {:?}, found `{name}`",
                        crate::reward::reward_function_names()
                    ),
                ));
            }
        }
        positive("reward.parallel_tasks", reward.parallel_tasks)?;
        if !(reward.timeout_s.is_finite() && reward.timeout_s > 0.0) {
            return Err(TrainError::config(
                "reward.timeout_s",
                format!("expected a number of seconds above 0, found {}", reward.timeout_s),
            ));
        }
        let not_http = |u: &&String| !(u.starts_with("http://") || u.starts_with("https://"));
        if let Some(url) = reward.url.0.iter().find(not_http) {
            return Err(TrainError::config(
                "reward.url",
                format!("expected http:// or https:// URLs, found `{url}`"),
            ));
        }
        let needs_label = rule && function.is_some_and(|f| f.needs_label);
        if needs_label && !self.data.prompt_data.is_empty() && self.data.label_key.is_none() {
            return Err(TrainError::config(
                "data.label_key",
                format!(
                    "expected a label key: reward `{}` compares responses with labels, found none",
                    reward.name
                ),
            ));
        }
        Ok(())
    }
}

/// `data.synthetic.*`: digits in range and non-empty splits.
fn validate_task(t: &TaskConfig) -> Result<()> {
    if t.min_digits == 0 || t.min_digits > t.max_digits || t.max_digits > 18 {
        return Err(TrainError::config(
            "data.synthetic.min_digits",
            format!(
                "expected 1 <= min_digits <= max_digits <= 18, found {}..={}",
                t.min_digits, t.max_digits
            ),
        ));
    }
    positive("data.synthetic.train_size", t.train_size)?;
    positive("data.synthetic.eval_size", t.eval_size)?;
    if let Some(tail) = &t.long_tail {
        if t.kind == crate::demo::task::TaskKind::Add {
            return Err(TrainError::config(
                "data.synthetic.long_tail",
                "expected kind reverse_digits or sort_digits (a sum of long numbers would not fit \
                 its 128-bit check), found add",
            ));
        }
        unit_interval("data.synthetic.long_tail.share", tail.share)?;
        if tail.min_digits == 0 || tail.min_digits > tail.max_digits || tail.max_digits > 512 {
            return Err(TrainError::config(
                "data.synthetic.long_tail.min_digits",
                format!(
                    "expected 1 <= min_digits <= max_digits <= 512, found {}..={}",
                    tail.min_digits, tail.max_digits
                ),
            ));
        }
    }
    Ok(())
}

impl CheckpointConfig {
    /// `checkpoint.keep_last` is absent or at least 1.
    fn validate(&self) -> Result<()> {
        if self.keep_last == Some(0) {
            return Err(TrainError::config(
                "checkpoint.keep_last",
                "expected at least 1 (or no key to keep all), found 0",
            ));
        }
        Ok(())
    }
}

impl ModelShape {
    /// `model.*` (the locally made policy): heads divide the width, KV heads the heads.
    fn validate(&self) -> Result<()> {
        if self.hidden_size <= 0 || self.num_heads <= 0 || self.hidden_size % self.num_heads != 0 {
            return Err(TrainError::config(
                "model.hidden_size",
                format!(
                    "expected a positive multiple of model.num_heads={}, found {}",
                    self.num_heads, self.hidden_size
                ),
            ));
        }
        if self.num_kv_heads <= 0 || self.num_heads % self.num_kv_heads != 0 {
            return Err(TrainError::config(
                "model.num_kv_heads",
                format!(
                    "expected a divisor of model.num_heads={}, found {}",
                    self.num_heads, self.num_kv_heads
                ),
            ));
        }
        if self.num_layers <= 0 || self.intermediate_size <= 0 {
            return Err(TrainError::config(
                "model.num_layers",
                "expected num_layers and intermediate_size above 0",
            ));
        }
        Ok(())
    }
}

impl WarmupConfig {
    /// `warmup.*`: a batch and a rate.
    fn validate(&self) -> Result<()> {
        positive("warmup.batch_size", self.batch_size)?;
        non_negative(&[("warmup.lr", self.lr)])
    }
}

impl ClusterConfig {
    /// `cluster.*`: GPUs, replicas, threads and deadlines.
    fn validate(&self) -> Result<()> {
        if let Some(gpus) = self.num_gpus
            && !(gpus >= 0.0 && gpus.fract() == 0.0)
        {
            return Err(TrainError::config(
                "cluster.num_gpus",
                format!("expected a whole number of GPUs >= 0, found {gpus}"),
            ));
        }
        positive("cluster.actor_replicas", self.actor_replicas)?;
        positive("cluster.ref_replicas", self.ref_replicas)?;
        positive("cluster.critic_replicas", self.critic_replicas)?;
        positive("cluster.reward_replicas", self.reward_replicas)?;
        positive("cluster.engine_replicas", self.engine_replicas)?;
        if let WorkerThreads::Fixed(n) = self.threads_per_worker
            && n < 1
        {
            return Err(TrainError::config(
                "cluster.threads_per_worker",
                format!("expected `auto` or at least 1, found {n}"),
            ));
        }
        for (key, value) in [
            ("cluster.call_timeout_s", self.call_timeout_s),
            ("cluster.stall_warn_s", self.stall_warn_s),
        ] {
            // Duration::from_secs_f64 panics past ~5.8e11 years: a year is plenty.
            if !(value.is_finite() && value > 0.0 && value <= 3.2e7) {
                return Err(TrainError::config(
                    key,
                    format!("expected a number of seconds in (0, 3.2e7], found {value}"),
                ));
            }
        }
        Ok(())
    }
}

impl AlgoConfig {
    /// `algo.*`: coefficients in range, a group for group baselines, the clip below 1.
    fn validate(&self, samples_per_prompt: usize) -> Result<()> {
        if self.advantage_estimator.is_group_baseline() && samples_per_prompt < 2 {
            return Err(TrainError::config(
                "rollout.n_samples_per_prompt",
                format!(
                    "expected at least 2 samples per prompt for advantage_estimator `{}` (a \
                     group baseline), found {samples_per_prompt}",
                    self.advantage_estimator
                ),
            ));
        }
        unit_interval("algo.gamma", self.gamma)?;
        unit_interval("algo.lambd", self.lambd)?;
        non_negative(&[
            ("algo.eps_clip_low", self.eps_clip_low),
            ("algo.eps_clip_high", self.eps_clip_high),
            ("algo.value_clip", self.value_clip),
            ("algo.entropy_coef", self.entropy_coef),
            ("algo.init_kl_coef", self.init_kl_coef),
            ("algo.reward_clip", self.reward_clip),
        ])?;
        if self.eps_clip_low >= 1.0 {
            return Err(TrainError::config(
                "algo.eps_clip_low",
                format!(
                    "expected a number in [0, 1) (the ratio is clipped below at 1 - eps_clip_low, \
                     which must stay above 0; OpenRLHF uses 0.2), found {}",
                    self.eps_clip_low
                ),
            ));
        }
        if let Some(dynamic) = &self.dynamic_sampling {
            positive("algo.dynamic_sampling.max_gen_batches", dynamic.max_gen_batches)?;
            if samples_per_prompt < 2 {
                return Err(TrainError::config(
                    "rollout.n_samples_per_prompt",
                    format!(
                        "expected at least 2 samples per prompt for algo.dynamic_sampling, which \
                         keeps groups whose rewards differ, found {samples_per_prompt}"
                    ),
                ));
            }
        }
        if let Some(penalty) = &self.overlong_penalty {
            positive("algo.overlong_penalty.buffer_len", penalty.buffer_len)?;
            non_negative(&[("algo.overlong_penalty.factor", penalty.factor)])?;
        }
        if let Some(c) = self.dual_clip
            && !(c.is_finite() && c > 1.0)
        {
            return Err(TrainError::config(
                "algo.dual_clip",
                format!("expected a number above 1 (OpenRLHF uses 3), found {c}"),
            ));
        }
        if let Some(target) = self.kl_target
            && !(target.is_finite() && target > 0.0)
        {
            return Err(TrainError::config(
                "algo.kl_target",
                format!("expected a number above 0, found {target}"),
            ));
        }
        if !(self.kl_horizon.is_finite() && self.kl_horizon > 0.0) {
            return Err(TrainError::config(
                "algo.kl_horizon",
                format!("expected a number above 0, found {}", self.kl_horizon),
            ));
        }
        Ok(())
    }
}
