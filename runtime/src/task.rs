//! Remote functions (tasks): options, the spec the control plane schedules, and submission.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::object::ObjectRef;
use crate::protocol::Arg;
use crate::runtime;

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
    pub placement: Option<crate::placement_group::BundleSchedule>,
}

impl TaskOptions {
    /// Runs the task inside a placement group (see [`crate::PlacementGroup::bundle`]).
    pub fn placement(mut self, schedule: crate::placement_group::BundleSchedule) -> Self {
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
    pub task: crate::ids::ObjectId,
    /// The registered function name.
    pub function: String,
    /// Encoded arguments.
    pub args: Vec<Arg>,
    /// Options.
    pub options: TaskOptions,
}

/// Submits a registered function (used by generated code).
#[doc(hidden)]
pub fn submit_task<R>(
    function: &str,
    options: TaskOptions,
    args: Vec<Result<Arg>>,
) -> ObjectRef<R> {
    let runtime = match runtime::current() {
        Ok(runtime) => runtime,
        Err(e) => return runtime::failed_ref(e),
    };
    let mut options = options;
    if options.placement.is_none() {
        options.placement = runtime.captured_placement();
    }
    match args.into_iter().collect::<Result<Vec<_>>>() {
        Ok(args) => runtime.submit_task(function.to_owned(), args, options),
        Err(e) => runtime::failed_ref(e),
    }
}
