//! Property tests of the cluster state machine: random clusters and random sequences of group
//! creation and removal, placement and release. After every step the books must balance
//! exactly (never oversubscribed, fractional shares summing exactly), group creation must be
//! all-or-nothing, strict strategies honoured, bundle order stable and grouped by node, and
//! undoing an operation must restore the exact prior state.

use std::collections::BTreeMap;

use proptest::prelude::*;
use rtrun_placement::{
    BundleRef, BundleTable, ClusterState, GPU, GroupId, GroupStatus, NodeId, NodeResources,
    PlacementGroupRequest, PlacementTarget, Quantity, ResourceSet, Strategy as PgStrategy,
};

#[derive(Clone, Debug)]
enum Op {
    Create { bundles: Vec<ResourceSet>, strategy: PgStrategy },
    Remove(usize),
    PlaceAnywhere(ResourceSet),
    PlaceInBundle { group: usize, bundle: usize, demand: ResourceSet },
    Release(usize),
    SchedulePending,
    RemoveNode(usize),
}

fn gpu_amount() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(0.1),
        Just(0.2),
        Just(0.25),
        Just(0.5),
        Just(0.7),
        Just(1.0),
        Just(2.0)
    ]
}

fn demand() -> impl Strategy<Value = ResourceSet> {
    (gpu_amount(), 0u32..4, prop::bool::ANY).prop_map(|(gpu, cpu, custom)| {
        let mut set = ResourceSet::from_floats([(GPU, gpu), ("CPU", f64::from(cpu))]).unwrap();
        if custom {
            set.set("custom", Quantity::from_f64(0.001).unwrap());
        }
        if set.is_empty() {
            set.set("CPU", Quantity::from_f64(0.5).unwrap());
        }
        set
    })
}

fn strategy() -> impl Strategy<Value = PgStrategy> {
    prop_oneof![
        Just(PgStrategy::Pack),
        Just(PgStrategy::Spread),
        Just(PgStrategy::StrictPack),
        Just(PgStrategy::StrictSpread)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::collection::vec(demand(), 1..6), strategy())
            .prop_map(|(bundles, strategy)| Op::Create { bundles, strategy }),
        // Many identical bundles: the RLHF shape, and the one bundle order matters most for.
        2 => (demand(), 1usize..10, strategy())
            .prop_map(|(bundle, n, strategy)| Op::Create { bundles: vec![bundle; n], strategy }),
        1 => (0usize..8).prop_map(Op::Remove),
        2 => demand().prop_map(Op::PlaceAnywhere),
        3 => (0usize..8, 0usize..10, demand())
            .prop_map(|(group, bundle, demand)| Op::PlaceInBundle { group, bundle, demand }),
        2 => (0usize..16).prop_map(Op::Release),
        1 => Just(Op::SchedulePending),
        1 => (0usize..4).prop_map(Op::RemoveNode),
    ]
}

fn cluster() -> impl Strategy<Value = ClusterState> {
    prop::collection::vec((0u64..12, 0u32..9, prop::bool::ANY), 1..5).prop_map(|nodes| {
        let mut cluster = ClusterState::new();
        for (i, (cpus, gpus, custom)) in nodes.into_iter().enumerate() {
            let id = NodeId::new(format!("n{i}"));
            let mut node = NodeResources::with_fake_gpus(id.clone(), cpus, gpus);
            if custom {
                let mut resources = node.total().clone();
                resources.set("custom", Quantity::whole(1));
                let gpus = node.gpus().slots().iter().map(|s| s.gpu.clone()).collect();
                node = NodeResources::new(id, resources, gpus).unwrap();
            }
            cluster.add_node(node).unwrap();
        }
        cluster
    })
}

/// The books balance exactly: per node, per GPU and per bundle.
fn check_books(cluster: &ClusterState) -> Result<(), TestCaseError> {
    if let Err(e) = cluster.verify_indexes() {
        prop_assert!(false, "{}", e);
    }
    let tables: Vec<BundleTable> = cluster
        .groups()
        .filter(|(_, _, status)| *status == GroupStatus::Placed)
        .filter_map(|(id, _, _)| cluster.bundle_table(id).cloned())
        .collect();
    for node in cluster.nodes() {
        // total == available + bundles reserved here + allocations outside bundles here.
        let mut used = node.available().clone();
        let mut per_gpu: BTreeMap<String, Quantity> = BTreeMap::new();
        for slot in node.gpus().slots() {
            prop_assert!(slot.free <= slot.capacity);
            per_gpu.insert(slot.gpu.uuid.clone(), slot.free);
        }
        for bundle in tables.iter().flat_map(|t| &t.bundles).filter(|b| &b.node == node.id()) {
            used.add(&bundle.resources);
            for share in &bundle.gpus {
                let sum = per_gpu.get_mut(&share.gpu.uuid).unwrap();
                *sum = sum.checked_add(share.share).unwrap();
            }
        }
        for allocation in cluster.allocations().filter(|a| a.bundle.is_none()) {
            if &allocation.node == node.id() {
                used.add(&allocation.resources);
                for share in &allocation.gpus {
                    let sum = per_gpu.get_mut(&share.gpu.uuid).unwrap();
                    *sum = sum.checked_add(share.share).unwrap();
                }
            }
        }
        prop_assert_eq!(&used, node.total(), "node {} books", node.id());
        for (uuid, sum) in per_gpu {
            prop_assert_eq!(sum, Quantity::whole(1), "GPU {} shares", uuid);
        }
        prop_assert_eq!(node.gpus().free_total(), node.available().get(GPU));
    }
    // Inside each bundle: allocations never exceed its resources or its GPU shares.
    for table in &tables {
        for bundle in &table.bundles {
            let here = BundleRef { group: table.group, index: bundle.index };
            let mut used = ResourceSet::new();
            let mut per_gpu: BTreeMap<String, Quantity> = BTreeMap::new();
            for allocation in cluster.allocations().filter(|a| a.bundle == Some(here)) {
                prop_assert_eq!(&allocation.node, &bundle.node);
                used.add(&allocation.resources);
                for share in &allocation.gpus {
                    let sum = per_gpu.entry(share.gpu.uuid.clone()).or_default();
                    *sum = sum.checked_add(share.share).unwrap();
                }
            }
            prop_assert!(bundle.resources.contains(&used), "bundle over-committed");
            for (uuid, sum) in per_gpu {
                let reserved = bundle.gpus.iter().find(|s| s.gpu.uuid == uuid).map(|s| s.share);
                prop_assert!(reserved.is_some_and(|r| sum <= r), "GPU {} over bundle share", uuid);
            }
        }
    }
    Ok(())
}

/// Strictness, stable order grouped by node, and GPU amounts matching the request.
fn check_table(
    cluster: &ClusterState,
    request: &PlacementGroupRequest,
    table: &BundleTable,
) -> Result<(), TestCaseError> {
    let position = |node: &NodeId| cluster.nodes().iter().position(|n| n.id() == node).unwrap();
    prop_assert_eq!(table.bundles.len(), request.bundles.len());
    let nodes: Vec<usize> = table.bundles.iter().map(|b| position(&b.node)).collect();
    match request.strategy {
        PgStrategy::StrictPack => prop_assert!(nodes.iter().all(|n| *n == nodes[0])),
        PgStrategy::StrictSpread => {
            let mut distinct = nodes.clone();
            distinct.sort_unstable();
            distinct.dedup();
            prop_assert_eq!(distinct.len(), nodes.len());
        }
        PgStrategy::Pack | PgStrategy::Spread => {}
    }
    for (index, bundle) in table.bundles.iter().enumerate() {
        prop_assert_eq!(bundle.index, index);
        prop_assert_eq!(&bundle.resources, &request.bundles[index]);
        let shares =
            bundle.gpus.iter().fold(Quantity::ZERO, |s, g| s.checked_add(g.share).unwrap());
        prop_assert_eq!(shares, request.bundles[index].get(GPU));
    }
    // Identical bundles: node order non-decreasing with the index, and on one node whole-GPU
    // bundles take ascending GPU indices.
    for (i, a) in table.bundles.iter().enumerate() {
        for b in &table.bundles[i + 1..] {
            if a.resources != b.resources {
                continue;
            }
            prop_assert!(position(&a.node) <= position(&b.node), "bundle order not grouped");
            if a.node == b.node && a.resources.get(GPU).is_whole() && !a.gpus.is_empty() {
                prop_assert!(a.gpu_indices() < b.gpu_indices(), "GPU order not ascending");
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_operations_keep_every_invariant(
        mut cluster in cluster(),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let mut groups: Vec<GroupId> = Vec::new();
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Create { bundles, strategy } => {
                    let request =
                        PlacementGroupRequest { name: format!("g{step}"), strategy, bundles };
                    let before = cluster.clone();
                    match cluster.create_group(request.clone()) {
                        Ok((id, GroupStatus::Placed)) => {
                            groups.push(id);
                            let table = cluster.bundle_table(id).unwrap().clone();
                            check_table(&cluster, &request, &table)?;
                            // Removing it at once restores the exact prior nodes.
                            let mut undo = cluster.clone();
                            undo.remove_group(id).unwrap();
                            prop_assert_eq!(undo.nodes(), before.nodes());
                        }
                        Ok((id, GroupStatus::Pending)) => {
                            groups.push(id);
                            prop_assert_eq!(cluster.nodes(), before.nodes(), "pending kept");
                        }
                        Err(_) => prop_assert_eq!(&cluster, &before, "failed create kept"),
                    }
                }
                Op::Remove(i) => {
                    if !groups.is_empty() {
                        let id = groups.remove(i % groups.len());
                        let removed = cluster.remove_group(id).unwrap();
                        for allocation in removed.released {
                            prop_assert!(cluster.allocation(allocation.id).is_none());
                        }
                    }
                }
                Op::PlaceAnywhere(demand) => {
                    let before = cluster.clone();
                    match cluster.place(&demand, &PlacementTarget::Anywhere) {
                        Ok(allocation) => {
                            let mut undo = cluster.clone();
                            undo.release(allocation.id).unwrap();
                            prop_assert_eq!(undo.nodes(), before.nodes());
                        }
                        Err(_) => prop_assert_eq!(&cluster, &before),
                    }
                }
                Op::PlaceInBundle { group, bundle, demand } => {
                    if groups.is_empty() {
                        continue;
                    }
                    let id = groups[group % groups.len()];
                    let target = PlacementTarget::Bundle(BundleRef { group: id, index: bundle });
                    let before = cluster.clone();
                    if cluster.place(&demand, &target).is_err() {
                        prop_assert_eq!(&cluster, &before);
                    }
                }
                Op::Release(i) => {
                    let ids: Vec<_> = cluster.allocations().map(|a| a.id).collect();
                    if !ids.is_empty() {
                        cluster.release(ids[i % ids.len()]).unwrap();
                    }
                }
                Op::RemoveNode(i) => {
                    if cluster.nodes().len() > 1 {
                        let id = cluster.nodes()[i % cluster.nodes().len()].id().clone();
                        let lost = cluster.remove_node(&id).unwrap();
                        for allocation in &lost.lost_allocations {
                            prop_assert!(cluster.allocation(allocation.id).is_none());
                        }
                        for group in lost.requeued_groups {
                            prop_assert_eq!(cluster.group_status(group), Some(GroupStatus::Pending));
                        }
                        prop_assert!(cluster.allocations().all(|a| a.node != id));
                    }
                }
                Op::SchedulePending => {
                    for id in cluster.schedule_pending() {
                        let request = cluster
                            .groups()
                            .find(|(g, _, _)| *g == id)
                            .map(|(_, r, _)| r.clone())
                            .unwrap();
                        let table = cluster.bundle_table(id).unwrap().clone();
                        check_table(&cluster, &request, &table)?;
                    }
                }
            }
            check_books(&cluster)?;
        }
        // Tearing everything down returns every node to empty.
        let ids: Vec<_> = cluster.allocations().filter(|a| a.bundle.is_none()).map(|a| a.id).collect();
        for id in ids {
            cluster.release(id).unwrap();
        }
        for id in groups {
            cluster.remove_group(id).unwrap();
        }
        for node in cluster.nodes() {
            prop_assert_eq!(node.available(), node.total());
        }
        prop_assert_eq!(cluster.allocations().count(), 0);
    }

    #[test]
    fn fractional_shares_in_a_bundle_sum_exactly(
        shares in prop::collection::vec(prop_oneof![Just(0.1), Just(0.2), Just(0.25), Just(0.3)], 1..20),
    ) {
        let mut cluster = ClusterState::with_fake_nodes(1, 8, 1);
        let bundle = ResourceSet::from_floats([(GPU, 1.0)]).unwrap();
        let request = PlacementGroupRequest { name: "g".into(), strategy: PgStrategy::Pack, bundles: vec![bundle] };
        let (id, _) = cluster.create_group(request).unwrap();
        let target = PlacementTarget::Bundle(BundleRef { group: id, index: 0 });
        let mut given = Quantity::ZERO;
        for share in shares {
            let demand = ResourceSet::from_floats([(GPU, share)]).unwrap();
            let fits = given.checked_add(demand.get(GPU)).unwrap() <= Quantity::whole(1);
            match cluster.place(&demand, &target) {
                Ok(allocation) => {
                    prop_assert!(fits);
                    prop_assert_eq!(allocation.cuda_visible_devices(), "0");
                    given = given.checked_add(allocation.gpus[0].share).unwrap();
                }
                Err(_) => prop_assert!(!fits),
            }
        }
        prop_assert!(given <= Quantity::whole(1));
    }

    #[test]
    fn infeasible_is_only_reported_when_an_empty_cluster_cannot_fit(
        cluster in cluster(),
        bundles in prop::collection::vec(demand(), 1..8),
        strategy in strategy(),
    ) {
        let request = PlacementGroupRequest { name: "g".into(), strategy, bundles };
        let mut fresh = cluster.clone();
        let result = fresh.create_group(request);
        // The generated cluster is empty, so a placeable group is placed, never pending.
        if let Ok((_, status)) = result {
            prop_assert_eq!(status, GroupStatus::Placed);
        } else if let Err(err) = result {
            prop_assert!(err.to_string().starts_with("placement group `g` "), "{}", err);
            prop_assert_eq!(&fresh, &cluster);
        }
    }
}
