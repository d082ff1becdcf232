//! Tensor parallelism of the engine: one engine runs as `world` ranks, each holding its share
//! of every decoder layer (Megatron's split, [`layout`]), stepping in lock step.
//!
//! - **Split**: q/k/v and gate/up are column-parallel (a rank computes its heads and its slice
//!   of the MLP), o_proj and down_proj row-parallel (a rank's partial sums), with one
//!   all-reduce after each of the two per layer ([`TensorParallel::all_reduce`]). Key/value
//!   heads follow the query heads; with fewer key/value heads than ranks, or a grouping that
//!   straddles ranks, they are replicated ([`layout::TpLayout`]).
//! - **Embedding and LM head are replicated**, not vocabulary-parallel. Every rank looks up its
//!   own embedding rows (no all-reduce), and only rank 0 computes logits, for the rows it
//!   samples (no gather of logits). A vocabulary-parallel head would save `vocab × hidden`
//!   elements per rank (136M of Qwen2-0.5B's 494M parameters at bf16: 272 MB) at the cost of
//!   two more collectives per step; on the CPU ring, whose collectives cost tens of
//!   microseconds each, the step is latency-bound, so replication is the faster choice here.
//! - **Lock step**: rank 0 ([`crate::LlmEngine`]) owns the scheduler, the block manager and the
//!   sampler. Before each runner operation it sends one [`RankCommand`] to every other rank
//!   ([`Followers`]): the step's [`crate::runner::batch::StepBatch`] — one message per step,
//!   not per layer — or a sleep / wake-up. Every rank holds its key/value heads' share of the
//!   paged KV cache under the same block ids, so the block tables rank 0 sends are valid on
//!   every rank. Prefix caching is block bookkeeping on rank 0 only: a cached block's K/V is
//!   present on every rank because every rank ran the step that wrote it, and
//!   `reset_prefix_cache` only has rank 0's bookkeeping to forget.
//! - **Weights**: a rank is built from the whole model ([`shard_model`]) and updated with its
//!   shard only ([`reshard`]: the name map, packing of q/k/v and gate/up, and the splits back).

mod collective;
pub mod follower;
pub mod layout;
pub mod reshard;

pub use collective::TensorParallel;
pub use follower::{Follower, Followers, RankCommand, ThreadFollowers};
pub use layout::TpLayout;

use rtrun_rlhf_model::CausalLm;
use tch::{Device, Kind};

use crate::error::EngineError;

/// Rank `rank`'s shard of the whole model `full` for `layout`, on `device` in `kind`.
pub fn shard_model(
    full: &CausalLm,
    layout: &TpLayout,
    rank: usize,
    device: Device,
    kind: Kind,
) -> Result<CausalLm, EngineError> {
    if rank >= layout.world {
        return Err(EngineError::InvalidArgument(format!(
            "tensor-parallel rank {rank} is outside a group of {}",
            layout.world
        )));
    }
    let config = layout.shard_config(full.config());
    let shard = CausalLm::uninitialised(&config, device, kind)?;
    tch::no_grad(|| -> Result<(), EngineError> {
        for (name, tensor) in full.named_parameters() {
            let part = reshard::shard(layout, rank, name, tensor)?;
            shard.params.copy_into(name, &part)?;
        }
        Ok(())
    })?;
    Ok(shard)
}
