//! NCCL's in-place reduce-scatter and all-gather on a CUDA tensor's memory (feature `cuda`):
//! the checked, safe entry to [`rtrun::collective::Communicator`]'s raw-pointer calls. The
//! shard units stage their collectives through host memory today (decision 061); these are the
//! device path's building blocks, exercised by `scripts/gpu-check.sh`.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use rtrun::collective::{Communicator, ReduceOp};
use tch::{Device, Kind, Tensor};

use crate::error::{Result, ShardError};

/// Checks that `t` is a contiguous tensor of `kind` on the communicator's CUDA device whose
/// length divides among the ranks; returns the elements per rank.
fn check(comm: &Communicator, t: &Tensor, kind: Option<Kind>) -> Result<usize> {
    let device = comm.cuda_device().ok_or_else(|| {
        ShardError::Config("device collectives need a communicator on the nccl backend".into())
    })?;
    if t.device() != Device::Cuda(device) || !t.is_contiguous() {
        return Err(ShardError::Config(format!(
            "expected a contiguous tensor on cuda:{device}, found one on {:?}",
            t.device()
        )));
    }
    if let Some(kind) = kind
        && t.kind() != kind
    {
        return Err(ShardError::Config(format!("expected {kind:?}, found {:?}", t.kind())));
    }
    let world = comm.world_size();
    if !t.numel().is_multiple_of(world) {
        return Err(ShardError::Config(format!(
            "{} elements do not divide among {world} ranks",
            t.numel()
        )));
    }
    Ok(t.numel() / world)
}

/// Reduce-scatters a float32 CUDA tensor in place: afterwards this rank's chunk holds the
/// combination of every rank's.
pub fn reduce_scatter_on_device(comm: &mut Communicator, t: &Tensor, op: ReduceOp) -> Result<()> {
    let per_rank = check(comm, t, Some(Kind::Float))?;
    // SAFETY: `t` is a live contiguous f32 tensor on the communicator's device (checked) of
    // `per_rank × world` elements, borrowed for the call, which synchronises before returning.
    unsafe { comm.reduce_scatter_device_f32(t.data_ptr() as u64, per_rank, op) }
        .map_err(|source| ShardError::Collective { what: "device reduce-scatter".into(), source })
}

/// All-gathers a CUDA tensor in place (any dtype): this rank's chunk is its contribution.
pub fn all_gather_on_device(comm: &mut Communicator, t: &Tensor) -> Result<()> {
    let per_rank = check(comm, t, None)?;
    let bytes = per_rank * t.kind().elt_size_in_bytes();
    // SAFETY: as above, for `bytes × world` bytes of `t`'s memory.
    unsafe { comm.all_gather_device(t.data_ptr() as u64, bytes) }
        .map_err(|source| ShardError::Collective { what: "device all-gather".into(), source })
}
