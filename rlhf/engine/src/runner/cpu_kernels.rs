//! The runner's C++ kernels for the CPU (built by `build.rs`):
//! - [`pack`] and [`linear`] (`onednn.cpp`): oneDNN's inner product with the weight packed once
//!   into its blocked layout (what `torch.compile` runs for a CPU linear). tch binds neither
//!   `mkldnn::_reorder_linear_weight` nor `mkldnn::_linear_pointwise`.
//! - [`gemm_pack`] and [`gemm`] (`gemm.cpp`): the same product on AVX-512 with the weight in
//!   panels of 32 output columns, faster than oneDNN's where the weights stream from memory.
//! - [`rms_norm`], [`add_rms_norm`], [`rotary`] and [`silu_mul`] (`fused.cpp`): element-wise
//!   steps that libtorch runs as 2-7 operators each, whose fixed costs outweigh their
//!   arithmetic at decode sizes.
//! - [`parallel_for`] (`fused.cpp`): host work of a step (the sampler's rows) on the same
//!   intra-op threads; [`with_floats`] lends it the step's logits in place.
//! - [`decode_attention`] (`attention.cpp`): one query per sequence over its decode lanes, in
//!   one pass per key/value head and sequence, where MKL's batched products spend most of
//!   their time packing small operands; and [`write_kv`], a step's keys and values into the
//!   paged cache and the lanes in one pass, where libtorch ran a copy and an index operator per
//!   tensor, each on one thread.
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
        pub fn rtrun_gemm_supported() -> i32;
        pub fn rtrun_gemm_pack(
            weight: *const C_tensor,
            out: *mut *mut C_tensor,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn rtrun_gemm(
            x: *const C_tensor,
            packed: *const C_tensor,
            bias: *const C_tensor,
            outputs: i64,
            out: *mut *mut C_tensor,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn rtrun_sole_owner(t: *const C_tensor) -> i32;
        pub fn rtrun_parallel_for(
            n: i64,
            grain: i64,
            body: extern "C" fn(*mut std::ffi::c_void, i64, i64),
            ctx: *mut std::ffi::c_void,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn rtrun_rms_norm(
            x: *const C_tensor,
            add: *const C_tensor,
            w: *const C_tensor,
            eps: f64,
            out: *mut *mut C_tensor,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn rtrun_rotary(
            x: *const C_tensor,
            cos: *const C_tensor,
            sin: *const C_tensor,
            out: *mut *mut C_tensor,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn rtrun_silu_mul(
            x: *const C_tensor,
            out: *mut *mut C_tensor,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn rtrun_decode_attention_supported() -> i32;
        pub fn rtrun_write_kv(
            k: *const C_tensor,
            v: *const C_tensor,
            rows: *const C_tensor,
            cache_k: *const C_tensor,
            cache_v: *const C_tensor,
            lane_k: *const C_tensor,
            lane_v: *const C_tensor,
            positions: *const C_tensor,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn rtrun_decode_attention(
            q: *const C_tensor,
            kt: *const C_tensor,
            v: *const C_tensor,
            keep: *const C_tensor,
            readable: i64,
            scale: f64,
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
    call_unit(what, |err, len| f(&mut out, err, len))?;
    if out.is_null() {
        return Err(EngineError::Torch(tch::TchError::Torch(format!(
            "{what}: no tensor came back"
        ))));
    }
    // SAFETY: on success the shim stored a tensor it allocated with `new` and hands it over;
    // `from_ptr` takes ownership and frees it on drop.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Runs a shim call that returns nothing, or the shim's error message.
fn call_unit(what: &str, f: impl FnOnce(*mut u8, usize) -> i32) -> Result<(), EngineError> {
    let mut err = [0u8; 512];
    if f(err.as_mut_ptr(), err.len()) == 0 {
        return Ok(());
    }
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    let message = String::from_utf8_lossy(&err[..end]);
    Err(EngineError::Torch(tch::TchError::Torch(format!("{what}: {message}"))))
}

/// Whether this CPU runs [`gemm`] (AVX-512F).
pub fn gemm_supported() -> bool {
    // SAFETY: the shim function takes no arguments and only reads CPU feature flags.
    unsafe { ffi::rtrun_gemm_supported() == 1 }
}

/// `weight: [out, in]` (float32, CPU) packed into [`gemm`]'s panels of 32 output columns,
/// `[ceil(out / 32), in, 32]` (zero-padded). The result is a copy.
pub fn gemm_pack(weight: &Tensor) -> Result<Tensor, EngineError> {
    // SAFETY: `weight` outlives the call, and the shim writes at most `len` bytes into `err`.
    call("weight packing", |out, err, len| unsafe {
        ffi::rtrun_gemm_pack(weight.as_ptr(), out, err, len)
    })
}

/// `x W^T + b` for rows `x: [T, in]` (float32) and a weight [`gemm_pack`]ed from `W: [outputs,
/// in]`; a contiguous `[T, outputs]`. Needs [`gemm_supported`].
pub fn gemm(
    x: &Tensor,
    packed: &Tensor,
    bias: Option<&Tensor>,
    outputs: i64,
) -> Result<Tensor, EngineError> {
    let x = match x.stride().last() == Some(&1) {
        true => x.shallow_clone(),
        false => x.f_contiguous()?,
    };
    let bias_ptr = bias.map_or(std::ptr::null(), Tensor::as_ptr);
    // SAFETY: `x`, `packed` and `bias` outlive the call (null stands for no bias); the shim
    // checks their shapes, kinds and strides before reading them and writes at most `len` bytes
    // into `err`.
    call("packed projection", |out, err, len| unsafe {
        ffi::rtrun_gemm(x.as_ptr(), packed.as_ptr(), bias_ptr, outputs, out, err, len)
    })
}

/// Calls `body(begin, end)` on chunks covering `0..n` on libtorch's intra-op threads (all of
/// `0..n` on this thread when `n <= grain`); returns once every chunk ran. A panic in `body` is
/// caught on its thread and comes back as an error (unwinding must not cross into C++).
pub fn parallel_for<F: Fn(usize, usize) + Sync>(
    n: usize,
    grain: usize,
    body: F,
) -> Result<(), EngineError> {
    struct Context<F> {
        body: F,
        panicked: std::sync::atomic::AtomicBool,
    }
    extern "C" fn trampoline<F: Fn(usize, usize) + Sync>(
        ctx: *mut std::ffi::c_void,
        begin: i64,
        end: i64,
    ) {
        // SAFETY: `ctx` is the `Context<F>` that `parallel_for` below passed, alive for the
        // whole call, and only read (`F: Sync`) from the threads that run chunks.
        let context = unsafe { &*(ctx as *const Context<F>) };
        let run = std::panic::AssertUnwindSafe(|| (context.body)(begin as usize, end as usize));
        if std::panic::catch_unwind(run).is_err() {
            context.panicked.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let context = Context { body, panicked: std::sync::atomic::AtomicBool::new(false) };
    let ctx = &context as *const Context<F> as *mut std::ffi::c_void;
    // SAFETY: `trampoline::<F>` reads `ctx` as the `Context<F>` it is, which outlives the call;
    // the shim writes at most `len` bytes into `err`.
    call_unit("parallel loop", |err, len| unsafe {
        ffi::rtrun_parallel_for(n as i64, grain as i64, trampoline::<F>, ctx, err, len)
    })?;
    match context.panicked.load(std::sync::atomic::Ordering::Relaxed) {
        true => Err(EngineError::InvalidArgument("a parallel loop's body panicked".into())),
        false => Ok(()),
    }
}

/// Calls `f` with the elements of `t` (a float32 CPU tensor) as a slice: the host sampler reads
/// a step's logits where the runner left them. `t` is taken by value, and lent in place only
/// when it is contiguous and the one holder of its memory (as a step's fresh logits are), so no
/// other handle can write what `f` reads; any other tensor is copied first.
pub fn with_floats<R>(t: Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R, EngineError> {
    if t.f_kind()? != tch::Kind::Float || t.device() != tch::Device::Cpu {
        return Err(EngineError::InvalidArgument(format!(
            "expected float32 CPU values, found {:?} on {:?}",
            t.f_kind()?,
            t.device()
        )));
    }
    // SAFETY: the shim only reads the tensor's and its storage's reference counts.
    let sole = |t: &Tensor| unsafe { ffi::rtrun_sole_owner(t.as_ptr()) == 1 };
    let t = match t.is_contiguous() && sole(&t) {
        true => t,
        false => t.f_contiguous()?.f_detach_copy()?,
    };
    let numel = t.numel();
    let data = t.data_ptr() as *const f32;
    let values: &[f32] = match numel {
        0 => &[],
        // SAFETY: `t` is a contiguous float32 CPU tensor of `numel` elements at `data`, held
        // here (neither freed nor resized) until `f` returns; it is the only handle to its
        // tensor and that tensor the only holder of its storage, and `f` cannot reach `t`, so
        // nothing writes the memory while `values` lives.
        _ => unsafe { std::slice::from_raw_parts(data, numel) },
    };
    Ok(f(values))
}

/// Runs `f` on the values of `t`, a contiguous float32 CPU tensor, writable in place (a
/// tensor-parallel all-reduce into a layer's partial output).
pub fn with_floats_mut<R>(t: &Tensor, f: impl FnOnce(&mut [f32]) -> R) -> Result<R, EngineError> {
    if t.f_kind()? != tch::Kind::Float || t.device() != tch::Device::Cpu || !t.is_contiguous() {
        return Err(EngineError::InvalidArgument(format!(
            "expected contiguous float32 CPU values, found {:?} on {:?}",
            t.f_kind()?,
            t.device()
        )));
    }
    let numel = t.numel();
    let data = t.data_ptr() as *mut f32;
    let values: &mut [f32] = match numel {
        0 => &mut [],
        // SAFETY: `t` is a contiguous float32 CPU tensor of `numel` elements at `data`, borrowed
        // (so neither freed nor resized) until `f` returns; the runner that owns it is single-
        // threaded and reads it only after `f`, so nothing else touches the memory meanwhile.
        _ => unsafe { std::slice::from_raw_parts_mut(data, numel) },
    };
    Ok(f(values))
}

/// `weight: [out, in]` (float32, CPU) reordered into oneDNN's blocked layout for
/// [`linear`]. The result is a copy: a later change to `weight` does not reach it.
pub fn pack(weight: &Tensor) -> Result<Tensor, EngineError> {
    let weight = weight.f_contiguous()?;
    // SAFETY: `weight` outlives the call, and the shim writes at most `len` bytes into `err`.
    call("oneDNN weight reorder", |out, err, len| unsafe {
        ffi::rtrun_onednn_pack(weight.as_ptr(), out, err, len)
    })
}

/// `x W^T + b` for rows `x: [T, in]` and a weight [`pack`]ed from `W: [out, in]`; `[T, out]`.
pub fn linear(x: &Tensor, packed: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, EngineError> {
    let x = x.f_contiguous()?;
    let bias_ptr = bias.map_or(std::ptr::null(), Tensor::as_ptr);
    // SAFETY: `x`, `packed` and `bias` outlive the call (null stands for no bias), and the shim
    // writes at most `len` bytes into `err`.
    call("oneDNN inner product", |out, err, len| unsafe {
        ffi::rtrun_onednn_linear(x.as_ptr(), packed.as_ptr(), bias_ptr, out, err, len)
    })
}

/// `w * (x / sqrt(mean(x^2) + eps))` per row of `x: [rows, h]` (float32, last dimension
/// contiguous): the model's RMSNorm in one pass. Returns a contiguous `[rows, h]`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor, EngineError> {
    // SAFETY: the tensors outlive the call, the shim checks their shapes, kinds and strides
    // before reading them, and it writes at most `len` bytes into `err`.
    call("RMSNorm", |out, err, len| unsafe {
        ffi::rtrun_rms_norm(x.as_ptr(), std::ptr::null(), w.as_ptr(), eps, out, err, len)
    })
}

/// The residual sum and the next norm in one pass: `x += delta` in place (the bits of
/// libtorch's add), then [`rms_norm`] of the new `x`. `x` and `delta` are `[rows, h]` float32
/// with contiguous last dimensions, `x`'s rows its own memory.
pub fn add_rms_norm(
    x: &mut Tensor,
    delta: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<Tensor, EngineError> {
    // SAFETY: as in `rms_norm`; the shim writes `x` only after checking that its rows do not
    // overlap, and `x` is borrowed mutably for the call.
    call("residual add and RMSNorm", |out, err, len| unsafe {
        ffi::rtrun_rms_norm(x.as_ptr(), delta.as_ptr(), w.as_ptr(), eps, out, err, len)
    })
}

/// RoPE in the rotate-half form, `x * cos + rotate_half(x) * sin`, on `x: [rows, heads,
/// head_dim]` with `cos, sin: [rows, head_dim]` (float32, last dimensions contiguous): the same
/// products and sum as [`rtrun_rlhf_model::rope::apply_rotary`], bit for bit. Returns a
/// contiguous `[rows, heads, head_dim]`.
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, EngineError> {
    // SAFETY: as in `rms_norm`.
    call("RoPE", |out, err, len| unsafe {
        ffi::rtrun_rotary(x.as_ptr(), cos.as_ptr(), sin.as_ptr(), out, err, len)
    })
}

/// `silu(gate) * up` for `x: [rows, 2 * width]` holding the gate then the up projection
/// (float32, last dimension contiguous). Returns a contiguous `[rows, width]`.
pub fn silu_mul(x: &Tensor) -> Result<Tensor, EngineError> {
    // SAFETY: as in `rms_norm`.
    call("SiLU-and-multiply", |out, err, len| unsafe {
        ffi::rtrun_silu_mul(x.as_ptr(), out, err, len)
    })
}

/// Whether this CPU runs [`decode_attention`] (AVX2 and FMA).
pub fn decode_attention_supported() -> bool {
    // SAFETY: the shim function takes no arguments and only reads CPU feature flags.
    unsafe { ffi::rtrun_decode_attention_supported() == 1 }
}

/// Attention of query rows over their sequences' keys: `q: [batch * queries, heads, head_dim]`
/// (row `r` of sequence `r / queries`: one row per sequence in a decode step, a chunk's rows in
/// a prefill), keys transposed `kt: [kv_heads, batch, head_dim, len]`, `v: [kv_heads, batch,
/// len, head_dim]` (float32, any strides but a contiguous last dimension) and `keep: [batch *
/// queries, len]` (bool, contiguous: the positions each row attends). `readable` is how many
/// positions each key row may be read at: `len`, or more where the rows hold finite values
/// past it (the lanes' headroom), which spares the kernel a padded copy of the last block; the
/// shim never reads past a row's stride or the keys' storage. Returns a contiguous `[batch *
/// queries, heads * head_dim]`: `softmax(q k^T * scale) v` per query head, query heads grouped
/// over the key/value heads in order; a row that attends nothing is zeros. Needs
/// [`decode_attention_supported`].
pub fn decode_attention(
    q: &Tensor,
    kt: &Tensor,
    v: &Tensor,
    keep: &Tensor,
    readable: i64,
    scale: f64,
) -> Result<Tensor, EngineError> {
    // SAFETY: as in `rms_norm`; the shim bounds its reads by `kt`'s strides and storage
    // whatever `readable` says.
    call("decode attention", |out, err, len| unsafe {
        ffi::rtrun_decode_attention(
            q.as_ptr(),
            kt.as_ptr(),
            v.as_ptr(),
            keep.as_ptr(),
            readable,
            scale,
            out,
            err,
            len,
        )
    })
}

/// The decode lanes a step appends to: keys `[kv_heads, T, head_dim, capacity]` (transposed),
/// values `[kv_heads, T, capacity, head_dim]`, and each token's position (`[T]`, int64; token
/// `t` is lane `t`).
pub struct LaneTarget<'a> {
    /// The layer's key lanes.
    pub keys: &'a Tensor,
    /// The layer's value lanes.
    pub values: &'a Tensor,
    /// Where each lane's new position goes.
    pub positions: &'a Tensor,
}

/// Writes a step's keys and values `k, v: [T, kv_heads, head_dim]` (CPU, one kind, any strides)
/// into the paged cache `cache_k, cache_v: [N, head_dim]` (contiguous) at `rows: [kv_heads *
/// T]` (int64, head-major, as [`super::kv_cache::KvCache::head_major`] gives them), and into
/// the decode lanes when `lanes` is given. Rows and positions out of range are errors.
pub fn write_kv(
    k: &Tensor,
    v: &Tensor,
    rows: &Tensor,
    cache_k: &Tensor,
    cache_v: &Tensor,
    lanes: Option<LaneTarget<'_>>,
) -> Result<(), EngineError> {
    let (lane_k, lane_v, positions) = match &lanes {
        Some(l) => (l.keys.as_ptr(), l.values.as_ptr(), l.positions.as_ptr()),
        None => (std::ptr::null(), std::ptr::null(), std::ptr::null()),
    };
    // SAFETY: every tensor outlives the call (null stands for no lanes); the shim checks kinds,
    // shapes, strides, rows and positions before it writes, writes only inside the caches and
    // the lanes, and writes at most `len` bytes into `err`.
    call_unit("writing keys and values", |err, len| unsafe {
        ffi::rtrun_write_kv(
            k.as_ptr(),
            v.as_ptr(),
            rows.as_ptr(),
            cache_k.as_ptr(),
            cache_v.as_ptr(),
            lane_k,
            lane_v,
            positions,
            err,
            len,
        )
    })
}
