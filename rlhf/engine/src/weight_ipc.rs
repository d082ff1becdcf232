//! Weight sync by CUDA IPC, for engines on the same GPU as the policy (the hybrid engine of
//! a colocated spec, where NCCL refuses two ranks on one device).
//!
//! The policy plans its parameters into buckets of about `bucket_bytes` ([`plan_buckets`]:
//! every parameter at a 256-byte aligned offset), packs one bucket at a time into a flat
//! device buffer ([`pack_bucket`]), and exports that buffer as an
//! [`rtrun::cuda_ipc::IpcMemHandle`]. The engine checks the bucket's layout against its own
//! model ([`check_bucket`]: every name known, same shape and dtype, sizes that add up, ranges
//! inside the buffer and not overlapping — all before a byte is copied), maps the buffer and
//! copies each range into its parameter in place ([`unpack_bucket`]). Nothing is staged
//! through host memory. Packing, checks and unpacking are plain tensor code and run on the
//! CPU in tests; only export and mapping need a GPU.

use rtrun::cuda_ipc::IpcMemHandle;
use rtrun_rlhf_model::CausalLm;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::EngineError;
use crate::weight_sync::WeightMeta;

/// Offsets of parameters in a bucket are multiples of this (CUDA's allocation alignment).
pub const IPC_ALIGN: u64 = 256;

/// One parameter's bytes in a bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcEntry {
    /// Name, shape and dtype of the parameter.
    pub meta: WeightMeta,
    /// Offset of its bytes in the bucket.
    pub offset: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

/// Where each parameter of one bucket goes, and the bucket's size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcBucketPlan {
    /// The parameters, in order.
    pub entries: Vec<IpcEntry>,
    /// Bytes of the bucket's buffer.
    pub len: u64,
}

/// A bucket as it travels to the engines: the exported buffer and its layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcWeightBucket {
    /// The policy's packed buffer.
    pub memory: IpcMemHandle,
    /// What lies where in it.
    pub entries: Vec<IpcEntry>,
}

/// Bytes of one element of a float dtype named as [`WeightMeta::dtype`] names it (libtorch's
/// kind name).
pub fn element_bytes(dtype: &str) -> Option<u64> {
    [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half]
        .into_iter()
        .find(|kind| format!("{kind:?}") == dtype)
        .map(|kind| kind.elt_size_in_bytes() as u64)
}

fn numel(shape: &[i64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?))
}

fn entry_bytes(meta: &WeightMeta) -> Result<u64, EngineError> {
    let invalid = |message: String| EngineError::InvalidWeight { name: meta.name.clone(), message };
    let size = element_bytes(&meta.dtype)
        .ok_or_else(|| invalid(format!("expected a float dtype, found {}", meta.dtype)))?;
    numel(&meta.shape)
        .and_then(|n| n.checked_mul(size))
        .ok_or_else(|| invalid(format!("shape {:?} is not a valid size", meta.shape)))
}

fn align(offset: u64) -> u64 {
    offset.div_ceil(IPC_ALIGN) * IPC_ALIGN
}

/// Splits `metas` (in order) into buckets of at most `bucket_bytes` each; a parameter larger
/// than that gets a bucket of its own.
pub fn plan_buckets(
    metas: &[WeightMeta],
    bucket_bytes: usize,
) -> Result<Vec<IpcBucketPlan>, EngineError> {
    let limit = bucket_bytes.max(1) as u64;
    let mut plans = Vec::new();
    let mut current = IpcBucketPlan { entries: Vec::new(), len: 0 };
    for meta in metas {
        let bytes = entry_bytes(meta)?;
        let mut offset = align(current.len);
        if !current.entries.is_empty() && offset + bytes > limit {
            plans.push(std::mem::replace(
                &mut current,
                IpcBucketPlan { entries: Vec::new(), len: 0 },
            ));
            offset = 0;
        }
        current.entries.push(IpcEntry { meta: meta.clone(), offset, bytes });
        current.len = offset + bytes;
    }
    if !current.entries.is_empty() {
        plans.push(current);
    }
    Ok(plans)
}

/// The parameter tensors of `model` that `entries` fill, after checking the layout against
/// the model and a buffer of `memory_len` bytes. Nothing is copied when this fails.
pub fn check_bucket(
    model: &CausalLm,
    entries: &[IpcEntry],
    memory_len: u64,
) -> Result<Vec<Tensor>, EngineError> {
    let mut targets = Vec::with_capacity(entries.len());
    let mut seen = std::collections::HashSet::new();
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        let meta = &entry.meta;
        let invalid =
            |message: String| EngineError::InvalidWeight { name: meta.name.clone(), message };
        if !seen.insert(meta.name.as_str()) {
            return Err(invalid("appears twice in one bucket".into()));
        }
        let param = crate::weight_sync::matching_param(model, meta)?;
        let bytes = entry_bytes(meta)?;
        if entry.bytes != bytes {
            return Err(invalid(format!(
                "expected {bytes} bytes for {:?} {}, the bucket says {}",
                meta.shape, meta.dtype, entry.bytes
            )));
        }
        if entry.offset % IPC_ALIGN != 0 {
            return Err(invalid(format!(
                "offset {} is not a multiple of {IPC_ALIGN}",
                entry.offset
            )));
        }
        match entry.offset.checked_add(bytes) {
            Some(end) if end <= memory_len => ranges.push((entry.offset, end, &meta.name)),
            _ => {
                return Err(invalid(format!(
                    "bytes {}..{} lie outside the {memory_len}-byte bucket",
                    entry.offset,
                    entry.offset.saturating_add(bytes)
                )));
            }
        }
        if !param.is_contiguous() {
            return Err(invalid("the engine's parameter is not contiguous".into()));
        }
        targets.push(param);
    }
    ranges.sort();
    for pair in ranges.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(EngineError::InvalidWeight {
                name: pair[1].2.clone(),
                message: format!("overlaps `{}` in the bucket", pair[0].2),
            });
        }
    }
    Ok(targets)
}

/// The bytes of a contiguous tensor, as a flat `uint8` view sharing its storage.
fn byte_view(tensor: &Tensor) -> Result<Tensor, EngineError> {
    Ok(tensor.f_reshape([-1])?.f_view_dtype(Kind::Uint8)?)
}

/// Packs the parameters of `plan` from `model` into a new flat `uint8` buffer on the model's
/// device.
pub fn pack_bucket(model: &CausalLm, plan: &IpcBucketPlan) -> Result<Tensor, EngineError> {
    let device = model.params.device();
    let len = i64::try_from(plan.len)
        .map_err(|_| EngineError::InvalidArgument(format!("bucket of {} bytes", plan.len)))?;
    let buffer = Tensor::f_zeros([len], (Kind::Uint8, device))?;
    tch::no_grad(|| -> Result<(), EngineError> {
        for entry in &plan.entries {
            let param =
                model.params.get(&entry.meta.name).ok_or_else(|| EngineError::InvalidWeight {
                    name: entry.meta.name.clone(),
                    message: "the policy's model has no parameter of this name".into(),
                })?;
            let source = byte_view(&param.f_contiguous()?)?;
            buffer.f_narrow(0, entry.offset as i64, entry.bytes as i64)?.f_copy_(&source)?;
        }
        Ok(())
    })?;
    Ok(buffer)
}

/// Copies every entry from `source` (a flat `uint8` tensor over the bucket's bytes) into
/// `targets` (from [`check_bucket`], in the same order), in place.
pub fn unpack_bucket(
    entries: &[IpcEntry],
    targets: &[Tensor],
    source: &Tensor,
) -> Result<(), EngineError> {
    tch::no_grad(|| -> Result<(), EngineError> {
        for (entry, target) in entries.iter().zip(targets) {
            let bytes = source.f_narrow(0, entry.offset as i64, entry.bytes as i64)?;
            byte_view(target)?.f_copy_(&bytes)?;
        }
        Ok(())
    })
}

/// The CUDA device index of a tensor's device.
fn cuda_index(device: tch::Device) -> Result<usize, EngineError> {
    match device {
        tch::Device::Cuda(index) => Ok(index),
        other => Err(EngineError::InvalidArgument(format!(
            "CUDA IPC weight sync needs the model on a CUDA device, found {other:?}"
        ))),
    }
}

/// The policy's half: packs bucket `plan` and exports it. The returned buffer must be kept
/// until every engine has received the bucket.
pub fn export_bucket(
    model: &CausalLm,
    plan: &IpcBucketPlan,
) -> Result<(Tensor, IpcWeightBucket), EngineError> {
    let device = cuda_index(model.params.device())?;
    let buffer = pack_bucket(model, plan)?;
    // The copies run on libtorch's stream; the engine reads after this returns.
    tch::Cuda::synchronize(device as i64);
    let memory = rtrun::cuda_ipc::export(device, buffer.data_ptr() as u64, plan.len)
        .map_err(|e| EngineError::InvalidArgument(format!("exporting a weight bucket: {e}")))?;
    Ok((buffer, IpcWeightBucket { memory, entries: plan.entries.clone() }))
}

/// The engine's half: checks `bucket` against `model`, maps the policy's buffer and copies
/// every parameter in place. Returns the bytes copied.
pub fn receive_bucket(model: &CausalLm, bucket: &IpcWeightBucket) -> Result<u64, EngineError> {
    let targets = check_bucket(model, &bucket.entries, bucket.memory.len)?;
    let device = cuda_index(model.params.device())?;
    receive_mapped(device, bucket, &targets)?;
    Ok(bucket.entries.iter().map(|e| e.bytes).sum())
}

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn receive_mapped(
    device: usize,
    bucket: &IpcWeightBucket,
    targets: &[Tensor],
) -> Result<(), EngineError> {
    let ipc = |e: rtrun::cuda_ipc::CudaIpcError| {
        EngineError::InvalidArgument(format!("mapping a weight bucket: {e}"))
    };
    let mapping = rtrun::cuda_ipc::IpcMapping::open(device, &bucket.memory).map_err(ipc)?;
    let address = mapping.address(0, bucket.memory.len).map_err(ipc)?;
    let len = i64::try_from(bucket.memory.len)
        .map_err(|_| EngineError::InvalidArgument("bucket too large".into()))?;
    // SAFETY: `address` is `len` bytes of mapped device memory on `device`, alive while
    // `mapping` is; the view is dropped (and the copies synchronised) before the mapping.
    let source = unsafe {
        Tensor::f_from_blob(
            address as *const u8,
            &[len],
            &[1],
            Kind::Uint8,
            tch::Device::Cuda(device),
        )
    }?;
    let result = unpack_bucket(&bucket.entries, targets, &source);
    tch::Cuda::synchronize(device as i64);
    drop(source);
    drop(mapping);
    result
}

#[cfg(not(feature = "cuda"))]
fn receive_mapped(
    _device: usize,
    _bucket: &IpcWeightBucket,
    _targets: &[Tensor],
) -> Result<(), EngineError> {
    Err(EngineError::InvalidArgument(
        "CUDA IPC weight sync needs rtrun built with the `cuda` feature".into(),
    ))
}

#[cfg(test)]
mod tests {
    use rtrun_rlhf_model::ModelFamily;
    use rtrun_rlhf_model::tiny::{tiny_config, tiny_model};

    use super::*;

    fn metas(model: &CausalLm) -> Vec<WeightMeta> {
        WeightMeta::of_model(model).unwrap()
    }

    #[test]
    fn buckets_hold_every_parameter_once_aligned_and_within_the_limit() {
        let model = tiny_model(&tiny_config(ModelFamily::Qwen2), 1).unwrap();
        let metas = metas(&model);
        let plans = plan_buckets(&metas, 8192).unwrap();
        assert!(plans.len() > 1);
        let names: Vec<_> =
            plans.iter().flat_map(|p| p.entries.iter().map(|e| e.meta.name.clone())).collect();
        assert_eq!(names, metas.iter().map(|m| m.name.clone()).collect::<Vec<_>>());
        for plan in &plans {
            for entry in &plan.entries {
                assert_eq!(entry.offset % IPC_ALIGN, 0);
                assert!(entry.offset + entry.bytes <= plan.len);
            }
            assert!(plan.len <= 8192 || plan.entries.len() == 1, "{}", plan.len);
        }
    }

    #[test]
    fn a_packed_bucket_unpacks_into_another_model_bit_for_bit() {
        let config = tiny_config(ModelFamily::Llama);
        let sender = tiny_model(&config, 1).unwrap();
        let receiver = tiny_model(&config, 2).unwrap();
        for plan in plan_buckets(&metas(&sender), 4096).unwrap() {
            let buffer = pack_bucket(&sender, &plan).unwrap();
            let targets = check_bucket(&receiver, &plan.entries, plan.len).unwrap();
            unpack_bucket(&plan.entries, &targets, &buffer).unwrap();
        }
        for ((name, want), (_, got)) in sender.named_parameters().zip(receiver.named_parameters()) {
            assert!(want.equal(got), "{name} differs after the sync");
        }
    }

    fn refused(entries: &[IpcEntry], len: u64, model: &CausalLm) -> String {
        check_bucket(model, entries, len).map(|_| ()).unwrap_err().to_string()
    }

    #[test]
    fn mismatched_layouts_are_refused_naming_the_weight() {
        let model = tiny_model(&tiny_config(ModelFamily::Llama), 1).unwrap();
        let plan = plan_buckets(&metas(&model), usize::MAX).unwrap().remove(0);
        let name = plan.entries[1].meta.name.clone();
        let edit = |f: &dyn Fn(&mut Vec<IpcEntry>)| {
            let mut entries = plan.entries.clone();
            f(&mut entries);
            entries
        };
        let shape = edit(&|e| e[1].meta.shape.push(1));
        assert!(refused(&shape, plan.len, &model).contains(&format!("weight `{name}`: expected")));
        let dtype = edit(&|e| e[1].meta.dtype = "BFloat16".into());
        assert!(refused(&dtype, plan.len, &model).contains("BFloat16"));
        let unknown = edit(&|e| e[1].meta.name = "model.nope.weight".into());
        assert!(refused(&unknown, plan.len, &model).contains("no parameter of this name"));
        let short = edit(&|e| e[1].bytes -= 2);
        assert!(refused(&short, plan.len, &model).contains("bytes"));
        let overlap = edit(&|e| e[1].offset = e[0].offset);
        assert!(refused(&overlap, plan.len, &model).contains("overlaps"));
        let misaligned = edit(&|e| e[1].offset += 4);
        assert!(refused(&misaligned, plan.len, &model).contains("multiple of 256"));
        assert!(refused(&plan.entries, plan.len - 1, &model).contains("outside"));
        let twice = edit(&|e| e[1] = e[0].clone());
        assert!(refused(&twice, plan.len, &model).contains("twice"));
    }

    #[test]
    fn without_a_gpu_export_and_receive_say_what_they_need() {
        let model = tiny_model(&tiny_config(ModelFamily::Llama), 1).unwrap();
        let plan = plan_buckets(&metas(&model), usize::MAX).unwrap().remove(0);
        let err = export_bucket(&model, &plan).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("CUDA device"), "{err}");
    }
}
