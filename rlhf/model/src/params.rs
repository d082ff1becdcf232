//! The parameter registry: every weight of a model under its Hugging Face name, in a stable
//! order.
//!
//! Layers hold shallow clones of the tensors registered here, so updating a tensor in place
//! through the registry (loading a checkpoint, an optimizer step, a weight-sync bucket from the
//! trainer) is seen by the forward pass without rebuilding anything.

use tch::{Device, Kind, Tensor};

use crate::error::{ModelError, Result};

/// How a new parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with mean zero and the given standard deviation.
    Normal(f64),
    /// Every element set to the value (ones for norms, zeros for biases).
    Constant(f64),
}

/// Named parameters in registration order.
#[derive(Debug)]
pub struct Parameters {
    entries: Vec<(String, Tensor)>,
    device: Device,
    kind: Kind,
}

impl Parameters {
    /// An empty registry creating parameters of `kind` on `device`.
    pub fn new(device: Device, kind: Kind) -> Self {
        Self { entries: Vec::new(), device, kind }
    }

    /// Creates, registers and returns a trainable parameter.
    pub fn create(&mut self, name: &str, shape: &[i64], init: Init) -> Result<Tensor> {
        if self.entries.iter().any(|(n, _)| n == name) {
            return Err(ModelError::Input(format!(
                "parameter names should be unique, found `{name}` twice"
            )));
        }
        let options = (Kind::Float, self.device);
        let tensor = match init {
            Init::Normal(std) => Tensor::f_randn(shape, options)?.f_mul_scalar(std)?,
            Init::Constant(value) => Tensor::f_full(shape, value, options)?,
        };
        let tensor = tensor.f_to_kind(self.kind)?.f_set_requires_grad(true)?;
        self.entries.push((name.to_string(), tensor.shallow_clone()));
        Ok(tensor)
    }

    /// The device parameters live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The dtype of the parameters.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// `(name, tensor)` pairs in registration order; the tensors share storage with the model.
    pub fn named(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.entries.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// The parameter called `name`, if any.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Total number of scalar elements.
    pub fn numel(&self) -> i64 {
        self.entries.iter().map(|(_, t)| t.numel() as i64).sum()
    }

    /// Copies `value` into the parameter `name` in place (converting dtype and device), after
    /// checking its shape.
    pub fn copy_into(&self, name: &str, value: &Tensor) -> Result<()> {
        let target = self
            .get(name)
            .ok_or_else(|| ModelError::Input(format!("no parameter named `{name}`")))?;
        let expected = target.size();
        let found = value.size();
        if expected != found {
            return Err(ModelError::Shape { name: name.to_string(), expected, found });
        }
        tch::no_grad(|| {
            let mut target = target.shallow_clone();
            target.f_copy_(value)
        })?;
        Ok(())
    }

    /// Turns gradient tracking on or off for every parameter (off for frozen reference models).
    pub fn set_requires_grad(&self, requires_grad: bool) -> Result<()> {
        for (_, tensor) in &self.entries {
            let _ = tensor.f_set_requires_grad(requires_grad)?;
        }
        Ok(())
    }
}
