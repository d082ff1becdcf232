//! Nodes leaving the cluster: what dies with a node and which groups must be placed again.

use crate::cluster::fit::{Amounts, FitIndex};
use crate::cluster::{Allocation, ClusterState, GroupId, GroupRecord, GroupSlot};

/// Tombstones kept before the state compacts (and only once they outnumber the live nodes).
const COMPACT_AFTER: usize = 32;
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
        // Its place stays (a tombstone), so no other node moves: O(log n), not a shift of every
        // later node and a rebuild of the first-fit indexes (which made a death at 10,000 nodes
        // cost 3× one at 2,000).
        let node = self.nodes[position].clone();
        self.gone[position] = true;
        self.gone_count += 1;
        self.serials.remove(id);
        self.free.clear(position);
        self.whole.clear(position);
        if self.gone_count > COMPACT_AFTER && 2 * self.gone_count > self.nodes.len() {
            self.compact();
        }
        Ok(LostNode { node, lost_allocations, requeued_groups: affected })
    }

    /// Drops the places of the nodes that left (once they outnumber the live ones: amortised
    /// O(1) per departure) and rebuilds the first-fit indexes.
    fn compact(&mut self) {
        let gone = std::mem::take(&mut self.gone);
        let mut keep = gone.iter().map(|g| !*g);
        self.nodes.retain(|_| keep.next().unwrap_or(true));
        let mut keep = gone.iter().map(|g| !*g);
        self.order.retain(|_| keep.next().unwrap_or(true));
        self.gone = vec![false; self.nodes.len()];
        self.gone_count = 0;
        self.free = FitIndex::new(Amounts::Available, &self.nodes, &self.gone);
        self.whole = FitIndex::new(Amounts::Total, &self.nodes, &self.gone);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{
        BundleRef, GroupStatus, PlacementGroupRequest, PlacementTarget, Strategy,
    };
    use crate::resources::{GPU, ResourceSet};

    /// Nodes that leave keep their places until they outnumber the live ones; placement never
    /// picks one (not even for a demand of nothing), finds the first live node in cluster order,
    /// and the indexes agree with a rebuild before and after the state compacts.
    #[test]
    fn departed_nodes_are_never_picked_and_compaction_keeps_the_order() {
        let mut cluster = ClusterState::with_fake_nodes(100, 2, 0);
        let cpu = ResourceSet::from_floats([("CPU", 1.0)]).unwrap();
        let nothing = ResourceSet::new();
        for i in 0..80 {
            cluster.remove_node(&NodeId::new(format!("node-{i}"))).unwrap();
            cluster.verify_indexes().unwrap();
            let live: Vec<String> = cluster.live_nodes().map(|n| n.id().to_string()).collect();
            assert_eq!(live.len(), 99 - i);
            assert_eq!(live[0], format!("node-{}", i + 1));
            for demand in [&cpu, &nothing] {
                let mut probe = cluster.clone();
                let placed = probe.place(demand, &PlacementTarget::Anywhere).unwrap();
                assert_eq!(placed.node.as_str(), live[0], "after {i} left");
            }
            if i == 40 {
                assert!(cluster.gone_count > 0, "tombstones before compacting");
            }
        }
        // It compacted once the 51st left (51 of 100 places): 49 places, then 29 more left.
        assert_eq!((cluster.nodes.len(), cluster.gone_count), (49, 29));
        let err = cluster.remove_node(&NodeId::new("node-3")).unwrap_err();
        assert!(matches!(err, PlacementError::UnknownNode(_)), "{err}");
    }

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
