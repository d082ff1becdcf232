//! What submitting a task asks for: its options and the spec the control plane schedules.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::ObjectId;
use crate::placement_group::BundleSchedule;
use crate::protocol::Arg;

/// Options for one task submission (Ray's `.options(...)` on a remote function).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskOptions {
    /// CPUs held while the task runs (default 1).
    pub num_cpus: f64,
    /// GPUs held while the task runs.
    pub num_gpus: f64,
    /// Custom resources held while it runs.
    pub resources: BTreeMap<String, f64>,
    /// Re-runs when the worker running it dies (default 3, as Ray).
    pub max_retries: u32,
    /// Where inside a placement group the task runs (its resources then come out of the
    /// bundle's reservation); `None` uses the cluster's free resources.
    pub placement: Option<BundleSchedule>,
}

impl TaskOptions {
    /// Runs the task inside a placement group (see `rtrun::PlacementGroup::bundle`).
    pub fn placement(mut self, schedule: BundleSchedule) -> Self {
        self.placement = Some(schedule);
        self
    }
}

impl Default for TaskOptions {
    fn default() -> Self {
        TaskOptions {
            num_cpus: 1.0,
            num_gpus: 0.0,
            resources: BTreeMap::new(),
            max_retries: 3,
            placement: None,
        }
    }
}

/// What the control plane schedules.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskSpec {
    /// The task's id: the id of the object its result is stored as.
    pub task: ObjectId,
    /// The registered function name.
    pub function: String,
    /// Encoded arguments.
    pub args: Vec<Arg>,
    /// Options.
    pub options: TaskOptions,
}
