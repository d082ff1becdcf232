//! Data-parallel synchronisation: after `backward`, every DP rank calls
//! [`all_reduce_gradients`] with its parameters in the same order, and each gradient becomes
//! the mean over the ranks (what DDP / DeepSpeed do between backward and the optimizer step);
//! before training, [`broadcast_parameters`] gives every rank the root's weights (what DDP does
//! at construction) so the replicas start identical.
//!
//! Gradients are packed into flat `f32` buckets of about [`GradientSyncConfig::bucket_bytes`]
//! so that many small tensors cost one collective, and a huge one does not need a second full
//! copy of the model's gradients in host memory. Half-precision gradients are reduced in `f32`
//! and rounded back once.

use rtrun::collective::{Communicator, ReduceOp};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::{AlgoError, Result};

/// Default for [`GradientSyncConfig::bucket_bytes`] (PyTorch DDP's `bucket_cap_mb` of 25).
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Settings of the gradient all-reduce.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GradientSyncConfig {
    /// Target size of one bucket in `f32` bytes; a single larger gradient gets a bucket of its
    /// own.
    pub bucket_bytes: usize,
}

impl Default for GradientSyncConfig {
    fn default() -> Self {
        GradientSyncConfig { bucket_bytes: DEFAULT_BUCKET_BYTES }
    }
}

/// What one synchronisation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GradientSyncStats {
    /// Parameters that had a gradient (the others are skipped, on every rank alike).
    pub parameters: usize,
    /// Gradient elements all-reduced.
    pub elements: usize,
    /// Collectives issued.
    pub buckets: usize,
}

/// Replaces each defined gradient of `params` with its mean over the ranks of `comm`.
///
/// Every rank must pass the same parameters in the same order with gradients defined on the
/// same ones; a mismatch in sizes is reported by the collective as an error, not silently
/// averaged. Gradients may live on any device and have any floating dtype.
pub fn all_reduce_gradients(
    comm: &mut Communicator,
    params: &[Tensor],
    config: &GradientSyncConfig,
) -> Result<GradientSyncStats> {
    let mut grads = Vec::new();
    for (index, param) in params.iter().enumerate() {
        let grad = param.grad();
        if !grad.defined() {
            continue;
        }
        match grad.kind() {
            Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16 => {}
            other => {
                return Err(AlgoError::Gradient {
                    index,
                    message: format!("expected a floating-point gradient, found {other:?}"),
                });
            }
        }
        grads.push((index, grad));
    }
    let mut stats = GradientSyncStats { parameters: grads.len(), ..GradientSyncStats::default() };
    if comm.world_size() == 1 {
        stats.elements = grads.iter().map(|(_, g)| g.numel()).sum();
        return Ok(stats);
    }
    let bucket_elements = (config.bucket_bytes / std::mem::size_of::<f32>()).max(1);
    let mut start = 0;
    while start < grads.len() {
        let mut end = start;
        let mut elements = 0;
        while end < grads.len()
            && (end == start || elements + grads[end].1.numel() <= bucket_elements)
        {
            elements += grads[end].1.numel();
            end += 1;
        }
        reduce_bucket(comm, &mut grads[start..end])?;
        stats.elements += elements;
        stats.buckets += 1;
        start = end;
    }
    Ok(stats)
}

/// Copies `root`'s values of `params` into every other rank's `params`, bit for bit (any
/// dtype, any device), in buckets of about `config.bucket_bytes`. Every rank must pass the
/// same parameters (shapes and dtypes) in the same order; a size mismatch is an error.
/// Returns the number of bytes broadcast.
pub fn broadcast_parameters(
    comm: &mut Communicator,
    params: &[Tensor],
    root: usize,
    config: &GradientSyncConfig,
) -> Result<usize> {
    let sizes: Vec<usize> = params
        .iter()
        .map(|p| Ok(p.numel() * p.f_kind()?.elt_size_in_bytes()))
        .collect::<Result<_>>()?;
    let total = sizes.iter().sum();
    if comm.world_size() == 1 {
        return Ok(total);
    }
    let is_root = comm.rank() == root;
    let mut start = 0;
    while start < params.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < params.len() && (end == start || bytes + sizes[end] <= config.bucket_bytes) {
            bytes += sizes[end];
            end += 1;
        }
        let mut bucket = vec![0u8; bytes];
        if is_root {
            let mut offset = 0;
            for (param, &size) in params[start..end].iter().zip(&sizes[start..end]) {
                let host = param.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?;
                host.f_copy_data_u8(&mut bucket[offset..offset + size], param.numel())?;
                offset += size;
            }
        }
        comm.broadcast(&mut bucket, root)?;
        if !is_root {
            let mut offset = 0;
            for (index, (param, &size)) in
                params[start..end].iter().zip(&sizes[start..end]).enumerate()
            {
                // `bucket[offset..offset + size]` holds exactly numel × element size bytes, the
                // length `from_data_size` reads.
                let value = Tensor::f_from_data_size(
                    &bucket[offset..offset + size],
                    &param.size(),
                    param.f_kind()?,
                )?;
                let mut target = param.shallow_clone();
                tch::no_grad(|| target.f_copy_(&value)).map_err(|e| AlgoError::Gradient {
                    index: start + index,
                    message: format!("cannot write the broadcast value: {e}"),
                })?;
                offset += size;
            }
        }
        start = end;
    }
    Ok(total)
}

/// All-reduces (mean) one bucket of gradients through a flat `f32` buffer: on the GPU in place
/// when the communicator is NCCL's and the gradients live on its device, through host memory
/// otherwise.
fn reduce_bucket(comm: &mut Communicator, bucket: &mut [(usize, Tensor)]) -> Result<()> {
    let nccl_device = comm.cuda_device().map(Device::Cuda);
    let staging = match nccl_device {
        Some(device) if bucket.iter().all(|(_, g)| g.device() == device) => device,
        _ => Device::Cpu,
    };
    let flat_parts = bucket
        .iter()
        .map(|(_, g)| g.f_detach()?.f_to_device(staging)?.f_to_kind(Kind::Float)?.f_reshape([-1]))
        .collect::<Result<Vec<_>, _>>()?;
    let flat = Tensor::f_cat(&flat_parts, 0)?.f_contiguous()?;
    let reduced = if staging == Device::Cpu {
        let mut host = Vec::<f32>::try_from(&flat)?;
        comm.all_reduce_f32(&mut host, ReduceOp::Mean)?;
        Tensor::from_slice(&host)
    } else {
        all_reduce_on_device(comm, &flat)?;
        flat
    };
    tch::no_grad(|| -> Result<()> {
        let mut offset = 0i64;
        for (index, grad) in bucket.iter_mut() {
            let numel = grad.numel() as i64;
            let shape = grad.size();
            let source = reduced.f_narrow(0, offset, numel)?.f_view(shape.as_slice())?;
            grad.f_copy_(&source).map_err(|e| AlgoError::Gradient {
                index: *index,
                message: format!("cannot write the reduced gradient back: {e}"),
            })?;
            offset += numel;
        }
        Ok(())
    })
}

/// All-reduces (mean) a contiguous f32 CUDA tensor in place with NCCL.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn all_reduce_on_device(comm: &mut Communicator, flat: &Tensor) -> Result<()> {
    let count = flat.numel();
    // SAFETY: `flat` is a freshly allocated contiguous f32 tensor of `count` elements on the
    // communicator's CUDA device (the caller checked the device), alive until this returns,
    // and nothing else holds it; the call synchronises the device before and after.
    unsafe { comm.all_reduce_device_f32(flat.data_ptr() as u64, count, ReduceOp::Mean) }?;
    Ok(())
}

/// Without the `cuda` feature no communicator has a CUDA device, so this is never reached.
#[cfg(not(feature = "cuda"))]
fn all_reduce_on_device(_comm: &mut Communicator, _flat: &Tensor) -> Result<()> {
    Err(AlgoError::Config("device all-reduce needs rtrun-rlhf-algo built with `cuda`".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtrun::collective::CollectiveConfig;

    #[test]
    fn broadcast_in_a_group_of_one_counts_the_bytes() {
        let mut comm =
            Communicator::init(CollectiveConfig::new("solo", 0, 1, "127.0.0.1", 0)).unwrap();
        let params = [Tensor::from_slice(&[1.0f32, 2.0]), Tensor::from_slice(&[1.0f64])];
        let bytes = broadcast_parameters(&mut comm, &params, 0, &GradientSyncConfig::default());
        assert_eq!(bytes.unwrap(), 2 * 4 + 8);
    }

    #[test]
    fn a_group_of_one_leaves_gradients_alone_and_counts_them() {
        let mut comm =
            Communicator::init(CollectiveConfig::new("solo", 0, 1, "127.0.0.1", 0)).unwrap();
        let w = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let unused = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        (&w * &w).sum(Kind::Float).backward();
        let stats = all_reduce_gradients(
            &mut comm,
            &[w.shallow_clone(), unused],
            &GradientSyncConfig::default(),
        )
        .unwrap();
        assert_eq!(stats, GradientSyncStats { parameters: 1, elements: 2, buckets: 0 });
        assert_eq!(Vec::<f32>::try_from(&w.grad()).unwrap(), vec![2.0, 4.0]);
    }
}
