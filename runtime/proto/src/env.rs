//! What a process learns from its environment: the variables the runtime sets for the processes
//! it starts, and the worker's spec.

use crate::address::Address;
use crate::ids::WorkerId;

/// The environment variable that stops the runtime from setting `CUDA_VISIBLE_DEVICES` (and
/// `CUDA_DEVICE_ORDER`) for workers given GPUs (Ray's
/// `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`). Set it in the driver's environment for every
/// worker, or in one actor's [`ActorOptions::env`](crate::actor::ActorOptions::env) for that
/// actor; any non-empty value other than `0` counts.
pub const NOSET_CUDA_VISIBLE_DEVICES_ENV: &str = "RTRUN_NOSET_CUDA_VISIBLE_DEVICES";

/// Whether an opt-out variable is set: any non-empty value other than `0`.
pub fn opt_out(value: Option<&str>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0")
}

/// The variable that makes a process a worker (see [`WorkerSpec`]).
pub const WORKER_ENV: &str = "RTRUN_WORKER";

/// The variable that tells a job's driver and workers their job id.
pub const JOB_ENV: &str = "RTRUN_JOB_ID";

/// Who a worker process is, passed in its environment.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// The session it belongs to.
    pub session: String,
    /// Its id.
    pub worker: WorkerId,
    /// The control plane's endpoint.
    pub head_address: Address,
    /// The namespace for named actors.
    pub namespace: String,
}

impl WorkerSpec {
    /// The `(name, value)` environment entry for this spec.
    pub fn to_env(&self) -> (String, String) {
        (
            WORKER_ENV.to_owned(),
            format!("{};{};{};{}", self.session, self.worker.0, self.head_address, self.namespace),
        )
    }

    /// Reads the spec from the value of [`WORKER_ENV`]; `None` when it is not one.
    pub fn parse(value: &str) -> Option<WorkerSpec> {
        let mut parts = value.splitn(4, ';');
        let session = parts.next()?.to_owned();
        let worker = WorkerId(parts.next()?.parse().ok()?);
        let head_address = parts.next()?.to_owned();
        let namespace = parts.next()?.to_owned();
        Some(WorkerSpec { session, worker, head_address, namespace })
    }
}
