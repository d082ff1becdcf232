//! The config of the trainers beside RL (`mode: sft | rm | dpo`): the same YAML + `--set`
//! style, key checks and file:line errors as the RL config, with OpenRLHF's `train_sft` /
//! `train_rm` / `train_dpo` defaults.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::validate::positive;
use crate::config::{
    CheckpointConfig, ClusterConfig, ConfigOrigin, ConfigTree, EvalConfig, Mode, RoleModelConfig,
    WorkerThreads,
};
use crate::data::PathList;
use crate::error::{Result, TrainError};

/// A supervised run: SFT, reward model or DPO.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct StageConfig {
    /// The trainer (the YAML's `mode:`, taken out before the rest is read).
    #[serde(skip)]
    pub mode: Mode,
    /// Seed of everything random in the run (the held-out split, the order of every epoch).
    pub seed: u64,
    /// Where metrics, checkpoints and the trained model go.
    pub run_dir: PathBuf,
    /// Start afresh in a `run_dir` holding an earlier run (its results and checkpoints are
    /// removed first; the driver's `--overwrite`).
    pub overwrite: bool,
    /// The model to train: a Hugging Face directory (`pretrain`, required), device, dtype.
    pub model: RoleModelConfig,
    /// The dataset.
    pub data: StageDataConfig,
    /// Optimisation.
    pub train: StageTrainConfig,
    /// The runtime and the DP ranks.
    pub cluster: StageClusterConfig,
    /// Held-out loss.
    pub eval: EvalConfig,
    /// Checkpoints and resume.
    pub checkpoint: CheckpointConfig,
    /// DPO's loss (`mode: dpo`).
    pub dpo: DpoConfig,
}

/// DPO's loss (OpenRLHF's `train_dpo` flags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DpoConfig {
    /// β: how strongly the policy is held to the reference (`--beta`).
    pub beta: f64,
    /// cDPO: the probability that a preference label is wrong (`--label_smoothing`).
    pub label_smoothing: f64,
    /// IPO's squared loss on mean log-probs per token instead of DPO's (`--ipo`).
    pub ipo: bool,
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self { beta: 0.1, label_smoothing: 0.0, ipo: false }
    }
}

/// The role name of a mode's ranks: in messages, `rtrun list actors` and placement specs.
pub fn role_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Rm => "reward",
        Mode::Dpo => "dpo",
        _ => "sft",
    }
}

impl StageConfig {
    /// The preference loss of a pair mode (`None` for SFT).
    pub fn preference_loss(&self) -> Option<crate::stage::losses::PreferenceLoss> {
        use crate::stage::losses::PreferenceLoss;
        match self.mode {
            Mode::Rm => Some(PreferenceLoss::BradleyTerry),
            Mode::Dpo => Some(PreferenceLoss::Dpo {
                beta: self.dpo.beta,
                label_smoothing: self.dpo.label_smoothing,
                ipo: self.dpo.ipo,
            }),
            _ => None,
        }
    }
}

impl Default for StageConfig {
    fn default() -> Self {
        Self {
            seed: 42,
            run_dir: PathBuf::from("runs/sft"),
            overwrite: false,
            model: RoleModelConfig::default(),
            data: StageDataConfig::default(),
            train: StageTrainConfig::default(),
            cluster: StageClusterConfig::default(),
            eval: EvalConfig::default(),
            checkpoint: CheckpointConfig::default(),
            dpo: DpoConfig::default(),
            mode: Mode::Sft,
        }
    }
}

/// The dataset of a supervised run (OpenRLHF's flag in each doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct StageDataConfig {
    /// JSONL (`.jsonl`, `.json`) or Parquet (`.parquet`) files (`--dataset`).
    pub train_data: PathList,
    /// Held-out files (`--eval_dataset`); without them `eval_fraction` of `train_data` is held
    /// out.
    pub eval_data: PathList,
    /// Fraction of `train_data` held out when `eval_data` is empty.
    pub eval_fraction: f64,
    /// The record key of the prompt: a string, or a list of `{role, content}` messages
    /// (`--input_key`).
    pub input_key: String,
    /// The record key of the response, a string (`--output_key`; SFT). Absent: `input_key`
    /// holds a whole conversation and its last message, the assistant's, is the response.
    pub output_key: Option<String>,
    /// The record key of the preferred response (`--chosen_key`; reward model and DPO): a string
    /// answering `input_key`'s prompt, or a whole conversation ending in the response.
    pub chosen_key: String,
    /// The record key of the other response (`--rejected_key`), in the same form.
    pub rejected_key: String,
    /// Render with the model tokenizer's chat template (`--apply_chat_template`); a string
    /// prompt becomes one user message.
    pub apply_chat_template: bool,
    /// Samples longer than this many tokens (prompt + response) are dropped and counted
    /// (`--max_len`); packed rows hold at most this many tokens.
    pub max_len: usize,
    /// Use at most this many training records, the first ones (`--max_samples`).
    pub max_samples: Option<usize>,
}

impl Default for StageDataConfig {
    fn default() -> Self {
        Self {
            train_data: PathList::default(),
            eval_data: PathList::default(),
            eval_fraction: 0.05,
            input_key: "input".to_owned(),
            output_key: Some("output".to_owned()),
            chosen_key: "chosen".to_owned(),
            rejected_key: "rejected".to_owned(),
            apply_chat_template: false,
            max_len: 2048,
            max_samples: None,
        }
    }
}

/// Optimisation of a supervised run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct StageTrainConfig {
    /// Passes over the training set (`--max_epochs`).
    pub epochs: usize,
    /// Stop after this many optimizer steps (absent: all epochs).
    pub max_steps: Option<u64>,
    /// Samples per optimizer step over all ranks (`--train_batch_size`); an epoch's last
    /// samples that do not fill a batch are left out (`drop_last`).
    pub batch_size: usize,
    /// Rows per forward pass on each rank (`--micro_train_batch_size`; default 8, or
    /// `batch_size` when that is smaller; a value set larger than `batch_size` is an error).
    pub micro_batch_size: usize,
    /// Pack several samples into each row of up to `data.max_len` tokens, each attending only
    /// itself (`--packing_samples`).
    pub packing: bool,
    /// Reward model and DPO: lay each pair's prompt out once, followed by both responses (the
    /// rejected one attends the prompt and itself, not the chosen one), so the prompt is
    /// computed once per pair instead of twice; the numbers are those of separate sequences.
    pub share_prompt: bool,
    /// Peak learning rate (`--learning_rate`).
    pub lr: f64,
    /// Warm-up as a fraction of the run's steps (`--lr_warmup_ratio`).
    pub lr_warmup_ratio: f64,
    /// The cosine schedule's floor as a fraction of `lr` (OpenRLHF: 0.1).
    pub min_lr_ratio: f64,
    /// AdamW weight decay (`--l2`).
    pub weight_decay: f64,
    /// Gradient clipping (`--max_norm`; 0: off).
    pub max_grad_norm: f64,
    /// What each data-parallel rank shards (`--zero_stage`; `fsdp` is stage 3): 0 nothing,
    /// 1 AdamW state, 2 also gradients, 3 also parameters.
    pub zero_stage: rtrun_rlhf_shard::ZeroStage,
    /// Recompute each decoder layer in the backward pass (`--gradient_checkpointing`).
    pub gradient_checkpointing: bool,
}

impl StageTrainConfig {
    /// The sharding of the ranks.
    pub fn shard(&self) -> rtrun_rlhf_shard::ShardConfig {
        rtrun_rlhf_shard::ShardConfig {
            stage: self.zero_stage,
            gradient_checkpointing: self.gradient_checkpointing,
        }
    }
}

impl Default for StageTrainConfig {
    fn default() -> Self {
        Self {
            epochs: 1,
            max_steps: None,
            batch_size: 32,
            micro_batch_size: 8,
            packing: false,
            share_prompt: true,
            lr: 5e-6,
            lr_warmup_ratio: 0.03,
            min_lr_ratio: 0.1,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            zero_stage: rtrun_rlhf_shard::ZeroStage::Zero,
            gradient_checkpointing: false,
        }
    }
}

/// The runtime and the DP ranks of a supervised run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct StageClusterConfig {
    /// A running cluster's head, `host:port` (`train --address`, `RTRUN_ADDRESS`); without
    /// it the run starts an embedded single-node runtime.
    pub address: Option<String>,
    /// CPUs the embedded node offers (default: the machine's).
    pub num_cpus: Option<f64>,
    /// GPUs the embedded node declares (absent: the host's; more than the host has is an
    /// error unless `fake_gpus` is on).
    pub num_gpus: Option<f64>,
    /// Declare `num_gpus` GPUs even where the host has fewer, the missing ones fake.
    pub fake_gpus: bool,
    /// Data-parallel ranks (each a worker process holding a replica).
    pub replicas: usize,
    /// A YAML placement spec (placement/SPEC.md) declaring this trainer's role (`sft`, `dpo`
    /// or `reward`): its ranks go into the spec's bundles (nodes, GPUs, custom resources), and
    /// its `replicas` replace `cluster.replicas`.
    pub placement_spec: Option<PathBuf>,
    /// libtorch intra-op threads per rank: `auto` (the machine's cores shared among the ranks)
    /// or a number.
    pub threads_per_worker: WorkerThreads,
    /// Seconds a rank may take to answer one call before the step fails naming it.
    pub call_timeout_s: f64,
    /// Seconds after which a late rank is logged as a warning.
    pub stall_warn_s: f64,
}

impl Default for StageClusterConfig {
    fn default() -> Self {
        let rl = ClusterConfig::default();
        Self {
            address: None,
            num_cpus: None,
            num_gpus: None,
            fake_gpus: false,
            replicas: 1,
            placement_spec: None,
            threads_per_worker: WorkerThreads::Auto,
            call_timeout_s: rl.call_timeout_s,
            stall_warn_s: rl.stall_warn_s,
        }
    }
}

impl StageClusterConfig {
    /// The same settings in the RL config's shape (what the call watch and the runtime start
    /// read).
    pub fn as_cluster(&self) -> ClusterConfig {
        ClusterConfig {
            address: self.address.clone(),
            num_cpus: self.num_cpus,
            num_gpus: self.num_gpus,
            fake_gpus: self.fake_gpus,
            actor_replicas: self.replicas,
            threads_per_worker: self.threads_per_worker,
            call_timeout_s: self.call_timeout_s,
            stall_warn_s: self.stall_warn_s,
            ..ClusterConfig::default()
        }
    }
}

impl StageConfig {
    /// Reads a YAML file with `key=value` overrides; `user_overrides` of them are the user's
    /// (for the driver's first line).
    pub fn load_with_origin(
        path: &Path,
        overrides: &[String],
        user_overrides: usize,
    ) -> Result<(Self, ConfigOrigin)> {
        let tree = ConfigTree::read(path, overrides)?;
        let origin = tree.origin(user_overrides);
        Ok((Self::from_tree(tree)?, origin))
    }

    /// Parses YAML text (`file` names it in errors) with overrides.
    pub fn from_yaml(text: &str, file: &str, overrides: &[String]) -> Result<Self> {
        Self::from_tree(ConfigTree::parse(text, file, overrides)?)
    }

    /// The typed and checked config of a parsed tree (overrides applied) of `mode: sft | rm
    /// | dpo`.
    pub fn from_tree(tree: ConfigTree) -> Result<Self> {
        let mode = tree.mode;
        if mode == Mode::Rl {
            tree.expect_mode(Mode::Sft)?;
        }
        let micro_set = tree.sets("train.micro_batch_size");
        let mut config: Self = tree.typed()?;
        config.mode = mode;
        if let Some(path) = &config.cluster.placement_spec {
            let spec = crate::placement_map::read_spec(path)?;
            let name = role_name(mode);
            let role = spec.roles.iter().find(|r| r.name == name).ok_or_else(|| {
                TrainError::config(
                    "cluster.placement_spec",
                    format!(
                        "expected {} to declare the role `{name}` (the `{}` trainer's ranks), found {:?}",
                        path.display(),
                        mode.name(),
                        spec.roles.iter().map(|r| r.name.as_str()).collect::<Vec<_>>()
                    ),
                )
            })?;
            config.cluster.replicas = role.replicas;
        }
        if !micro_set {
            // The default micro-batch shrinks to a small batch's per-rank share; one the
            // config names must fit (`validate`).
            config.train.micro_batch_size =
                config.train.micro_batch_size.min(config.train.batch_size.max(1));
        }
        if mode != Mode::Sft && config.run_dir == StageConfig::default().run_dir {
            config.run_dir = PathBuf::from(format!("runs/{}", mode.name()));
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and cross-key constraints.
    pub fn validate(&self) -> Result<()> {
        self.validate_model()?;
        self.data.validate()?;
        self.train.validate(self.cluster.replicas)?;
        self.cluster.validate()?;
        if self.mode == Mode::Dpo && !(self.dpo.beta > 0.0 && self.dpo.beta.is_finite()) {
            return Err(TrainError::config(
                "dpo.beta",
                format!("expected a positive number, found {}", self.dpo.beta),
            ));
        }
        if !(0.0..0.5).contains(&self.dpo.label_smoothing) {
            return Err(TrainError::config(
                "dpo.label_smoothing",
                format!("expected a number in [0, 0.5), found {}", self.dpo.label_smoothing),
            ));
        }
        Ok(())
    }

    /// `model.*`: a Hugging Face directory, a usable device, LoRA settings that fit.
    fn validate_model(&self) -> Result<()> {
        match &self.model.pretrain {
            None => {
                return Err(TrainError::config(
                    "model.pretrain",
                    "expected the Hugging Face directory of the model to fine-tune, found none",
                ));
            }
            Some(dir) if !dir.join("config.json").is_file() => {
                return Err(TrainError::config(
                    "model.pretrain",
                    format!(
                        "expected a Hugging Face directory with config.json, found {}",
                        if dir.is_dir() { "a directory without it" } else { "no directory" }
                    ) + &format!(" at {}", dir.display()),
                ));
            }
            Some(_) => {}
        }
        self.model.device.validate("model.device")?;
        self.model.validate_lora("model", true, None)
    }
}

impl StageDataConfig {
    /// `data.*`: files that exist, a held-out share, lengths above 0.
    fn validate(&self) -> Result<()> {
        if self.train_data.is_empty() {
            return Err(TrainError::config(
                "data.train_data",
                "expected one or more JSONL / Parquet files, found none",
            ));
        }
        crate::data::check_files("data.train_data", &self.train_data)?;
        crate::data::check_files("data.eval_data", &self.eval_data)?;
        if !(self.eval_fraction > 0.0 && self.eval_fraction < 1.0) {
            return Err(TrainError::config(
                "data.eval_fraction",
                format!("expected a number in (0, 1), found {}", self.eval_fraction),
            ));
        }
        if self.input_key.is_empty() {
            return Err(TrainError::config("data.input_key", "expected a key name, found ``"));
        }
        positive("data.max_len", self.max_len)?;
        if self.max_samples == Some(0) {
            return Err(TrainError::config("data.max_samples", "expected at least 1, found 0"));
        }
        Ok(())
    }
}

impl StageTrainConfig {
    /// `train.*` over `replicas` ranks: sizes, at least a sample per rank, a micro-batch no
    /// larger than a rank's share, rates in range.
    fn validate(&self, replicas: usize) -> Result<()> {
        positive("train.epochs", self.epochs)?;
        positive("train.batch_size", self.batch_size)?;
        positive("train.micro_batch_size", self.micro_batch_size)?;
        positive("cluster.replicas", replicas)?;
        if self.batch_size < replicas {
            return Err(TrainError::config(
                "train.batch_size",
                format!(
                    "expected at least one sample per rank: {replicas} or more for \
                     cluster.replicas = {replicas}, found {}",
                    self.batch_size
                ),
            ));
        }
        if self.micro_batch_size > self.batch_size {
            return Err(TrainError::config(
                "train.micro_batch_size",
                format!(
                    "expected at most train.batch_size = {} (the samples of one optimizer step), \
                     found {}",
                    self.batch_size, self.micro_batch_size
                ),
            ));
        }
        if self.max_steps == Some(0) {
            return Err(TrainError::config("train.max_steps", "expected at least 1, found 0"));
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err(TrainError::config(
                "train.lr",
                format!("expected a positive number, found {}", self.lr),
            ));
        }
        for (key, value) in [
            ("train.lr_warmup_ratio", self.lr_warmup_ratio),
            ("train.min_lr_ratio", self.min_lr_ratio),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(TrainError::config(
                    key,
                    format!("expected a number in [0, 1], found {value}"),
                ));
            }
        }
        for (key, value) in
            [("train.weight_decay", self.weight_decay), ("train.max_grad_norm", self.max_grad_norm)]
        {
            if !(value >= 0.0 && value.is_finite()) {
                return Err(TrainError::config(
                    key,
                    format!("expected a non-negative number, found {value}"),
                ));
            }
        }
        Ok(())
    }
}

impl StageClusterConfig {
    /// `cluster.*`: deadlines and threads.
    fn validate(&self) -> Result<()> {
        for (key, value) in [
            ("cluster.call_timeout_s", self.call_timeout_s),
            ("cluster.stall_warn_s", self.stall_warn_s),
        ] {
            if !(value > 0.0 && value.is_finite()) {
                return Err(TrainError::config(
                    key,
                    format!("expected a positive number of seconds, found {value}"),
                ));
            }
        }
        if let WorkerThreads::Fixed(n) = self.threads_per_worker
            && n < 1
        {
            return Err(TrainError::config(
                "cluster.threads_per_worker",
                format!("expected `auto` or at least 1, found {n}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rtrun-stage-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        std::fs::write(dir.join("train.jsonl"), "{}\n").unwrap();
        dir
    }

    #[test]
    fn errors_name_the_key_and_line() {
        let dir = checkpoint_dir();
        let yaml = format!(
            "mode: sft\nmodel:\n  pretrain: {d}\ndata:\n  train_data: {d}/train.jsonl\ntrain:\n  batch_sise: 4\n",
            d = dir.display()
        );
        let err = StageConfig::from_yaml(&yaml, "sft.yaml", &[]).unwrap_err().to_string();
        assert!(err.contains("train.batch_sise") && err.contains("sft.yaml:7"), "{err}");
        let err = StageConfig::from_yaml(&yaml.replace("mode: sft", "mode: sf"), "sft.yaml", &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`mode`") && err.contains("sft.yaml:1"), "{err}");
        let ok = yaml.replace("batch_sise: 4", "batch_size: 4");
        let config =
            StageConfig::from_yaml(&ok, "sft.yaml", &["cluster.replicas=2".into()]).unwrap();
        assert_eq!((config.train.batch_size, config.cluster.replicas), (4, 2));
        let err = StageConfig::from_yaml(&ok, "sft.yaml", &["cluster.replicas=8".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("train.batch_size") && err.contains("one sample per rank"), "{err}");
        // The default micro-batch (8) shrinks to a small batch; a set one must fit in it.
        assert_eq!(config.train.micro_batch_size, 4);
        let sets = ["cluster.replicas=2".into(), "train.micro_batch_size=5".into()];
        let err = StageConfig::from_yaml(&ok, "sft.yaml", &sets).unwrap_err().to_string();
        assert!(err.contains("train.micro_batch_size") && err.contains("= 4 (the"), "{err}");
        // An RL config handed to the SFT trainer, and the other way round.
        let err = StageConfig::from_yaml("seed: 3\n", "grpo.yaml", &[]).unwrap_err().to_string();
        assert!(err.contains("expected a `sft` config"), "{err}");
        let dpo =
            StageConfig::from_yaml(&ok.replace("mode: sft", "mode: dpo"), "d.yaml", &[]).unwrap();
        assert_eq!((dpo.mode, dpo.run_dir.as_path()), (Mode::Dpo, Path::new("runs/dpo")));
        let err = StageConfig::from_yaml(
            &ok.replace("mode: sft", "mode: dpo"),
            "d.yaml",
            &["dpo.beta=0".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("dpo.beta"), "{err}");
        let err = crate::TrainConfig::from_yaml(&ok, "sft.yaml", &[]).unwrap_err().to_string();
        assert!(err.contains("expected a `rl` config"), "{err}");
        let err = StageConfig::from_yaml("mode: sft\n", "sft.yaml", &[]).unwrap_err().to_string();
        assert!(err.contains("model.pretrain"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
