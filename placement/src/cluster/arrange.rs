//! Choosing nodes for a placement group's bundles under each strategy, making the bundle order
//! stable and grouped by node, and explaining why a group can never fit.
//!
//! Everything here works on scratch copies of the nodes; the caller commits the copy only when
//! every bundle found a place, which is what makes reservation all-or-nothing.

use crate::cluster::Strategy;
use crate::error::Infeasibility;
use crate::gpu::GpuShare;
use crate::node::NodeResources;
use crate::resources::{Quantity, ResourceSet};

/// Where each bundle went: the node's position in the cluster and the GPU shares it holds.
pub(crate) type Arrangement = Vec<(usize, Vec<GpuShare>)>;

/// Places every bundle on a copy of `nodes`, returning the updated copy and each bundle's node
/// and GPU shares, or `None` when the strategy finds no arrangement.
///
/// Identical bundles are then re-ordered so that their nodes follow cluster order with
/// ascending bundle index (bundle order grouped by node), and reserved again in index order so
/// that GPU indices also ascend with the bundle index on each node.
pub(crate) fn arrange(
    nodes: &[NodeResources],
    bundles: &[ResourceSet],
    strategy: Strategy,
) -> Option<(Vec<NodeResources>, Arrangement)> {
    let mut scratch = nodes.to_vec();
    let first = choose(&mut scratch, bundles, strategy)?;
    let chosen: Vec<usize> = first.iter().map(|(node, _)| *node).collect();
    let canonical = group_by_node(bundles, &chosen);
    if canonical == chosen {
        return Some((scratch, first));
    }
    let mut again = nodes.to_vec();
    let mut arrangement = Vec::with_capacity(bundles.len());
    for (bundle, &node) in bundles.iter().zip(&canonical) {
        match again[node].take(bundle) {
            Some(shares) => arrangement.push((node, shares)),
            // The canonical order puts the same multiset of bundles on each node, so this
            // cannot fail; should it, the first arrangement is still a valid one.
            None => return Some((scratch, first)),
        }
    }
    Some((again, arrangement))
}

fn choose(
    scratch: &mut [NodeResources],
    bundles: &[ResourceSet],
    strategy: Strategy,
) -> Option<Arrangement> {
    match strategy {
        Strategy::StrictPack => single_node(scratch, bundles),
        Strategy::Pack => single_node(scratch, bundles).or_else(|| first_fit(scratch, bundles)),
        Strategy::Spread => least_used(scratch, bundles, true),
        Strategy::StrictSpread => least_used(scratch, bundles, false),
    }
}

/// All bundles on the first node (in cluster order) that holds them all.
fn single_node(scratch: &mut [NodeResources], bundles: &[ResourceSet]) -> Option<Arrangement> {
    'nodes: for (position, node) in scratch.iter_mut().enumerate() {
        let mut trial = node.clone();
        let mut arrangement = Vec::with_capacity(bundles.len());
        for bundle in bundles {
            match trial.take(bundle) {
                Some(shares) => arrangement.push((position, shares)),
                None => continue 'nodes,
            }
        }
        *node = trial;
        return Some(arrangement);
    }
    None
}

/// Each bundle on the first node (in cluster order) with room: fills nodes one after another.
fn first_fit(scratch: &mut [NodeResources], bundles: &[ResourceSet]) -> Option<Arrangement> {
    let mut arrangement = Vec::with_capacity(bundles.len());
    for bundle in bundles {
        let placed = scratch
            .iter_mut()
            .enumerate()
            .find_map(|(position, node)| node.take(bundle).map(|shares| (position, shares)))?;
        arrangement.push(placed);
    }
    Some(arrangement)
}

/// Each bundle on the node with room that holds the fewest bundles of this group so far (ties
/// in cluster order); with `reuse` false a node never takes a second bundle.
fn least_used(
    scratch: &mut [NodeResources],
    bundles: &[ResourceSet],
    reuse: bool,
) -> Option<Arrangement> {
    let mut used = vec![0usize; scratch.len()];
    let mut arrangement = Vec::with_capacity(bundles.len());
    for bundle in bundles {
        let position = (0..scratch.len())
            .filter(|&i| (reuse || used[i] == 0) && scratch[i].can_take(bundle))
            .min_by_key(|&i| (used[i], i))?;
        let shares = scratch[position].take(bundle)?;
        used[position] += 1;
        arrangement.push((position, shares));
    }
    Some(arrangement)
}

/// Re-assigns nodes among identical bundles so that, for each kind of bundle, node positions
/// are non-decreasing with the bundle index. Each node keeps the same multiset of bundles.
pub(crate) fn group_by_node(bundles: &[ResourceSet], chosen: &[usize]) -> Vec<usize> {
    let mut kinds: Vec<(&ResourceSet, Vec<usize>)> = Vec::new();
    for (index, bundle) in bundles.iter().enumerate() {
        match kinds.iter_mut().find(|(kind, _)| *kind == bundle) {
            Some((_, members)) => members.push(index),
            None => kinds.push((bundle, vec![index])),
        }
    }
    let mut canonical = chosen.to_vec();
    for (_, members) in kinds {
        let mut positions: Vec<usize> = members.iter().map(|&i| chosen[i]).collect();
        positions.sort_unstable();
        for (member, position) in members.into_iter().zip(positions) {
            canonical[member] = position;
        }
    }
    canonical
}

/// Explains why `bundles` cannot be arranged on `empty` (the cluster with nothing in use),
/// naming the missing resource and amounts where one explains it.
pub(crate) fn diagnose(
    empty: &[NodeResources],
    bundles: &[ResourceSet],
    strategy: Strategy,
) -> Infeasibility {
    let mut needed = ResourceSet::new();
    bundles.iter().for_each(|bundle| needed.add(bundle));
    let mut cluster = ResourceSet::new();
    empty.iter().for_each(|node| cluster.add(node.total()));
    if let Some((resource, needed, available)) = cluster.first_shortfall(&needed) {
        return Infeasibility::ClusterShortfall { resource, needed, available };
    }
    let largest = |resource: &str| {
        empty.iter().map(|node| node.total().get(resource)).max().unwrap_or(Quantity::ZERO)
    };
    for (bundle, demand) in bundles.iter().enumerate() {
        if empty.iter().any(|node| node.can_take(demand)) {
            continue;
        }
        if let Some((resource, amount)) =
            demand.iter().find(|(resource, amount)| *amount > largest(resource))
        {
            return Infeasibility::BundleTooLarge {
                bundle,
                resource: resource.to_owned(),
                needed: amount,
                largest: largest(resource),
            };
        }
        return Infeasibility::BundleFitsNowhere { bundle, demand: demand.clone() };
    }
    match strategy {
        Strategy::StrictPack => {
            if let Some((resource, amount)) =
                needed.iter().find(|(resource, amount)| *amount > largest(resource))
            {
                return Infeasibility::StrictPackTooLarge {
                    resource: resource.to_owned(),
                    needed: amount,
                    largest: largest(resource),
                };
            }
        }
        Strategy::StrictSpread if bundles.len() > empty.len() => {
            return Infeasibility::TooFewNodes { bundles: bundles.len(), nodes: empty.len() };
        }
        _ => {}
    }
    Infeasibility::NoArrangement { strategy }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::NodeId;
    use crate::resources::GPU;

    fn nodes(count: usize, gpus: u32) -> Vec<NodeResources> {
        (0..count)
            .map(|i| NodeResources::with_fake_gpus(NodeId::new(format!("n{i}")), 16, gpus))
            .collect()
    }

    fn gpu_bundles(count: usize, gpu: f64) -> Vec<ResourceSet> {
        vec![ResourceSet::from_floats([(GPU, gpu)]).unwrap(); count]
    }

    #[test]
    fn spread_round_robin_is_regrouped_by_node() {
        let cluster = nodes(2, 8);
        let (_, arrangement) = arrange(&cluster, &gpu_bundles(4, 1.0), Strategy::Spread).unwrap();
        let placed: Vec<(usize, u32)> =
            arrangement.iter().map(|(node, shares)| (*node, shares[0].gpu.index)).collect();
        assert_eq!(placed, [(0, 0), (0, 1), (1, 0), (1, 1)]);
    }

    #[test]
    fn pack_prefers_one_node_then_fills_in_order() {
        let cluster = nodes(3, 8);
        let (_, one) = arrange(&cluster, &gpu_bundles(8, 1.0), Strategy::Pack).unwrap();
        assert!(one.iter().all(|(node, _)| *node == 0));
        let (_, two) = arrange(&cluster, &gpu_bundles(12, 1.0), Strategy::Pack).unwrap();
        let on_first = two.iter().filter(|(node, _)| *node == 0).count();
        assert_eq!(on_first, 8);
        assert!(arrange(&cluster, &gpu_bundles(12, 1.0), Strategy::StrictPack).is_none());
    }

    #[test]
    fn diagnosis_names_the_missing_resource() {
        let cluster = nodes(1, 4);
        let reason = diagnose(&cluster, &gpu_bundles(8, 1.0), Strategy::Pack);
        assert_eq!(reason.to_string(), "needs GPU: 8, cluster has 4");
        let two = nodes(2, 4);
        let reason = diagnose(&two, &gpu_bundles(1, 6.0), Strategy::Pack);
        assert_eq!(reason.to_string(), "bundle 0 needs GPU: 6 on one node, the largest node has 4");
        let reason = diagnose(&two, &gpu_bundles(6, 1.0), Strategy::StrictPack);
        assert_eq!(
            reason.to_string(),
            "needs GPU: 6 on one node (STRICT_PACK), the largest node has 4"
        );
        let reason = diagnose(&two, &gpu_bundles(3, 1.0), Strategy::StrictSpread);
        assert_eq!(reason.to_string(), "needs 3 distinct nodes (STRICT_SPREAD), cluster has 2");
    }
}
