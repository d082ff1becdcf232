//! CUDA graphs of the static decode step (issue 42, with the `cuda` feature): the first step of
//! each [`DecodeShape`] (bucket of rows, block-table width) runs eagerly, which also warms
//! libtorch's kernels and allocator up, and then captures the step over that shape's
//! [`DecodeInputs`] (`graph.cpp`, over `at::cuda::CUDAGraph`); later steps of the shape copy
//! their inputs in and replay the graph, one launch for the whole step where eager execution
//! launches some 1,700 kernels for 24 layers. All graphs share one memory pool, as vLLM's do.
//!
//! A captured graph reads the weights, the KV cache and the inputs at their addresses:
//! weight updates copy into the weights in place, and whatever moves them (fusing or unfusing
//! the projections around a sleep, a new KV cache) drops the graphs ([`Graphs::clear`]). A
//! capture that fails (out of memory, an operation that cannot be captured) leaves that shape
//! eager, with a warning naming the reason; `EngineConfig::enforce_eager` keeps every step
//! eager.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use std::collections::HashMap;
use std::ffi::c_void;

use tch::Tensor;

use super::ModelRunner;
use super::kv_cache::KvCache;
use super::static_decode::{DecodeInputs, DecodeShape, HostInputs};
use crate::error::EngineError;

mod ffi {
    use std::ffi::c_void;

    unsafe extern "C" {
        pub fn rtrun_graph_capture(
            device: i32,
            body: extern "C" fn(*mut c_void) -> i32,
            ctx: *mut c_void,
            pool_first: u64,
            pool_second: u64,
            out: *mut *mut c_void,
            pool_out: *mut u64,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn rtrun_graph_replay(graph: *mut c_void, err: *mut u8, len: usize) -> i32;
        pub fn rtrun_graph_free(graph: *mut c_void);
    }
}

/// One captured graph, freed on drop.
#[derive(Debug)]
struct Graph(*mut c_void);

// SAFETY: the graph is only replayed and freed through `&mut`/ownership by the runner that
// holds it, never from two threads at once; `at::cuda::CUDAGraph` has no thread affinity.
unsafe impl Send for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from a successful `rtrun_graph_capture` and is freed once.
        unsafe { ffi::rtrun_graph_free(self.0) }
    }
}

/// A shape's inputs and, where its capture succeeded, its graph and the output it writes.
#[derive(Debug)]
enum Entry {
    Captured { graph: Graph, inputs: DecodeInputs, logits: Tensor },
    Eager { inputs: DecodeInputs },
}

/// The runner's graphs, by shape.
#[derive(Debug, Default)]
pub(super) struct Graphs {
    entries: HashMap<DecodeShape, Entry>,
    /// The memory pool the graphs share (`[0, 0]` until the first capture).
    pool: [u64; 2],
}

impl Graphs {
    /// Drops every graph (their inputs, weights or cache moved).
    pub(super) fn clear(&mut self) {
        self.entries.clear();
        self.pool = [0, 0];
    }
}

/// Runs `body` under a CUDA graph capture on `device`; the graph, the tensor `body` returned
/// (which the graph's replays write) and the pool.
fn capture(
    device: usize,
    pool: [u64; 2],
    body: &mut dyn FnMut() -> Result<Tensor, EngineError>,
) -> Result<(Graph, Tensor, [u64; 2]), EngineError> {
    struct Context<'a> {
        body: &'a mut dyn FnMut() -> Result<Tensor, EngineError>,
        result: Option<Result<Tensor, EngineError>>,
    }
    extern "C" fn trampoline(ctx: *mut c_void) -> i32 {
        // SAFETY: `ctx` is the `Context` `capture` passed, alive and borrowed by nothing else
        // during the call.
        let context = unsafe { &mut *(ctx as *mut Context<'_>) };
        let run = std::panic::AssertUnwindSafe(|| (context.body)());
        let result = std::panic::catch_unwind(run).unwrap_or_else(|_| {
            Err(EngineError::InvalidArgument("the captured step panicked".into()))
        });
        let status = if result.is_ok() { 0 } else { 1 };
        context.result = Some(result);
        status
    }
    let mut context = Context { body, result: None };
    let mut out: *mut c_void = std::ptr::null_mut();
    let mut pool_out = [0u64; 2];
    let mut err = [0u8; 512];
    // SAFETY: `trampoline` reads `ctx` as the `Context` it is, which outlives the call; the
    // shim writes one pointer to `out`, two integers to `pool_out` and at most `len` bytes to
    // `err`.
    let status = unsafe {
        ffi::rtrun_graph_capture(
            device as i32,
            trampoline,
            &mut context as *mut Context<'_> as *mut c_void,
            pool[0],
            pool[1],
            &mut out,
            pool_out.as_mut_ptr(),
            err.as_mut_ptr(),
            err.len(),
        )
    };
    let body_result = context.result.take();
    if status != 0 {
        // The step's own error says more than "failed while captured".
        if let Some(Err(error)) = body_result {
            return Err(error);
        }
        let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
        let message = String::from_utf8_lossy(&err[..end]).into_owned();
        return Err(EngineError::Torch(tch::TchError::Torch(message)));
    }
    let logits = body_result.unwrap_or_else(|| {
        Err(EngineError::InvalidArgument("the captured step did not run".into()))
    })?;
    Ok((Graph(out), logits, pool_out))
}

impl ModelRunner {
    /// The static step of `shape` over `host`: by its graph where one was captured, else
    /// eagerly (capturing the shape's graph after its first eager step).
    pub(super) fn run_static(
        &self,
        shape: DecodeShape,
        host: &HostInputs,
        cache: &KvCache,
    ) -> Result<Tensor, EngineError> {
        let device = self.device();
        let tch::Device::Cuda(index) = device else {
            return self.run_static_eagerly(shape, host, cache);
        };
        if self.enforce_eager {
            return self.run_static_eagerly(shape, host, cache);
        }
        let mut graphs = self.graphs.borrow_mut();
        match graphs.entries.get_mut(&shape) {
            Some(Entry::Captured { graph, inputs, logits }) => {
                inputs.load(host)?;
                let mut err = [0u8; 512];
                // SAFETY: `graph.0` is a live graph; the shim writes at most `len` bytes.
                let status =
                    unsafe { ffi::rtrun_graph_replay(graph.0, err.as_mut_ptr(), err.len()) };
                if status != 0 {
                    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
                    let message = String::from_utf8_lossy(&err[..end]).into_owned();
                    return Err(EngineError::Torch(tch::TchError::Torch(message)));
                }
                self.static_stats.borrow_mut().graph_replays += 1;
                return Ok(logits.shallow_clone());
            }
            Some(Entry::Eager { inputs }) => {
                inputs.load(host)?;
                return self.static_forward(inputs, cache);
            }
            None => {}
        }
        // The shape's first step: eagerly, then its capture.
        let mut inputs = DecodeInputs::new(shape, device)?;
        inputs.load(host)?;
        let logits = self.static_forward(&inputs, cache)?;
        let before = rtrun_rlhf_model::cuda::memory_on(device, false);
        let captured = capture(index, graphs.pool, &mut || self.static_forward(&inputs, cache));
        let after = rtrun_rlhf_model::cuda::memory_on(device, false);
        let entry = match captured {
            Ok((graph, graph_logits, pool)) => {
                graphs.pool = pool;
                let mut stats = self.static_stats.borrow_mut();
                stats.graphs_captured += 1;
                if let (Some(before), Some(after)) = (before, after) {
                    let grown = after.reserved.saturating_sub(before.reserved);
                    stats.graph_memory_bytes += grown;
                }
                Entry::Captured { graph, inputs, logits: graph_logits }
            }
            Err(error) => {
                tracing::warn!(
                    rows = shape.0,
                    width_blocks = shape.1,
                    %error,
                    "capturing the decode step failed; this shape runs eagerly"
                );
                self.static_stats.borrow_mut().capture_failures += 1;
                Entry::Eager { inputs }
            }
        };
        graphs.entries.insert(shape, entry);
        Ok(logits)
    }
}
