//! A tiny deterministic generator (SplitMix64) for group sampling.
//!
//! The dock must sample the same groups for the same seed on every machine and every run (a
//! resumed run continues identically), so it carries its own generator instead of depending on
//! `rand`, whose stream is not promised to stay stable across versions.

use serde::{Deserialize, Serialize};

/// SplitMix64 (Steele, Lea and Flood, 2014): one 64-bit word of state, full period, good enough
/// statistical quality for picking which ready prompt groups a consumer receives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose stream is fully determined by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0..bound`, without modulo bias (Lemire's multiply-and-reject).
    /// Returns 0 when `bound` is 0 so that callers never divide by zero.
    pub fn below(&mut self, bound: usize) -> usize {
        if bound == 0 {
            return 0;
        }
        let bound = bound as u64;
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(bound);
            if (product as u64) >= threshold {
                // The high half of a 64x64 product is below `bound`, which came from a usize.
                return (product >> 64) as usize;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn same_seed_same_stream() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(SplitMix64::new(7).next_u64(), SplitMix64::new(8).next_u64());
    }

    #[test]
    fn below_zero_is_zero() {
        assert_eq!(SplitMix64::new(1).below(0), 0);
    }

    #[test]
    fn below_covers_small_range() {
        let mut rng = SplitMix64::new(3);
        let mut seen = [false; 5];
        for _ in 0..200 {
            seen[rng.below(5)] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }

    proptest! {
        #[test]
        fn below_stays_in_range(seed: u64, bound in 1usize..10_000) {
            let mut rng = SplitMix64::new(seed);
            for _ in 0..16 {
                prop_assert!(rng.below(bound) < bound);
            }
        }
    }
}
