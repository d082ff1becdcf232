//! Unit and property tests of the block manager.

use super::*;
use crate::RequestId;
use proptest::prelude::*;

fn seq(request: u64) -> SequenceId {
    SequenceId { request: RequestId(request), sample_index: 0 }
}

fn manager(num_blocks: usize, block_size: usize) -> BlockManager {
    BlockManager::new(BlockManagerConfig { num_blocks, block_size, enable_prefix_caching: true })
        .unwrap()
}

/// Allocates `tokens` and marks them all computed, as a finished prefill would.
fn prefill(m: &mut BlockManager, s: SequenceId, tokens: &[u32]) -> usize {
    let cached = m.allocate(s, tokens).unwrap();
    m.cache_full_blocks(s, tokens, tokens.len()).unwrap();
    m.check_invariants().unwrap();
    cached
}

#[test]
fn invalid_configs_are_rejected() {
    let config = |num_blocks, block_size| BlockManagerConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: true,
    };
    assert!(BlockManager::new(config(0, 16)).is_err());
    assert!(BlockManager::new(config(4, 0)).is_err());
}

#[test]
fn tables_cover_their_tokens_and_free_returns_blocks() {
    let mut m = manager(8, 4);
    assert_eq!(prefill(&mut m, seq(1), &[1, 2, 3, 4, 5]), 0);
    assert_eq!(m.block_table(seq(1)).unwrap().len(), 2);
    m.append_slots(seq(1), 3).unwrap();
    assert_eq!(m.block_table(seq(1)).unwrap().len(), 2);
    m.append_slots(seq(1), 1).unwrap();
    assert_eq!(m.block_table(seq(1)).unwrap().len(), 3);
    assert_eq!(m.stats().used_blocks, 3);
    m.free(seq(1)).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.num_free_blocks(), 8);
    assert_eq!(m.free(seq(1)), Err(BlockError::UnknownSequence(seq(1))));
    assert_eq!(m.allocate(seq(2), &[0; 4]).unwrap(), 0);
    assert_eq!(m.allocate(seq(2), &[0; 4]), Err(BlockError::AlreadyAllocated(seq(2))));
}

#[test]
fn full_prefix_blocks_are_shared_and_the_last_token_is_never_cached() {
    let mut m = manager(16, 4);
    let prompt: Vec<u32> = (0..10).collect();
    prefill(&mut m, seq(1), &prompt);
    assert_eq!(prefill(&mut m, seq(2), &prompt), 8);
    let (a, b) = (m.block_table(seq(1)).unwrap().to_vec(), m.block_table(seq(2)).unwrap().to_vec());
    assert_eq!(a[..2], b[..2]);
    assert_ne!(a[2], b[2]);
    // A block-aligned prompt leaves its last block to be computed.
    let aligned: Vec<u32> = (0..8).collect();
    assert_eq!(prefill(&mut m, seq(3), &aligned), 4);
    // A diverging second block shares only the first.
    let diverging: Vec<u32> = vec![0, 1, 2, 3, 9, 9, 9, 9, 9];
    assert_eq!(prefill(&mut m, seq(4), &diverging), 4);
    let stats = m.stats();
    assert_eq!(stats.prefix_queried_blocks, 2 + 2 + 1 + 2);
    assert_eq!(stats.prefix_hit_blocks, 2 + 1 + 1);
}

#[test]
fn freed_cached_blocks_are_revived_and_evicted_least_recent_first() {
    let mut m = manager(4, 2);
    prefill(&mut m, seq(1), &[1, 1, 2, 2, 3]);
    m.free(seq(1)).unwrap();
    assert_eq!(m.stats().cached_free_blocks, 2);
    assert_eq!(m.blocks_needed_to_allocate(&[1, 1, 2, 2, 3]), 3);
    assert_eq!(prefill(&mut m, seq(2), &[1, 1, 2, 2, 3]), 4);
    m.free(seq(2)).unwrap();
    // Freed tail first: block [2, 2] is less recent than [1, 1] and goes first.
    prefill(&mut m, seq(3), &[7, 7, 8]);
    assert_eq!(m.stats().evictions, 0);
    m.append_slots(seq(3), 2).unwrap();
    assert_eq!(m.stats().evictions, 1);
    // Reviving the surviving head block costs a free block too.
    assert_eq!(
        m.allocate(seq(4), &[1, 1, 2, 2, 3]),
        Err(BlockError::OutOfBlocks { needed: 3, free: 1 })
    );
    assert_eq!(m.blocks_needed_to_allocate(&[1, 1, 5]), 2);
    m.free(seq(3)).unwrap();
    assert_eq!(prefill(&mut m, seq(4), &[1, 1, 5]), 2);
}

#[test]
fn out_of_blocks_changes_nothing() {
    let mut m = manager(2, 2);
    prefill(&mut m, seq(1), &[1, 2, 3]);
    let before = m.stats();
    assert_eq!(m.append_slots(seq(1), 2), Err(BlockError::OutOfBlocks { needed: 1, free: 0 }));
    assert_eq!(m.stats(), before);
    assert_eq!(m.num_slots(seq(1)), Some(3));
    m.check_invariants().unwrap();
}

#[test]
fn reset_prefix_cache_drops_free_and_detaches_in_use_hashes() {
    let mut m = manager(12, 2);
    prefill(&mut m, seq(1), &[1, 1, 2, 2, 3]);
    prefill(&mut m, seq(2), &[4, 4, 5]);
    m.free(seq(2)).unwrap();
    let reset = m.reset_prefix_cache();
    m.check_invariants().unwrap();
    assert_eq!(reset, PrefixCacheReset { dropped_free_blocks: 1, detached_in_use_blocks: 2 });
    assert_eq!(prefill(&mut m, seq(3), &[1, 1, 2, 2, 3]), 0);
    assert_eq!(prefill(&mut m, seq(4), &[4, 4, 5]), 0);
    // The pre-reset sequence no longer registers blocks; the new ones do.
    m.append_slots(seq(1), 1).unwrap();
    m.cache_full_blocks(seq(1), &[1, 1, 2, 2, 3, 3], 6).unwrap();
    assert_eq!(prefill(&mut m, seq(5), &[1, 1, 2, 2, 3, 3, 0]), 4);
    assert_eq!(m.stats().prefix_cache_resets, 1);
}

#[test]
fn disabled_prefix_caching_never_shares() {
    let mut m = BlockManager::new(BlockManagerConfig {
        num_blocks: 8,
        block_size: 2,
        enable_prefix_caching: false,
    })
    .unwrap();
    prefill(&mut m, seq(1), &[1, 1, 2]);
    assert_eq!(prefill(&mut m, seq(2), &[1, 1, 2]), 0);
    assert_eq!(m.stats().prefix_queried_blocks, 0);
}

#[derive(Debug, Clone)]
enum Op {
    Allocate { sequence: u64, prefix: usize, extra: Vec<u32> },
    Append { sequence: u64, slots: usize },
    Free { sequence: u64 },
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..6, 0usize..4, prop::collection::vec(0u32..3, 0..6))
            .prop_map(|(sequence, prefix, extra)| Op::Allocate { sequence, prefix, extra }),
        4 => (0u64..6, 1usize..5).prop_map(|(sequence, slots)| Op::Append { sequence, slots }),
        2 => (0u64..6).prop_map(|sequence| Op::Free { sequence }),
        1 => Just(Op::Reset),
    ]
}

proptest! {
    /// Random allocate / append / free / reset workloads keep every invariant, and a failed
    /// operation changes nothing.
    #[test]
    fn random_workloads_keep_invariants(ops in prop::collection::vec(op(), 1..80), block_size in 1usize..4) {
        let mut m = manager(12, block_size);
        // Shared prefixes come from one base token list so that hits are frequent.
        let base: Vec<u32> = (0..12).map(|i| i % 5).collect();
        let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
        for op in ops {
            match op {
                Op::Allocate { sequence, prefix, extra } => {
                    let mut t = base[..prefix * block_size.min(3)].to_vec();
                    t.extend(extra);
                    t.push(7);
                    let before = m.num_free_blocks();
                    let needed = m.blocks_needed_to_allocate(&t);
                    match m.allocate(seq(sequence), &t) {
                        Ok(cached) => {
                            prop_assert!(cached < t.len() && cached % block_size == 0);
                            prop_assert_eq!(m.num_free_blocks(), before - needed);
                            m.cache_full_blocks(seq(sequence), &t, t.len()).unwrap();
                            tokens.insert(sequence, t);
                        }
                        Err(BlockError::AlreadyAllocated(_)) => prop_assert!(tokens.contains_key(&sequence)),
                        Err(BlockError::OutOfBlocks { .. }) => prop_assert_eq!(m.num_free_blocks(), before),
                        Err(other) => prop_assert!(false, "unexpected {other}"),
                    }
                }
                Op::Append { sequence, slots } => {
                    let before = m.stats();
                    match m.append_slots(seq(sequence), slots) {
                        Ok(()) => {
                            let t = tokens.get_mut(&sequence).unwrap();
                            t.extend(std::iter::repeat_n(sequence as u32, slots));
                            m.cache_full_blocks(seq(sequence), t, t.len()).unwrap();
                        }
                        Err(BlockError::UnknownSequence(_)) => prop_assert!(!tokens.contains_key(&sequence)),
                        Err(BlockError::OutOfBlocks { .. }) => prop_assert_eq!(m.stats(), before),
                        Err(other) => prop_assert!(false, "unexpected {other}"),
                    }
                }
                Op::Free { sequence } => {
                    prop_assert_eq!(m.free(seq(sequence)).is_ok(), tokens.remove(&sequence).is_some());
                }
                Op::Reset => {
                    m.reset_prefix_cache();
                }
            }
            if let Err(violation) = m.check_invariants() {
                prop_assert!(false, "{violation}");
            }
            for (sequence, t) in &tokens {
                prop_assert_eq!(m.num_slots(seq(*sequence)), Some(t.len()));
            }
        }
    }
}
