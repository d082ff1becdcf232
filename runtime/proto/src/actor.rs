//! What creating an actor asks for: its options, the spec the control plane schedules, and
//! what a caller needs to call it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::context::GroupMembership;
use crate::ids::ActorId;
use crate::placement_group::{BundleSchedule, Bundles};
use crate::protocol::Arg;

/// Options for creating an actor (Ray's `.options(...)`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ActorOptions {
    /// CPUs held while the actor lives (default 0, as Ray's actors hold none once placed).
    pub num_cpus: Option<f64>,
    /// GPUs held, fractional allowed (0.2 for a hybrid-engine share).
    pub num_gpus: Option<f64>,
    /// Custom resources held.
    pub resources: BTreeMap<String, f64>,
    /// A name for lookup with `get_actor`.
    pub name: Option<String>,
    /// The name's namespace (default: the runtime's namespace).
    pub namespace: Option<String>,
    /// Ray's `lifetime="detached"`: the actor outlives the driver that created it and is
    /// stopped only by `ActorRef::kill` or `rtrun kill` (or its cluster stopping). Without it
    /// an actor dies with its driver.
    pub detached: bool,
    /// Ray's `get_if_exists=True`: when a live actor of this name and type exists in the
    /// namespace, creating returns it instead of failing (the head decides, so two drivers
    /// asking at once get one actor). Needs a name.
    pub get_if_exists: bool,
    /// How often the actor is restarted after its process dies (-1: forever).
    pub max_restarts: i32,
    /// How often a call in flight when the actor died is retried on the restarted actor
    /// (-1: forever).
    pub max_task_retries: i32,
    /// Concurrency for `&self` methods (sync default 1, async default 1000).
    pub max_concurrency: Option<usize>,
    /// Extra environment variables for the actor's worker process.
    pub env: BTreeMap<String, String>,
    /// Set by actor groups.
    pub group: Option<GroupMembership>,
    /// Where inside a placement group the actor goes (it then uses the bundle's reserved
    /// resources and GPUs); `None` places it on the cluster's free resources.
    pub placement: Option<BundleSchedule>,
}

impl ActorOptions {
    /// Sets `num_cpus`.
    pub fn num_cpus(mut self, n: f64) -> Self {
        self.num_cpus = Some(n);
        self
    }
    /// Sets `num_gpus`.
    pub fn num_gpus(mut self, n: f64) -> Self {
        self.num_gpus = Some(n);
        self
    }
    /// Adds a custom resource requirement.
    pub fn resource(mut self, name: &str, amount: f64) -> Self {
        self.resources.insert(name.to_owned(), amount);
        self
    }
    /// Names the actor.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }
    /// Sets the namespace of the name.
    pub fn namespace(mut self, namespace: &str) -> Self {
        self.namespace = Some(namespace.to_owned());
        self
    }
    /// Makes the actor detached: it survives its driver (see [`ActorOptions::detached`]).
    pub fn detached(mut self) -> Self {
        self.detached = true;
        self
    }
    /// Gets the live actor of this name instead of failing when one exists (see
    /// [`ActorOptions::get_if_exists`]).
    pub fn get_if_exists(mut self) -> Self {
        self.get_if_exists = true;
        self
    }
    /// Sets `max_restarts`.
    pub fn max_restarts(mut self, n: i32) -> Self {
        self.max_restarts = n;
        self
    }
    /// Sets `max_task_retries`.
    pub fn max_task_retries(mut self, n: i32) -> Self {
        self.max_task_retries = n;
        self
    }
    /// Sets `max_concurrency`.
    pub fn max_concurrency(mut self, n: usize) -> Self {
        self.max_concurrency = Some(n);
        self
    }
    /// Adds an environment variable for the worker process.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.insert(key.to_owned(), value.to_owned());
        self
    }
    /// Places the actor inside a placement group (see `rtrun::PlacementGroup::bundle`).
    pub fn placement(mut self, schedule: BundleSchedule) -> Self {
        self.placement = Some(schedule);
        self
    }
    /// Places the actor in bundle `index` of `group` (a placement group's handle).
    pub fn bundle(self, group: &impl Bundles, index: usize) -> Self {
        self.placement(group.bundle_schedule(index))
    }
    /// Sets `num_cpus`, `num_gpus` and custom resources from an exact resource set (as a
    /// placement spec gives them).
    pub fn resource_set(mut self, resources: &rtrun_placement::ResourceSet) -> Self {
        self.num_cpus = None;
        self.num_gpus = None;
        self.resources.clear();
        for (name, amount) in resources.iter() {
            let amount = amount.as_f64();
            match name {
                rtrun_placement::CPU => self.num_cpus = Some(amount),
                rtrun_placement::GPU => self.num_gpus = Some(amount),
                other => {
                    self.resources.insert(other.to_owned(), amount);
                }
            }
        }
        self
    }
}

/// What the control plane needs to create an actor.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ActorSpec {
    /// The registered type name.
    pub type_name: String,
    /// Encoded constructor arguments.
    pub ctor_args: Vec<Arg>,
    /// Creation options.
    pub options: ActorOptions,
}

/// What a caller needs to call an actor: carried inside every `ActorRef`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorInfo {
    /// The actor.
    pub id: ActorId,
    /// Its registered type name.
    pub type_name: String,
    /// Retries for calls in flight when it dies.
    pub max_task_retries: i32,
}

/// A type's name without its module path (`Probe` for `cluster_driver::Probe`), as Ray prints
/// a class name.
pub fn short_type(type_name: &str) -> &str {
    type_name.rsplit("::").next().unwrap_or(type_name)
}
