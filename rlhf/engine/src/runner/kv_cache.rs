//! The paged KV cache tensors: per decoder layer one key and one value tensor of
//! `[num_blocks * block_size, kv_heads, head_dim]`, where block `b` owns rows
//! `b * block_size .. (b + 1) * block_size`. The block manager decides which block a sequence's
//! position lives in; this module only writes rows and gathers them.
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
    /// `[slots, kv_heads, head_dim]` keys (after RoPE).
    pub keys: Tensor,
    /// `[slots, kv_heads, head_dim]` values.
    pub values: Tensor,
}

impl LayerCache {
    /// Writes `k, v: [T, kv_heads, head_dim]` (the rows of one packed step) into `slots: [T]`.
    /// The rows are made contiguous first: `index_copy_` from the strided views the projections
    /// leave took 40x as long as the copy itself (a twentieth of the decode step at batch 64).
    pub fn write(&self, slots: &Tensor, k: &Tensor, v: &Tensor) -> Result<(), EngineError> {
        let _ = self.keys.shallow_clone().f_index_copy_(0, slots, &k.f_contiguous()?)?;
        let _ = self.values.shallow_clone().f_index_copy_(0, slots, &v.f_contiguous()?)?;
        Ok(())
    }

    /// Gathers `[batch, kv_heads, len, head_dim]` keys and values at `slots: [batch * len]`.
    pub fn gather(
        &self,
        slots: &Tensor,
        batch: i64,
        len: i64,
    ) -> Result<(Tensor, Tensor), EngineError> {
        let pick = |t: &Tensor| -> Result<Tensor, EngineError> {
            let size = t.size();
            Ok(t.f_index_select(0, slots)?
                .f_view([batch, len, size[1], size[2]])?
                .f_permute([0, 2, 1, 3])?)
        };
        Ok((pick(&self.keys)?, pick(&self.values)?))
    }
}

/// All layers' caches.
#[derive(Debug)]
pub struct KvCache {
    /// One entry per decoder layer.
    pub layers: Vec<LayerCache>,
    /// Blocks in the pool.
    pub num_blocks: usize,
}

impl KvCache {
    /// Allocates a zeroed cache of `num_blocks` blocks on `device`.
    pub fn allocate(
        shape: &KvCacheShape,
        num_blocks: usize,
        device: Device,
    ) -> Result<Self, EngineError> {
        let slots = i64::try_from(num_blocks * shape.block_size).map_err(|_| {
            EngineError::InvalidConfig(format!("{num_blocks} kv blocks overflow the slot index"))
        })?;
        let size = [slots, shape.num_kv_heads, shape.head_dim];
        let layers = (0..shape.num_layers)
            .map(|_| -> Result<LayerCache, EngineError> {
                Ok(LayerCache {
                    keys: Tensor::f_zeros(size, (shape.kind, device))?,
                    values: Tensor::f_zeros(size, (shape.kind, device))?,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { layers, num_blocks })
    }
}
