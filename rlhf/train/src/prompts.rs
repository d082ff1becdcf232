//! What a run trains on, whatever its source: prompt records and the seeded, resumable order
//! the trainer draws them in.

use serde::{Deserialize, Serialize};

use crate::rng::SplitMix64;

/// A prompt and the exact answer a rule checks against.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptRecord {
    /// The prompt text (without `<bos>`).
    pub prompt: String,
    /// The expected answer text (without `<eos>`).
    pub label: String,
    /// The record's `data_source` (verl's column), which `reward.by_source` routes to a reward
    /// function; empty when the record has none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub data_source: String,
}

/// An epoch-wise, seeded shuffle over a dataset, with a position that checkpoints record
/// (OpenRLHF resumes from `consumed_samples`; here the position says the same thing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptLoader {
    /// Dataset size.
    pub len: usize,
    /// Shuffle seed.
    pub seed: u64,
    /// Samples consumed so far, across epochs.
    pub consumed: usize,
}

impl PromptLoader {
    /// A loader at the start of the data.
    pub fn new(len: usize, seed: u64) -> Self {
        Self { len, seed, consumed: 0 }
    }

    /// The order of epoch `epoch`: a Fisher-Yates shuffle seeded by `(seed, epoch)`.
    fn order(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        let mut rng = SplitMix64::new(self.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9));
        for i in (1..order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
        order
    }

    /// The next `count` dataset indices, wrapping into the next epoch when one runs out.
    pub fn next_batch(&mut self, count: usize) -> Vec<usize> {
        if self.len == 0 {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(count);
        let mut epoch = self.consumed / self.len;
        let mut order = self.order(epoch);
        while out.len() < count {
            let e = self.consumed / self.len;
            if e != epoch {
                epoch = e;
                order = self.order(epoch);
            }
            out.push(order[self.consumed % self.len]);
            self.consumed += 1;
        }
        out
    }

    /// The epoch the next sample comes from.
    pub fn epoch(&self) -> usize {
        self.consumed.checked_div(self.len).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loader_covers_each_epoch_once_and_resumes_identically() {
        let mut loader = PromptLoader::new(10, 5);
        let first: Vec<usize> = loader.next_batch(10);
        let mut sorted = first.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_eq!(loader.epoch(), 1);
        let mut resumed = PromptLoader { consumed: 4, ..PromptLoader::new(10, 5) };
        let mut straight = PromptLoader::new(10, 5);
        straight.next_batch(4);
        assert_eq!(resumed.next_batch(13), straight.next_batch(13));
        assert_ne!(
            PromptLoader::new(10, 5).next_batch(10),
            PromptLoader::new(10, 6).next_batch(10)
        );
    }
}
