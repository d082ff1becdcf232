//! Finding the first node, in cluster order, that can take a demand without looking at every
//! node: a max segment tree over the nodes' CPU and GPU amounts. A subtree whose largest CPU or
//! GPU amount is below the demand's holds no candidate and is skipped; a node the bounds admit
//! is then checked exactly (other resources, the GPU arrangement) by the caller. The result is
//! the same node a scan in cluster order finds, at O(log n) per skipped range instead of O(n):
//! at 10,000 nodes a full cluster costs a placement a few dozen steps, not 10,000.
//!
//! Leaves hold each amount plus one, so a leaf of zeros — past the last node, or a node that
//! left (a tombstone until the state compacts) — admits nothing, not even a demand of zero,
//! and a node leaving changes one leaf and its ancestors.

use crate::node::NodeResources;
use crate::resources::{CPU, GPU, ResourceSet};

/// Which amounts of a node the index keys on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Amounts {
    /// What is free now.
    Available,
    /// Everything the node has (for "could it ever fit").
    Total,
}

/// The index; leaves past the last node, and those of nodes that left, hold nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FitIndex {
    amounts: Amounts,
    /// Nodes indexed.
    len: usize,
    /// Leaves (a power of two, at least 1).
    width: usize,
    /// `[cpu, gpu]` maxima; node `i` of the tree has children `2i` and `2i + 1`, the root is
    /// 1 and leaf `p` is `width + p`.
    max: Vec<[u64; 2]>,
}

impl FitIndex {
    /// An index over `nodes`, but those `gone` says left.
    pub(crate) fn new(amounts: Amounts, nodes: &[NodeResources], gone: &[bool]) -> FitIndex {
        let width = nodes.len().next_power_of_two().max(1);
        let mut index = FitIndex { amounts, len: nodes.len(), width, max: vec![[0, 0]; 2 * width] };
        for (position, node) in nodes.iter().enumerate() {
            if !gone.get(position).copied().unwrap_or(false) {
                index.max[width + position] = index.key(node);
            }
        }
        for i in (1..width).rev() {
            index.max[i] = combine(index.max[2 * i], index.max[2 * i + 1]);
        }
        index
    }

    fn key(&self, node: &NodeResources) -> [u64; 2] {
        let set = match self.amounts {
            Amounts::Available => node.available(),
            Amounts::Total => node.total(),
        };
        leaf_of(set)
    }

    /// Node `position`'s amounts changed (or it is the node just appended).
    pub(crate) fn update(&mut self, position: usize, node: &NodeResources) {
        if position >= self.width {
            // Appending past the leaves: grow by rebuilding at twice the width (amortised O(1)).
            let mut grown = FitIndex::new(self.amounts, &[], &[]);
            grown.width = (position + 1).next_power_of_two();
            grown.max = vec![[0, 0]; 2 * grown.width];
            grown.max[grown.width..grown.width + self.len]
                .copy_from_slice(&self.max[self.width..self.width + self.len]);
            grown.len = self.len;
            for i in (1..grown.width).rev() {
                grown.max[i] = combine(grown.max[2 * i], grown.max[2 * i + 1]);
            }
            *self = grown;
        }
        self.len = self.len.max(position + 1);
        let mut i = self.width + position;
        self.max[i] = self.key(node);
        while i > 1 {
            i /= 2;
            self.max[i] = combine(self.max[2 * i], self.max[2 * i + 1]);
        }
    }

    /// Whether this index holds what an index built from `nodes` (but those `gone`) would: the
    /// same amounts per node, and every maximum the maximum of its children (the width may
    /// differ: an index keeps its width when the state compacts).
    pub(crate) fn agrees_with(&self, nodes: &[NodeResources], gone: &[bool]) -> bool {
        let built = FitIndex::new(self.amounts, nodes, gone);
        self.len == built.len
            && self.max[self.width..self.width + self.len]
                == built.max[built.width..built.width + built.len]
            && self.max[self.width + self.len..].iter().all(|leaf| *leaf == [0, 0])
            && (1..self.width).all(|i| self.max[i] == combine(self.max[2 * i], self.max[2 * i + 1]))
    }

    /// Node `position` left: its leaf admits nothing any more (the positions of the others
    /// stay). O(log n).
    pub(crate) fn clear(&mut self, position: usize) {
        if position >= self.len {
            return;
        }
        let mut i = self.width + position;
        self.max[i] = [0, 0];
        while i > 1 {
            i /= 2;
            self.max[i] = combine(self.max[2 * i], self.max[2 * i + 1]);
        }
    }

    /// The first position, in cluster order, whose amounts admit `demand` and that `accept`s
    /// (the caller's exact check).
    pub(crate) fn first(
        &self,
        demand: &ResourceSet,
        mut accept: impl FnMut(usize) -> bool,
    ) -> Option<usize> {
        let need = key_of(demand);
        // Leaves hold amounts plus one (see the module's documentation).
        let need = [need[0].saturating_add(1), need[1].saturating_add(1)];
        let admits = |i: usize| self.max[i][0] >= need[0] && self.max[i][1] >= need[1];
        // Depth-first, left child first: positions come out in cluster order.
        let mut stack = vec![1usize];
        while let Some(i) = stack.pop() {
            if !admits(i) {
                continue;
            }
            if i >= self.width {
                let position = i - self.width;
                if position < self.len && accept(position) {
                    return Some(position);
                }
                continue;
            }
            stack.push(2 * i + 1);
            stack.push(2 * i);
        }
        None
    }
}

fn key_of(set: &ResourceSet) -> [u64; 2] {
    [set.get(CPU).raw(), set.get(GPU).raw()]
}

/// A node's leaf: its amounts plus one (zeros are "no node").
fn leaf_of(set: &ResourceSet) -> [u64; 2] {
    let [cpu, gpu] = key_of(set);
    [cpu.saturating_add(1), gpu.saturating_add(1)]
}

fn combine(a: [u64; 2], b: [u64; 2]) -> [u64; 2] {
    [a[0].max(b[0]), a[1].max(b[1])]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::NodeId;

    fn node(name: &str, cpus: u64, gpus: u32) -> NodeResources {
        NodeResources::with_fake_gpus(NodeId::new(name), cpus, gpus)
    }

    fn demand(cpus: f64, gpus: f64) -> ResourceSet {
        ResourceSet::from_floats([(CPU, cpus), (GPU, gpus)]).unwrap()
    }

    /// The index finds what a scan in cluster order finds, for every demand, as nodes are
    /// appended one at a time (through the growth path) and their amounts change.
    #[test]
    fn finds_the_first_node_a_scan_finds() {
        let mut nodes: Vec<NodeResources> = Vec::new();
        let mut index = FitIndex::new(Amounts::Available, &nodes, &[]);
        for i in 0..37u64 {
            nodes.push(node(&format!("n{i}"), (i * 7) % 11, ((i * 5) % 9) as u32));
            index.update(nodes.len() - 1, &nodes[nodes.len() - 1]);
        }
        // Take some of a few nodes so that availability differs from totals.
        for p in [3usize, 10, 20, 36] {
            nodes[p].take(&demand(1.0, 1.0));
            index.update(p, &nodes[p]);
        }
        assert!(index.agrees_with(&nodes, &[]), "updates = a rebuild");
        for cpus in 0..12 {
            for gpus in 0..10 {
                let d = demand(f64::from(cpus), f64::from(gpus));
                let scan = nodes.iter().position(|n| n.can_take(&d));
                assert_eq!(index.first(&d, |p| nodes[p].can_take(&d)), scan, "{d}");
            }
        }
        // A caller's refusal moves the search on to the next admitted node.
        let d = demand(1.0, 0.0);
        let second = index.first(&d, |p| p > 1 && nodes[p].can_take(&d));
        assert_eq!(second, nodes.iter().enumerate().position(|(p, n)| p > 1 && n.can_take(&d)));
        // Nodes that leave keep their places and are never found, not even for nothing.
        let mut gone = vec![false; nodes.len()];
        for p in [36usize, 0, 17] {
            gone[p] = true;
            index.clear(p);
            assert!(index.agrees_with(&nodes, &gone), "after removing {p}");
        }
        for cpus in 0..12 {
            let d = demand(f64::from(cpus), 0.0);
            let scan = (0..nodes.len()).find(|p| !gone[*p] && nodes[*p].can_take(&d));
            assert_eq!(index.first(&d, |p| nodes[p].can_take(&d)), scan, "{d}");
        }
        let total = FitIndex::new(Amounts::Total, &nodes, &gone);
        let d = demand(10.0, 8.0);
        let scan = (0..nodes.len()).find(|p| !gone[*p] && nodes[*p].total().contains(&d));
        assert!(scan.is_some());
        assert_eq!(total.first(&d, |_| true), scan);
        let nothing = demand(0.0, 0.0);
        assert_eq!(FitIndex::new(Amounts::Total, &[], &[]).first(&nothing, |_| true), None);
        let only_gone = FitIndex::new(Amounts::Total, &nodes[..1], &[true]);
        assert_eq!(only_gone.first(&nothing, |_| true), None);
    }
}
