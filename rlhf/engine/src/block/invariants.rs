//! The block manager's bookkeeping invariants, checked from scratch (slow; tests and debug).

use super::{BlockError, BlockId, BlockManager};
use std::collections::HashMap;

/// Checks: reference counts equal the number of table entries; free and used blocks partition
/// the pool; a block appears in two tables only as a full prefix block of both; each table
/// covers exactly its slots; cache entries point at blocks that carry the same hash.
pub(super) fn check(manager: &BlockManager) -> Result<(), BlockError> {
    let fail = |message: String| Err(BlockError::InvariantViolated(message));
    let block_size = manager.config.block_size;
    let mut references: HashMap<BlockId, u32> = HashMap::new();
    for (sequence, table) in &manager.tables {
        if table.blocks.len() != table.num_slots.div_ceil(block_size) {
            return fail(format!(
                "{sequence} covers {} slots with {} blocks, expected {}",
                table.num_slots,
                table.blocks.len(),
                table.num_slots.div_ceil(block_size)
            ));
        }
        if table.num_full_prefix_blocks * block_size > table.num_slots {
            return fail(format!("{sequence} has more full blocks than slots"));
        }
        for &block in &table.blocks {
            *references.entry(block).or_default() += 1;
        }
    }
    for (sequence, table) in &manager.tables {
        for (index, block) in table.blocks.iter().enumerate() {
            if references[block] > 1 && index >= table.num_full_prefix_blocks {
                return fail(format!(
                    "{sequence} shares {block:?} at index {index}, which is not a full prefix block"
                ));
            }
        }
    }
    let mut free_seen = vec![false; manager.blocks.len()];
    for &block in manager.free_uncached.iter().chain(manager.evictable.values()) {
        let seen = &mut free_seen[block.0 as usize];
        if *seen {
            return fail(format!("{block:?} is listed free twice"));
        }
        *seen = true;
    }
    for (index, state) in manager.blocks.iter().enumerate() {
        let block = BlockId(index as u32);
        let expected = references.get(&block).copied().unwrap_or(0);
        if state.ref_count != expected {
            return fail(format!(
                "{block:?} has ref_count {}, expected {expected}",
                state.ref_count
            ));
        }
        if (state.ref_count == 0) != free_seen[index] {
            return fail(format!(
                "{block:?} with ref_count {} is free: {}",
                state.ref_count, free_seen[index]
            ));
        }
        if state.lru_tick.is_some() != (state.ref_count == 0 && state.cached.is_some()) {
            return fail(format!(
                "{block:?} is evictable: {}, expected iff free and cached",
                state.lru_tick.is_some()
            ));
        }
    }
    let used = manager.blocks.iter().filter(|s| s.ref_count > 0).count();
    if used + manager.num_free_blocks() != manager.blocks.len() {
        return fail(format!(
            "used {used} + free {} != total {}",
            manager.num_free_blocks(),
            manager.blocks.len()
        ));
    }
    for (hash, block) in &manager.cache {
        let carried = manager.blocks[block.0 as usize].cached.as_ref().map(|c| c.hash);
        if carried != Some(*hash) {
            return fail(format!("cache maps {hash:?} to {block:?}, which carries {carried:?}"));
        }
    }
    let hashed = manager.blocks.iter().filter(|s| s.cached.is_some()).count();
    if hashed != manager.cache.len() {
        return fail(format!(
            "{hashed} blocks carry a hash but the cache has {} entries",
            manager.cache.len()
        ));
    }
    Ok(())
}
