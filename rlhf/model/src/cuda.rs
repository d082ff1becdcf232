//! What tch does not bind of libtorch's CUDA caching allocator: giving cached blocks back to
//! the driver (`torch.cuda.empty_cache`) and its statistics (`torch.cuda.memory_stats`).
//!
//! Freeing a tensor returns its memory to the allocator's cache, not to the GPU; a role that
//! sleeps or offloads so that another process on the same GPU can use the memory must empty
//! the cache as well. The calls go to a small C++ shim (`src/cuda/shim.cpp`, built with the
//! `cuda` feature). Without that feature, or without a GPU, there is nothing to empty and no
//! statistics.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use serde::{Deserialize, Serialize};

/// The caching allocator's view of one device, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaMemory {
    /// Bytes held by live tensors.
    pub allocated: u64,
    /// Most bytes held by live tensors since the last [`reset_peak`].
    pub peak_allocated: u64,
    /// Bytes the allocator holds from the driver (live tensors plus its cache).
    pub reserved: u64,
    /// Most bytes reserved since the last [`reset_peak`].
    pub peak_reserved: u64,
}

#[cfg(feature = "cuda")]
mod ffi {
    unsafe extern "C" {
        pub fn rtrun_cuda_empty_cache(err: *mut u8, len: usize) -> i32;
        pub fn rtrun_cuda_memory_stats(device: i32, out: *mut i64, err: *mut u8, len: usize)
        -> i32;
        pub fn rtrun_cuda_reset_peak(device: i32, err: *mut u8, len: usize) -> i32;
    }
}

#[cfg(feature = "cuda")]
fn call(f: impl FnOnce(*mut u8, usize) -> i32) -> Result<(), String> {
    let mut err = [0u8; 512];
    if f(err.as_mut_ptr(), err.len()) == 0 {
        return Ok(());
    }
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    Err(String::from_utf8_lossy(&err[..end]).into_owned())
}

/// Whether a CUDA device is usable from this build and process.
fn usable() -> bool {
    cfg!(feature = "cuda") && tch::Cuda::is_available()
}

/// Gives the allocator's cached, unused blocks back to the driver. Does nothing without CUDA.
pub fn empty_cache() -> crate::Result<()> {
    if !usable() {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    // SAFETY: the shim writes at most `len` bytes into `err`.
    call(|err, len| unsafe { ffi::rtrun_cuda_empty_cache(err, len) })
        .map_err(|e| crate::ModelError::Config(format!("emptying the CUDA cache: {e}")))?;
    Ok(())
}

/// The allocator's statistics for CUDA device `device`; `None` without CUDA.
pub fn memory(device: usize) -> Option<CudaMemory> {
    if !usable() {
        return None;
    }
    #[cfg(feature = "cuda")]
    {
        let mut out = [0i64; 4];
        let device = i32::try_from(device).ok()?;
        // SAFETY: `out` has the four slots the shim writes; `err` as above.
        call(|err, len| unsafe {
            ffi::rtrun_cuda_memory_stats(device, out.as_mut_ptr(), err, len)
        })
        .ok()?;
        let [allocated, peak_allocated, reserved, peak_reserved] = out.map(|v| v.max(0) as u64);
        Some(CudaMemory { allocated, peak_allocated, reserved, peak_reserved })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}

/// [`memory`] of the CUDA device `device` (`None` for the CPU), then, with `reset_peak`, a new
/// peak: what a role reports at the end of each phase.
pub fn memory_on(device: tch::Device, reset_peak_after: bool) -> Option<CudaMemory> {
    let tch::Device::Cuda(index) = device else {
        return None;
    };
    let read = memory(index);
    if reset_peak_after {
        reset_peak(index);
    }
    read
}

/// Starts a new peak for [`memory`]'s `peak_*` fields. Does nothing without CUDA.
pub fn reset_peak(device: usize) {
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    #[cfg(feature = "cuda")]
    if usable()
        && let Ok(device) = i32::try_from(device)
    {
        // SAFETY: as above.
        if let Err(e) = call(|err, len| unsafe { ffi::rtrun_cuda_reset_peak(device, err, len) }) {
            tracing::warn!("resetting the CUDA memory peak: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn without_a_gpu_there_is_nothing_to_empty_and_no_statistics() {
        if tch::Cuda::is_available() {
            return;
        }
        super::empty_cache().unwrap();
        assert_eq!(super::memory(0), None);
        super::reset_peak(0);
    }
}
