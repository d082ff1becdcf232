//! Placement logic for rtrun: resource quantities and sets, GPUs as instances, nodes, the
//! cluster state machine with placement groups and bundles, and the YAML colocation specs that
//! map role groups onto them.
//!
//! Everything here is pure: no I/O, no clocks, no threads. The runtime feeds it the cluster's
//! state and gets decisions back, which is what makes it property-testable.
//!
//! The runtime's use, in order: register nodes ([`ClusterState::add_node`], with detected or
//! fake GPUs from [`GpuInstance::synthetic_set`]); turn a spec into requests
//! ([`spec::parse_spec`] then [`spec::PlacementSpec::plan`]); create groups
//! ([`ClusterState::create_group`]); place actors into bundles ([`ClusterState::place`]) and
//! set `CUDA_VISIBLE_DEVICES` from [`Allocation::cuda_visible_devices`]; release allocations and
//! remove groups, then call [`ClusterState::schedule_pending`].
#![forbid(unsafe_code)]

pub mod cluster;
pub mod error;
pub mod gpu;
pub mod node;
pub mod resources;
pub mod spec;

pub use cluster::{
    Allocation, AllocationId, BundlePlacement, BundleRef, BundleTable, ClusterState, GroupId,
    GroupStatus, LostNode, PlacementGroupRequest, PlacementTarget, RemovedGroup, Strategy,
};
pub use error::{Infeasibility, PlacementError};
pub use gpu::{GpuDemandError, GpuInstance, GpuPool, GpuShare, GpuSlot, synthetic_uuid};
pub use node::{NodeError, NodeId, NodeResources};
pub use resources::{CPU, GPU, MEMORY, Quantity, QuantityError, ResourceSet};
