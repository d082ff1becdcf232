//! Placement groups as the control plane sees them: what to reserve, a group's state, and
//! where inside a group an actor or task goes.

use serde::{Deserialize, Serialize};

pub use rtrun_placement::{
    BundlePlacement, BundleRef, BundleTable, GpuInstance, GpuShare, GroupId as PlacementGroupId,
    Quantity, ResourceSet, Strategy,
};

use crate::error::{Error, Result};

/// Something with bundles an actor can be placed in: a placement group's handle.
pub trait Bundles {
    /// Placement into bundle `index`.
    fn bundle_schedule(&self, index: usize) -> BundleSchedule;
}

/// What to reserve: bundles, a strategy and an optional name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementGroupOptions {
    /// The bundles, in the order their indices refer to.
    pub bundles: Vec<ResourceSet>,
    /// How to spread the bundles over nodes (default `PACK`).
    pub strategy: Strategy,
    /// A name, unique among live groups, for `rtrun::get_placement_group`. Without one the group
    /// is named `pg-<n>`.
    pub name: Option<String>,
}

impl PlacementGroupOptions {
    /// A group of these bundles with strategy `PACK` and no name.
    pub fn new(bundles: Vec<ResourceSet>) -> PlacementGroupOptions {
        PlacementGroupOptions { bundles, strategy: Strategy::Pack, name: None }
    }

    /// `count` identical bundles given as `(resource, amount)` pairs, e.g.
    /// `uniform(8, &[("GPU", 1.0), ("CPU", 1.0)])`.
    pub fn uniform(count: usize, bundle: &[(&str, f64)]) -> Result<PlacementGroupOptions> {
        let bundle = ResourceSet::from_floats(bundle.iter().copied())
            .map_err(|e| Error::Invalid(format!("placement group bundle: {e}")))?;
        Ok(PlacementGroupOptions::new(vec![bundle; count]))
    }

    /// Sets the strategy.
    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Names the group.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }
}

/// Whether a group's bundles are reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PlacementGroupStatus {
    /// Waiting for resources to free up.
    Pending,
    /// Every bundle is reserved.
    Created,
}

/// A snapshot of one placement group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementGroupState {
    /// The group's id.
    pub id: PlacementGroupId,
    /// Its name.
    pub name: String,
    /// Its strategy.
    pub strategy: Strategy,
    /// Its bundles as requested.
    pub bundles: Vec<ResourceSet>,
    /// Pending or created.
    pub status: PlacementGroupStatus,
    /// Where each bundle lives, once created.
    pub table: Option<BundleTable>,
}

/// Where inside a placement group an actor or task goes (Ray's
/// `PlacementGroupSchedulingStrategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BundleSchedule {
    /// The group.
    pub group: PlacementGroupId,
    /// The bundle; `None` takes the first bundle with room (Ray's index `-1`).
    pub bundle_index: Option<usize>,
    /// Whether actors and tasks created by this actor go into the same group by default.
    pub capture_child_tasks: bool,
}

impl BundleSchedule {
    /// Makes the actor's children (actors and tasks it creates without a placement of their
    /// own) go into the same group.
    pub fn capture_child_tasks(mut self) -> Self {
        self.capture_child_tasks = true;
        self
    }
}
