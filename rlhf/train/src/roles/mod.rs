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
    /// libtorch intra-op threads.
    pub threads: i32,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// The parameters' precision.
    pub dtype: ModelDtype,
    /// Whether the rank's training state is offloaded (hybrid engine).
    pub offloaded: bool,
}

impl WorkerSetup {
    /// A CPU fp32 rank of `role` with `threads` threads.
    pub fn cpu(role: &str, threads: i32) -> Self {
        Self {
            role: role.to_owned(),
            threads,
            device: "cpu".to_owned(),
            dtype: ModelDtype::Fp32,
            offloaded: false,
        }
    }

    /// A rank of `role` on `device` in `dtype`.
    pub fn on(role: &str, threads: i32, device: &DeviceName, dtype: ModelDtype) -> Self {
        Self { device: device.0.clone(), dtype, ..Self::cpu(role, threads) }
    }

    /// The libtorch kind of the parameters.
    pub fn kind(&self) -> tch::Kind {
        self.dtype.kind()
    }

    /// Applies the process-wide settings (thread counts).
    pub fn apply(&self) {
        tch::set_num_threads(self.threads.max(1));
        tch::set_num_interop_threads(1);
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
