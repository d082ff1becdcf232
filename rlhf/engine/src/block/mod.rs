//! The paged-KV block manager: a fixed pool of KV blocks of `block_size` token slots, one block
//! table per sequence, and prefix caching.
//!
//! Prefix caching: a *full* block is identified by a chained hash of (parent block's hash, the
//! token ids in the block), so equal hashes mean equal prefixes up to and including the block
//! (the block's own tokens are also stored and compared on a hit, so a 64-bit collision on the
//! last link cannot share wrong K/V). Full blocks are immutable — a sequence only ever writes
//! into its last, partial block — so they can be shared by reference count without
//! copy-on-write. A block whose count drops to zero keeps its hash and joins an LRU list of
//! evictable blocks: a later hit revives it, and a request for a fresh block takes a never-cached
//! block first, then evicts the least recently freed cached one.
//!
//! A block's hash is registered only once its K/V is (or, within the current step, will be)
//! computed: the scheduler calls [`BlockManager::cache_full_blocks`] with the number of tokens
//! whose K/V exists by the end of the step. Registering at allocation time would let another
//! sequence skip computing K/V that nobody has written yet.
//!
//! Everything here is pure bookkeeping on block ids; the engine owns the K/V tensors they index.

mod hash;

pub use hash::{BlockHash, hash_block};

use crate::SequenceId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use thiserror::Error;

/// Index of a KV block in the engine's cache tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockId(pub u32);

/// Sizing of the block pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BlockManagerConfig {
    /// Number of KV blocks (the engine derives it from the memory it may use). Default 1024.
    pub num_blocks: usize,
    /// Token slots per block. Default 16 (vLLM's default).
    pub block_size: usize,
    /// Whether full blocks are hashed and shared between sequences. Default true.
    pub enable_prefix_caching: bool,
}

impl Default for BlockManagerConfig {
    fn default() -> Self {
        Self { num_blocks: 1024, block_size: 16, enable_prefix_caching: true }
    }
}

/// Errors of the block manager.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum BlockError {
    /// The configuration cannot describe a pool.
    #[error("invalid block manager config: {0}")]
    InvalidConfig(String),
    /// `allocate` was called for a sequence that already holds blocks.
    #[error("{0} already has a block table")]
    AlreadyAllocated(SequenceId),
    /// The sequence holds no blocks.
    #[error("{0} has no block table")]
    UnknownSequence(SequenceId),
    /// Not enough free blocks; nothing was changed.
    #[error("need {needed} free kv blocks, found {free}")]
    OutOfBlocks {
        /// Blocks the operation needed from the free pool.
        needed: usize,
        /// Blocks that were free (including evictable cached ones).
        free: usize,
    },
    /// A bookkeeping invariant does not hold (a bug, reported by `check_invariants`).
    #[error("block manager invariant violated: {0}")]
    InvariantViolated(String),
}

/// A snapshot of the pool and the prefix cache.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockManagerStats {
    /// Total blocks in the pool.
    pub num_blocks: usize,
    /// Blocks referenced by at least one sequence.
    pub used_blocks: usize,
    /// Blocks available for new allocations (never-cached plus evictable cached ones).
    pub free_blocks: usize,
    /// Free blocks that still hold a cached prefix.
    pub cached_free_blocks: usize,
    /// `used_blocks / num_blocks`.
    pub usage: f64,
    /// Full prompt blocks looked up in the prefix cache.
    pub prefix_queried_blocks: u64,
    /// Lookups that hit.
    pub prefix_hit_blocks: u64,
    /// `prefix_hit_blocks / prefix_queried_blocks` (0 before any query).
    pub prefix_hit_rate: f64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
    /// Calls to `reset_prefix_cache`.
    pub prefix_cache_resets: u64,
}

/// What [`BlockManager::reset_prefix_cache`] dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixCacheReset {
    /// Cached free blocks whose hash was dropped (they became plain free blocks).
    pub dropped_free_blocks: usize,
    /// Blocks still referenced by sequences whose hash was dropped; they stay with their
    /// sequences but can never be hit again and are not re-registered.
    pub detached_in_use_blocks: usize,
}

/// The cache identity of a full block.
#[derive(Debug, Clone)]
struct CachedContent {
    hash: BlockHash,
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
}

#[derive(Debug, Clone, Default)]
struct BlockState {
    ref_count: u32,
    cached: Option<CachedContent>,
    /// Position in the evictable LRU list while free and cached.
    lru_tick: Option<u64>,
}

/// The blocks of one sequence.
#[derive(Debug, Clone)]
struct SequenceBlocks {
    blocks: Vec<BlockId>,
    /// Token slots covered; `blocks.len() == num_slots.div_ceil(block_size)`.
    num_slots: usize,
    /// Leading blocks that are full and immutable (prefix hits or registered by this sequence).
    num_full_prefix_blocks: usize,
    /// Hash of the last of those blocks, the parent of the next one.
    last_hash: Option<BlockHash>,
    /// Cache generation at allocation; a reset makes the sequence stop registering blocks.
    epoch: u64,
}

/// The block pool, the block tables and the prefix cache.
#[derive(Debug, Clone)]
pub struct BlockManager {
    config: BlockManagerConfig,
    blocks: Vec<BlockState>,
    /// Never-cached free blocks, taken from the end.
    free_uncached: Vec<BlockId>,
    /// Free cached blocks by the tick at which they were freed (smallest = least recent).
    evictable: BTreeMap<u64, BlockId>,
    next_tick: u64,
    cache: HashMap<BlockHash, BlockId>,
    tables: HashMap<SequenceId, SequenceBlocks>,
    epoch: u64,
    queried_blocks: u64,
    hit_blocks: u64,
    evictions: u64,
    resets: u64,
}

impl BlockManager {
    /// An empty pool of `config.num_blocks` blocks.
    pub fn new(config: BlockManagerConfig) -> Result<Self, BlockError> {
        if config.block_size == 0 {
            return Err(BlockError::InvalidConfig("block_size must be at least 1, found 0".into()));
        }
        if config.num_blocks == 0 || u32::try_from(config.num_blocks).is_err() {
            return Err(BlockError::InvalidConfig(format!(
                "num_blocks must be in 1..={}, found {}",
                u32::MAX,
                config.num_blocks
            )));
        }
        // Reverse so that `pop` hands out block 0 first: easier to read in traces.
        let free_uncached = (0..config.num_blocks as u32).rev().map(BlockId).collect();
        Ok(Self {
            blocks: vec![BlockState::default(); config.num_blocks],
            free_uncached,
            evictable: BTreeMap::new(),
            next_tick: 0,
            cache: HashMap::new(),
            tables: HashMap::new(),
            epoch: 0,
            queried_blocks: 0,
            hit_blocks: 0,
            evictions: 0,
            resets: 0,
            config,
        })
    }

    /// The configuration the pool was built with.
    pub fn config(&self) -> &BlockManagerConfig {
        &self.config
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Total blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.config.num_blocks
    }

    /// Blocks available to allocations (never-cached plus evictable cached ones).
    pub fn num_free_blocks(&self) -> usize {
        self.free_uncached.len() + self.evictable.len()
    }

    /// Blocks needed to hold `num_tokens` token slots.
    pub fn blocks_for_tokens(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.config.block_size)
    }

    /// The block table of a sequence, if it holds blocks.
    pub fn block_table(&self, sequence: SequenceId) -> Option<&[BlockId]> {
        self.tables.get(&sequence).map(|t| t.blocks.as_slice())
    }

    /// Token slots covered by a sequence's table, if it holds blocks.
    pub fn num_slots(&self, sequence: SequenceId) -> Option<usize> {
        self.tables.get(&sequence).map(|t| t.num_slots)
    }

    /// Blocks that [`BlockManager::allocate`] of `tokens` would take from the free pool now:
    /// prefix hits on blocks in use cost nothing, hits on evictable blocks and misses cost one.
    pub fn blocks_needed_to_allocate(&self, tokens: &[u32]) -> usize {
        let hits = self.lookup_prefix(tokens);
        let revived =
            hits.iter().filter(|&&(b, _)| self.blocks[b.0 as usize].ref_count == 0).count();
        self.blocks_for_tokens(tokens.len()) - hits.len() + revived
    }

    /// Gives `sequence` a table covering `tokens`, reusing cached full prefix blocks, and returns
    /// how many leading tokens already have K/V (a multiple of the block size, always less than
    /// `tokens.len()` so that the last token is computed and yields logits).
    pub fn allocate(&mut self, sequence: SequenceId, tokens: &[u32]) -> Result<usize, BlockError> {
        if self.tables.contains_key(&sequence) {
            return Err(BlockError::AlreadyAllocated(sequence));
        }
        let needed = self.blocks_needed_to_allocate(tokens);
        let free = self.num_free_blocks();
        if needed > free {
            return Err(BlockError::OutOfBlocks { needed, free });
        }
        let hits = self.lookup_prefix(tokens);
        if self.config.enable_prefix_caching {
            self.queried_blocks += self.cacheable_prefix_blocks(tokens.len()) as u64;
            self.hit_blocks += hits.len() as u64;
        }
        let mut blocks = Vec::with_capacity(self.blocks_for_tokens(tokens.len()));
        // Take the hits first so that evictions for the fresh blocks cannot evict them.
        for &(block, _) in &hits {
            self.acquire(block);
            blocks.push(block);
        }
        while blocks.len() < self.blocks_for_tokens(tokens.len()) {
            blocks.push(self.take_fresh_block());
        }
        let num_cached_tokens = hits.len() * self.config.block_size;
        self.tables.insert(
            sequence,
            SequenceBlocks {
                blocks,
                num_slots: tokens.len(),
                num_full_prefix_blocks: hits.len(),
                last_hash: hits.last().map(|&(_, h)| h),
                epoch: self.epoch,
            },
        );
        Ok(num_cached_tokens)
    }

    /// Blocks that appending `num_new_slots` slots to `sequence` would take from the free pool.
    pub fn blocks_needed_to_append(
        &self,
        sequence: SequenceId,
        num_new_slots: usize,
    ) -> Result<usize, BlockError> {
        let table = self.tables.get(&sequence).ok_or(BlockError::UnknownSequence(sequence))?;
        Ok(self.blocks_for_tokens(table.num_slots + num_new_slots) - table.blocks.len())
    }

    /// Extends the table of `sequence` by `num_new_slots` token slots (fresh blocks as needed).
    /// On [`BlockError::OutOfBlocks`] nothing changes.
    pub fn append_slots(
        &mut self,
        sequence: SequenceId,
        num_new_slots: usize,
    ) -> Result<(), BlockError> {
        let needed = self.blocks_needed_to_append(sequence, num_new_slots)?;
        let free = self.num_free_blocks();
        if needed > free {
            return Err(BlockError::OutOfBlocks { needed, free });
        }
        let fresh: Vec<BlockId> = (0..needed).map(|_| self.take_fresh_block()).collect();
        let table = self.tables.get_mut(&sequence).ok_or(BlockError::UnknownSequence(sequence))?;
        table.blocks.extend(fresh);
        table.num_slots += num_new_slots;
        Ok(())
    }

    /// Registers in the prefix cache the full blocks of `sequence` whose K/V exists by the end
    /// of the current step: those within the first `num_computed_tokens` of `tokens` (the
    /// sequence's whole token list). Blocks already registered are skipped; a block whose hash
    /// another block already holds stays private. No-op when caching is off or after a reset.
    pub fn cache_full_blocks(
        &mut self,
        sequence: SequenceId,
        tokens: &[u32],
        num_computed_tokens: usize,
    ) -> Result<(), BlockError> {
        let block_size = self.config.block_size;
        let table = self.tables.get_mut(&sequence).ok_or(BlockError::UnknownSequence(sequence))?;
        if !self.config.enable_prefix_caching || table.epoch != self.epoch {
            return Ok(());
        }
        let full = num_computed_tokens.min(tokens.len()).min(table.num_slots) / block_size;
        for index in table.num_full_prefix_blocks..full {
            let block_tokens = &tokens[index * block_size..(index + 1) * block_size];
            let parent = table.last_hash;
            let hash = hash_block(parent, block_tokens);
            let block = table.blocks[index];
            if let std::collections::hash_map::Entry::Vacant(slot) = self.cache.entry(hash) {
                slot.insert(block);
                self.blocks[block.0 as usize].cached =
                    Some(CachedContent { hash, parent, tokens: block_tokens.to_vec() });
            }
            table.last_hash = Some(hash);
            table.num_full_prefix_blocks = index + 1;
        }
        Ok(())
    }

    /// Releases the blocks of `sequence`. Cached blocks whose count drops to zero become
    /// evictable, the sequence's tail first (so that shared heads outlive private tails).
    pub fn free(&mut self, sequence: SequenceId) -> Result<(), BlockError> {
        let table = self.tables.remove(&sequence).ok_or(BlockError::UnknownSequence(sequence))?;
        for &block in table.blocks.iter().rev() {
            let state = &mut self.blocks[block.0 as usize];
            // Invariant: a block in a table has a positive count, so this never underflows.
            state.ref_count -= 1;
            if state.ref_count == 0 {
                if state.cached.is_some() {
                    state.lru_tick = Some(self.next_tick);
                    self.evictable.insert(self.next_tick, block);
                    self.next_tick += 1;
                } else {
                    self.free_uncached.push(block);
                }
            }
        }
        Ok(())
    }

    /// Forgets every cached prefix, as needed after each weight update (cached K/V was computed
    /// by the old weights). Free cached blocks become plain free blocks. Blocks still used by
    /// sequences keep their K/V (those sequences carry on — the RLHF loop only updates weights
    /// between generation rounds, when none should be left) but lose their hash, so no new
    /// sequence can hit them, and their sequences stop registering further blocks.
    pub fn reset_prefix_cache(&mut self) -> PrefixCacheReset {
        let mut outcome = PrefixCacheReset::default();
        for (_, block) in std::mem::take(&mut self.evictable) {
            let state = &mut self.blocks[block.0 as usize];
            state.cached = None;
            state.lru_tick = None;
            self.free_uncached.push(block);
            outcome.dropped_free_blocks += 1;
        }
        for &block in self.cache.values() {
            let state = &mut self.blocks[block.0 as usize];
            if state.cached.take().is_some() {
                outcome.detached_in_use_blocks += 1;
            }
        }
        self.cache.clear();
        self.epoch += 1;
        self.resets += 1;
        outcome
    }

    /// A snapshot of usage and prefix-cache counters.
    pub fn stats(&self) -> BlockManagerStats {
        let free_blocks = self.num_free_blocks();
        let used_blocks = self.config.num_blocks - free_blocks;
        BlockManagerStats {
            num_blocks: self.config.num_blocks,
            used_blocks,
            free_blocks,
            cached_free_blocks: self.evictable.len(),
            usage: used_blocks as f64 / self.config.num_blocks as f64,
            prefix_queried_blocks: self.queried_blocks,
            prefix_hit_blocks: self.hit_blocks,
            prefix_hit_rate: if self.queried_blocks == 0 {
                0.0
            } else {
                self.hit_blocks as f64 / self.queried_blocks as f64
            },
            evictions: self.evictions,
            prefix_cache_resets: self.resets,
        }
    }

    /// Full blocks of a `num_tokens`-token prompt that may come from the cache: those that lie
    /// entirely before the last token, which must be computed to produce logits.
    fn cacheable_prefix_blocks(&self, num_tokens: usize) -> usize {
        num_tokens.saturating_sub(1) / self.config.block_size
    }

    /// The longest run of leading full blocks of `tokens` present in the cache, with hashes.
    fn lookup_prefix(&self, tokens: &[u32]) -> Vec<(BlockId, BlockHash)> {
        let mut hits = Vec::new();
        if !self.config.enable_prefix_caching {
            return hits;
        }
        let mut parent = None;
        for block_tokens in tokens
            .chunks_exact(self.config.block_size)
            .take(self.cacheable_prefix_blocks(tokens.len()))
        {
            let hash = hash_block(parent, block_tokens);
            let Some(&block) = self.cache.get(&hash) else { break };
            let verified = self.blocks[block.0 as usize]
                .cached
                .as_ref()
                .is_some_and(|c| c.hash == hash && c.parent == parent && c.tokens == block_tokens);
            if !verified {
                break;
            }
            hits.push((block, hash));
            parent = Some(hash);
        }
        hits
    }

    /// Adds a reference to a cached block, reviving it from the evictable list if needed.
    fn acquire(&mut self, block: BlockId) {
        let state = &mut self.blocks[block.0 as usize];
        if state.ref_count == 0
            && let Some(tick) = state.lru_tick.take()
        {
            self.evictable.remove(&tick);
        }
        state.ref_count += 1;
    }

    /// Takes a block for new K/V: a never-cached one, else the least recently freed cached one
    /// (whose hash is dropped). Callers check `num_free_blocks` first.
    fn take_fresh_block(&mut self) -> BlockId {
        let block = match self.free_uncached.pop() {
            Some(block) => block,
            None => {
                // Invariant: callers checked that `num_free_blocks()` covers the request, and the
                // uncached list is empty, so the evictable list is not.
                let (_, block) =
                    self.evictable.pop_first().expect("free block count was checked by the caller");
                let state = &mut self.blocks[block.0 as usize];
                state.lru_tick = None;
                if let Some(content) = state.cached.take() {
                    self.cache.remove(&content.hash);
                }
                self.evictions += 1;
                block
            }
        };
        self.blocks[block.0 as usize].ref_count = 1;
        block
    }

    /// Checks every bookkeeping invariant; used by the property tests and available to the
    /// engine's debug assertions.
    pub fn check_invariants(&self) -> Result<(), BlockError> {
        invariants::check(self)
    }
}

mod invariants;

#[cfg(test)]
mod tests;
