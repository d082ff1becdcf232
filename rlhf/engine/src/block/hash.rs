//! The chained hash that identifies a full KV block by its whole prefix.
//!
//! Written out (rather than `std::hash::DefaultHasher`) so that its value is fixed across Rust
//! releases and processes: hashes may be logged and compared between engine replicas.

use crate::rng::mix64;
use serde::{Deserialize, Serialize};

/// Hash of a full block and, through its parent, of every token before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockHash(pub u64);

/// Seed of the chain for the first block of a sequence.
const ROOT: u64 = 0x6A09_E667_F3BC_C908;

/// `hash(parent, tokens)`: the identity of a block whose prefix hashes to `parent`.
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = mix64(parent.map_or(ROOT, |p| p.0 ^ ROOT.rotate_left(17)));
    h = mix64(h ^ tokens.len() as u64);
    for &token in tokens {
        h = mix64(h.rotate_left(23) ^ u64::from(token));
    }
    BlockHash(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_parent_tokens_and_order() {
        let a = hash_block(None, &[1, 2, 3]);
        assert_eq!(a, hash_block(None, &[1, 2, 3]));
        assert_ne!(a, hash_block(None, &[3, 2, 1]));
        assert_ne!(a, hash_block(Some(BlockHash(0)), &[1, 2, 3]));
        assert_ne!(hash_block(Some(a), &[4]), hash_block(None, &[4]));
    }
}
