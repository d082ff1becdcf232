//! The cluster as the placement logic sees it: nodes, placement groups with their reserved
//! bundles, and allocations (actors and tasks) on nodes or inside bundles.
//!
//! [`ClusterState`] is a plain state machine. The runtime registers nodes, then asks it to
//! create and remove groups and to place and release demands; it answers with decisions (which
//! node, which GPUs) and never blocks. A group that cannot be placed yet is kept pending: after
//! anything is released the runtime calls [`ClusterState::schedule_pending`], which places
//! every pending group that now fits, oldest first.

mod arrange;
mod fit;
mod group;
mod membership;
mod restore;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use serde::{Deserialize, Serialize};

pub use membership::LostNode;

use crate::error::PlacementError;
use crate::gpu::{GpuPool, GpuShare, cuda_visible_devices};
use crate::node::{NodeId, NodeResources};
use crate::resources::{GPU, ResourceSet};
use fit::{Amounts, FitIndex};

/// How a placement group spreads its bundles over nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Strategy {
    /// As few nodes as possible; one node when it fits, else nodes filled in cluster order.
    #[default]
    Pack,
    /// Bundles spread over nodes, reusing a node only when needed.
    Spread,
    /// All bundles on one node, or the group waits.
    StrictPack,
    /// Every bundle on a different node, or the group waits.
    StrictSpread,
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Strategy::Pack => "PACK",
            Strategy::Spread => "SPREAD",
            Strategy::StrictPack => "STRICT_PACK",
            Strategy::StrictSpread => "STRICT_SPREAD",
        })
    }
}

/// A placement group id, unique for the life of a [`ClusterState`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GroupId(pub u64);

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pg-{}", self.0)
    }
}

/// An allocation id (one actor or task), unique for the life of a [`ClusterState`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AllocationId(pub u64);

impl fmt::Display for AllocationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "alloc-{}", self.0)
    }
}

/// What to reserve: a named group of bundles and how to spread them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementGroupRequest {
    /// The group's name, unique among live groups.
    pub name: String,
    /// How to spread the bundles.
    pub strategy: Strategy,
    /// The bundles, in the order their indices refer to.
    pub bundles: Vec<ResourceSet>,
}

/// One bundle of one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BundleRef {
    /// The group.
    pub group: GroupId,
    /// The bundle's index in the group's request.
    pub index: usize,
}

/// Where one bundle was reserved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BundlePlacement {
    /// The bundle's index.
    pub index: usize,
    /// The node holding it.
    pub node: NodeId,
    /// What it reserves.
    pub resources: ResourceSet,
    /// The GPUs it reserves, ascending by index.
    pub gpus: Vec<GpuShare>,
}

impl BundlePlacement {
    /// The reserved GPUs' device indices.
    pub fn gpu_indices(&self) -> Vec<u32> {
        self.gpus.iter().map(|share| share.gpu.index).collect()
    }

    /// The reserved GPUs' UUIDs.
    pub fn gpu_uuids(&self) -> Vec<&str> {
        self.gpus.iter().map(|share| share.gpu.uuid.as_str()).collect()
    }
}

/// Where every bundle of a placed group lives, indexed by bundle index. Identical bundles are
/// ordered by node (cluster order) and, on one node, by ascending GPU index, so rank `i` of a
/// role group using bundle `i` sits next to ranks `i ± 1`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BundleTable {
    /// The group.
    pub group: GroupId,
    /// The group's name.
    pub name: String,
    /// The bundles by index.
    pub bundles: Vec<BundlePlacement>,
}

/// Whether a group's bundles are reserved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GroupStatus {
    /// Waiting for resources to free up.
    Pending,
    /// Every bundle is reserved.
    Placed,
}

/// Where to put a single actor or task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PlacementTarget {
    /// The first node (in cluster order) with room.
    Anywhere,
    /// This node.
    Node(NodeId),
    /// Inside this bundle, sharing its reserved resources.
    Bundle(BundleRef),
}

/// Resources handed to one actor or task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// The allocation's id, for [`ClusterState::release`].
    pub id: AllocationId,
    /// The node it runs on.
    pub node: NodeId,
    /// What it was given.
    pub resources: ResourceSet,
    /// Its GPUs and shares, ascending by index.
    pub gpus: Vec<GpuShare>,
    /// The bundle it lives in, if any.
    pub bundle: Option<BundleRef>,
}

impl Allocation {
    /// The value of `CUDA_VISIBLE_DEVICES` for this worker: its GPU indices, comma-separated.
    pub fn cuda_visible_devices(&self) -> String {
        cuda_visible_devices(&self.gpus)
    }

    /// Its GPUs' device indices.
    pub fn gpu_indices(&self) -> Vec<u32> {
        self.gpus.iter().map(|share| share.gpu.index).collect()
    }

    /// Its GPUs' UUIDs.
    pub fn gpu_uuids(&self) -> Vec<&str> {
        self.gpus.iter().map(|share| share.gpu.uuid.as_str()).collect()
    }
}

/// What removing a group released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemovedGroup {
    /// The group's name.
    pub name: String,
    /// The allocations that lived in its bundles (the runtime stops their actors).
    pub released: Vec<Allocation>,
}

/// A bundle's reserved resources and what is handed out from them.
#[derive(Clone, Debug, PartialEq, Eq)]
struct BundleState {
    available: ResourceSet,
    gpus: GpuPool,
    allocations: BTreeSet<AllocationId>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum GroupSlot {
    Pending,
    Placed { table: BundleTable, bundles: Vec<BundleState> },
}

impl GroupSlot {
    fn status(&self) -> GroupStatus {
        match self {
            GroupSlot::Pending => GroupStatus::Pending,
            GroupSlot::Placed { .. } => GroupStatus::Placed,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct GroupRecord {
    request: PlacementGroupRequest,
    slot: GroupSlot,
}

/// The whole cluster: nodes in registration order, groups, and allocations.
///
/// Every decision costs about the same at 10,000 nodes as at 10: nodes are found by id through
/// a map, the first node that can take a demand through a max segment tree (not a scan), groups by
/// name through a map, and what lives on a node through per-node sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterState {
    /// The nodes in registration order, with the places of those that left (`gone`) kept
    /// until they outnumber the live ones: a node leaving moves no other node.
    nodes: Vec<NodeResources>,
    gone: Vec<bool>,
    gone_count: usize,
    groups: BTreeMap<GroupId, GroupRecord>,
    allocations: BTreeMap<AllocationId, Allocation>,
    next_group: u64,
    next_allocation: u64,
    /// Each node's serial number, counted up as nodes register, and the serials of `nodes` in
    /// order (ascending, as nodes keep registration order): a node's position is a binary
    /// search away, and a node leaving renumbers nothing.
    serials: HashMap<NodeId, u64>,
    order: Vec<u64>,
    next_serial: u64,
    /// What each node has free, and has at all, for first-fit searches.
    free: FitIndex,
    whole: FitIndex,
    /// Live groups by name.
    names: HashMap<String, GroupId>,
    /// Groups waiting to be placed.
    pending: BTreeSet<GroupId>,
    /// The placed groups with a bundle on each node.
    groups_on: HashMap<NodeId, BTreeSet<GroupId>>,
    /// The allocations made on each node outside any bundle.
    direct_on: HashMap<NodeId, BTreeSet<AllocationId>>,
}

impl Default for ClusterState {
    fn default() -> ClusterState {
        ClusterState {
            nodes: Vec::new(),
            gone: Vec::new(),
            gone_count: 0,
            groups: BTreeMap::new(),
            allocations: BTreeMap::new(),
            next_group: 0,
            next_allocation: 0,
            serials: HashMap::new(),
            order: Vec::new(),
            next_serial: 0,
            free: FitIndex::new(Amounts::Available, &[], &[]),
            whole: FitIndex::new(Amounts::Total, &[], &[]),
            names: HashMap::new(),
            pending: BTreeSet::new(),
            groups_on: HashMap::new(),
            direct_on: HashMap::new(),
        }
    }
}

impl ClusterState {
    /// An empty cluster.
    pub fn new() -> ClusterState {
        ClusterState::default()
    }

    /// A cluster of `nodes` nodes named `node-0`, `node-1`, … with `cpus` CPUs and
    /// `gpus_per_node` fake GPUs each (for `--num-gpus` on CPU machines, and for tests).
    pub fn with_fake_nodes(nodes: usize, cpus: u64, gpus_per_node: u32) -> ClusterState {
        let mut cluster = ClusterState::new();
        for i in 0..nodes {
            let id = NodeId::new(format!("node-{i}"));
            let node = NodeResources::with_fake_gpus(id, cpus, gpus_per_node);
            // Invariant: the names are distinct.
            if let Err(e) = cluster.add_node(node) {
                unreachable!("fake nodes have distinct names: {e}");
            }
        }
        cluster
    }

    /// Checks that the state's indexes agree with what they index — node positions, the
    /// first-fit indexes, group names, the pending set, the groups and direct allocations on
    /// each node — naming the first disagreement (for tests and simulators: every operation
    /// keeps them true).
    pub fn verify_indexes(&self) -> Result<(), String> {
        let mut problems = Vec::new();
        let positions_agree = self.nodes.len() == self.order.len()
            && self.gone.len() == self.nodes.len()
            && self.gone.iter().filter(|g| **g).count() == self.gone_count
            && self.serials.len() == self.nodes.len() - self.gone_count
            && self.order.windows(2).all(|pair| pair[0] < pair[1])
            && self
                .nodes
                .iter()
                .enumerate()
                .filter(|(p, _)| !self.gone[*p])
                .all(|(p, node)| self.node_position(node.id()) == Some(p));
        if !positions_agree {
            problems.push("node positions");
        }
        if !self.free.agrees_with(&self.nodes, &self.gone) {
            problems.push("the free-resource index");
        }
        if !self.whole.agrees_with(&self.nodes, &self.gone) {
            problems.push("the total-resource index");
        }
        let names: HashMap<String, GroupId> =
            self.groups.iter().map(|(id, record)| (record.request.name.clone(), *id)).collect();
        if names != self.names {
            problems.push("group names");
        }
        let pending: BTreeSet<GroupId> = self
            .groups
            .iter()
            .filter(|(_, record)| record.slot == GroupSlot::Pending)
            .map(|(id, _)| *id)
            .collect();
        if pending != self.pending {
            problems.push("the pending groups");
        }
        let mut groups_on: HashMap<NodeId, BTreeSet<GroupId>> = HashMap::new();
        for (id, record) in &self.groups {
            if let GroupSlot::Placed { table, .. } = &record.slot {
                for bundle in &table.bundles {
                    groups_on.entry(bundle.node.clone()).or_default().insert(*id);
                }
            }
        }
        if groups_on != self.groups_on {
            problems.push("the groups on each node");
        }
        let mut direct_on: HashMap<NodeId, BTreeSet<AllocationId>> = HashMap::new();
        for allocation in self.allocations.values().filter(|a| a.bundle.is_none()) {
            direct_on.entry(allocation.node.clone()).or_default().insert(allocation.id);
        }
        if direct_on != self.direct_on {
            problems.push("the allocations on each node");
        }
        match problems.is_empty() {
            true => Ok(()),
            false => Err(format!("stale indexes: {}", problems.join(", "))),
        }
    }

    /// Registers a node; later nodes come later in cluster order.
    pub fn add_node(&mut self, node: NodeResources) -> Result<(), PlacementError> {
        if self.node_position(node.id()).is_some() {
            return Err(PlacementError::DuplicateNode(node.id().clone()));
        }
        let position = self.nodes.len();
        self.serials.insert(node.id().clone(), self.next_serial);
        self.order.push(self.next_serial);
        self.next_serial += 1;
        self.free.update(position, &node);
        self.whole.update(position, &node);
        self.nodes.push(node);
        self.gone.push(false);
        Ok(())
    }

    /// The nodes in cluster order.
    pub fn nodes(&self) -> Vec<&NodeResources> {
        self.live_nodes().collect()
    }

    /// The nodes in cluster order, one at a time.
    pub fn live_nodes(&self) -> impl Iterator<Item = &NodeResources> {
        self.nodes.iter().zip(&self.gone).filter(|(_, gone)| !**gone).map(|(node, _)| node)
    }

    /// One node.
    pub fn node(&self, id: &NodeId) -> Option<&NodeResources> {
        self.node_position(id).map(|position| &self.nodes[position])
    }

    /// A live allocation.
    pub fn allocation(&self, id: AllocationId) -> Option<&Allocation> {
        self.allocations.get(&id)
    }

    /// Every live allocation, by id.
    pub fn allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.allocations.values()
    }

    /// Places one actor or task's `demand` at `target`.
    ///
    /// Fails with [`PlacementError::Unavailable`] when it could fit once something is released
    /// and with [`PlacementError::DemandInfeasible`] when it never could.
    pub fn place(
        &mut self,
        demand: &ResourceSet,
        target: &PlacementTarget,
    ) -> Result<Allocation, PlacementError> {
        GpuPool::check_demand(demand.get(GPU))?;
        let (node, gpus, bundle) = match target {
            PlacementTarget::Anywhere => self.take_on_nodes(demand, None)?,
            PlacementTarget::Node(id) => {
                let position = self
                    .node_position(id)
                    .ok_or_else(|| PlacementError::UnknownNode(id.clone()))?;
                self.take_on_nodes(demand, Some(position))?
            }
            PlacementTarget::Bundle(bundle) => self.take_in_bundle(demand, *bundle)?,
        };
        let id = AllocationId(self.next_allocation);
        self.next_allocation += 1;
        if bundle.is_none() {
            self.direct_on.entry(node.clone()).or_default().insert(id);
        }
        let allocation = Allocation { id, node, resources: demand.clone(), gpus, bundle };
        self.allocations.insert(id, allocation.clone());
        Ok(allocation)
    }

    /// Releases an allocation, returning its resources to its bundle or node. Afterwards the
    /// runtime should call [`ClusterState::schedule_pending`].
    pub fn release(&mut self, id: AllocationId) -> Result<Allocation, PlacementError> {
        let allocation =
            self.allocations.get(&id).cloned().ok_or(PlacementError::UnknownAllocation(id))?;
        self.give_back(&allocation)?;
        self.allocations.remove(&id);
        if allocation.bundle.is_none() {
            remove_member(&mut self.direct_on, &allocation.node, &id);
        }
        Ok(allocation)
    }

    fn node_position(&self, id: &NodeId) -> Option<usize> {
        let serial = self.serials.get(id)?;
        self.order.binary_search(serial).ok()
    }

    /// Node `position`'s copy in `touched`, made on first use: a change over several nodes
    /// works on copies and commits them ([`ClusterState::set_node`]) only once all succeeded.
    fn touched_copy<'a>(
        &self,
        touched: &'a mut Vec<(usize, NodeResources)>,
        position: usize,
    ) -> &'a mut NodeResources {
        let slot = match touched.iter().position(|(p, _)| *p == position) {
            Some(slot) => slot,
            None => {
                touched.push((position, self.nodes[position].clone()));
                touched.len() - 1
            }
        };
        &mut touched[slot].1
    }

    /// Replaces node `position`'s state, keeping the free-resource index true.
    fn set_node(&mut self, position: usize, node: NodeResources) {
        self.free.update(position, &node);
        self.nodes[position] = node;
    }
}

/// Removes `item` from `key`'s set, and the set when it empties (the per-node indexes).
fn remove_member<K, V>(map: &mut HashMap<K, BTreeSet<V>>, key: &K, item: &V)
where
    K: std::hash::Hash + Eq,
    V: Ord,
{
    if let Some(set) = map.get_mut(key) {
        set.remove(item);
        if set.is_empty() {
            map.remove(key);
        }
    }
}

impl ClusterState {
    fn take_on_nodes(
        &mut self,
        demand: &ResourceSet,
        only: Option<usize>,
    ) -> Result<(NodeId, Vec<GpuShare>, Option<BundleRef>), PlacementError> {
        // (`take` checks the exact fit itself.)
        let found = match only {
            Some(position) => Some(position),
            None => {
                let nodes = &self.nodes;
                self.free.first(demand, |position| nodes[position].can_take(demand))
            }
        };
        if let Some(position) = found
            && let Some(shares) = self.nodes[position].take(demand)
        {
            self.free.update(position, &self.nodes[position]);
            return Ok((self.nodes[position].id().clone(), shares, None));
        }
        let fits_when_empty = match only {
            Some(position) => self.nodes[position].emptied().can_take(demand),
            None => {
                let nodes = &self.nodes;
                self.whole
                    .first(demand, |position| nodes[position].emptied().can_take(demand))
                    .is_some()
            }
        };
        let place = match only {
            Some(position) => format!("node `{}`", self.nodes[position].id()),
            None => format!("any of {} nodes", self.nodes.len() - self.gone_count),
        };
        if fits_when_empty {
            return Err(PlacementError::Unavailable {
                demand: demand.clone(),
                reason: format!("{place} is busy"),
            });
        }
        let candidates: Vec<usize> = match only {
            Some(position) => vec![position],
            None => (0..self.nodes.len()).filter(|p| !self.gone[*p]).collect(),
        };
        let mut largest = ResourceSet::new();
        for &position in &candidates {
            for (name, amount) in self.nodes[position].total().iter() {
                if amount > largest.get(name) {
                    largest.set(name, amount);
                }
            }
        }
        let reason = match largest.first_shortfall(demand) {
            Some((name, needed, has)) => {
                format!("needs {name}: {needed}, {place} has at most {has}")
            }
            None => format!("no GPU arrangement on {place} serves GPU: {}", demand.get(GPU)),
        };
        Err(PlacementError::DemandInfeasible { demand: demand.clone(), reason })
    }

    fn take_in_bundle(
        &mut self,
        demand: &ResourceSet,
        bundle: BundleRef,
    ) -> Result<(NodeId, Vec<GpuShare>, Option<BundleRef>), PlacementError> {
        let record =
            self.groups.get_mut(&bundle.group).ok_or(PlacementError::UnknownGroup(bundle.group))?;
        let (table, states) = match &mut record.slot {
            GroupSlot::Pending => {
                return Err(PlacementError::GroupPending(record.request.name.clone()));
            }
            GroupSlot::Placed { table, bundles } => (table, bundles),
        };
        let count = states.len();
        let (Some(state), Some(placement)) =
            (states.get_mut(bundle.index), table.bundles.get(bundle.index))
        else {
            return Err(PlacementError::BundleOutOfRange {
                group: table.name.clone(),
                bundles: count,
                index: bundle.index,
            });
        };
        let place = format!("bundle {} of `{}`", bundle.index, table.name);
        let whole_pool = GpuPool::from_shares(&placement.gpus);
        if let Some((name, needed, has)) = placement.resources.first_shortfall(demand) {
            return Err(PlacementError::DemandInfeasible {
                demand: demand.clone(),
                reason: format!("needs {name}: {needed}, {place} has {has}"),
            });
        }
        if whole_pool.plan(demand.get(GPU)).is_none() {
            return Err(PlacementError::DemandInfeasible {
                demand: demand.clone(),
                reason: format!("{place} holds no GPU arrangement for GPU: {}", demand.get(GPU)),
            });
        }
        if !state.available.contains(demand) {
            return Err(PlacementError::Unavailable {
                demand: demand.clone(),
                reason: format!("{place} has {} free", state.available),
            });
        }
        let Some(shares) = state.gpus.take(demand.get(GPU)) else {
            return Err(PlacementError::Unavailable {
                demand: demand.clone(),
                reason: format!("{place} has no GPU with enough free share"),
            });
        };
        // Invariant: `contains` was checked just above.
        state.available.try_subtract(demand).map_err(|(name, _, _)| {
            PlacementError::Accounting(format!("{place} lost {name} between check and take"))
        })?;
        // `place` gives the allocation this id right after this returns.
        state.allocations.insert(AllocationId(self.next_allocation));
        Ok((placement.node.clone(), shares, Some(bundle)))
    }

    fn give_back(&mut self, allocation: &Allocation) -> Result<(), PlacementError> {
        let broken = || {
            PlacementError::Accounting(format!(
                "{} could not be returned to where it was taken",
                allocation.id
            ))
        };
        match allocation.bundle {
            None => {
                let position = self.node_position(&allocation.node).ok_or_else(broken)?;
                if !self.nodes[position].give_back(&allocation.resources, &allocation.gpus) {
                    return Err(broken());
                }
                self.free.update(position, &self.nodes[position]);
            }
            Some(bundle) => {
                let record = self.groups.get_mut(&bundle.group).ok_or_else(broken)?;
                let GroupSlot::Placed { table, bundles } = &mut record.slot else {
                    return Err(broken());
                };
                let (state, placement) = bundles
                    .get_mut(bundle.index)
                    .zip(table.bundles.get(bundle.index))
                    .ok_or_else(broken)?;
                let mut available = state.available.clone();
                available.add(&allocation.resources);
                if !placement.resources.contains(&available) {
                    return Err(broken());
                }
                state.gpus.give_back(&allocation.gpus).map_err(|_| broken())?;
                state.available = available;
                state.allocations.remove(&allocation.id);
            }
        }
        Ok(())
    }
}
