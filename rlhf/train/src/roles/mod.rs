//! Role actors — policy (`actor`), reference (`ref`), critic, reward model — each a group of DP
//! ranks on the runtime's [`rtrun::ActorGroup`] (OpenRLHF's `PPORayActorGroup`), plus what every
//! rank shares: process setup and sharding the model over the data-parallel group.

pub mod critic;
pub mod lm;

use serde::{Deserialize, Serialize};
use tch::Device;

use rtrun_rlhf_model::CausalLm;
use rtrun_rlhf_model::train::OptimizerConfig;
use rtrun_rlhf_shard::{GroupComm, ShardConfig, ShardedModel};

use crate::config::{DeviceName, ModelDtype};

/// Per-process settings every role rank applies first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSetup {
    /// The role (`actor`, `ref`, `critic`, `reward`), for messages.
    pub role: String,
    /// libtorch intra-op threads, per phase.
    pub threads: ThreadPlan,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// The parameters' precision.
    pub dtype: ModelDtype,
    /// Whether the rank's training state is offloaded (hybrid engine).
    pub offloaded: bool,
}

/// The two phases of a step in which role workers compute: making experience (log-probs,
/// values, rewards of the rollout) and training on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Forward passes over the rollout.
    Experience,
    /// Optimizer steps.
    Train,
}

/// How many libtorch intra-op threads a worker uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ThreadPlan {
    /// This many in every phase (`cluster.threads_per_worker: N`).
    Fixed(i32),
    /// `cluster.threads_per_worker: auto`: in each phase the machine's cores divided by the
    /// workers that compute in that phase at the same time (counted as if all were on this
    /// machine, so co-located workers never oversubscribe the cores; the phases of a step run
    /// one after another, so each phase's workers get the cores the others leave idle).
    Shared {
        /// Workers computing at once while experience is made.
        experience: u32,
        /// Workers computing at once while training.
        train: u32,
    },
}

impl ThreadPlan {
    /// The thread count for `phase` on a machine with `cores` cores.
    pub fn threads(&self, phase: Phase, cores: usize) -> i32 {
        match *self {
            ThreadPlan::Fixed(n) => n.max(1),
            ThreadPlan::Shared { experience, train } => {
                let share = match phase {
                    Phase::Experience => experience,
                    Phase::Train => train,
                };
                i32::try_from(cores / share.max(1) as usize).unwrap_or(i32::MAX).max(1)
            }
        }
    }
}

impl WorkerSetup {
    /// A CPU fp32 rank of `role` with `threads` threads.
    pub fn cpu(role: &str, threads: ThreadPlan) -> Self {
        Self {
            role: role.to_owned(),
            threads,
            device: "cpu".to_owned(),
            dtype: ModelDtype::Fp32,
            offloaded: false,
        }
    }

    /// A rank of `role` on `device` in `dtype`.
    pub fn on(role: &str, threads: ThreadPlan, device: &DeviceName, dtype: ModelDtype) -> Self {
        Self { device: device.0.clone(), dtype, ..Self::cpu(role, threads) }
    }

    /// The libtorch kind of the parameters.
    pub fn kind(&self) -> tch::Kind {
        self.dtype.kind()
    }

    /// Applies the process-wide settings (thread counts, those of the experience phase until
    /// a call says otherwise; freed tensor memory kept in the heap, see
    /// [`rtrun_rlhf_model::host_memory`]).
    pub fn apply(&self) {
        rtrun_rlhf_model::host_memory::keep_freed_memory();
        tch::set_num_interop_threads(1);
        self.enter(Phase::Experience);
    }

    /// Sets the intra-op threads for a call of `phase` (cheap: a libtorch setting, read when the
    /// next operator runs).
    pub fn enter(&self, phase: Phase) {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        tch::set_num_threads(self.threads.threads(phase, cores));
    }

    /// The tensor device (the driver checked the name and that CUDA is there; a worker that
    /// finds otherwise falls back to the CPU rather than failing every call).
    pub fn device(&self) -> Device {
        match rtrun_rlhf_engine::config::parse_device(&self.device) {
            Ok(Device::Cuda(i)) if tch::Cuda::is_available() => Device::Cuda(i),
            _ => Device::Cpu,
        }
    }
}

/// An error naming the first of `params` that holds NaN or ±inf: weights a checkpoint load
/// brought in that no step can train from (the run that saved them diverged).
pub(crate) fn require_finite<'a>(
    params: impl Iterator<Item = (&'a str, &'a tch::Tensor)>,
) -> Result<(), String> {
    for (name, tensor) in params {
        if tensor.is_floating_point() && tensor.isfinite().all().int64_value(&[]) == 0 {
            return Err(format!(
                "its weight `{name}` holds NaN or infinite values (the run that saved it \
                 diverged): remove this checkpoint to resume from an earlier one, or start over"
            ));
        }
    }
    Ok(())
}

/// Shards a causal LM over the rank's data-parallel group ([`rtrun_rlhf_shard`]): its
/// parameters become views into flat units, and the stage's hooks (and activation
/// checkpointing) are installed on its trunk. With `optimizer` it trains.
pub(crate) fn shard_model(
    model: &CausalLm,
    config: ShardConfig,
    group: GroupComm,
    optimizer: Option<OptimizerConfig>,
    role: &str,
) -> std::result::Result<ShardedModel, String> {
    ShardedModel::for_causal_lm(model, config, group, optimizer)
        .map_err(|e| format!("{role}: sharding the model (zero_stage {}): {e}", config.stage))
}

/// [`shard_model`] for a scalar-head model (critic, reward model): its trunk and parameters.
pub(crate) fn shard_scalar_head(
    model: &rtrun_rlhf_model::ScalarHeadModel,
    config: ShardConfig,
    group: GroupComm,
    optimizer: Option<OptimizerConfig>,
    role: &str,
) -> std::result::Result<ShardedModel, String> {
    let adapters = model.lora_parameters().map(|p| p.named()).into_iter().flatten();
    let named: Vec<(String, tch::Tensor)> = model
        .named_parameters()
        .chain(adapters)
        .map(|(n, t)| (n.to_string(), t.shallow_clone()))
        .collect();
    ShardedModel::new(&model.backbone, &named, false, config, group, optimizer)
        .map_err(|e| format!("{role}: sharding the model (zero_stage {}): {e}", config.stage))
}

/// Refuses a stage-0 checkpoint `dir` of the other kind: an adapter save (`adapter_config.json`)
/// for a rank without LoRA, or a whole-model save for a rank with it (`key`: the config key).
pub(crate) fn check_adapter_save(
    dir: &std::path::Path,
    lora: bool,
    key: &str,
) -> std::result::Result<(), String> {
    match (dir.join("adapter_config.json").is_file(), lora) {
        (false, true) => Err(format!(
            "it holds no LoRA adapter (adapter_config.json): it was saved by a run without {key}"
        )),
        (true, false) => Err(format!(
            "it holds LoRA adapters (adapter_config.json): resume it with {key} set as when it \
             was saved"
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod thread_plan_tests {
    use super::*;

    #[test]
    fn a_checkpoint_of_the_other_kind_is_refused_naming_the_key() {
        let dir = std::env::temp_dir().join(format!("rtrun-adapter-kind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(check_adapter_save(&dir, false, "policy.lora").is_ok());
        let err = check_adapter_save(&dir, true, "policy.lora").unwrap_err();
        assert!(err.contains("no LoRA adapter") && err.contains("policy.lora"), "{err}");
        std::fs::write(dir.join("adapter_config.json"), "{}").unwrap();
        assert!(check_adapter_save(&dir, true, "model.lora").is_ok());
        let err = check_adapter_save(&dir, false, "model.lora").unwrap_err();
        assert!(err.contains("resume it with model.lora"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn shared_plans_split_the_cores_per_phase_and_never_go_below_one() {
        let plan = ThreadPlan::Shared { experience: 2, train: 1 };
        assert_eq!(plan.threads(Phase::Experience, 8), 4);
        assert_eq!(plan.threads(Phase::Train, 8), 8);
        assert_eq!(plan.threads(Phase::Experience, 1), 1);
        assert_eq!(ThreadPlan::Shared { experience: 0, train: 3 }.threads(Phase::Experience, 2), 2);
        assert_eq!(ThreadPlan::Fixed(3).threads(Phase::Train, 64), 3);
    }
}
