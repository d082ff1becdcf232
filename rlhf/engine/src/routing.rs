//! Routing of finished outputs back to the trainer rank that submitted each request.
//!
//! Several trainer ranks call `add_requests(actor_rank, prompts, params)` on one engine; the
//! engine runs all their prompts in one continuous batch and must hand each rank exactly its own
//! outputs, in the order it submitted the prompts. [`RequestRouter`] is that bookkeeping, generic
//! over the output type so that it does not care what a finished request carries.

use crate::RequestId;
use std::collections::{BTreeMap, HashMap};
use thiserror::Error;

/// Errors of the router.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RoutingError {
    /// An output arrived for a request the router never issued, or one already completed.
    #[error("expected an outstanding request id, found {0}")]
    UnknownRequest(RequestId),
}

/// Submission bookkeeping of one rank.
#[derive(Debug)]
struct RankQueue<T> {
    next_position: u64,
    outstanding: usize,
    /// Finished outputs by submission position, so they come back in submission order.
    finished: BTreeMap<u64, (RequestId, T)>,
}

impl<T> Default for RankQueue<T> {
    fn default() -> Self {
        Self { next_position: 0, outstanding: 0, finished: BTreeMap::new() }
    }
}

/// Issues request ids per submitting rank and collects finished outputs per rank.
#[derive(Debug)]
pub struct RequestRouter<T> {
    next_id: u64,
    owners: HashMap<RequestId, (u32, u64)>,
    ranks: BTreeMap<u32, RankQueue<T>>,
}

impl<T> Default for RequestRouter<T> {
    fn default() -> Self {
        Self { next_id: 0, owners: HashMap::new(), ranks: BTreeMap::new() }
    }
}

impl<T> RequestRouter<T> {
    /// An empty router.
    pub fn new() -> Self {
        Self::default()
    }

    /// Issues `count` fresh request ids owned by `rank`, in submission order.
    pub fn register(&mut self, rank: u32, count: usize) -> Vec<RequestId> {
        let queue = self.ranks.entry(rank).or_default();
        let mut ids = Vec::with_capacity(count);
        for _ in 0..count {
            let id = RequestId(self.next_id);
            self.next_id += 1;
            self.owners.insert(id, (rank, queue.next_position));
            queue.next_position += 1;
            queue.outstanding += 1;
            ids.push(id);
        }
        ids
    }

    /// Records the output of a finished request and returns the rank it belongs to.
    pub fn complete(&mut self, id: RequestId, output: T) -> Result<u32, RoutingError> {
        let (rank, position) = self.owners.remove(&id).ok_or(RoutingError::UnknownRequest(id))?;
        // Invariant: `register` creates the rank's queue before issuing any of its ids.
        let queue = self.ranks.entry(rank).or_default();
        queue.outstanding -= 1;
        queue.finished.insert(position, (id, output));
        Ok(rank)
    }

    /// Requests of `rank` still running.
    pub fn outstanding(&self, rank: u32) -> usize {
        self.ranks.get(&rank).map_or(0, |q| q.outstanding)
    }

    /// Takes the finished outputs of `rank` so far, in submission order (for streaming).
    pub fn take_finished(&mut self, rank: u32) -> Vec<(RequestId, T)> {
        self.ranks
            .get_mut(&rank)
            .map(|q| std::mem::take(&mut q.finished).into_values().collect())
            .unwrap_or_default()
    }

    /// Takes all outputs of `rank` once none of its requests is outstanding; `None` before.
    pub fn take_if_complete(&mut self, rank: u32) -> Option<Vec<(RequestId, T)>> {
        if self.ranks.get(&rank)?.outstanding > 0 {
            return None;
        }
        Some(self.take_finished(rank))
    }

    /// Ranks with outputs waiting to be taken.
    pub fn ranks_with_outputs(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranks.iter().filter(|(_, q)| !q.finished.is_empty()).map(|(&rank, _)| rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn outputs_go_back_to_their_rank_in_submission_order() {
        let mut router = RequestRouter::new();
        let a = router.register(0, 3);
        let b = router.register(1, 2);
        assert_eq!(router.complete(a[2], "a2"), Ok(0));
        assert_eq!(router.complete(b[0], "b0"), Ok(1));
        assert_eq!(router.take_if_complete(0), None);
        assert_eq!(router.complete(a[0], "a0"), Ok(0));
        assert_eq!(router.complete(a[1], "a1"), Ok(0));
        assert_eq!(router.complete(a[1], "again"), Err(RoutingError::UnknownRequest(a[1])));
        let outputs: Vec<_> =
            router.take_if_complete(0).unwrap().into_iter().map(|(_, o)| o).collect();
        assert_eq!(outputs, ["a0", "a1", "a2"]);
        assert_eq!(router.outstanding(1), 1);
        assert_eq!(router.ranks_with_outputs().collect::<Vec<_>>(), [1]);
        assert_eq!(router.take_finished(1), vec![(b[0], "b0")]);
        assert_eq!(router.take_if_complete(7), None);
    }

    proptest! {
        #[test]
        fn every_output_reaches_its_rank_once(submissions in prop::collection::vec((0u32..4, 1usize..5), 1..10), seed in any::<u64>()) {
            let mut router = RequestRouter::new();
            let mut issued = Vec::new();
            for (rank, count) in submissions {
                for id in router.register(rank, count) {
                    issued.push((id, rank));
                }
            }
            let mut rng = crate::rng::SplitMix64::new(seed);
            for i in (1..issued.len()).rev() {
                issued.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            for &(id, rank) in &issued {
                prop_assert_eq!(router.complete(id, (id, rank)), Ok(rank));
            }
            for rank in 0..4 {
                let outputs = router.take_if_complete(rank).unwrap_or_default();
                let ids: Vec<RequestId> = outputs.iter().map(|(id, _)| *id).collect();
                prop_assert!(ids.windows(2).all(|w| w[0] < w[1]));
                prop_assert!(outputs.iter().all(|(_, (_, r))| *r == rank));
                prop_assert_eq!(outputs.len(), issued.iter().filter(|(_, r)| *r == rank).count());
            }
        }
    }
}
