//! Nodes leaving the cluster: what dies with a node and which groups must be placed again.

use crate::cluster::{Allocation, ClusterState, GroupId, GroupRecord, GroupSlot};
use crate::error::PlacementError;
use crate::node::{NodeId, NodeResources};

/// What the cluster lost with a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostNode {
    /// The node as it was when it left.
    pub node: NodeResources,
    /// Allocations that are gone: those that ran on the node, and every allocation of a group
    /// that had a bundle there (a group with a lost rank is restarted as a whole). The runtime
    /// stops those that still run elsewhere and reports the rest as dead.
    pub lost_allocations: Vec<Allocation>,
    /// Groups that had a bundle on the node, now pending again with the same ids; the runtime
    /// calls [`ClusterState::schedule_pending`] to place them anew.
    pub requeued_groups: Vec<GroupId>,
}

impl ClusterState {
    /// Removes a node that left or died.
    pub fn remove_node(&mut self, id: &NodeId) -> Result<LostNode, PlacementError> {
        if self.node(id).is_none() {
            return Err(PlacementError::UnknownNode(id.clone()));
        }
        let affected: Vec<GroupId> =
            self.groups_on.get(id).map(|set| set.iter().copied().collect()).unwrap_or_default();
        let mut lost_allocations = Vec::new();
        for group in &affected {
            let Some(request) = self.groups.get(group).map(|record| record.request.clone()) else {
                continue;
            };
            let removed = self.remove_group(*group)?;
            lost_allocations.extend(removed.released);
            self.insert_group(*group, GroupRecord { request, slot: GroupSlot::Pending });
        }
        let direct = self.direct_on.remove(id).unwrap_or_default();
        lost_allocations.extend(direct.iter().filter_map(|a| self.allocations.remove(a)));
        self.groups_on.remove(id);
        // Invariant: the node was found at the top and nothing above removes nodes.
        let position = self.node_position(id).ok_or_else(|| {
            PlacementError::Accounting(format!("node `{id}` vanished while being removed"))
        })?;
        let node = self.nodes.remove(position);
        self.order.remove(position);
        self.serials.remove(id);
        self.free.remove(position);
        self.whole.remove(position);
        Ok(LostNode { node, lost_allocations, requeued_groups: affected })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{
        BundleRef, GroupStatus, PlacementGroupRequest, PlacementTarget, Strategy,
    };
    use crate::resources::{GPU, ResourceSet};

    #[test]
    fn a_lost_node_requeues_its_groups_and_kills_their_actors() {
        let mut cluster = ClusterState::with_fake_nodes(3, 16, 8);
        let bundle = ResourceSet::from_floats([(GPU, 1.0)]).unwrap();
        let request = PlacementGroupRequest {
            name: "train".into(),
            strategy: Strategy::StrictSpread,
            bundles: vec![bundle.clone(); 2],
        };
        let (group, _) = cluster.create_group(request).unwrap();
        let fifth = ResourceSet::from_floats([(GPU, 0.2)]).unwrap();
        for index in 0..2 {
            let target = PlacementTarget::Bundle(BundleRef { group, index });
            cluster.place(&fifth, &target).unwrap();
        }
        let bystander = cluster.place(&bundle, &PlacementTarget::Anywhere).unwrap();
        assert_eq!(bystander.node.as_str(), "node-0");

        let lost = cluster.remove_node(&NodeId::new("node-1")).unwrap();
        assert_eq!(lost.requeued_groups, [group]);
        assert_eq!(lost.lost_allocations.len(), 2);
        assert_eq!(cluster.group_status(group), Some(GroupStatus::Pending));
        assert!(cluster.allocation(bystander.id).is_some());
        assert_eq!(cluster.schedule_pending(), [group]);
        let nodes: Vec<&str> =
            cluster.bundle_table(group).unwrap().bundles.iter().map(|b| b.node.as_str()).collect();
        assert_eq!(nodes, ["node-0", "node-2"]);

        let lost = cluster.remove_node(&NodeId::new("node-0")).unwrap();
        assert_eq!(lost.lost_allocations.len(), 1, "the bystander dies with its node");
        assert_eq!(cluster.group_status(group), Some(GroupStatus::Pending));
        assert!(cluster.schedule_pending().is_empty(), "one node cannot hold STRICT_SPREAD 2");
        assert!(cluster.remove_node(&NodeId::new("node-0")).is_err());
    }
}
