//! Weight-sync buckets read straight from the slices of a stage-0 rank's sharding-manager
//! buffers: one copy of each slice's bytes to host memory, cut into its parameters by offset,
//! instead of one tensor copy per parameter ([`WeightBucket::split_model`]). The bytes, the
//! order and the bucketing are the same as `split_model`'s, so the engines end bit-identical
//! to the policy either way.

use tch::Device;

use rtrun_rlhf_engine::{NamedTensor, WeightBucket};
use rtrun_rlhf_shard::manager::Bucket;

/// The [`WeightBucket`] of one slice of the parameters' buffer (f32, bf16 or f16).
pub(super) fn bucket_from_slice(slice: &Bucket) -> Result<WeightBucket, String> {
    let dtype = rtrun_rlhf_engine::api::dtype_name(slice.kind).ok_or_else(|| {
        format!("a synced weight should be f32, bf16 or f16, found {:?}", slice.kind)
    })?;
    let element = slice.kind.elt_size_in_bytes();
    let numel = usize::try_from(slice.numel).map_err(|_| {
        format!("a bucket's element count should be positive, found {}", slice.numel)
    })?;
    // The one read of the slice: a device-to-host copy on a GPU; on the CPU the view itself.
    let host = slice.view().f_to_device(Device::Cpu).map_err(|e| e.to_string())?;
    let mut bytes = vec![0u8; numel * element];
    host.f_copy_data_u8(&mut bytes, numel).map_err(|e| e.to_string())?;
    let mut tensors = Vec::with_capacity(slice.tensors.len());
    for meta in &slice.tensors {
        let outside = || format!("`{}` lies outside its weight bucket", meta.name);
        let start = usize::try_from(meta.offset - slice.offset).map_err(|_| outside())? * element;
        let end = start + usize::try_from(meta.bytes()).map_err(|_| outside())?;
        let data = bytes.get(start..end).ok_or_else(outside)?.to_vec();
        tensors.push(NamedTensor {
            name: meta.name.clone(),
            dtype: dtype.to_owned(),
            shape: meta.shape.clone(),
            data,
        });
    }
    Ok(WeightBucket { tensors })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtrun_rlhf_model::ModelFamily;
    use rtrun_rlhf_model::tiny::{tiny_config, tiny_model};
    use rtrun_rlhf_model::train::OptimizerConfig;
    use rtrun_rlhf_shard::manager::Mode;
    use rtrun_rlhf_shard::{GroupComm, ShardConfig, ShardedModel};

    /// The slices' buckets equal `split_model`'s byte for byte, bucket for bucket, whether the
    /// parameters are resident or offloaded into host buffers.
    #[test]
    fn slice_buckets_equal_split_model() {
        for family in [ModelFamily::Llama, ModelFamily::Qwen2, ModelFamily::Qwen3] {
            let model = tiny_model(&tiny_config(family), 5).unwrap();
            let optimizer = Some(OptimizerConfig::default());
            let config = ShardConfig::default();
            let mut sharded =
                ShardedModel::for_causal_lm(&model, config, GroupComm::solo(), optimizer).unwrap();
            for mode in [Mode::Train, Mode::Infer] {
                sharded.transition(mode).unwrap();
                for max_bytes in [1usize, 40_000, 1 << 30] {
                    let slices = sharded.param_buckets(max_bytes as u64).unwrap().unwrap();
                    let ours: Vec<WeightBucket> =
                        slices.iter().map(|s| bucket_from_slice(s).unwrap()).collect();
                    let theirs = WeightBucket::split_model(&model, max_bytes, None).unwrap();
                    assert_eq!(ours, theirs, "{family:?} {mode} {max_bytes}");
                    assert!(max_bytes < 1 << 30 || ours.len() == 1);
                }
            }
        }
    }
}
