//! The all-reduce of a tensor-parallel rank's partial outputs (after `o_proj` and after
//! `down_proj`), on the group's communicator: the CPU ring in place on a float32 CPU tensor,
//! NCCL on the device with the `cuda` feature and the nccl backend, host-staged otherwise.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list: NCCL on a tensor's memory.

use std::cell::{Cell, RefCell};

use rtrun::collective::{Communicator, ReduceOp};
use tch::{Device, Kind, Tensor};

use crate::error::EngineError;

/// A rank's tensor-parallel communicator and what it moved.
#[derive(Debug)]
pub struct TensorParallel {
    comm: RefCell<Communicator>,
    rank: usize,
    collectives: Cell<u64>,
    bytes: Cell<u64>,
}

impl TensorParallel {
    /// Wraps the group's communicator (rank and world size are the communicator's).
    pub fn new(comm: Communicator) -> Self {
        let rank = comm.rank();
        Self { comm: RefCell::new(comm), rank, collectives: Cell::new(0), bytes: Cell::new(0) }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.comm.borrow().world_size()
    }

    /// All-reduces issued and the bytes each rank contributed to them.
    pub fn totals(&self) -> (u64, u64) {
        (self.collectives.get(), self.bytes.get())
    }

    /// The sum over the ranks of every rank's `partial` (same shape everywhere), in `partial`'s
    /// kind and device. Every rank gets the same values bit for bit (the ring's all-gather
    /// copies each reduced chunk from its owner).
    pub fn all_reduce(&self, partial: Tensor) -> Result<Tensor, EngineError> {
        let mut comm = self.comm.borrow_mut();
        let failed = |e| EngineError::TensorParallel {
            rank: self.rank,
            message: format!("all-reduce of a layer's partial outputs: {e}"),
        };
        self.collectives.set(self.collectives.get() + 1);
        self.bytes.set(self.bytes.get() + (partial.numel() * 4) as u64);
        let (kind, device) = (partial.f_kind()?, partial.device());
        if device == Device::Cpu && kind == Kind::Float {
            let t = partial.f_contiguous()?;
            crate::runner::cpu_kernels::with_floats_mut(&t, |values| {
                comm.all_reduce_f32(values, ReduceOp::Sum)
            })?
            .map_err(failed)?;
            return Ok(t);
        }
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(index), Some(nccl)) = (device, comm.cuda_device())
            && index == nccl
        {
            let t = partial.f_to_kind(Kind::Float)?.f_contiguous()?;
            // SAFETY: `t` is a live contiguous f32 tensor on the communicator's device, held
            // until the call returns (it synchronises the stream), and nothing else uses it.
            unsafe { comm.all_reduce_device_f32(t.data_ptr() as u64, t.numel(), ReduceOp::Sum) }
                .map_err(failed)?;
            return Ok(t.f_to_kind(kind)?);
        }
        let host = partial.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?.f_contiguous()?;
        let mut values = Vec::<f32>::try_from(host.f_view(-1)?)?;
        comm.all_reduce_f32(&mut values, ReduceOp::Sum).map_err(failed)?;
        let summed = Tensor::f_from_slice(&values)?.f_view(partial.size().as_slice())?;
        Ok(summed.f_to_device(device)?.f_to_kind(kind)?)
    }
}
