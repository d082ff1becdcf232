//! Where the engine's weights are: resident on the device, offloaded to host memory (sleep
//! level 1) or discarded (sleep level 2), and the in-place weight update from buckets.
//!
//! The model's layers hold shallow clones of the tensors in its parameter registry, so swapping
//! a parameter's storage with `set_data` (to a host copy, to an empty tensor, back to a device
//! tensor) is seen by every layer without rebuilding the model, and so is `copy_` of new values.

use rtrun_rlhf_model::CausalLm;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::api::WeightBucket;
use crate::error::EngineError;

/// Residency of the weights.
#[derive(Debug)]
pub enum WeightResidency {
    /// On the device, usable.
    Resident,
    /// Sleep level 1. `host` holds the copies when the device is not the host; on a CPU engine
    /// the weights stay where they are (they already are in host memory).
    Offloaded {
        /// Host copies in `named_parameters` order, or `None` on a CPU engine.
        host: Option<Vec<Tensor>>,
    },
    /// Sleep level 2: storage released; waking allocates zeroed weights that a weight update
    /// must then fill.
    Discarded,
}

/// The residency as a word, for stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightState {
    /// Usable.
    Resident,
    /// Offloaded to host memory.
    Offloaded,
    /// Released.
    Discarded,
}

impl WeightResidency {
    /// Refuses `operation` unless the weights are resident.
    pub(crate) fn require_resident(&self, operation: &'static str) -> Result<(), EngineError> {
        match self {
            WeightResidency::Resident => Ok(()),
            _ => Err(EngineError::Asleep { operation, part: "weights" }),
        }
    }

    /// The state word.
    pub fn state(&self) -> WeightState {
        match self {
            WeightResidency::Resident => WeightState::Resident,
            WeightResidency::Offloaded { .. } => WeightState::Offloaded,
            WeightResidency::Discarded => WeightState::Discarded,
        }
    }
}

/// Points every parameter of `model` at `value(index, current)`'s storage.
fn replace_storage(
    model: &CausalLm,
    mut value: impl FnMut(usize, &Tensor) -> Result<Tensor, EngineError>,
) -> Result<(), EngineError> {
    tch::no_grad(|| {
        for (index, (_, param)) in model.named_parameters().enumerate() {
            let new = value(index, param)?;
            param.shallow_clone().f_set_data(&new)?;
        }
        Ok(())
    })
}

/// Moves resident weights to host memory (level 1) or releases them (level 2).
pub fn put_to_sleep(
    model: &CausalLm,
    residency: WeightResidency,
    level: u32,
) -> Result<WeightResidency, EngineError> {
    let device = model.params.device();
    let empty = || Tensor::f_empty([0], (model.params.kind(), device));
    match (residency, level) {
        (WeightResidency::Resident, 1) if device == Device::Cpu => {
            Ok(WeightResidency::Offloaded { host: None })
        }
        (WeightResidency::Resident, 1) => {
            let mut host = Vec::new();
            replace_storage(model, |_, param| {
                host.push(param.f_to_device(Device::Cpu)?);
                Ok(empty()?)
            })?;
            Ok(WeightResidency::Offloaded { host: Some(host) })
        }
        (WeightResidency::Resident | WeightResidency::Offloaded { host: None }, 2) => {
            replace_storage(model, |_, _| Ok(empty()?))?;
            Ok(WeightResidency::Discarded)
        }
        // Host copies are simply dropped; the device storage is already released.
        (WeightResidency::Offloaded { host: Some(_) }, 2) => Ok(WeightResidency::Discarded),
        (state, _) => Ok(state),
    }
}

/// Brings the weights back to the device; discarded weights come back zeroed with their
/// shapes, waiting for a weight update.
pub fn wake(
    model: &CausalLm,
    residency: WeightResidency,
    shapes: &[Vec<i64>],
) -> Result<WeightResidency, EngineError> {
    let (device, kind) = (model.params.device(), model.params.kind());
    match residency {
        WeightResidency::Resident | WeightResidency::Offloaded { host: None } => {}
        WeightResidency::Offloaded { host: Some(host) } => {
            replace_storage(model, |index, _| Ok(host[index].f_to_device(device)?))?;
        }
        WeightResidency::Discarded => {
            replace_storage(model, |index, _| {
                Ok(Tensor::f_zeros(shapes[index].as_slice(), (kind, device))?)
            })?;
        }
    }
    Ok(WeightResidency::Resident)
}

/// Copies a bucket into the resident weights after checking every tensor of it: on any error
/// nothing is changed. A packed name of the tensor-parallel name map (`…qkv_proj.*`,
/// `…gate_up_proj.*`, see [`crate::tp::reshard`]) is split back into its members by their
/// rows. Returns the number of tensors updated.
pub fn apply_bucket(model: &CausalLm, bucket: &WeightBucket) -> Result<usize, EngineError> {
    let mut staged = Vec::with_capacity(bucket.tensors.len());
    for named in &bucket.tensors {
        let value = named.to_tensor()?;
        let targets = match model.params.get(&named.name) {
            Some(_) => vec![named.name.clone()],
            None => crate::tp::reshard::unpacked_names(&named.name)
                .map(|members| members.into_iter().map(|(_, name)| name).collect())
                .ok_or_else(|| EngineError::InvalidWeight {
                    name: named.name.clone(),
                    message: "the model has no parameter of this name".into(),
                })?,
        };
        let mut rows = Vec::with_capacity(targets.len());
        let mut expected = Vec::new();
        for name in &targets {
            let target = model.params.get(name).ok_or_else(|| EngineError::InvalidWeight {
                name: named.name.clone(),
                message: format!("the model has no parameter `{name}` to unpack it into"),
            })?;
            let size = target.size();
            rows.push(size.first().copied().unwrap_or(1));
            match expected.is_empty() {
                true => expected = size,
                false => expected[0] += size[0],
            }
        }
        if value.size() != expected {
            return Err(EngineError::InvalidWeight {
                name: named.name.clone(),
                message: format!("shape should be {expected:?}, found {:?}", value.size()),
            });
        }
        let parts = match targets.len() {
            1 => vec![value],
            _ => crate::tp::reshard::unpack(&value, &rows)?,
        };
        staged.extend(targets.into_iter().zip(parts));
    }
    for (name, value) in &staged {
        model.params.copy_into(name, value)?;
    }
    Ok(staged.len())
}

/// The shapes of every parameter, in `named_parameters` order.
pub fn parameter_shapes(model: &CausalLm) -> Vec<Vec<i64>> {
    model.named_parameters().map(|(_, t)| t.size()).collect()
}

/// Checks that `model` lives on `device` in `kind`.
pub fn check_placement(model: &CausalLm, device: Device, kind: Kind) -> Result<(), EngineError> {
    let (found_device, found_kind) = (model.params.device(), model.params.kind());
    if found_device != device || found_kind != kind {
        return Err(EngineError::InvalidConfig(format!(
            "the engine config asks for {device:?} / {kind:?}, the model is on {found_device:?} / {found_kind:?}"
        )));
    }
    Ok(())
}

/// Puts one rank's weights and KV cache to sleep (level 1: offload the weights, level 2:
/// release them): the cache is freed and the fused projections dropped first.
pub(crate) fn sleep_rank(
    runner: &mut crate::runner::ModelRunner,
    residency: &mut WeightResidency,
    level: u32,
) -> Result<(), EngineError> {
    runner.free_kv_cache();
    runner.unfuse();
    let current = std::mem::replace(residency, WeightResidency::Resident);
    *residency = put_to_sleep(runner.model(), current, level)?;
    // Freed tensors go back to libtorch's cache, not to the GPU: give them back so the
    // training roles colocated on this GPU can use the memory.
    rtrun_rlhf_model::cuda::empty_cache()?;
    Ok(())
}

/// Wakes one rank's weights and/or KV cache (an empty list wakes both; weights first).
pub(crate) fn wake_rank(
    runner: &mut crate::runner::ModelRunner,
    residency: &mut WeightResidency,
    shapes: &[Vec<i64>],
    num_blocks: usize,
    targets: &[crate::WakeTarget],
) -> Result<(), EngineError> {
    use crate::WakeTarget;
    let all = targets.is_empty();
    if all || targets.contains(&WakeTarget::Weights) {
        let current = std::mem::replace(residency, WeightResidency::Resident);
        *residency = wake(runner.model(), current, shapes)?;
        runner.fuse()?;
    }
    if (all || targets.contains(&WakeTarget::KvCache)) && !runner.has_kv_cache() {
        runner.allocate_kv_cache(num_blocks)?;
    }
    Ok(())
}

/// The KV blocks `config` asks for on `runner` (every tensor-parallel rank computes the same
/// number: each holds as many key/value heads).
pub(crate) fn kv_blocks(
    config: &crate::EngineConfig,
    runner: &crate::runner::ModelRunner,
) -> Result<usize, EngineError> {
    let num_blocks = match config.num_gpu_blocks {
        Some(blocks) => blocks,
        None => usize::try_from(config.kv_cache_bytes / runner.kv_bytes_per_block())
            .unwrap_or(usize::MAX),
    };
    if num_blocks == 0 {
        return Err(EngineError::InvalidConfig(format!(
            "the kv cache must hold at least one block of {} bytes, found num_gpu_blocks {:?} and kv_cache_bytes {}",
            runner.kv_bytes_per_block(),
            config.num_gpu_blocks,
            config.kv_cache_bytes
        )));
    }
    Ok(num_blocks)
}

/// One rank's runner over `model` (the whole model, or its shard with `tp`) as `config` asks,
/// with its KV cache allocated; also the parameters' shapes (to wake discarded weights) and the
/// cache's blocks.
pub(crate) fn rank_runner(
    model: CausalLm,
    tp: Option<crate::tp::TensorParallel>,
    config: &crate::EngineConfig,
) -> Result<(crate::runner::ModelRunner, Vec<Vec<i64>>, usize), EngineError> {
    check_placement(&model, config.torch_device()?, config.torch_kind()?)?;
    if config.torch_device()? == Device::Cpu {
        // Each step's activations are allocated afresh; see `host_memory`.
        rtrun_rlhf_model::host_memory::keep_freed_memory();
    }
    model.params.set_requires_grad(false)?;
    let shapes = parameter_shapes(&model);
    let mut runner = crate::runner::ModelRunner::new(model, tp, config.block_size)?;
    if let Some(on) = config.static_decode {
        runner.set_static_decode(on);
    }
    runner.set_enforce_eager(config.enforce_eager);
    let num_blocks = kv_blocks(config, &runner)?;
    runner.allocate_kv_cache(num_blocks)?;
    Ok((runner, shapes, num_blocks))
}
