//! The seeded generator (the RLHF crates' one SplitMix64, `rtrun_rlhf_rng`) for everything the
//! trainer randomises: dataset draws, shuffles and per-step sampling seeds. Its whole state is
//! one `u64`, so checkpoints record it exactly and a resumed run draws the same numbers.

pub use rtrun_rlhf_rng::SplitMix64;

/// Mixes two numbers into a seed (for per-step, per-prompt seeds derived from the run's seed).
pub fn mix_seed(a: u64, b: u64) -> u64 {
    SplitMix64::new(a ^ b.wrapping_mul(0xD6E8_FEB8_6659_FD93)).next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_bounds_hold() {
        let mut a = SplitMix64::new(3);
        let mut b = SplitMix64::new(3);
        for _ in 0..100 {
            let x = a.below(7);
            assert_eq!(x, b.below(7));
            assert!(x < 7);
        }
        assert_eq!(SplitMix64::new(1).below(0), 0);
        assert_ne!(mix_seed(1, 2), mix_seed(2, 1));
    }
}
