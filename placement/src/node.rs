//! One node's resources as the placement logic sees them: totals, what is still available, and
//! the node's GPUs as a [`GpuPool`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::gpu::{GpuInstance, GpuPool, GpuShare};
use crate::resources::{GPU, Quantity, ResourceSet};

/// A node's identity, as the runtime names it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(String);

impl NodeId {
    /// A node id from the runtime's name for the node.
    pub fn new(id: impl Into<String>) -> NodeId {
        NodeId(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A node description whose resources do not agree with its GPUs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeError {
    /// The `GPU` amount differs from the number of GPU instances.
    #[error("node `{node}` declares GPU: {declared} but has {instances} GPU instances")]
    GpuCountMismatch {
        /// The node.
        node: NodeId,
        /// The declared `GPU` amount.
        declared: Quantity,
        /// How many instances were given.
        instances: usize,
    },
    /// Two GPU instances share an index or a UUID.
    #[error("node `{node}` lists GPU {gpu} twice")]
    DuplicateGpu {
        /// The node.
        node: NodeId,
        /// The repeated GPU.
        gpu: GpuInstance,
    },
}

/// What a node has and what is still free on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeResources {
    id: NodeId,
    total: ResourceSet,
    available: ResourceSet,
    gpus: GpuPool,
}

impl NodeResources {
    /// A node with `resources` (CPU, memory, custom names) and the given GPU instances. The
    /// `GPU` amount is taken from the instances; when `resources` names one too, it must agree.
    pub fn new(
        id: NodeId,
        resources: ResourceSet,
        gpus: Vec<GpuInstance>,
    ) -> Result<NodeResources, NodeError> {
        let count = Quantity::saturating_whole(gpus.len() as u64);
        let declared = resources.get(GPU);
        if declared != Quantity::ZERO && declared != count {
            return Err(NodeError::GpuCountMismatch { node: id, declared, instances: gpus.len() });
        }
        for (i, gpu) in gpus.iter().enumerate() {
            if gpus[..i].iter().any(|other| other.index == gpu.index || other.uuid == gpu.uuid) {
                return Err(NodeError::DuplicateGpu { node: id, gpu: gpu.clone() });
            }
        }
        let mut total = resources;
        total.set(GPU, count);
        Ok(NodeResources { id, available: total.clone(), total, gpus: GpuPool::whole(gpus) })
    }

    /// A node with `cpus` CPUs and `gpus` fake GPUs with synthetic UUIDs (`--num-gpus N` on a
    /// machine without GPUs).
    pub fn with_fake_gpus(id: NodeId, cpus: u64, gpus: u32) -> NodeResources {
        let mut resources = ResourceSet::new();
        resources.set(crate::resources::CPU, Quantity::saturating_whole(cpus));
        resources.set(GPU, Quantity::whole(u64::from(gpus)));
        let instances = GpuInstance::synthetic_set(id.as_str(), gpus);
        let node = NodeResources::new(id, resources, instances);
        // Invariant: the GPU amount was set from the instance count and synthetic UUIDs and
        // indices are distinct, so `new` has nothing to reject.
        node.expect("fake GPUs always agree with their count")
    }

    /// The node's id.
    pub fn id(&self) -> &NodeId {
        &self.id
    }

    /// Everything the node has.
    pub fn total(&self) -> &ResourceSet {
        &self.total
    }

    /// What is not reserved or allocated.
    pub fn available(&self) -> &ResourceSet {
        &self.available
    }

    /// The node's GPUs with their free shares.
    pub fn gpus(&self) -> &GpuPool {
        &self.gpus
    }

    /// Whether `demand` could be taken now (resources and a GPU assignment).
    pub fn can_take(&self, demand: &ResourceSet) -> bool {
        self.available.contains(demand) && self.gpus.plan(demand.get(GPU)).is_some()
    }

    /// Takes `demand`, returning its GPU shares, or `None` (changing nothing) when it does not
    /// fit now.
    pub(crate) fn take(&mut self, demand: &ResourceSet) -> Option<Vec<GpuShare>> {
        if !self.can_take(demand) {
            return None;
        }
        let shares = self.gpus.take(demand.get(GPU))?;
        // Invariant: `can_take` checked `available.contains(demand)`.
        self.available.try_subtract(demand).ok()?;
        Some(shares)
    }

    /// Gives back what [`NodeResources::take`] handed out. Fails (changing nothing) when the
    /// amounts were never taken from this node.
    pub(crate) fn give_back(&mut self, demand: &ResourceSet, shares: &[GpuShare]) -> bool {
        let mut available = self.available.clone();
        available.add(demand);
        if !self.total.contains(&available) {
            return false;
        }
        if self.gpus.give_back(shares).is_err() {
            return false;
        }
        self.available = available;
        true
    }

    /// Takes `demand` with exactly these GPU shares (what a restarting control plane finds
    /// already handed out); `false`, changing nothing, when they are not free.
    pub(crate) fn take_exact(&mut self, demand: &ResourceSet, shares: &[GpuShare]) -> bool {
        let mut available = self.available.clone();
        if available.try_subtract(demand).is_err() {
            return false;
        }
        let mut gpus = self.gpus.clone();
        if gpus.take_exact(shares).is_err() {
            return false;
        }
        self.available = available;
        self.gpus = gpus;
        true
    }

    /// This node with nothing reserved or allocated.
    pub(crate) fn emptied(&self) -> NodeResources {
        let gpus = GpuPool::whole(self.gpus.slots().iter().map(|slot| slot.gpu.clone()));
        NodeResources {
            id: self.id.clone(),
            total: self.total.clone(),
            available: self.total.clone(),
            gpus,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_count_must_match_instances() {
        let resources = ResourceSet::from_floats([(GPU, 2.0)]).unwrap();
        let err =
            NodeResources::new(NodeId::new("a"), resources, GpuInstance::synthetic_set("a", 1))
                .unwrap_err();
        assert_eq!(err.to_string(), "node `a` declares GPU: 2 but has 1 GPU instances");
    }

    #[test]
    fn duplicate_gpus_are_rejected() {
        let gpus = vec![GpuInstance::new(0, "GPU-x"), GpuInstance::new(0, "GPU-y")];
        let err = NodeResources::new(NodeId::new("a"), ResourceSet::new(), gpus).unwrap_err();
        assert!(matches!(err, NodeError::DuplicateGpu { .. }));
    }

    #[test]
    fn take_and_give_back_round_trip() {
        let mut node = NodeResources::with_fake_gpus(NodeId::new("a"), 4, 2);
        let before = node.clone();
        let demand = ResourceSet::from_floats([(GPU, 0.5), ("CPU", 1.0)]).unwrap();
        let shares = node.take(&demand).unwrap();
        assert_eq!(node.available().get(GPU), Quantity::from_f64(1.5).unwrap());
        assert!(node.give_back(&demand, &shares));
        assert_eq!(node, before);
        assert!(!node.give_back(&demand, &shares), "giving back twice must fail");
        assert_eq!(node, before);
    }
}
