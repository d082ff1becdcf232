//! CUDA IPC: one process exports a range of its GPU memory as a handle, another process on
//! the same GPU maps that memory and reads it, with no copy through host memory. This is how
//! colocated roles on one GPU hand each other tensors (the policy's weights to the engine in
//! a hybrid-engine run), where NCCL refuses two ranks on one device.
//!
//! A handle names the whole device allocation (`cuMemGetAddressRange` of the pointer: with a
//! caching allocator a tensor is an offset into a larger segment), so [`IpcMemHandle`] carries
//! the offset and length of the exported range and the device's UUID, and `IpcMapping`
//! checks every read against them. The checks are plain code ([`IpcMemHandle::check_range`],
//! [`IpcMemHandle::check_device`]) and are tested without a GPU; the driver calls need the
//! `cuda` feature (cudarc, libcuda loaded at run time).

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use serde::{Deserialize, Serialize};

/// Bytes of a `CUipcMemHandle`.
pub const IPC_HANDLE_BYTES: usize = 64;

/// Errors of CUDA IPC.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaIpcError {
    /// This build or machine has no CUDA driver.
    #[error("CUDA IPC is unavailable: {0}")]
    Unavailable(String),
    /// A handle or range that cannot be used.
    #[error("invalid CUDA IPC handle: {0}")]
    InvalidHandle(String),
    /// A CUDA driver call failed.
    #[error("{call} failed: {message}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's error.
        message: String,
    },
}

/// An exported range of device memory, as it travels to the process that maps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcMemHandle {
    /// The `CUipcMemHandle` of the allocation containing the range.
    pub handle: Vec<u8>,
    /// Offset of the range from the start of that allocation.
    pub offset: u64,
    /// Bytes of the range.
    pub len: u64,
    /// Bytes of the whole allocation (the range lies inside it).
    pub allocation_len: u64,
    /// UUID of the GPU the memory is on.
    pub device_uuid: [u8; 16],
    /// The exporting process (for error messages).
    pub pid: u32,
}

impl IpcMemHandle {
    /// Checks the handle's own fields: handle size, and the range inside the allocation.
    pub fn validate(&self) -> Result<(), CudaIpcError> {
        if self.handle.len() != IPC_HANDLE_BYTES {
            return Err(CudaIpcError::InvalidHandle(format!(
                "expected a {IPC_HANDLE_BYTES}-byte handle, found {} bytes",
                self.handle.len()
            )));
        }
        match self.offset.checked_add(self.len) {
            Some(end) if end <= self.allocation_len => Ok(()),
            _ => Err(CudaIpcError::InvalidHandle(format!(
                "range {}+{} lies outside its {}-byte allocation",
                self.offset, self.len, self.allocation_len
            ))),
        }
    }

    /// Checks that `[offset, offset + len)` of the exported range exists.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), CudaIpcError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaIpcError::InvalidHandle(format!(
                "bytes {offset}..{} requested from a {}-byte range exported by process {}",
                offset.saturating_add(len),
                self.len,
                self.pid
            ))),
        }
    }

    /// Checks that the memory is on the GPU with `uuid` (IPC maps memory of the same GPU here;
    /// another GPU would need peer access, which this path does not set up).
    pub fn check_device(&self, uuid: &[u8; 16]) -> Result<(), CudaIpcError> {
        if &self.device_uuid == uuid {
            Ok(())
        } else {
            Err(CudaIpcError::InvalidHandle(format!(
                "memory exported by process {} is on GPU {}, this process is on GPU {}",
                self.pid,
                format_uuid(&self.device_uuid),
                format_uuid(uuid)
            )))
        }
    }
}

/// A GPU UUID as `nvidia-smi` prints it (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
pub fn format_uuid(uuid: &[u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

#[cfg(feature = "cuda")]
pub use driver::{IpcMapping, device_memory, device_uuid, export};

#[cfg(not(feature = "cuda"))]
mod driver_stub {
    use super::{CudaIpcError, IpcMemHandle};

    fn unavailable() -> CudaIpcError {
        CudaIpcError::Unavailable("rtrun was built without the `cuda` feature".into())
    }

    /// Without the `cuda` feature nothing can be exported.
    pub fn export(_device: usize, _ptr: u64, _len: u64) -> Result<IpcMemHandle, CudaIpcError> {
        Err(unavailable())
    }

    /// Without the `cuda` feature there is no device.
    pub fn device_memory(_device: usize) -> Result<(u64, u64), CudaIpcError> {
        Err(unavailable())
    }

    /// Without the `cuda` feature there is no device.
    pub fn device_uuid(_device: usize) -> Result<[u8; 16], CudaIpcError> {
        Err(unavailable())
    }
}

#[cfg(not(feature = "cuda"))]
pub use driver_stub::{device_memory, device_uuid, export};

#[cfg(feature = "cuda")]
mod driver {
    use std::mem::MaybeUninit;

    use cudarc::driver::CudaContext;
    use cudarc::driver::sys as cuda_sys;

    use super::{CudaIpcError, IPC_HANDLE_BYTES, IpcMemHandle};

    fn check(call: &'static str, result: cuda_sys::CUresult) -> Result<(), CudaIpcError> {
        if result == cuda_sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(CudaIpcError::Driver { call, message: format!("{result:?}") })
        }
    }

    /// Makes the device's primary context (the one libtorch's runtime API uses) current on
    /// this thread.
    fn bind(device: usize) -> Result<std::sync::Arc<CudaContext>, CudaIpcError> {
        // SAFETY: only tries to load the shared library.
        if !unsafe { cuda_sys::is_culib_present() } {
            return Err(CudaIpcError::Unavailable(
                "the CUDA driver (libcuda) is not installed".into(),
            ));
        }
        let context = CudaContext::new(device).map_err(|e| CudaIpcError::Driver {
            call: "cuDevicePrimaryCtxRetain",
            message: e.to_string(),
        })?;
        context.bind_to_thread().map_err(|e| CudaIpcError::Driver {
            call: "cuCtxSetCurrent",
            message: e.to_string(),
        })?;
        Ok(context)
    }

    /// The UUID of CUDA device `device` (an ordinal among the visible devices).
    pub fn device_uuid(device: usize) -> Result<[u8; 16], CudaIpcError> {
        uuid_of(&*bind(device)?)
    }

    fn uuid_of(context: &CudaContext) -> Result<[u8; 16], CudaIpcError> {
        let uuid = context.uuid().map_err(|e| CudaIpcError::Driver {
            call: "cuDeviceGetUuid",
            message: e.to_string(),
        })?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// Free and total bytes of device `device` as the driver sees them (every process's use
    /// counted, as `nvidia-smi` shows).
    pub fn device_memory(device: usize) -> Result<(u64, u64), CudaIpcError> {
        let _context = bind(device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals; a context is current.
        check("cuMemGetInfo", unsafe { cuda_sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok((free as u64, total as u64))
    }

    /// Exports `len` bytes at device pointer `ptr` on `device`. The memory must stay allocated
    /// until every process that maps it has closed its mapping.
    pub fn export(device: usize, ptr: u64, len: u64) -> Result<IpcMemHandle, CudaIpcError> {
        let context = bind(device)?;
        let device_uuid = uuid_of(&context)?;
        let mut base: cuda_sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: out-pointers to locals; the driver validates `ptr`.
        check("cuMemGetAddressRange", unsafe {
            cuda_sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        let mut handle = MaybeUninit::<cuda_sys::CUipcMemHandle>::uninit();
        // SAFETY: `handle` is a valid place for the result; `base` starts an allocation.
        check("cuIpcGetMemHandle", unsafe {
            cuda_sys::cuIpcGetMemHandle(handle.as_mut_ptr(), base)
        })?;
        // SAFETY: the call succeeded, so it wrote the handle.
        let handle = unsafe { handle.assume_init() };
        let exported = IpcMemHandle {
            handle: handle.reserved.iter().map(|&c| c as u8).collect(),
            offset: ptr - base,
            len,
            allocation_len: size as u64,
            device_uuid,
            pid: std::process::id(),
        };
        exported.validate()?;
        Ok(exported)
    }

    /// Another process's exported range, mapped into this one until dropped.
    pub struct IpcMapping {
        base: cuda_sys::CUdeviceptr,
        handle: IpcMemHandle,
        _context: std::sync::Arc<CudaContext>,
    }

    // SAFETY: the mapping is a device address; the driver calls on it are thread-safe.
    unsafe impl Send for IpcMapping {}

    impl IpcMapping {
        /// Maps `handle` on `device` after checking it names memory of this GPU.
        pub fn open(device: usize, handle: &IpcMemHandle) -> Result<IpcMapping, CudaIpcError> {
            handle.validate()?;
            let context = bind(device)?;
            handle.check_device(&uuid_of(&context)?)?;
            let mut raw = cuda_sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
            for (c, &b) in raw.reserved.iter_mut().zip(&handle.handle) {
                *c = b as _;
            }
            let mut base: cuda_sys::CUdeviceptr = 0;
            // SAFETY: `base` is a valid out-pointer; the handle bytes came from
            // cuIpcGetMemHandle in the exporting process.
            check("cuIpcOpenMemHandle", unsafe {
                cuda_sys::cuIpcOpenMemHandle_v2(
                    &mut base,
                    raw,
                    cuda_sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            })
            .map_err(|e| {
                CudaIpcError::InvalidHandle(format!(
                    "cannot map the memory of process {} ({e}); the exporter must still hold it",
                    handle.pid
                ))
            })?;
            Ok(IpcMapping { base, handle: handle.clone(), _context: context })
        }

        /// The device address of byte `offset` of the exported range, after checking that
        /// `len` bytes from there exist.
        pub fn address(&self, offset: u64, len: u64) -> Result<u64, CudaIpcError> {
            self.handle.check_range(offset, len)?;
            Ok(self.base + self.handle.offset + offset)
        }

        /// The exported range this maps.
        pub fn handle(&self) -> &IpcMemHandle {
            &self.handle
        }
    }

    impl Drop for IpcMapping {
        fn drop(&mut self) {
            // SAFETY: `base` came from cuIpcOpenMemHandle and is closed once.
            let result = unsafe { cuda_sys::cuIpcCloseMemHandle(self.base) };
            if result != cuda_sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(?result, "cuIpcCloseMemHandle failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> IpcMemHandle {
        IpcMemHandle {
            handle: vec![7; IPC_HANDLE_BYTES],
            offset: 512,
            len: 1024,
            allocation_len: 2 << 20,
            device_uuid: [1; 16],
            pid: 42,
        }
    }

    #[test]
    fn a_well_formed_handle_validates_and_reads_inside_its_range() {
        let h = handle();
        h.validate().unwrap();
        h.check_range(0, 1024).unwrap();
        h.check_range(1000, 24).unwrap();
        let err = h.check_range(1000, 25).unwrap_err().to_string();
        assert!(err.contains("bytes 1000..1025") && err.contains("process 42"), "{err}");
        assert!(h.check_range(u64::MAX, 2).is_err());
    }

    #[test]
    fn a_short_handle_or_a_range_past_its_allocation_is_refused() {
        let mut short = handle();
        short.handle.pop();
        assert!(short.validate().unwrap_err().to_string().contains("64-byte handle"));
        let mut outside = handle();
        outside.offset = outside.allocation_len - 10;
        assert!(outside.validate().unwrap_err().to_string().contains("outside"));
    }

    #[test]
    fn memory_of_another_gpu_is_refused_naming_both() {
        let err = handle().check_device(&[2; 16]).unwrap_err().to_string();
        assert!(err.contains("GPU-01010101-0101") && err.contains("GPU-02020202"), "{err}");
        handle().check_device(&[1; 16]).unwrap();
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_cuda_feature_export_says_so() {
        let err = export(0, 0, 1).unwrap_err().to_string();
        assert!(err.contains("`cuda` feature"), "{err}");
    }
}
