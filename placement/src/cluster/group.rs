//! Placement-group operations on [`ClusterState`]: create (placed, pending or infeasible),
//! remove, retry pending groups, and read the bundle table.

use std::collections::BTreeSet;

use crate::cluster::arrange::{arrange, diagnose};
use crate::cluster::{
    Allocation, BundlePlacement, BundleState, BundleTable, ClusterState, GroupId, GroupRecord,
    GroupSlot, GroupStatus, PlacementGroupRequest, RemovedGroup, remove_member,
};
use crate::error::PlacementError;
use crate::gpu::GpuPool;
use crate::node::NodeResources;
use crate::resources::GPU;

impl ClusterState {
    /// Creates a placement group: reserves all its bundles at once, or none of them.
    ///
    /// Returns the group's id and [`GroupStatus::Placed`] when every bundle was reserved, or
    /// [`GroupStatus::Pending`] when the group could fit on this cluster once resources free
    /// up (it is then placed by a later [`ClusterState::schedule_pending`]). Fails with
    /// [`PlacementError::Infeasible`], keeping nothing, when it could never fit.
    pub fn create_group(
        &mut self,
        request: PlacementGroupRequest,
    ) -> Result<(GroupId, GroupStatus), PlacementError> {
        validate(&request)?;
        if self.group_by_name(&request.name).is_some() {
            return Err(PlacementError::DuplicateGroupName(request.name));
        }
        let id = GroupId(self.next_group);
        let slot = match self.try_reserve(id, &request) {
            Some(slot) => slot,
            None => {
                let ever =
                    arrange(&self.nodes, &self.whole, true, &request.bundles, request.strategy);
                if ever.is_none() {
                    let empty: Vec<NodeResources> =
                        self.live_nodes().map(|n| n.emptied()).collect();
                    let reason = diagnose(&empty, &request.bundles, request.strategy);
                    return Err(PlacementError::Infeasible { group: request.name, reason });
                }
                GroupSlot::Pending
            }
        };
        self.next_group += 1;
        let status = slot.status();
        self.insert_group(id, GroupRecord { request, slot });
        Ok((id, status))
    }

    /// Places every pending group that fits now, oldest first, and returns their ids. Call it
    /// after anything is released or a node joins; a group that still does not fit stays
    /// pending without blocking younger ones.
    pub fn schedule_pending(&mut self) -> Vec<GroupId> {
        let pending: Vec<GroupId> = self.pending.iter().copied().collect();
        let mut placed = Vec::new();
        for id in pending {
            let Some(request) = self.groups.get(&id).map(|record| record.request.clone()) else {
                continue;
            };
            if let Some(slot) = self.try_reserve(id, &request) {
                self.insert_group(id, GroupRecord { request, slot });
                placed.push(id);
            }
        }
        placed
    }

    /// Records a group (new, or placed after pending) and what finds it: its name, the pending
    /// set, the nodes holding its bundles.
    pub(super) fn insert_group(&mut self, id: GroupId, record: GroupRecord) {
        self.names.insert(record.request.name.clone(), id);
        match &record.slot {
            GroupSlot::Pending => {
                self.pending.insert(id);
            }
            GroupSlot::Placed { table, .. } => {
                self.pending.remove(&id);
                for bundle in &table.bundles {
                    self.groups_on.entry(bundle.node.clone()).or_default().insert(id);
                }
            }
        }
        self.groups.insert(id, record);
    }

    /// Forgets a group and what finds it.
    fn forget_group(&mut self, id: GroupId) {
        let Some(record) = self.groups.remove(&id) else { return };
        self.names.remove(&record.request.name);
        self.pending.remove(&id);
        if let GroupSlot::Placed { table, .. } = &record.slot {
            for bundle in &table.bundles {
                remove_member(&mut self.groups_on, &bundle.node, &id);
            }
        }
    }

    /// Removes a group: releases every allocation in its bundles (returned so the runtime can
    /// stop those actors) and gives the bundles' reservations back to their nodes. Afterwards
    /// the runtime should call [`ClusterState::schedule_pending`].
    pub fn remove_group(&mut self, id: GroupId) -> Result<RemovedGroup, PlacementError> {
        let record = self.groups.get(&id).ok_or(PlacementError::UnknownGroup(id))?;
        let name = record.request.name.clone();
        let GroupSlot::Placed { table, bundles } = &record.slot else {
            self.forget_group(id);
            return Ok(RemovedGroup { name, released: Vec::new() });
        };
        let members: BTreeSet<_> =
            bundles.iter().flat_map(|bundle| bundle.allocations.iter().copied()).collect();
        let table = table.clone();
        // Only the nodes holding bundles change; copy those, so a failure changes nothing.
        let mut touched: Vec<(usize, NodeResources)> = Vec::new();
        for placement in &table.bundles {
            let position = self.node_position(&placement.node);
            let returned = position.is_some_and(|p| {
                self.touched_copy(&mut touched, p).give_back(&placement.resources, &placement.gpus)
            });
            if !returned {
                return Err(PlacementError::Accounting(format!(
                    "bundle {} of `{name}` could not be returned to node `{}`",
                    placement.index, placement.node
                )));
            }
        }
        let released: Vec<Allocation> =
            members.iter().filter_map(|member| self.allocations.remove(member)).collect();
        for (position, node) in touched {
            self.set_node(position, node);
        }
        self.forget_group(id);
        Ok(RemovedGroup { name, released })
    }

    /// Whether a live group is placed or pending.
    pub fn group_status(&self, id: GroupId) -> Option<GroupStatus> {
        self.group(id).map(|(_, status)| status)
    }

    /// The bundle table of a placed group (`None` while pending or when unknown).
    pub fn bundle_table(&self, id: GroupId) -> Option<&BundleTable> {
        match &self.groups.get(&id)?.slot {
            GroupSlot::Placed { table, .. } => Some(table),
            GroupSlot::Pending => None,
        }
    }

    /// The id of the live group with this name.
    pub fn group_by_name(&self, name: &str) -> Option<GroupId> {
        self.names.get(name).copied()
    }

    /// A live group's request and status.
    pub fn group(&self, id: GroupId) -> Option<(&PlacementGroupRequest, GroupStatus)> {
        let record = self.groups.get(&id)?;
        Some((&record.request, record.slot.status()))
    }

    /// Every live group: id, request and status, oldest first.
    pub fn groups(&self) -> impl Iterator<Item = (GroupId, &PlacementGroupRequest, GroupStatus)> {
        self.groups.iter().map(|(id, record)| (*id, &record.request, record.slot.status()))
    }

    /// The ids of the allocations living in a group's bundles.
    pub fn group_allocations(&self, id: GroupId) -> Vec<crate::cluster::AllocationId> {
        match self.groups.get(&id).map(|record| &record.slot) {
            Some(GroupSlot::Placed { bundles, .. }) => {
                let members: BTreeSet<_> =
                    bundles.iter().flat_map(|b| b.allocations.iter().copied()).collect();
                members.into_iter().collect()
            }
            _ => Vec::new(),
        }
    }

    /// Reserves every bundle of `request` now, committing the new node state, or returns
    /// `None` and changes nothing.
    fn try_reserve(&mut self, id: GroupId, request: &PlacementGroupRequest) -> Option<GroupSlot> {
        let (changed, arrangement) =
            arrange(&self.nodes, &self.free, false, &request.bundles, request.strategy)?;
        let mut placements = Vec::with_capacity(arrangement.len());
        let mut states = Vec::with_capacity(arrangement.len());
        for (index, ((position, gpus), resources)) in
            arrangement.into_iter().zip(&request.bundles).enumerate()
        {
            states.push(BundleState {
                available: resources.clone(),
                gpus: GpuPool::from_shares(&gpus),
                allocations: BTreeSet::new(),
            });
            placements.push(BundlePlacement {
                index,
                node: self.nodes[position].id().clone(),
                resources: resources.clone(),
                gpus,
            });
        }
        for (position, node) in changed {
            self.set_node(position, node);
        }
        let table = BundleTable { group: id, name: request.name.clone(), bundles: placements };
        Some(GroupSlot::Placed { table, bundles: states })
    }
}

fn validate(request: &PlacementGroupRequest) -> Result<(), PlacementError> {
    let invalid =
        |reason: String| PlacementError::InvalidGroup { group: request.name.clone(), reason };
    if request.bundles.is_empty() {
        return Err(invalid("expected at least one bundle, found none".to_owned()));
    }
    for (index, bundle) in request.bundles.iter().enumerate() {
        if bundle.is_empty() {
            return Err(invalid(format!("expected resources in bundle {index}, found none")));
        }
        GpuPool::check_demand(bundle.get(GPU))
            .map_err(|err| invalid(format!("bundle {index}: {err}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{BundleRef, PlacementTarget, Strategy};
    use crate::resources::{Quantity, ResourceSet};

    fn request(name: &str, count: usize, gpu: f64, strategy: Strategy) -> PlacementGroupRequest {
        let bundle = ResourceSet::from_floats([(GPU, gpu), ("CPU", 1.0)]).unwrap();
        PlacementGroupRequest { name: name.to_owned(), strategy, bundles: vec![bundle; count] }
    }

    #[test]
    fn infeasible_group_names_the_missing_resource_and_keeps_nothing() {
        let mut cluster = ClusterState::with_fake_nodes(1, 16, 4);
        let before = cluster.clone();
        let err = cluster.create_group(request("pg0", 8, 1.0, Strategy::Pack)).unwrap_err();
        assert_eq!(err.to_string(), "placement group `pg0` needs GPU: 8, cluster has 4");
        assert_eq!(cluster, before);
    }

    #[test]
    fn pending_group_is_placed_once_resources_free() {
        let mut cluster = ClusterState::with_fake_nodes(1, 16, 8);
        let (first, status) = cluster.create_group(request("a", 6, 1.0, Strategy::Pack)).unwrap();
        assert_eq!(status, GroupStatus::Placed);
        let (second, status) = cluster.create_group(request("b", 4, 1.0, Strategy::Pack)).unwrap();
        assert_eq!(status, GroupStatus::Pending);
        assert!(cluster.bundle_table(second).is_none());
        assert!(cluster.schedule_pending().is_empty());
        cluster.remove_group(first).unwrap();
        assert_eq!(cluster.schedule_pending(), [second]);
        let table = cluster.bundle_table(second).unwrap();
        let indices: Vec<Vec<u32>> = table.bundles.iter().map(|b| b.gpu_indices()).collect();
        assert_eq!(indices, [[0], [1], [2], [3]]);
    }

    #[test]
    fn five_fifths_share_one_bundle_gpu_and_removal_frees_everything() {
        let mut cluster = ClusterState::with_fake_nodes(1, 16, 8);
        let empty = cluster.clone();
        let (id, _) = cluster.create_group(request("hybrid", 8, 1.0, Strategy::Pack)).unwrap();
        let bundle = BundleRef { group: id, index: 3 };
        let demand = ResourceSet::from_floats([(GPU, 0.2)]).unwrap();
        let mut uuids = Vec::new();
        for _ in 0..5 {
            let allocation = cluster.place(&demand, &PlacementTarget::Bundle(bundle)).unwrap();
            assert_eq!(allocation.cuda_visible_devices(), "3");
            uuids.push(allocation.gpus[0].gpu.uuid.clone());
        }
        uuids.dedup();
        assert_eq!(uuids.len(), 1);
        let err = cluster.place(&demand, &PlacementTarget::Bundle(bundle)).unwrap_err();
        assert!(matches!(err, PlacementError::Unavailable { .. }), "{err}");
        let too_big = ResourceSet::from_floats([(GPU, 2.0)]).unwrap();
        let err = cluster.place(&too_big, &PlacementTarget::Bundle(bundle)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "demand {GPU: 2} can never fit: needs GPU: 2, bundle 3 of `hybrid` has 1"
        );
        let removed = cluster.remove_group(id).unwrap();
        assert_eq!(removed.released.len(), 5);
        assert_eq!(cluster.nodes(), empty.nodes());
        assert_eq!(cluster.allocations().count(), 0);
        assert_eq!(cluster.nodes()[0].available().get(GPU), Quantity::whole(8));
    }

    #[test]
    fn invalid_requests_are_rejected() {
        let mut cluster = ClusterState::with_fake_nodes(1, 16, 8);
        let err = cluster.create_group(request("x", 0, 1.0, Strategy::Pack)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "placement group `x` is invalid: expected at least one bundle, found none"
        );
        let err = cluster.create_group(request("x", 1, 1.5, Strategy::Pack)).unwrap_err();
        assert!(err.to_string().contains("must be whole, found 1.5"), "{err}");
        cluster.create_group(request("x", 1, 1.0, Strategy::Pack)).unwrap();
        let err = cluster.create_group(request("x", 1, 1.0, Strategy::Pack)).unwrap_err();
        assert_eq!(err, PlacementError::DuplicateGroupName("x".to_owned()));
    }

    #[test]
    fn strict_spread_over_two_nodes_groups_bundles_by_node() {
        let mut cluster = ClusterState::with_fake_nodes(2, 16, 8);
        let (id, _) = cluster.create_group(request("s", 2, 8.0, Strategy::StrictSpread)).unwrap();
        let table = cluster.bundle_table(id).unwrap();
        let nodes: Vec<&str> = table.bundles.iter().map(|b| b.node.as_str()).collect();
        assert_eq!(nodes, ["node-0", "node-1"]);
        assert_eq!(table.bundles[1].gpu_indices(), (0..8).collect::<Vec<u32>>());
    }
}
