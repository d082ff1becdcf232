//! Role actors — policy (`actor`), reference (`ref`), critic, reward model — each a group of DP
//! ranks on the runtime's [`rtrun::ActorGroup`] (OpenRLHF's `PPORayActorGroup`), plus what every
//! rank shares: process setup and the data-parallel gradient all-reduce.

pub mod critic;
pub mod lm;

use serde::{Deserialize, Serialize};
use tch::Device;

use rtrun_rlhf_model::CausalLm;

use crate::config::{DeviceName, ModelDtype};
use crate::error::{Result, TrainError};

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

/// The data-parallel collective of a rank, created on first use from the rank's group
/// membership (rank, world size, master address and port).
#[derive(Default)]
pub struct DpComm {
    comm: Option<rtrun::collective::Communicator>,
}

impl DpComm {
    /// All-reduces (mean) the gradients of `model` over the rank's group; a rank outside a group
    /// or alone in it has nothing to do.
    pub fn all_reduce_gradients(&mut self, model: &CausalLm, role: &str) -> Result<()> {
        let params: Vec<tch::Tensor> =
            model.named_parameters().map(|(_, t)| t.shallow_clone()).collect();
        self.all_reduce(&params, role)
    }

    /// All-reduces (mean) the gradients of `params`.
    pub fn all_reduce(&mut self, params: &[tch::Tensor], role: &str) -> Result<()> {
        let world = rtrun::context()?.group.map(|g| g.world_size).unwrap_or(1);
        if world <= 1 {
            return Ok(());
        }
        if self.comm.is_none() {
            let comm = rtrun::collective::Communicator::from_group_context()
                .map_err(|e| TrainError::role(role, format!("joining the DP collective: {e}")))?;
            self.comm = Some(comm);
        }
        let comm =
            self.comm.as_mut().ok_or_else(|| TrainError::role(role, "collective missing"))?;
        rtrun_rlhf_algo::all_reduce_gradients(comm, params, &Default::default())
            .map(|_| ())
            .map_err(|e| TrainError::role(role, format!("gradient all-reduce: {e}")))
    }
}

#[cfg(test)]
mod thread_plan_tests {
    use super::*;

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
