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
/// nothing is changed. Returns the number of tensors updated.
pub fn apply_bucket(model: &CausalLm, bucket: &WeightBucket) -> Result<usize, EngineError> {
    let mut staged = Vec::with_capacity(bucket.tensors.len());
    for named in &bucket.tensors {
        let target = model.params.get(&named.name).ok_or_else(|| EngineError::InvalidWeight {
            name: named.name.clone(),
            message: "the model has no parameter of this name".into(),
        })?;
        let value = named.to_tensor()?;
        if value.size() != target.size() {
            return Err(EngineError::InvalidWeight {
                name: named.name.clone(),
                message: format!("shape should be {:?}, found {:?}", target.size(), value.size()),
            });
        }
        staged.push((named.name.as_str(), value));
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
