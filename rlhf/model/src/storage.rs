//! What sharded training needs of a tensor that `tch` does not bind, through a small C++ shim
//! (`src/storage/shim.cpp`, compiled by `build.rs` against the libtorch headers):
//!
//! - [`free_storage`] / [`allocate_storage`]: release a tensor's storage memory and give it a
//!   fresh allocation in place, as FSDP does with `storage.resize_(0)`. Every tensor that views
//!   the storage follows — the model's parameters (views into their layer's flat buffer) and
//!   the views autograd saved for the backward pass — so a ZeRO-3 layer's gathered parameters
//!   really leave memory after its forward, and the backward finds them again once they are
//!   gathered back into the same storage.
//! - [`clear_grad`]: drop a parameter's `.grad` (tch can only zero it), so ZeRO-2/3 hold no
//!   full gradient once it has been reduce-scattered into the rank's shard.
//! - [`track_host_allocations`] and [`host_allocations`]: a counting wrapper around c10's CPU
//!   allocator, the measured "bytes of host tensors" (current and peak) that the memory
//!   benchmark reports, as `torch.cuda.max_memory_allocated` is on a GPU.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use tch::Tensor;

use crate::error::{ModelError, Result};

mod ffi {
    use tch::Tensor;

    // `C_tensor` is an opaque `at::Tensor`; the shim takes `at::Tensor*`.
    type TensorPtr = *mut torch_sys::C_tensor;

    unsafe extern "C" {
        pub fn rtrun_storage_resize(t: TensorPtr, nbytes: usize, err: *mut u8, len: usize) -> i32;
        pub fn rtrun_storage_nbytes(t: TensorPtr) -> i64;
        pub fn rtrun_clear_grad(t: TensorPtr, err: *mut u8, len: usize) -> i32;
        pub fn rtrun_track_host_allocations(err: *mut u8, len: usize) -> i32;
        pub fn rtrun_host_allocations(out: *mut i64);
        pub fn rtrun_reset_host_peak();
    }

    /// The `at::Tensor*` behind a tch tensor (the shim only reads the handle and mutates the
    /// shared C++ objects behind it, which tch's `&Tensor` methods do too).
    pub fn handle(t: &Tensor) -> TensorPtr {
        t.as_ptr() as TensorPtr
    }
}

fn call(what: &str, f: impl FnOnce(*mut u8, usize) -> i32) -> Result<()> {
    let mut err = [0u8; 512];
    if f(err.as_mut_ptr(), err.len()) == 0 {
        return Ok(());
    }
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    Err(ModelError::Hook(format!("{what}: {}", String::from_utf8_lossy(&err[..end]))))
}

/// Releases the memory of `tensor`'s storage. The tensor (and every view of the storage) keeps
/// its shape but must not be read until [`allocate_storage`] gives it memory again.
pub fn free_storage(tensor: &Tensor) -> Result<()> {
    // SAFETY: the handle is a live tensor (borrowed for the call); the shim writes at most
    // `len` bytes into `err`.
    call("freeing a storage", |err, len| unsafe {
        ffi::rtrun_storage_resize(ffi::handle(tensor), 0, err, len)
    })
}

/// Gives `tensor`'s storage a fresh (uninitialised) allocation of `nbytes` bytes from its own
/// allocator, in place: the tensor and every view of the storage see the new memory.
pub fn allocate_storage(tensor: &Tensor, nbytes: usize) -> Result<()> {
    // SAFETY: as in `free_storage`.
    call("allocating a storage", |err, len| unsafe {
        ffi::rtrun_storage_resize(ffi::handle(tensor), nbytes, err, len)
    })
}

/// The bytes of `tensor`'s storage (0 after [`free_storage`]).
pub fn storage_bytes(tensor: &Tensor) -> usize {
    // SAFETY: the handle is a live tensor borrowed for the call; the shim only reads it.
    let bytes = unsafe { ffi::rtrun_storage_nbytes(ffi::handle(tensor)) };
    usize::try_from(bytes).unwrap_or(0)
}

/// Drops `tensor.grad`, releasing its memory unless something else holds it.
pub fn clear_grad(tensor: &Tensor) -> Result<()> {
    // SAFETY: as in `free_storage`.
    call("clearing a gradient", |err, len| unsafe {
        ffi::rtrun_clear_grad(ffi::handle(tensor), err, len)
    })
}

/// Host tensor bytes as counted since [`track_host_allocations`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostAllocations {
    /// Bytes of live host tensors allocated since tracking began.
    pub current: i64,
    /// The most `current` has been since tracking began or [`reset_host_peak`].
    pub peak: i64,
}

/// Counts every later host tensor allocation of this process (idempotent). Memory allocated
/// before is not counted, and its release is not subtracted.
pub fn track_host_allocations() -> Result<()> {
    // SAFETY: the shim writes at most `len` bytes into `err`.
    call("tracking host allocations", |err, len| unsafe {
        ffi::rtrun_track_host_allocations(err, len)
    })
}

/// The counted host tensor bytes (zeros before [`track_host_allocations`]).
pub fn host_allocations() -> HostAllocations {
    let mut out = [0i64; 2];
    // SAFETY: the shim writes exactly two values into `out`.
    unsafe { ffi::rtrun_host_allocations(out.as_mut_ptr()) };
    HostAllocations { current: out[0], peak: out[1] }
}

/// Starts a new peak from the current count.
pub fn reset_host_peak() {
    // SAFETY: no arguments; the shim updates its own counters.
    unsafe { ffi::rtrun_reset_host_peak() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// A freed storage comes back in place: views taken before (as autograd saves them) read
    /// what is written into the storage afterwards, and the bytes are really released.
    #[test]
    fn a_freed_storage_comes_back_under_its_views() {
        let flat = Tensor::zeros([6], (Kind::Float, Device::Cpu));
        let view = flat.narrow(0, 2, 3).view([3, 1]);
        let transposed = view.tr();
        assert_eq!(storage_bytes(&flat), 24);
        free_storage(&flat).unwrap();
        assert_eq!(storage_bytes(&flat), 0);
        assert_eq!(storage_bytes(&view), 0);
        allocate_storage(&flat, 24).unwrap();
        let mut target = flat.shallow_clone();
        target.copy_(&Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0]));
        assert_eq!(Vec::<f32>::try_from(&transposed.reshape([-1])).unwrap(), vec![2.0, 3.0, 4.0]);
    }

    #[test]
    fn gradients_can_be_dropped() {
        let w = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        (&w * &w).sum(Kind::Float).backward();
        assert!(w.grad().defined());
        clear_grad(&w).unwrap();
        assert!(!w.grad().defined());
        (&w * 3.0).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(&w.grad()).unwrap(), vec![3.0, 3.0]);
    }

    #[test]
    fn host_allocations_are_counted() {
        track_host_allocations().unwrap();
        let before = host_allocations();
        let t = Tensor::zeros([1 << 20], (Kind::Float, Device::Cpu));
        let during = host_allocations();
        assert!(during.current - before.current >= 4 << 20, "{before:?} {during:?}");
        assert!(during.peak >= during.current);
        drop(t);
        // Other tests' tensors may come and go on their threads; ours is released at least.
        assert!(host_allocations().current <= during.current);
    }
}
