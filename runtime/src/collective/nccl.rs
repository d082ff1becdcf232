//! The NCCL backend (cargo feature `cuda`): float all-reduce, byte broadcast and the ZeRO
//! pair (reduce-scatter, all-gather of a buffer's chunks) on the GPU
//! through cudarc's NCCL bindings, bootstrapped over the CPU ring.
//!
//! Rank 0 creates the NCCL unique id and broadcasts it over the ring; every rank then joins
//! the NCCL communicator on its CUDA device. Host buffers are staged through device memory;
//! device buffers (a tch CUDA tensor's storage) are reduced in place. cudarc loads libcuda and
//! libnccl at run time, so this compiles everywhere and fails with
//! [`CollectiveError::BackendUnavailable`] where they are missing.
//!
//! Failure model: every operation is enqueued on this communicator's stream and polled until
//! done; if it makes no progress within the timeout, or NCCL reports an asynchronous error (a
//! peer died), the communicator is aborted — which stops the kernels — and stays failed.
//! NCCL's own initialisation cannot be bounded that way: a barrier over the ring right before
//! it makes sure every rank is alive when it starts.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use std::ffi::{c_char, c_void};
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cuda_sys;
use cudarc::driver::{CudaContext, CudaStream, DevicePtrMut};
use cudarc::nccl::{result as nccl_result, sys as nccl_sys};

use super::cpu::{BroadcastTarget, Ring};
use super::{CollectiveConfig, CollectiveError, ElementKind, ReduceElement, ReduceOp};

/// How often a pending NCCL operation's stream is polled.
const POLL_INTERVAL: Duration = Duration::from_micros(50);

/// Bytes of an NCCL unique id.
const UNIQUE_ID_BYTES: usize = 128;

/// One rank's NCCL communicator and the stream its operations run on.
pub(crate) struct NcclComm {
    /// Null once aborted.
    comm: nccl_sys::ncclComm_t,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    group: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    failed: Option<String>,
    /// The CUDA device ordinal the communicator runs on.
    device: usize,
}

// SAFETY: an NCCL communicator may be used from any thread as long as two calls never run at
// once on it. `NcclComm` is only reachable through `&mut Communicator` (every method here takes
// `&mut self`), so calls are serialised; the CUDA context and stream handles are thread-safe.
unsafe impl Send for NcclComm {}
// SAFETY: no method takes `&self` and touches the raw communicator, so sharing references
// across threads cannot race on it.
unsafe impl Sync for NcclComm {}

fn nccl_error(what: &str, error: nccl_result::NcclError) -> CollectiveError {
    CollectiveError::Nccl(format!("{what}: {:?}", error.0))
}

fn cuda_error(what: &str, error: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::Nccl(format!("{what}: {error}"))
}

fn nccl_op(op: ReduceOp) -> nccl_sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nccl_sys::ncclRedOp_t::ncclSum,
        ReduceOp::Mean => nccl_sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => nccl_sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => nccl_sys::ncclRedOp_t::ncclMin,
    }
}

fn as_i32(name: &str, value: usize) -> Result<i32, CollectiveError> {
    i32::try_from(value)
        .map_err(|_| CollectiveError::InvalidConfig(format!("{name} {value} exceeds NCCL's limit")))
}

impl NcclComm {
    /// Creates the NCCL communicator of `config`'s rank; `ring` is the already connected CPU
    /// ring of the same group.
    pub(crate) fn init(
        config: &CollectiveConfig,
        ring: &mut Ring,
    ) -> Result<NcclComm, CollectiveError> {
        // SAFETY: these only try to load the shared libraries.
        if !unsafe { cuda_sys::is_culib_present() } {
            return Err(CollectiveError::BackendUnavailable(
                "the CUDA driver (libcuda) is not installed".into(),
            ));
        }
        // SAFETY: as above.
        if !unsafe { nccl_sys::is_culib_present() } {
            return Err(CollectiveError::BackendUnavailable(
                "NCCL (libnccl.so.2) is not installed".into(),
            ));
        }
        let world = as_i32("world size", config.world_size)?;
        let rank = as_i32("rank", config.rank)?;
        let context = CudaContext::new(config.cuda_device).map_err(|e| {
            cuda_error(&format!("cannot open CUDA device {}", config.cuda_device), e)
        })?;
        let stream =
            context.new_stream().map_err(|e| cuda_error("cannot create a CUDA stream", e))?;

        let mut id_bytes = [0u8; UNIQUE_ID_BYTES];
        if config.rank == 0 {
            let id = nccl_result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
            for (byte, c) in id_bytes.iter_mut().zip(id.internal) {
                *byte = c as u8;
            }
        }
        ring.broadcast(BroadcastTarget::Fixed(&mut id_bytes), 0)?;
        let mut id = nccl_sys::ncclUniqueId { internal: [0; UNIQUE_ID_BYTES] };
        for (c, byte) in id.internal.iter_mut().zip(id_bytes) {
            *c = byte as c_char;
        }
        // Everyone is alive right before the (unbounded) NCCL initialisation, and no two ranks
        // are on one GPU: NCCL refuses that (or, in some versions, hangs), so say it first.
        let uuid = context.uuid().map_err(|e| cuda_error("cannot read the GPU's UUID", e))?;
        let uuids = ring.all_gather(&uuid.bytes.map(|b| b as u8))?;
        if let Some((a, b)) = super::shared_gpu(&uuids) {
            return Err(CollectiveError::InvalidConfig(super::shared_gpu_message(
                &config.group_name,
                a,
                b,
                &uuids[a],
            )));
        }
        context.bind_to_thread().map_err(|e| cuda_error("cannot bind the CUDA context", e))?;
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is a valid place for the handle; `id` came from rank 0's
        // ncclGetUniqueId; rank and world size were validated by the caller.
        unsafe { nccl_result::comm_init_rank(comm.as_mut_ptr(), world, id, rank) }
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
        // SAFETY: ncclCommInitRank succeeded, so it wrote the handle.
        let comm = unsafe { comm.assume_init() };
        Ok(NcclComm {
            comm,
            context,
            stream,
            group: config.group_name.clone(),
            rank: config.rank,
            world_size: config.world_size,
            timeout: config.timeout,
            failed: None,
            device: config.cuda_device,
        })
    }

    /// The CUDA device ordinal this communicator runs on.
    pub(crate) fn device(&self) -> usize {
        self.device
    }

    /// All-reduces a host buffer by staging it through device memory.
    pub(crate) fn all_reduce_host<T: ReduceElement>(
        &mut self,
        buffer: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        if buffer.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let bytes: &[u8] = bytemuck::cast_slice(buffer);
        let mut device =
            self.stream.clone_htod(bytes).map_err(|e| cuda_error("host to device copy", e))?;
        {
            let stream = self.stream.clone();
            let (ptr, _record) = device.device_ptr_mut(&stream);
            // SAFETY: `ptr` addresses `buffer.len()` elements of `T` (the staged bytes) on this
            // communicator's device; `device` outlives the wait below.
            let enqueued = unsafe { self.enqueue_all_reduce(ptr, buffer.len(), T::KIND, op) };
            self.finish(enqueued)?;
        }
        self.stream
            .memcpy_dtoh(&device, bytemuck::cast_slice_mut::<T, u8>(buffer))
            .map_err(|e| cuda_error("device to host copy", e))?;
        self.stream.synchronize().map_err(|e| cuda_error("stream synchronize", e))
    }

    /// Broadcasts a host byte buffer from `root` through device memory.
    pub(crate) fn broadcast_host(
        &mut self,
        buffer: &mut [u8],
        root: usize,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        let root = as_i32("root", root)?;
        if buffer.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let mut device =
            self.stream.clone_htod(&*buffer).map_err(|e| cuda_error("host to device copy", e))?;
        {
            let stream = self.stream.clone();
            let (ptr, _record) = device.device_ptr_mut(&stream);
            // SAFETY: `ptr` addresses `buffer.len()` bytes on this device, alive until the wait
            // below returns; the communicator handle is live (checked above).
            let enqueued = unsafe {
                nccl_result::broadcast(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    buffer.len(),
                    nccl_sys::ncclDataType_t::ncclUint8,
                    root,
                    self.comm,
                    stream.cu_stream() as _,
                )
            }
            .map(|_| ())
            .map_err(|e| nccl_error("ncclBroadcast", e));
            self.finish(enqueued)?;
        }
        self.stream
            .memcpy_dtoh(&device, buffer)
            .map_err(|e| cuda_error("device to host copy", e))?;
        self.stream.synchronize().map_err(|e| cuda_error("stream synchronize", e))
    }

    /// All-reduces `count` f32 values of device memory in place.
    ///
    /// # Safety
    /// `device_ptr` must address `count` f32 values on this communicator's device that nothing
    /// else uses until this returns.
    pub(crate) unsafe fn all_reduce_device_f32(
        &mut self,
        device_ptr: u64,
        count: usize,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        if count == 0 {
            return Ok(());
        }
        self.bind()?;
        // Work already queued on the memory (tch's stream) must finish first: tch exposes no
        // stream to wait on, so synchronise the whole context.
        self.context.synchronize().map_err(|e| cuda_error("context synchronize", e))?;
        // SAFETY: forwarded from this function's contract.
        let enqueued = unsafe {
            self.enqueue_all_reduce(
                device_ptr as cuda_sys::CUdeviceptr,
                count,
                ElementKind::F32,
                op,
            )
        };
        self.finish(enqueued)
    }

    /// In-place reduce-scatter of `count_per_rank × world_size` f32 values at `device_ptr`:
    /// afterwards this rank's chunk (`rank × count_per_rank` onwards) holds the reduced values.
    ///
    /// # Safety
    /// `device_ptr` must address `count_per_rank × world_size` f32 values of live memory on
    /// this communicator's device, unused by anything else until this returns.
    pub(crate) unsafe fn reduce_scatter_device_f32(
        &mut self,
        device_ptr: u64,
        count_per_rank: usize,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        if count_per_rank == 0 {
            return Ok(());
        }
        self.bind()?;
        self.context.synchronize().map_err(|e| cuda_error("context synchronize", e))?;
        let op = nccl_op(op);
        let own = device_ptr + (self.rank * count_per_rank * std::mem::size_of::<f32>()) as u64;
        // SAFETY: NCCL's in-place form (the receive buffer is this rank's chunk of the send
        // buffer); both lie inside the caller's range; the handle is live (checked above).
        let enqueued = unsafe {
            nccl_result::reduce_scatter(
                device_ptr as *const c_void,
                own as *mut c_void,
                count_per_rank,
                nccl_sys::ncclDataType_t::ncclFloat32,
                op,
                self.comm,
                self.stream.cu_stream() as _,
            )
        }
        .map(|_| ())
        .map_err(|e| nccl_error("ncclReduceScatter", e));
        self.finish(enqueued)
    }

    /// In-place all-gather of `bytes_per_rank × world_size` bytes at `device_ptr`: this rank
    /// contributes its chunk (`rank × bytes_per_rank` onwards) and receives every other.
    ///
    /// # Safety
    /// As [`NcclComm::reduce_scatter_device_f32`], for `bytes_per_rank × world_size` bytes.
    pub(crate) unsafe fn all_gather_device(
        &mut self,
        device_ptr: u64,
        bytes_per_rank: usize,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        if bytes_per_rank == 0 {
            return Ok(());
        }
        self.bind()?;
        self.context.synchronize().map_err(|e| cuda_error("context synchronize", e))?;
        let own = device_ptr + (self.rank * bytes_per_rank) as u64;
        // SAFETY: NCCL's in-place form (the send buffer is this rank's chunk of the receive
        // buffer), inside the caller's range; the handle is live (checked above).
        let enqueued = unsafe {
            nccl_result::all_gather(
                own as *const c_void,
                device_ptr as *mut c_void,
                bytes_per_rank,
                nccl_sys::ncclDataType_t::ncclUint8,
                self.comm,
                self.stream.cu_stream() as _,
            )
        }
        .map(|_| ())
        .map_err(|e| nccl_error("ncclAllGather", e));
        self.finish(enqueued)
    }

    /// Enqueues an in-place all-reduce on this communicator's stream.
    ///
    /// # Safety
    /// `ptr` must address `count` elements of `kind` on this communicator's device.
    unsafe fn enqueue_all_reduce(
        &self,
        ptr: cuda_sys::CUdeviceptr,
        count: usize,
        kind: ElementKind,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let datatype = match kind {
            ElementKind::F32 => nccl_sys::ncclDataType_t::ncclFloat32,
            ElementKind::F64 => nccl_sys::ncclDataType_t::ncclFloat64,
        };
        let op = nccl_op(op);
        // SAFETY: the pointer contract is the caller's; the handle is live (callers check).
        unsafe {
            nccl_result::all_reduce(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                datatype,
                op,
                self.comm,
                self.stream.cu_stream() as _,
            )
        }
        .map(|_| ())
        .map_err(|e| nccl_error("ncclAllReduce", e))
    }

    /// Waits for an enqueued operation (if enqueueing worked), aborting on failure.
    fn finish(&mut self, enqueued: Result<(), CollectiveError>) -> Result<(), CollectiveError> {
        let result = enqueued.and_then(|()| self.wait());
        if let Err(error) = &result {
            self.abort(error.to_string());
        }
        result
    }

    /// Polls the stream until the operation completes, NCCL reports an error, or the timeout
    /// passes.
    fn wait(&self) -> Result<(), CollectiveError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            // SAFETY: the stream handle is owned by `self.stream` and alive.
            match unsafe { cuda_sys::cuStreamQuery(self.stream.cu_stream()) } {
                cuda_sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cuda_sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(CollectiveError::Nccl(format!("stream failed: {other:?}"))),
            }
            let mut async_error = nccl_sys::ncclResult_t::ncclSuccess;
            // SAFETY: the handle is live and `async_error` a valid out-pointer.
            unsafe { nccl_sys::ncclCommGetAsyncError(self.comm, &mut async_error) };
            if !matches!(
                async_error,
                nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress
            ) {
                return Err(CollectiveError::Nccl(format!(
                    "group `{}` rank {}: asynchronous NCCL error {async_error:?} (a peer failed?)",
                    self.group, self.rank
                )));
            }
            if Instant::now() >= deadline {
                return Err(CollectiveError::Timeout {
                    group: self.group.clone(),
                    rank: self.rank,
                    peer: (self.rank + 1) % self.world_size,
                    op: "nccl collective",
                    timeout: self.timeout,
                });
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    fn bind(&self) -> Result<(), CollectiveError> {
        self.context.bind_to_thread().map_err(|e| cuda_error("cannot bind the CUDA context", e))
    }

    fn check(&self) -> Result<(), CollectiveError> {
        match &self.failed {
            None => Ok(()),
            Some(cause) => Err(CollectiveError::Poisoned {
                group: self.group.clone(),
                rank: self.rank,
                cause: cause.clone(),
            }),
        }
    }

    /// Aborts the communicator (stopping its kernels) and remembers why.
    fn abort(&mut self, cause: String) {
        tracing::warn!(group = %self.group, rank = self.rank, %cause, "nccl collective failed; aborting the communicator");
        self.failed.get_or_insert(cause);
        if !self.comm.is_null() {
            // SAFETY: the handle is live and never used again (set to null below).
            let _ = unsafe { nccl_result::comm_abort(self.comm) };
            self.comm = std::ptr::null_mut();
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: the handle is live; every operation on it was waited for, so destroying
            // it cannot block on pending work. Abort rather than destroy anyway: it never waits.
            let _ = unsafe { nccl_result::comm_abort(self.comm) };
            self.comm = std::ptr::null_mut();
        }
    }
}
