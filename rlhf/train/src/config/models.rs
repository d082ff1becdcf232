//! The model roles' sections (`policy`, `reference`, `critic`, `engine`): where weights come
//! from, the device and precision of each role, and the checks that a checkpoint directory
//! holds a supported architecture and that a CUDA device is really there.

use std::path::{Path, PathBuf};

use rtrun_rlhf_model::LoraConfig;
use serde::{Deserialize, Serialize};

use super::{RewardKind, TrainConfig};
use crate::error::{Result, TrainError};

/// Where a model role's weights come from and where it runs (sections `policy`, `reference`,
/// `critic`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RoleModelConfig {
    /// A Hugging Face directory: `config.json`, one or sharded `*.safetensors`, tokenizer files
    /// (OpenRLHF's `--pretrain`, `--critic_pretrain`; the reference uses `--pretrain`).
    pub pretrain: Option<PathBuf>,
    /// Where the role's tensors live.
    pub device: DeviceName,
    /// The parameters' precision.
    pub dtype: ModelDtype,
    /// LoRA adapters on the trained model (the policy; the model of `--mode sft|dpo|rm`):
    /// `{rank, alpha, dropout, target_modules}`, OpenRLHF's `--lora_rank`, `--lora_alpha`,
    /// `--lora_dropout`, `--target_modules`. The base weights are frozen.
    pub lora: Option<LoraConfig>,
    /// A `peft` adapter directory to start from (`adapter_config.json`,
    /// `adapter_model.safetensors`) instead of fresh adapters; `lora` may be left out (the
    /// directory's settings apply) or must agree with it.
    pub lora_adapter: Option<PathBuf>,
}

impl RoleModelConfig {
    /// The adapters the role starts with: fresh ones from `lora`, or `lora_adapter`'s.
    pub fn lora_setup(&self, seed: u64) -> Option<crate::roles::lm::LoraSetup> {
        if self.lora.is_none() && self.lora_adapter.is_none() {
            return None;
        }
        Some(crate::roles::lm::LoraSetup {
            config: self.lora.clone(),
            adapter: self.lora_adapter.clone(),
            seed,
        })
    }

    /// Checks `<section>.lora` and `<section>.lora_adapter` against the model in `pretrain`,
    /// or without one against `local` (the shape of the locally made policy), and refuses them
    /// where `trained` is false (a frozen role: reference, critic).
    pub fn validate_lora(
        &self,
        section: &str,
        trained: bool,
        local: Option<rtrun_rlhf_model::ModelConfig>,
    ) -> Result<()> {
        let (lora_key, adapter_key) =
            (format!("{section}.lora"), format!("{section}.lora_adapter"));
        if !trained {
            for (key, set) in
                [(&lora_key, self.lora.is_some()), (&adapter_key, self.lora_adapter.is_some())]
            {
                if set {
                    return Err(TrainError::config(
                        key,
                        "expected it unset: LoRA adapters train on the policy (and the model of                          --mode sft|dpo|rm); this role is not trained with them",
                    ));
                }
            }
            return Ok(());
        }
        let model = match &self.pretrain {
            Some(dir) => rtrun_rlhf_model::ModelConfig::from_dir(dir).ok(),
            None => local,
        };
        if let Some(lora) = &self.lora {
            let checked = match &model {
                Some(model) => lora.check_against(model),
                None => lora.validate(),
            };
            checked.map_err(|e| TrainError::config(&lora_key, e.to_string()))?;
        }
        if let Some(dir) = &self.lora_adapter {
            let saved = rtrun_rlhf_model::lora::read_adapter_config(dir)
                .map_err(|e| TrainError::config(&adapter_key, e.to_string()))?;
            if let Some(model) = &model {
                saved
                    .check_against(model)
                    .map_err(|e| TrainError::config(&adapter_key, e.to_string()))?;
            }
            if let Some(lora) = &self.lora {
                let same = saved.rank == lora.rank
                    && saved.alpha == lora.alpha
                    && saved.targets().ok() == lora.targets().ok();
                if !same {
                    return Err(TrainError::config(
                        &lora_key,
                        format!(
                            "expected the settings of {adapter_key} ({}: rank {}, alpha {},                              target_modules {:?}), found rank {}, alpha {}, target_modules {:?}",
                            dir.display(),
                            saved.rank,
                            saved.alpha,
                            saved.target_modules,
                            lora.rank,
                            lora.alpha,
                            lora.target_modules
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A device name: `cpu`, `cuda` (the rank's first visible GPU) or `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(transparent)]
pub struct DeviceName(pub String);

impl Default for DeviceName {
    fn default() -> Self {
        DeviceName("cpu".to_owned())
    }
}

impl DeviceName {
    /// Whether this names a CUDA device.
    pub fn is_cuda(&self) -> bool {
        self.0.starts_with("cuda")
    }

    /// Checks the name, and that CUDA is there when it names a GPU.
    pub fn validate(&self, key: &str) -> Result<()> {
        rtrun_rlhf_engine::config::parse_device(&self.0)
            .map_err(|e| TrainError::config(key, e.to_string()))?;
        if self.is_cuda() {
            if !cfg!(feature = "cuda") {
                return Err(TrainError::config(
                    key,
                    format!(
                        "expected cpu in a build without the `cuda` feature, found `{}` (rebuild with `--features cuda`)",
                        self.0
                    ),
                ));
            }
            if !tch::Cuda::is_available() {
                return Err(TrainError::config(
                    key,
                    format!("expected cpu on a machine without a usable GPU, found `{}`", self.0),
                ));
            }
        }
        Ok(())
    }
}

/// Parameter precision of a role.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ModelDtype {
    /// 32-bit floats.
    #[default]
    Fp32,
    /// bfloat16 (log-probs, losses and optimizer moments still accumulate in fp32).
    Bf16,
}

impl ModelDtype {
    /// The libtorch kind.
    pub fn kind(self) -> tch::Kind {
        match self {
            ModelDtype::Fp32 => tch::Kind::Float,
            ModelDtype::Bf16 => tch::Kind::BFloat16,
        }
    }

    /// The generation engine's name for it.
    pub fn engine_name(self) -> &'static str {
        match self {
            ModelDtype::Fp32 => "f32",
            ModelDtype::Bf16 => "bf16",
        }
    }
}

/// The generation engines (vLLM's engine arguments).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSection {
    /// Where the engines run.
    pub device: DeviceName,
    /// Weights and KV cache precision.
    pub dtype: ModelDtype,
    /// Bytes of KV cache per engine (vLLM sizes it with `gpu_memory_utilization`; here it is
    /// given directly).
    pub kv_cache_bytes: u64,
    /// Running sequences per engine at most (`--max_num_seqs`).
    pub max_num_seqs: usize,
    /// libtorch intra-op threads of each engine process (absent: libtorch's default, every
    /// core).
    pub threads: Option<i32>,
    /// Ranks (processes) of each engine (vLLM's `tensor_parallel_size`, OpenRLHF's
    /// `--vllm_tensor_parallel_size`): each holds its share of the heads and of the MLP. Must
    /// divide the policy's query heads and intermediate size. Default 1.
    pub tensor_parallel_size: usize,
    /// Run steps of decodes only eagerly instead of replaying the CUDA graph captured for
    /// their batch-size bucket (vLLM's `enforce_eager`, OpenRLHF's `--enforce_eager`). Graphs
    /// exist only on a GPU. Default false.
    pub enforce_eager: bool,
}

impl Default for EngineSection {
    fn default() -> Self {
        let engine = rtrun_rlhf_engine::EngineConfig::default();
        Self {
            device: DeviceName::default(),
            dtype: ModelDtype::Fp32,
            kv_cache_bytes: engine.kv_cache_bytes,
            max_num_seqs: engine.max_num_seqs,
            threads: None,
            tensor_parallel_size: 1,
            enforce_eager: engine.enforce_eager,
        }
    }
}

impl TrainConfig {
    /// Checks the model sections: checkpoints present and of a supported architecture, the
    /// prompt source consistent with the policy, devices usable.
    pub(super) fn validate_models(&self) -> Result<()> {
        let config = self;
        if config.policy.pretrain.is_none() && !config.data.prompt_data.is_empty() {
            return Err(TrainError::config(
                "policy.pretrain",
                "expected a Hugging Face checkpoint directory for data.prompt_data (the locally made \
                     policy knows only the synthetic task's characters), found none",
            ));
        }
        if config.policy.pretrain.is_some() && config.data.synthetic.is_some() {
            return Err(TrainError::config(
                "data.synthetic",
                "expected data.prompt_data with policy.pretrain (the synthetic tasks use the \
                     character tokenizer of the locally made policy), found data.synthetic",
            ));
        }
        for (key, dir) in [
            ("policy.pretrain", &config.policy.pretrain),
            ("reference.pretrain", &config.reference.pretrain),
            ("critic.pretrain", &config.critic.pretrain),
        ] {
            if dir.is_some() && config.policy.pretrain.is_none() {
                return Err(TrainError::config(
                    key,
                    "expected policy.pretrain to be set too (the reference and critic must share \
                         the policy's tokenizer)",
                ));
            }
            if let Some(dir) = dir {
                let model = check_model_dir(key, dir)?;
                let budget = config.rollout.max_new_tokens;
                if key == "policy.pretrain" && budget as i64 >= model.max_position_embeddings {
                    return Err(TrainError::config(
                        "rollout.max_new_tokens",
                        format!(
                            "expected fewer tokens than the policy's context, \
                             max_position_embeddings {} in {}, found {budget}",
                            model.max_position_embeddings,
                            dir.join("config.json").display()
                        ),
                    ));
                }
            }
        }
        // Projection shapes do not depend on the context length.
        let local = crate::demo::warmup::policy_config(&config.model, 16);
        config.policy.validate_lora("policy", true, Some(local))?;
        config.reference.validate_lora("reference", false, None)?;
        config.critic.validate_lora("critic", false, None)?;
        if config.reward.kind == RewardKind::Model
            && let Some(dir) = &config.reward.model_dir
        {
            check_model_dir("reward.model_dir", dir)?;
        }
        if config.policy.pretrain.is_some() && config.rollout.max_new_tokens == 0 {
            return Err(TrainError::config(
                "rollout.max_new_tokens",
                "expected an explicit generation budget for prompt files, found 0 (only the \
                     synthetic tasks derive it from their answers)",
            ));
        }
        for (key, device) in [
            ("policy.device", &config.policy.device),
            ("reference.device", &config.reference.device),
            ("critic.device", &config.critic.device),
            ("engine.device", &config.engine.device),
            ("reward.device", &config.reward.device),
        ] {
            device.validate(key)?;
        }
        if config.engine.tensor_parallel_size == 0 {
            return Err(TrainError::config(
                "engine.tensor_parallel_size",
                "expected at least 1, found 0",
            ));
        }
        if let Some(threads) = config.engine.threads
            && threads < 1
        {
            return Err(TrainError::config(
                "engine.threads",
                format!("expected at least 1, found {threads}"),
            ));
        }
        Ok(())
    }
}

/// Checks that `dir` holds a Hugging Face config of a supported architecture, and reads it.
fn check_model_dir(key: &str, dir: &Path) -> Result<rtrun_rlhf_model::ModelConfig> {
    let file = dir.join("config.json");
    if !file.is_file() {
        return Err(TrainError::config(
            key,
            format!(
                "expected a Hugging Face directory with config.json, found no {}",
                file.display()
            ),
        ));
    }
    rtrun_rlhf_model::ModelConfig::from_dir(dir)
        .map_err(|e| TrainError::config(key, format!("{}: {e}", file.display())))
}
