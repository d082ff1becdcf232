//! Errors of the cluster state machine: infeasible and pending requests, unknown ids and bad
//! requests. Messages say what was expected and what was found.

use crate::cluster::{AllocationId, GroupId, Strategy};
use crate::gpu::GpuDemandError;
use crate::node::{NodeError, NodeId};
use crate::resources::{Quantity, ResourceSet};

/// Why a placement group can never be placed on this cluster, even with everything free.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Infeasibility {
    /// The bundles together need more of a resource than all nodes have.
    #[error("needs {resource}: {needed}, cluster has {available}")]
    ClusterShortfall {
        /// The resource.
        resource: String,
        /// The sum over all bundles.
        needed: Quantity,
        /// The sum over all nodes.
        available: Quantity,
    },
    /// One bundle needs more of a resource than any single node has.
    #[error(
        "bundle {bundle} needs {resource}: {needed} on one node, the largest node has {largest}"
    )]
    BundleTooLarge {
        /// The bundle index.
        bundle: usize,
        /// The resource.
        resource: String,
        /// What the bundle needs.
        needed: Quantity,
        /// The most any node has.
        largest: Quantity,
    },
    /// One bundle fits no node, though no single resource explains it (GPU fragmentation or a
    /// combination of resources).
    #[error("bundle {bundle} {demand} fits on no node")]
    BundleFitsNowhere {
        /// The bundle index.
        bundle: usize,
        /// The bundle's resources.
        demand: ResourceSet,
    },
    /// STRICT_PACK needs everything on one node, and no node is large enough.
    #[error("needs {resource}: {needed} on one node (STRICT_PACK), the largest node has {largest}")]
    StrictPackTooLarge {
        /// The resource.
        resource: String,
        /// The sum over all bundles.
        needed: Quantity,
        /// The most any node has.
        largest: Quantity,
    },
    /// STRICT_SPREAD needs one node per bundle.
    #[error("needs {bundles} distinct nodes (STRICT_SPREAD), cluster has {nodes}")]
    TooFewNodes {
        /// How many bundles (and so nodes) are needed.
        bundles: usize,
        /// How many nodes there are.
        nodes: usize,
    },
    /// Every bundle fits somewhere, but no arrangement the strategy allows fits them all.
    #[error("cannot fit its bundles onto the cluster's nodes with strategy {strategy}")]
    NoArrangement {
        /// The strategy.
        strategy: Strategy,
    },
}

/// An error from [`crate::ClusterState`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The group could never be placed on this cluster, even with everything free.
    #[error("placement group `{group}` {reason}")]
    Infeasible {
        /// The group's name.
        group: String,
        /// What is missing.
        reason: Infeasibility,
    },
    /// The request itself is malformed (no bundles, an empty bundle, a bad GPU amount).
    #[error("placement group `{group}` is invalid: {reason}")]
    InvalidGroup {
        /// The group's name.
        group: String,
        /// What was expected and found.
        reason: String,
    },
    /// Another live group already has this name.
    #[error("placement group name `{0}` is already in use")]
    DuplicateGroupName(String),
    /// No live group has this id.
    #[error("no placement group with id {0}")]
    UnknownGroup(GroupId),
    /// The group is waiting for resources; its bundles cannot host anything yet.
    #[error("placement group `{0}` is pending: expected a placed group")]
    GroupPending(String),
    /// A bundle index past the group's end.
    #[error("placement group `{group}` has {bundles} bundles, found bundle index {index}")]
    BundleOutOfRange {
        /// The group's name.
        group: String,
        /// How many bundles it has.
        bundles: usize,
        /// The index asked for.
        index: usize,
    },
    /// A demand that can never fit where it was asked to go.
    #[error("demand {demand} can never fit: {reason}")]
    DemandInfeasible {
        /// The demand.
        demand: ResourceSet,
        /// What is missing, naming the resource and amounts.
        reason: String,
    },
    /// A demand that could fit once other allocations are released.
    #[error("demand {demand} does not fit now: {reason}")]
    Unavailable {
        /// The demand.
        demand: ResourceSet,
        /// Where it was tried.
        reason: String,
    },
    /// A GPU amount with an impossible shape.
    #[error("invalid demand: {0}")]
    GpuDemand(#[from] GpuDemandError),
    /// No live allocation has this id.
    #[error("no allocation with id {0}")]
    UnknownAllocation(AllocationId),
    /// No node has this id.
    #[error("no node `{0}` in the cluster")]
    UnknownNode(NodeId),
    /// A node with this id is already registered.
    #[error("node `{0}` is already registered")]
    DuplicateNode(NodeId),
    /// A node description is inconsistent.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// Internal bookkeeping disagreed with itself; the operation was not applied.
    #[error("placement accounting is inconsistent: {0}")]
    Accounting(String),
}
