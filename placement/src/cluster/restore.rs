//! Rebuilding a [`ClusterState`] from what a control plane persisted (a head restarting from
//! its state directory): nodes are added as usual, then each placed group and each allocation
//! is taken back exactly where it was — the same nodes, bundles, GPUs and ids — rather than
//! placed anew, because the processes holding them are still running there.

use std::collections::BTreeSet;

use crate::cluster::{
    Allocation, BundleState, BundleTable, ClusterState, GroupId, GroupRecord, GroupSlot,
    PlacementGroupRequest,
};
use crate::error::PlacementError;
use crate::gpu::GpuPool;
use crate::resources::ResourceSet;

impl ClusterState {
    /// Restores group `id`: pending when `table` is `None`, else with each bundle reserved on
    /// the node the table names (its resources and GPU shares taken from that node). Fails,
    /// changing nothing, when a bundle no longer fits where it was or the table disagrees with
    /// the request.
    pub fn restore_group(
        &mut self,
        id: GroupId,
        request: PlacementGroupRequest,
        table: Option<BundleTable>,
    ) -> Result<(), PlacementError> {
        let accounting = |what: String| {
            PlacementError::Accounting(format!("restoring group `{}`: {what}", request.name))
        };
        if self.groups.contains_key(&id) || self.group_by_name(&request.name).is_some() {
            return Err(accounting(format!("{id} or its name is in use already")));
        }
        let slot = match table {
            None => GroupSlot::Pending,
            Some(table) => {
                let agrees = table.group == id
                    && table.bundles.len() == request.bundles.len()
                    && table.bundles.iter().zip(&request.bundles).enumerate().all(
                        |(i, (placed, asked))| placed.index == i && &placed.resources == asked,
                    );
                if !agrees {
                    return Err(accounting("its bundle table disagrees with its bundles".into()));
                }
                let mut touched: Vec<(usize, crate::node::NodeResources)> = Vec::new();
                for placement in &table.bundles {
                    let position = self.node_position(&placement.node).ok_or_else(|| {
                        accounting(format!("bundle {} is on unknown node", placement.index))
                    })?;
                    let node = self.touched_copy(&mut touched, position);
                    if !node.take_exact(&placement.resources, &placement.gpus) {
                        return Err(accounting(format!(
                            "bundle {} no longer fits on node `{}`",
                            placement.index, placement.node
                        )));
                    }
                }
                for (position, node) in touched {
                    self.set_node(position, node);
                }
                let bundles = table
                    .bundles
                    .iter()
                    .map(|placement| BundleState {
                        available: placement.resources.clone(),
                        gpus: GpuPool::from_shares(&placement.gpus),
                        allocations: BTreeSet::new(),
                    })
                    .collect();
                GroupSlot::Placed { table, bundles }
            }
        };
        self.next_group = self.next_group.max(id.0 + 1);
        self.insert_group(id, GroupRecord { request, slot });
        Ok(())
    }

    /// Restores an allocation with its id, node, resources, GPUs and bundle, taking them from
    /// its node or its (restored, placed) bundle. Fails, changing nothing, when they are not
    /// free there.
    pub fn restore_allocation(&mut self, allocation: Allocation) -> Result<(), PlacementError> {
        let accounting =
            |what: &str| PlacementError::Accounting(format!("restoring {}: {what}", allocation.id));
        if self.allocations.contains_key(&allocation.id) {
            return Err(accounting("its id is in use already"));
        }
        match allocation.bundle {
            Some(bundle) => {
                let record = self
                    .groups
                    .get_mut(&bundle.group)
                    .ok_or_else(|| accounting("its group is unknown"))?;
                let GroupSlot::Placed { table, bundles } = &mut record.slot else {
                    return Err(accounting("its group is not placed"));
                };
                let (Some(state), Some(placement)) =
                    (bundles.get_mut(bundle.index), table.bundles.get(bundle.index))
                else {
                    return Err(accounting("its bundle is out of range"));
                };
                if placement.node != allocation.node {
                    return Err(accounting("its bundle is on another node"));
                }
                take_from(&mut state.available, &mut state.gpus, &allocation)
                    .ok_or_else(|| accounting("its bundle has no room for it"))?;
                state.allocations.insert(allocation.id);
            }
            None => {
                let position = self
                    .node_position(&allocation.node)
                    .ok_or_else(|| accounting("its node is unknown"))?;
                let mut node = self.nodes[position].clone();
                if !node.take_exact(&allocation.resources, &allocation.gpus) {
                    return Err(accounting("its node has no room for it"));
                }
                self.set_node(position, node);
                self.direct_on.entry(allocation.node.clone()).or_default().insert(allocation.id);
            }
        }
        self.next_allocation = self.next_allocation.max(allocation.id.0 + 1);
        self.allocations.insert(allocation.id, allocation);
        Ok(())
    }

    /// The next group and allocation ids this state hands out.
    pub fn next_ids(&self) -> (u64, u64) {
        (self.next_group, self.next_allocation)
    }

    /// Moves the next group and allocation ids to at least `groups` and `allocations` (ids
    /// handed out before a restart must not be handed out again).
    pub fn advance_ids(&mut self, groups: u64, allocations: u64) {
        self.next_group = self.next_group.max(groups);
        self.next_allocation = self.next_allocation.max(allocations);
    }
}

/// Takes `allocation`'s resources and exact GPU shares from a bundle's free amounts.
fn take_from(
    available: &mut ResourceSet,
    gpus: &mut GpuPool,
    allocation: &Allocation,
) -> Option<()> {
    let mut left = available.clone();
    left.try_subtract(&allocation.resources).ok()?;
    let mut pool = gpus.clone();
    pool.take_exact(&allocation.gpus).ok()?;
    *available = left;
    *gpus = pool;
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{BundleRef, PlacementTarget, Strategy};
    use crate::node::NodeId;
    use crate::resources::GPU;

    /// A state with a placed group, an allocation in a bundle and one on a node, rebuilt from
    /// its nodes, groups and allocations, equals the original (indexes included).
    #[test]
    fn a_state_rebuilt_from_its_groups_and_allocations_is_the_same() {
        let mut cluster = ClusterState::with_fake_nodes(3, 8, 4);
        let bundle = ResourceSet::from_floats([(GPU, 1.0), ("CPU", 2.0)]).unwrap();
        let request = PlacementGroupRequest {
            name: "train".into(),
            strategy: Strategy::Spread,
            bundles: vec![bundle; 3],
        };
        let (group, _) = cluster.create_group(request.clone()).unwrap();
        let half = ResourceSet::from_floats([(GPU, 0.5), ("CPU", 1.0)]).unwrap();
        let inside =
            cluster.place(&half, &PlacementTarget::Bundle(BundleRef { group, index: 1 })).unwrap();
        let outside = cluster.place(&half, &PlacementTarget::Anywhere).unwrap();
        let pending = PlacementGroupRequest {
            name: "later".into(),
            strategy: Strategy::StrictPack,
            bundles: vec![ResourceSet::from_floats([(GPU, 4.0)]).unwrap()],
        };
        let (waiting, _) = cluster.create_group(pending.clone()).unwrap();

        let mut rebuilt = ClusterState::with_fake_nodes(3, 8, 4);
        let table = cluster.bundle_table(group).cloned();
        rebuilt.restore_group(group, request, table).unwrap();
        rebuilt.restore_group(waiting, pending, None).unwrap();
        rebuilt.restore_allocation(outside.clone()).unwrap();
        rebuilt.restore_allocation(inside.clone()).unwrap();
        assert_eq!(rebuilt, cluster);
        rebuilt.verify_indexes().unwrap();

        // The same allocation twice, or one that no longer fits, is refused and changes nothing.
        let before = rebuilt.clone();
        assert!(rebuilt.restore_allocation(outside.clone()).is_err());
        let mut elsewhere = outside;
        elsewhere.id = crate::cluster::AllocationId(99);
        elsewhere.node = NodeId::new("node-9");
        assert!(rebuilt.restore_allocation(elsewhere).is_err());
        assert_eq!(rebuilt, before);
    }
}
