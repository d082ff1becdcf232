//! Per-dtype contiguous buffers: a set of named tensors laid end to end in one flat buffer per
//! dtype, every tensor a view of its buffer, so a class of tensors moves between the device
//! and host memory as a few large copies and the weight sync reads buckets that are plain
//! slices of a buffer (no per-parameter copy).
//!
//! A tensor is pointed at its view with `set_data` on a shallow clone: the model's layers, the
//! optimizer and `.grad` hold shallow clones of the same tensor, so they all follow without
//! being rebuilt (the engine's weight offload and its fused projections do the same).

use tch::{Device, Kind, Tensor};

use super::plan::Residency;
use crate::error::{Result, ShardError};

/// One tensor's place in its dtype's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// The tensor's name (a parameter's Hugging Face name, `exp_avg.<name>` for a moment).
    pub name: String,
    /// Its dtype: the buffer it lives in.
    pub kind: Kind,
    /// Its first element in the buffer.
    pub offset: i64,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Its number of elements.
    pub numel: i64,
}

impl TensorMeta {
    /// Its bytes.
    pub fn bytes(&self) -> u64 {
        element_bytes(self.kind, self.numel)
    }
}

/// A contiguous range of one dtype's buffer, cut at tensor boundaries: what one weight-sync
/// message carries.
#[derive(Debug)]
pub struct Bucket {
    /// The dtype of its buffer.
    pub kind: Kind,
    /// Its first element in the buffer.
    pub offset: i64,
    /// Its number of elements.
    pub numel: i64,
    /// The tensors it holds, in buffer order.
    pub tensors: Vec<TensorMeta>,
    view: Tensor,
}

impl Bucket {
    /// A 1-D view of the bucket's range of the buffer (shares its storage: no copy).
    pub fn view(&self) -> &Tensor {
        &self.view
    }

    /// Its bytes.
    pub fn bytes(&self) -> u64 {
        element_bytes(self.kind, self.numel)
    }
}

/// One dtype's buffer.
#[derive(Debug)]
struct DtypeBuffer {
    kind: Kind,
    numel: i64,
    /// `[numel]`, on the device or in host memory; `None` once released.
    data: Option<Tensor>,
}

/// Named tensors laid out in one contiguous buffer per dtype (see the module doc).
#[derive(Debug)]
pub struct FlatBuffers {
    /// The device the buffers live on when resident.
    device: Device,
    metas: Vec<TensorMeta>,
    /// Shallow clones of the tensors, in `metas` order: what is pointed at the views.
    handles: Vec<Tensor>,
    buffers: Vec<DtypeBuffer>,
    /// [`Residency::Device`], [`Residency::Host`] or, once released, [`Residency::Freed`].
    residency: Residency,
}

fn element_bytes(kind: Kind, numel: i64) -> u64 {
    kind.elt_size_in_bytes() as u64 * numel.max(0) as u64
}

/// A host tensor of `numel` elements: pinned when it will be copied to or from a GPU.
fn host_buffer(kind: Kind, numel: i64, device: Device) -> Result<Tensor> {
    let host = Tensor::f_empty([numel], (kind, Device::Cpu))?;
    Ok(if device.is_cuda() { host.f_pin_memory(device)? } else { host })
}

impl FlatBuffers {
    /// Lays `named` (shallow clones of the tensors to repoint) out in one new buffer per dtype
    /// on `device`, copies their values in and points every tensor at its view.
    pub fn build(
        named: impl IntoIterator<Item = (String, Tensor)>,
        device: Device,
    ) -> Result<Self> {
        Self::lay_out(named, device, Residency::Device)
    }

    /// As [`FlatBuffers::build`], but the buffers are made in host memory (pinned when
    /// `device` is a GPU): the offload of tensors not laid out yet, with no device buffer
    /// allocated on the way.
    pub fn build_offloaded(
        named: impl IntoIterator<Item = (String, Tensor)>,
        device: Device,
    ) -> Result<Self> {
        Self::lay_out(named, device, Residency::Host)
    }

    fn lay_out(
        named: impl IntoIterator<Item = (String, Tensor)>,
        device: Device,
        residency: Residency,
    ) -> Result<Self> {
        let mut metas = Vec::new();
        let mut handles = Vec::new();
        let mut buffers: Vec<DtypeBuffer> = Vec::new();
        for (name, tensor) in named {
            if !tensor.defined() {
                return Err(ShardError::Config(format!(
                    "flat buffers need defined tensors, `{name}` is undefined"
                )));
            }
            let kind = tensor.f_kind()?;
            let index = match buffers.iter().position(|b| b.kind == kind) {
                Some(index) => index,
                None => {
                    buffers.push(DtypeBuffer { kind, numel: 0, data: None });
                    buffers.len() - 1
                }
            };
            let numel = tensor.numel() as i64;
            metas.push(TensorMeta {
                name,
                kind,
                offset: buffers[index].numel,
                shape: tensor.size(),
                numel,
            });
            buffers[index].numel += numel;
            handles.push(tensor);
        }
        for buffer in &mut buffers {
            buffer.data = Some(match residency {
                Residency::Host => host_buffer(buffer.kind, buffer.numel, device)?,
                _ => Tensor::f_empty([buffer.numel], (buffer.kind, device))?,
            });
        }
        let flat = Self { device, metas, handles, buffers, residency };
        tch::no_grad(|| -> Result<()> {
            for (meta, handle) in flat.metas.iter().zip(&flat.handles) {
                let mut slot = flat.slice(meta)?;
                slot.f_copy_(handle)?;
            }
            Ok(())
        })?;
        flat.repoint()?;
        Ok(flat)
    }

    /// Every tensor's place, in the order they were given.
    pub fn metas(&self) -> &[TensorMeta] {
        &self.metas
    }

    /// The dtypes, one buffer each, in order of first appearance.
    pub fn kinds(&self) -> Vec<Kind> {
        self.buffers.iter().map(|b| b.kind).collect()
    }

    /// Where the buffers are.
    pub fn residency(&self) -> Residency {
        self.residency
    }

    /// The device the buffers live on when resident.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Bytes laid out, wherever they are (the sum of every tensor's numel × element size).
    pub fn bytes(&self) -> u64 {
        self.buffers.iter().map(|b| element_bytes(b.kind, b.numel)).sum()
    }

    /// Bytes laid out per dtype.
    pub fn bytes_by_kind(&self) -> Vec<(Kind, u64)> {
        self.buffers.iter().map(|b| (b.kind, element_bytes(b.kind, b.numel))).collect()
    }

    /// Bytes held on the device now (0 while offloaded or released).
    pub fn device_bytes(&self) -> u64 {
        if self.residency == Residency::Device { self.bytes() } else { 0 }
    }

    /// Bytes held in host buffers now (0 while resident or released).
    pub fn host_bytes(&self) -> u64 {
        if self.residency == Residency::Host { self.bytes() } else { 0 }
    }

    /// The 1-D buffer of `kind`, wherever it is now.
    pub fn buffer(&self, kind: Kind) -> Option<&Tensor> {
        self.buffers.iter().find(|b| b.kind == kind).and_then(|b| b.data.as_ref())
    }

    /// Whether `current` are the tensors laid out here, each still a view at its place (not
    /// replaced by another tensor, nor repointed elsewhere since).
    pub fn is_laid_out(&self, current: &[(String, Tensor)]) -> bool {
        current.len() == self.metas.len()
            && current.iter().zip(&self.metas).all(|((name, tensor), meta)| {
                *name == meta.name
                    && tensor.defined()
                    && tensor.f_kind().ok() == Some(meta.kind)
                    && tensor.size() == meta.shape
                    && (meta.numel == 0 || self.points_at(tensor, meta))
            })
    }

    fn points_at(&self, tensor: &Tensor, meta: &TensorMeta) -> bool {
        let Some(buffer) = self.buffer(meta.kind) else {
            return false;
        };
        let start = buffer.data_ptr() as usize;
        let expected = start + element_bytes(meta.kind, meta.offset) as usize;
        tensor.data_ptr() as usize == expected
    }

    /// Copies the buffers into new host buffers (pinned when the device is a GPU), points the
    /// tensors there and drops the device buffers, so their memory is released. On a CPU
    /// device too the copy is a separate allocation. Returns the bytes copied.
    pub fn offload(&mut self) -> Result<u64> {
        self.require(Residency::Device, "offload")?;
        for buffer in &mut self.buffers {
            let mut host = host_buffer(buffer.kind, buffer.numel, self.device)?;
            if let Some(device) = &buffer.data {
                tch::no_grad(|| host.f_copy_(device))?;
            }
            buffer.data = Some(host);
        }
        self.residency = Residency::Host;
        self.repoint()?;
        Ok(self.bytes())
    }

    /// Allocates device buffers, copies the host buffers in, points the tensors there and
    /// drops the host buffers. Returns the bytes copied.
    pub fn onload(&mut self) -> Result<u64> {
        self.require(Residency::Host, "onload")?;
        for buffer in &mut self.buffers {
            let mut device = Tensor::f_empty([buffer.numel], (buffer.kind, self.device))?;
            if let Some(host) = &buffer.data {
                tch::no_grad(|| device.f_copy_(host))?;
            }
            buffer.data = Some(device);
        }
        self.residency = Residency::Device;
        self.repoint()?;
        Ok(self.bytes())
    }

    /// Contiguous slices of the buffers of at most `max_bytes` each (a tensor larger than
    /// that is a bucket of its own), cut at tensor boundaries; together they cover every
    /// tensor once, in buffer order. Each bucket's [`Bucket::view`] shares the buffer.
    pub fn bucket_slices(&self, max_bytes: u64) -> Result<Vec<Bucket>> {
        if max_bytes == 0 {
            return Err(ShardError::Config(
                "a bucket's max_bytes should be positive, found 0".into(),
            ));
        }
        let mut buckets = Vec::new();
        for buffer in &self.buffers {
            let data = buffer.data.as_ref().ok_or_else(|| {
                ShardError::Config("bucket_slices: the buffers were released".into())
            })?;
            let mut open: Vec<TensorMeta> = Vec::new();
            let mut bytes = 0;
            let metas = self.metas.iter().filter(|m| m.kind == buffer.kind);
            for meta in metas {
                if !open.is_empty() && bytes + meta.bytes() > max_bytes {
                    buckets.push(Self::bucket(data, buffer.kind, std::mem::take(&mut open))?);
                    bytes = 0;
                }
                bytes += meta.bytes();
                open.push(meta.clone());
            }
            if !open.is_empty() {
                buckets.push(Self::bucket(data, buffer.kind, open)?);
            }
        }
        Ok(buckets)
    }

    fn bucket(data: &Tensor, kind: Kind, tensors: Vec<TensorMeta>) -> Result<Bucket> {
        let offset = tensors.first().map_or(0, |m| m.offset);
        let numel = tensors.iter().map(|m| m.numel).sum();
        let view = data.f_narrow(0, offset, numel)?;
        Ok(Bucket { kind, offset, numel, tensors, view })
    }

    fn require(&self, residency: Residency, what: &str) -> Result<()> {
        if self.residency == residency {
            return Ok(());
        }
        Err(ShardError::Config(format!(
            "{what} needs the flat buffers {residency:?}, found them {:?}",
            self.residency
        )))
    }

    /// The view of `meta` in its buffer, shaped as the tensor.
    fn slice(&self, meta: &TensorMeta) -> Result<Tensor> {
        let buffer = self.buffer(meta.kind).ok_or_else(|| {
            ShardError::Config(format!("`{}`: no {:?} buffer", meta.name, meta.kind))
        })?;
        Ok(buffer.f_narrow(0, meta.offset, meta.numel)?.f_view(meta.shape.as_slice())?)
    }

    /// Points every tensor at its view of the current buffers.
    fn repoint(&self) -> Result<()> {
        tch::no_grad(|| {
            for (meta, handle) in self.metas.iter().zip(&self.handles) {
                handle.shallow_clone().f_set_data(&self.slice(meta)?)?;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(tensors: &[(&str, &Tensor)]) -> Vec<(String, Tensor)> {
        tensors.iter().map(|(n, t)| (n.to_string(), t.shallow_clone())).collect()
    }

    #[test]
    fn tensors_become_views_of_one_buffer_per_dtype() {
        let a = Tensor::from_slice(&[1f32, 2., 3., 4.]).view([2, 2]);
        let b = Tensor::from_slice(&[5f64, 6.]);
        let c = Tensor::from_slice(&[7f32]);
        let (a0, b0, c0) = (a.copy(), b.copy(), c.copy());
        let mut flat =
            FlatBuffers::build(named(&[("a", &a), ("b", &b), ("c", &c)]), Device::Cpu).unwrap();
        assert_eq!(flat.kinds(), [Kind::Float, Kind::Double]);
        assert_eq!(flat.bytes_by_kind(), [(Kind::Float, 20), (Kind::Double, 16)]);
        assert_eq!((flat.bytes(), flat.device_bytes(), flat.host_bytes()), (36, 36, 0));
        assert!(a.equal(&a0) && b.equal(&b0) && c.equal(&c0));
        let floats = flat.buffer(Kind::Float).unwrap();
        assert_eq!(Vec::<f32>::try_from(floats).unwrap(), [1., 2., 3., 4., 7.]);
        assert_eq!(flat.metas()[2].offset, 4);
        // The tensors are views: writing one writes the buffer.
        let _ = c.shallow_clone().fill_(9.0);
        assert_eq!(floats.double_value(&[4]), 9.0);
        let current = named(&[("a", &a), ("b", &b), ("c", &c)]);
        assert!(flat.is_laid_out(&current));
        // Offloaded: a separate host allocation, values kept, views follow.
        let device_ptr = floats.data_ptr() as usize;
        assert_eq!(flat.offload().unwrap(), 36);
        assert_eq!((flat.device_bytes(), flat.host_bytes()), (0, 36));
        assert_ne!(flat.buffer(Kind::Float).unwrap().data_ptr() as usize, device_ptr);
        assert!(flat.is_laid_out(&current) && a.equal(&a0) && b.equal(&b0));
        assert!(flat.offload().unwrap_err().to_string().contains("found them Host"));
        assert_eq!(flat.onload().unwrap(), 36);
        assert!(flat.is_laid_out(&current) && a.equal(&a0) && b.equal(&b0));
        // A tensor pointed elsewhere is no longer laid out.
        a.shallow_clone().set_data(&a0.copy());
        assert!(!flat.is_laid_out(&current));
    }

    #[test]
    fn buckets_cover_every_tensor_once_within_the_limit() {
        let tensors: Vec<Tensor> = [3i64, 1, 4, 1, 5, 9, 2, 6]
            .iter()
            .map(|&n| Tensor::rand([n], (Kind::Float, Device::Cpu)))
            .collect();
        let names: Vec<String> = (0..tensors.len()).map(|i| format!("t{i}")).collect();
        let list: Vec<(String, Tensor)> =
            names.iter().zip(&tensors).map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        let flat = FlatBuffers::build(list, Device::Cpu).unwrap();
        assert!(flat.bucket_slices(0).is_err());
        for max_bytes in [1, 4, 16, 24, 1000] {
            let buckets = flat.bucket_slices(max_bytes).unwrap();
            let covered: Vec<&str> =
                buckets.iter().flat_map(|b| b.tensors.iter().map(|m| m.name.as_str())).collect();
            assert_eq!(covered, names.iter().map(String::as_str).collect::<Vec<_>>());
            for bucket in &buckets {
                assert!(bucket.bytes() <= max_bytes || bucket.tensors.len() == 1);
                let joined: Vec<Tensor> = bucket
                    .tensors
                    .iter()
                    .map(|m| {
                        tensors[names.iter().position(|n| *n == m.name).unwrap()].reshape([-1])
                    })
                    .collect();
                assert!(bucket.view().equal(&Tensor::cat(&joined, 0)));
                assert_eq!(
                    bucket.bytes(),
                    bucket.tensors.iter().map(TensorMeta::bytes).sum::<u64>()
                );
            }
        }
    }
}
