//! oneDNN's inner product with the weight packed once into its blocked layout (what
//! `torch.compile` runs for a CPU linear), through a small C++ shim (`onednn.cpp`, built by
//! `build.rs`): tch binds neither `mkldnn::_reorder_linear_weight` nor
//! `mkldnn::_linear_pointwise`.
//!
//! Against the plain weight of `mkldnn_linear`, which oneDNN reorders on every call and which
//! wants its input converted to and from oneDNN's layout, the packed product takes and returns
//! dense rows and skips the reorder: measured with libtorch 2.13 on two Zen cores, `[64, 512] x
//! [512, 2816]` takes 385 µs against 470 (MKL: 917), and the 0.5M-parameter benchmark model's
//! projections at 64 rows take 20-46 µs against MKL's 25-88.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use tch::Tensor;
use torch_sys::C_tensor;

use crate::error::EngineError;

mod ffi {
    use torch_sys::C_tensor;

    unsafe extern "C" {
        pub fn rtrun_onednn_pack(
            weight: *const C_tensor,
            out: *mut *mut C_tensor,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn rtrun_onednn_linear(
            x: *const C_tensor,
            packed: *const C_tensor,
            bias: *const C_tensor,
            out: *mut *mut C_tensor,
            err: *mut u8,
            len: usize,
        ) -> i32;
    }
}

/// Runs a shim call that returns a new tensor, or the shim's error message.
fn call(
    what: &str,
    f: impl FnOnce(*mut *mut C_tensor, *mut u8, usize) -> i32,
) -> Result<Tensor, EngineError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let mut err = [0u8; 512];
    if f(&mut out, err.as_mut_ptr(), err.len()) == 0 && !out.is_null() {
        // SAFETY: on success the shim stored a tensor it allocated with `new` and hands it over;
        // `from_ptr` takes ownership and frees it on drop.
        return Ok(unsafe { Tensor::from_ptr(out) });
    }
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    let message = String::from_utf8_lossy(&err[..end]);
    Err(EngineError::Torch(tch::TchError::Torch(format!("oneDNN {what}: {message}"))))
}

/// `weight: [out, in]` (float32, CPU) reordered into oneDNN's blocked layout for
/// [`linear`]. The result is a copy: a later change to `weight` does not reach it.
pub fn pack(weight: &Tensor) -> Result<Tensor, EngineError> {
    let weight = weight.f_contiguous()?;
    // SAFETY: `weight` outlives the call, and the shim writes at most `len` bytes into `err`.
    call("weight reorder", |out, err, len| unsafe {
        ffi::rtrun_onednn_pack(weight.as_ptr(), out, err, len)
    })
}

/// `x W^T + b` for rows `x: [T, in]` and a weight [`pack`]ed from `W: [out, in]`; `[T, out]`.
pub fn linear(x: &Tensor, packed: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, EngineError> {
    let x = x.f_contiguous()?;
    let bias_ptr = bias.map_or(std::ptr::null(), Tensor::as_ptr);
    // SAFETY: `x`, `packed` and `bias` outlive the call (null stands for no bias), and the shim
    // writes at most `len` bytes into `err`.
    call("inner product", |out, err, len| unsafe {
        ffi::rtrun_onednn_linear(x.as_ptr(), packed.as_ptr(), bias_ptr, out, err, len)
    })
}
