//! Choosing nodes for a placement group's bundles under each strategy, making the bundle order
//! stable and grouped by node, and explaining why a group can never fit.
//!
//! Everything here works on scratch copies of the nodes; the caller commits the copy only when
//! every bundle found a place, which is what makes reservation all-or-nothing.

use std::collections::BTreeMap;

use crate::cluster::Strategy;
use crate::cluster::fit::FitIndex;
use crate::error::Infeasibility;
use crate::gpu::GpuShare;
use crate::node::NodeResources;
use crate::resources::{Quantity, ResourceSet};

/// Where each bundle went: the node's position in the cluster and the GPU shares it holds.
pub(crate) type Arrangement = Vec<(usize, Vec<GpuShare>)>;

/// The nodes an arrangement changed, by position, as it left them.
pub(crate) type Changed = BTreeMap<usize, NodeResources>;

/// The cluster as an arrangement in progress sees it: the nodes, with the ones it took from
/// copied on first use (copy-on-write: a group of 32 bundles copies at most 32 of 10,000 nodes),
/// and an index to find candidates without scanning. With `empty`, every node is seen with
/// nothing in use (and `fit` must index totals): "could this group ever fit".
pub(crate) struct Scratch<'a> {
    nodes: &'a [NodeResources],
    fit: &'a FitIndex,
    empty: bool,
    changed: Changed,
}

impl<'a> Scratch<'a> {
    pub(crate) fn new(nodes: &'a [NodeResources], fit: &'a FitIndex, empty: bool) -> Scratch<'a> {
        Scratch { nodes, fit, empty, changed: BTreeMap::new() }
    }

    /// Node `position` as this arrangement sees it, copied.
    fn current(&self, position: usize) -> NodeResources {
        match self.changed.get(&position) {
            Some(node) => node.clone(),
            None if self.empty => self.nodes[position].emptied(),
            None => self.nodes[position].clone(),
        }
    }

    fn can_take(&self, position: usize, demand: &ResourceSet) -> bool {
        match self.changed.get(&position) {
            Some(node) => node.can_take(demand),
            None if self.empty => self.nodes[position].emptied().can_take(demand),
            None => self.nodes[position].can_take(demand),
        }
    }

    fn take(&mut self, position: usize, demand: &ResourceSet) -> Option<Vec<GpuShare>> {
        if !self.changed.contains_key(&position) {
            let node = self.current(position);
            self.changed.insert(position, node);
        }
        self.changed.get_mut(&position)?.take(demand)
    }

    /// The first node in cluster order that can take `demand` and that `also` allows. The
    /// index holds amounts before this arrangement took anything, an upper bound of what the
    /// copies hold, so it never skips a node that could take the demand.
    fn first(&self, demand: &ResourceSet, also: impl Fn(usize) -> bool) -> Option<usize> {
        self.fit.first(demand, |position| also(position) && self.can_take(position, demand))
    }
}

/// Places every bundle on `scratch`, returning the nodes it changed and each bundle's node and
/// GPU shares, or `None` when the strategy finds no arrangement.
///
/// Identical bundles are then re-ordered so that their nodes follow cluster order with
/// ascending bundle index (bundle order grouped by node), and reserved again in index order so
/// that GPU indices also ascend with the bundle index on each node.
pub(crate) fn arrange(
    nodes: &[NodeResources],
    fit: &FitIndex,
    empty: bool,
    bundles: &[ResourceSet],
    strategy: Strategy,
) -> Option<(Changed, Arrangement)> {
    let mut scratch = Scratch::new(nodes, fit, empty);
    let first = choose(&mut scratch, bundles, strategy)?;
    let chosen: Vec<usize> = first.iter().map(|(node, _)| *node).collect();
    let canonical = group_by_node(bundles, &chosen);
    if canonical == chosen {
        return Some((scratch.changed, first));
    }
    let mut again = Scratch::new(nodes, fit, empty);
    let mut arrangement = Vec::with_capacity(bundles.len());
    for (bundle, &node) in bundles.iter().zip(&canonical) {
        match again.take(node, bundle) {
            Some(shares) => arrangement.push((node, shares)),
            // The canonical order puts the same multiset of bundles on each node, so this
            // cannot fail; should it, the first arrangement is still a valid one.
            None => return Some((scratch.changed, first)),
        }
    }
    Some((again.changed, arrangement))
}

fn choose(
    scratch: &mut Scratch<'_>,
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
fn single_node(scratch: &mut Scratch<'_>, bundles: &[ResourceSet]) -> Option<Arrangement> {
    // A node that holds every bundle has at least their sum free: the index prunes by it.
    let mut sum = ResourceSet::new();
    bundles.iter().for_each(|bundle| sum.add(bundle));
    let mut found = None;
    let position = scratch.fit.first(&sum, |position| {
        let mut trial = scratch.current(position);
        let mut arrangement = Vec::with_capacity(bundles.len());
        for bundle in bundles {
            match trial.take(bundle) {
                Some(shares) => arrangement.push((position, shares)),
                None => return false,
            }
        }
        found = Some((trial, arrangement));
        true
    })?;
    let (trial, arrangement) = found?;
    scratch.changed.insert(position, trial);
    Some(arrangement)
}

/// Each bundle on the first node (in cluster order) with room: fills nodes one after another.
fn first_fit(scratch: &mut Scratch<'_>, bundles: &[ResourceSet]) -> Option<Arrangement> {
    let mut arrangement = Vec::with_capacity(bundles.len());
    for bundle in bundles {
        let position = scratch.first(bundle, |_| true)?;
        let shares = scratch.take(position, bundle)?;
        arrangement.push((position, shares));
    }
    Some(arrangement)
}

/// Each bundle on the node with room that holds the fewest bundles of this group so far (ties
/// in cluster order); with `reuse` false a node never takes a second bundle.
fn least_used(
    scratch: &mut Scratch<'_>,
    bundles: &[ResourceSet],
    reuse: bool,
) -> Option<Arrangement> {
    let mut used: BTreeMap<usize, usize> = BTreeMap::new();
    let mut arrangement = Vec::with_capacity(bundles.len());
    for bundle in bundles {
        // A node this group has not used yet beats every used one; among those, the first.
        let position = match scratch.first(bundle, |position| !used.contains_key(&position)) {
            Some(position) => position,
            None if reuse => used
                .iter()
                .filter(|(position, _)| scratch.can_take(**position, bundle))
                .min_by_key(|(position, count)| (**count, **position))
                .map(|(position, _)| *position)?,
            None => return None,
        };
        let shares = scratch.take(position, bundle)?;
        *used.entry(position).or_default() += 1;
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

    fn arrange(
        nodes: &[NodeResources],
        bundles: &[ResourceSet],
        strategy: Strategy,
    ) -> Option<(Changed, Arrangement)> {
        let fit = FitIndex::new(crate::cluster::fit::Amounts::Available, nodes, &[]);
        super::arrange(nodes, &fit, false, bundles, strategy)
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
