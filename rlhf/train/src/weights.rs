//! Bucketed weight sync from the policy to the engines (CPU path): the policy's parameters are
//! grouped, in their stable Hugging Face order, into buckets of at most `bucket_bytes`, each
//! exported as one [`WeightBucket`] value. The trainer hands the reference to each bucket
//! straight from policy rank 0 to every engine's `update_weights`, so the bytes never pass
//! through the driver.

use tch::{Kind, Tensor};

use rtrun_rlhf_model::CausalLm;

pub use rtrun_rlhf_engine::{NamedTensor, WeightBucket};

use crate::error::Result;

/// The parameter names of each bucket: consecutive parameters while they fit in
/// `bucket_bytes` (a parameter larger than a bucket gets a bucket of its own).
pub fn bucket_plan<'a>(
    params: impl Iterator<Item = (&'a str, &'a Tensor)>,
    bucket_bytes: usize,
) -> Vec<Vec<String>> {
    let mut buckets: Vec<Vec<String>> = Vec::new();
    let mut current: Vec<String> = Vec::new();
    let mut current_bytes = 0usize;
    for (name, tensor) in params {
        let bytes = tensor.numel() * 4;
        if !current.is_empty() && current_bytes + bytes > bucket_bytes {
            buckets.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.push(name.to_owned());
        current_bytes += bytes;
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

/// The named parameters of `model` as an f32 bucket.
pub fn export_bucket(model: &CausalLm, names: &[String]) -> Result<WeightBucket> {
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let tensor = model.params.get(name).ok_or_else(|| {
            crate::TrainError::Data(format!("the policy has no parameter `{name}`"))
        })?;
        let values = tensor
            .f_detach()?
            .f_to_kind(Kind::Float)?
            .f_to_device(tch::Device::Cpu)?
            .f_contiguous()?;
        let flat = Vec::<f32>::try_from(values.f_view([-1])?)?;
        let mut data = Vec::with_capacity(flat.len() * 4);
        for v in flat {
            data.extend_from_slice(&v.to_le_bytes());
        }
        tensors.push(NamedTensor {
            name: name.clone(),
            dtype: "f32".to_owned(),
            shape: tensor.size(),
            data,
        });
    }
    Ok(WeightBucket { tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_respect_the_size_and_keep_the_order() {
        let tensors: Vec<(String, Tensor)> = [10i64, 10, 30, 5]
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("p{i}"), Tensor::zeros([n], (Kind::Float, tch::Device::Cpu))))
            .collect();
        let plan = bucket_plan(tensors.iter().map(|(n, t)| (n.as_str(), t)), 80);
        assert_eq!(plan, vec![vec!["p0", "p1"], vec!["p2"], vec!["p3"]]);
        let one = bucket_plan(tensors.iter().map(|(n, t)| (n.as_str(), t)), 1 << 20);
        assert_eq!(one.len(), 1);
    }
}
