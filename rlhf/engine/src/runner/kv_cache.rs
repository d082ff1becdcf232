//! The paged KV cache tensors: per decoder layer one key and one value tensor of
//! `[kv_heads * slots, head_dim]` (`slots = num_blocks * block_size`), head-major: head `h`'s
//! key at slot `s` is row `h * slots + s`, and block `b` owns slots
//! `b * block_size .. (b + 1) * block_size` of every head. The block manager decides which block
//! a sequence's position lives in; this module only writes slots and gathers them.
//!
//! Heads come first so that a gather is `[kv_heads, batch, len, head_dim]` and contiguous (the
//! decode attention multiplies it batch by batch without another copy), and rows are the one
//! indexed dimension so that writing and gathering copy whole rows ([`KvCache::head_major`]
//! turns slots into rows); `index_select` along an inner dimension was 5x slower.
//!
//! The tensors start zeroed: attention gathers padding keys from slot 0 and multiplies their
//! (masked, zero) weights with the values there, so uninitialised memory holding NaN would leak
//! into real outputs.

use tch::{Device, Kind, Tensor};

use crate::error::EngineError;

/// Shape of the cache of one shard of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheShape {
    /// Decoder layers.
    pub num_layers: usize,
    /// Key/value heads held by this shard.
    pub num_kv_heads: i64,
    /// Width of one head.
    pub head_dim: i64,
    /// Token slots per block.
    pub block_size: usize,
    /// Element type.
    pub kind: Kind,
}

impl KvCacheShape {
    /// Bytes one block takes across all layers, keys and values.
    pub fn bytes_per_block(&self) -> u64 {
        2 * self.num_layers as u64
            * self.block_size as u64
            * self.num_kv_heads as u64
            * self.head_dim as u64
            * self.kind.elt_size_in_bytes() as u64
    }
}

/// The key and value tensors of one layer.
#[derive(Debug)]
pub struct LayerCache {
    /// `[kv_heads * slots, head_dim]` keys (after RoPE).
    pub keys: Tensor,
    /// `[kv_heads * slots, head_dim]` values.
    pub values: Tensor,
}

impl LayerCache {
    /// Writes `k, v: [kv_heads, T, head_dim]` (the rows of one packed step, from
    /// [`head_major_rows`]) at `rows: [kv_heads * T]`, the [`KvCache::head_major`] rows of
    /// their slots.
    pub fn write(&self, rows: &Tensor, k: &Tensor, v: &Tensor) -> Result<(), EngineError> {
        let flat = |t: &Tensor| t.f_view([-1, t.size()[2]]);
        let _ = self.keys.shallow_clone().f_index_copy_(0, rows, &flat(k)?)?;
        let _ = self.values.shallow_clone().f_index_copy_(0, rows, &flat(v)?)?;
        Ok(())
    }

    /// Gathers the keys and values at `rows: [kv_heads * batch * len]` (the
    /// [`KvCache::head_major`] rows of `batch * len` slots) as contiguous `[kv_heads, batch,
    /// len, head_dim]` tensors.
    pub fn gather(
        &self,
        rows: &Tensor,
        batch: i64,
        len: i64,
    ) -> Result<(Tensor, Tensor), EngineError> {
        let pick = |t: &Tensor| -> Result<Tensor, EngineError> {
            Ok(t.f_index_select(0, rows)?.f_view([-1, batch, len, t.size()[1]])?)
        };
        Ok((pick(&self.keys)?, pick(&self.values)?))
    }
}

/// A step's new keys or values `[T, kv_heads, head_dim]` as contiguous `[kv_heads, T,
/// head_dim]`, the order of the cache's rows ([`LayerCache::write`]) and of the decode lanes.
/// The copy is made once per step (`index_copy_` from the strided views that the projections
/// leave took 40x as long as the copy itself).
pub fn head_major_rows(t: &Tensor) -> Result<Tensor, EngineError> {
    Ok(t.f_permute([1, 0, 2])?.f_contiguous()?)
}

/// All layers' caches.
#[derive(Debug)]
pub struct KvCache {
    /// One entry per decoder layer.
    pub layers: Vec<LayerCache>,
    /// Blocks in the pool (the block manager's; the tensors hold one more, the scratch block).
    pub num_blocks: usize,
    /// Slots per head (`(num_blocks + 1) * block_size`).
    slots: i64,
    /// Key/value heads.
    kv_heads: i64,
}

impl KvCache {
    /// Allocates a zeroed cache of `num_blocks` blocks on `device`, plus the scratch block
    /// ([`KvCache::scratch_block`]).
    pub fn allocate(
        shape: &KvCacheShape,
        num_blocks: usize,
        device: Device,
    ) -> Result<Self, EngineError> {
        let overflow = || {
            EngineError::InvalidConfig(format!("{num_blocks} kv blocks overflow the slot index"))
        };
        let blocks = num_blocks.checked_add(1).ok_or_else(overflow)?;
        let slots = blocks
            .checked_mul(shape.block_size)
            .and_then(|slots| i64::try_from(slots).ok())
            .ok_or_else(overflow)?;
        let rows = slots.checked_mul(shape.num_kv_heads).ok_or_else(overflow)?;
        let size = [rows, shape.head_dim];
        let layers = (0..shape.num_layers)
            .map(|_| -> Result<LayerCache, EngineError> {
                Ok(LayerCache {
                    keys: Tensor::f_zeros(size, (shape.kind, device))?,
                    values: Tensor::f_zeros(size, (shape.kind, device))?,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { layers, num_blocks, slots, kv_heads: shape.num_kv_heads })
    }

    /// The block after the pool's, which no sequence owns: the static decode step's padding
    /// rows write their keys and values there ([`super::static_decode`]), so a padded step
    /// never touches a real sequence's slots.
    pub fn scratch_block(&self) -> i64 {
        self.num_blocks as i64
    }

    /// Slots per head, the scratch block's included (the stride between heads' rows).
    pub fn slots_per_head(&self) -> i64 {
        self.slots
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> i64 {
        self.kv_heads
    }

    /// The cache rows of `slots` for every head, head by head: `h * slots_per_head + slot`.
    pub fn head_major(&self, slots: &[i64]) -> Vec<i64> {
        (0..self.kv_heads)
            .flat_map(|head| slots.iter().map(move |&slot| head * self.slots + slot))
            .collect()
    }
}
