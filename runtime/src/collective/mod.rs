//! Collectives for data-parallel training: all-reduce, broadcast, all-gather, barrier, and
//! ZeRO's reduce-scatter and in-place all-gather of a buffer's chunks, over
//! the members of an actor group (what `torch.distributed` gives OpenRLHF's DeepSpeed ranks).
//!
//! A [`Communicator`] is created by every rank of a group with the same group name, world size
//! and master address ([`Communicator::from_group_context`] reads them from the actor group
//! membership that [`crate::ActorGroup`] hands each member). Ranks rendezvous at rank 0's
//! master port, then form a ring of TCP connections: rank `r` writes to rank `r + 1` and reads
//! from rank `r − 1`. The CPU backend runs every collective over that ring (bandwidth-optimal
//! chunked reduce-scatter + all-gather for all-reduce, pipelined forwarding for broadcast). The
//! NCCL backend (cargo feature `cuda`) bootstraps an NCCL communicator through the same
//! rendezvous and runs float all-reduce and broadcast on the GPU; byte collectives and barriers
//! stay on the ring.
//!
//! Failure model: every blocking step is bounded by [`CollectiveConfig::timeout`] (time without
//! progress from a peer). A rank that dies closes its sockets, so its neighbours fail at once;
//! a communicator that failed shuts its own sockets down, so the failure travels around the
//! ring and every surviving rank gets an error instead of a hang. A failed communicator stays
//! failed ([`CollectiveError::Poisoned`]); create a new one to continue.
//!
//! All ranks must call the same collectives in the same order with matching lengths; a
//! mismatch is detected (each message carries the operation and its sequence number) and
//! reported as [`CollectiveError::Protocol`].

mod cpu;
#[cfg(feature = "cuda")]
mod nccl;
mod rendezvous;
mod wire;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::context::GroupMembership;

/// How values are combined by an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the world size (every rank gets bit-identical results).
    Mean,
    /// Element-wise maximum (IEEE `maxNum`: a NaN loses against a number).
    Max,
    /// Element-wise minimum (IEEE `minNum`: a NaN loses against a number).
    Min,
}

/// Which implementation carries the collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// TCP ring between the ranks' processes; works everywhere.
    #[default]
    Cpu,
    /// NCCL on the GPUs (needs the `cuda` feature, a CUDA driver and `libnccl.so.2`).
    Nccl,
}

/// Default for [`CollectiveConfig::timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Default for [`CollectiveConfig::segment_bytes`].
pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;

/// Everything a rank needs to join a collective group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveConfig {
    /// The group's name; every rank must use the same one (it guards against a stray
    /// connection from another group that reuses the port).
    pub group_name: String,
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// The address rank 0 listens on for the rendezvous.
    pub master_addr: String,
    /// The port rank 0 listens on for the rendezvous.
    pub master_port: u16,
    /// With `master_port` 0: rank 0 listens on a port of its own choosing (on `master_addr`,
    /// or when that is empty on its node's IP) and publishes the address under this key of the
    /// head's key-value store, where the other ranks read it ([`GroupMembership`]).
    pub rendezvous_key: Option<String>,
    /// The backend.
    pub backend: Backend,
    /// The longest the rendezvous may take, and the longest any collective waits for a peer
    /// without progress, before it fails.
    pub timeout: Duration,
    /// Bytes per message of the ring's pipelined transfers: smaller segments overlap sending,
    /// receiving and reducing better; larger ones cost fewer system calls.
    pub segment_bytes: usize,
    /// The CUDA device the NCCL backend uses (an index into `CUDA_VISIBLE_DEVICES`); ignored
    /// by the CPU backend.
    pub cuda_device: usize,
}

impl CollectiveConfig {
    /// A configuration with the default backend (CPU), timeout and segment size.
    pub fn new(
        group_name: impl Into<String>,
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> CollectiveConfig {
        CollectiveConfig {
            group_name: group_name.into(),
            rank,
            world_size,
            master_addr: master_addr.into(),
            master_port,
            rendezvous_key: None,
            backend: Backend::Cpu,
            timeout: DEFAULT_TIMEOUT,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            cuda_device: 0,
        }
    }

    /// The configuration of an actor group member (defaults as [`CollectiveConfig::new`]).
    pub fn from_membership(membership: &GroupMembership) -> CollectiveConfig {
        CollectiveConfig {
            rendezvous_key: membership.rendezvous_key.clone(),
            ..CollectiveConfig::new(
                membership.group.clone(),
                membership.rank,
                membership.world_size,
                membership.master_addr.clone(),
                membership.master_port,
            )
        }
    }

    /// The configuration of the calling actor, from its actor-group membership.
    pub fn from_group_context() -> Result<CollectiveConfig, CollectiveError> {
        let context = crate::context().map_err(|e| CollectiveError::NotInGroup(e.to_string()))?;
        let membership = context.group.ok_or_else(|| {
            CollectiveError::NotInGroup(
                "the calling process is not a member of an actor group".into(),
            )
        })?;
        Ok(CollectiveConfig::from_membership(&membership))
    }

    /// Sets the backend.
    pub fn with_backend(mut self, backend: Backend) -> CollectiveConfig {
        self.backend = backend;
        self
    }

    /// Sets the timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> CollectiveConfig {
        self.timeout = timeout;
        self
    }

    fn validate(&self) -> Result<(), CollectiveError> {
        let invalid = |m: String| Err(CollectiveError::InvalidConfig(m));
        if self.group_name.is_empty() {
            return invalid("group_name must not be empty".into());
        }
        if self.world_size == 0 {
            return invalid(format!("group `{}` needs world_size >= 1, found 0", self.group_name));
        }
        if self.rank >= self.world_size {
            return invalid(format!(
                "group `{}`: rank must be below world_size {}, found {}",
                self.group_name, self.world_size, self.rank
            ));
        }
        if self.timeout.is_zero() {
            return invalid("timeout must be positive, found 0".into());
        }
        if self.segment_bytes < 8 {
            return invalid(format!(
                "segment_bytes must be at least 8, found {}",
                self.segment_bytes
            ));
        }
        Ok(())
    }
}

/// Errors of the collectives.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The configuration cannot work.
    #[error("invalid collective config: {0}")]
    InvalidConfig(String),
    /// The caller is not an actor-group member, so there is no group to join.
    #[error("no collective group: {0}")]
    NotInGroup(String),
    /// The ranks did not all meet (missing rank, mismatched settings, unreachable master).
    #[error("rendezvous of group `{group}` failed on rank {rank}: {message}")]
    Rendezvous {
        /// The group.
        group: String,
        /// The rank reporting it.
        rank: usize,
        /// What went wrong.
        message: String,
    },
    /// A peer made no progress within the timeout.
    #[error(
        "group `{group}` rank {rank}: {op} timed out after {timeout:?} waiting for rank {peer}"
    )]
    Timeout {
        /// The group.
        group: String,
        /// The rank reporting it.
        rank: usize,
        /// The peer waited on.
        peer: usize,
        /// The collective.
        op: &'static str,
        /// The timeout.
        timeout: Duration,
    },
    /// A peer's connection closed or failed (it died or gave up after an error of its own).
    #[error("group `{group}` rank {rank}: {op} lost its connection to rank {peer}: {source}")]
    PeerLost {
        /// The group.
        group: String,
        /// The rank reporting it.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The collective.
        op: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Ranks disagreed on the collective sequence or buffer sizes.
    #[error("group `{group}` rank {rank}: protocol mismatch: {message}")]
    Protocol {
        /// The group.
        group: String,
        /// The rank reporting it.
        rank: usize,
        /// What disagreed.
        message: String,
    },
    /// A collective failed earlier on this communicator; it cannot be used any more.
    #[error("group `{group}` rank {rank}: communicator failed earlier ({cause}); create a new one")]
    Poisoned {
        /// The group.
        group: String,
        /// The rank reporting it.
        rank: usize,
        /// The first failure.
        cause: String,
    },
    /// A root or other argument is out of range.
    #[error("invalid collective argument: {0}")]
    InvalidArgument(String),
    /// The requested backend is not compiled in or not usable on this machine.
    #[error("collective backend unavailable: {0}")]
    BackendUnavailable(String),
    /// NCCL or CUDA reported an error.
    #[error("nccl: {0}")]
    Nccl(String),
}

/// The element types of [`ReduceElement`], for backends that need to name them.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementKind {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
}

/// Element types an all-reduce can combine. On the wire they are little-endian; on
/// little-endian machines (all the ones ML runs on) that is their memory layout, so buffers go
/// to the socket without a conversion pass.
pub trait ReduceElement:
    bytemuck::Pod + Send + Sync + PartialOrd + std::fmt::Debug + sealed::Sealed
{
    /// Bytes per element on the wire.
    const SIZE: usize;
    /// Which type this is.
    #[doc(hidden)]
    const KIND: ElementKind;
    /// This value's wire representation (byte-swapped on big-endian machines).
    fn wire_encoded(self) -> Self;
    /// The value a wire representation stands for.
    fn wire_decoded(self) -> Self;
    /// Combines two values.
    fn combine(self, other: Self, op: ReduceOp) -> Self;
    /// Divides by the world size (the last step of a mean).
    fn divide(self, world_size: usize) -> Self;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

macro_rules! impl_reduce_element {
    ($t:ty, $kind:expr) => {
        impl ReduceElement for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            const KIND: ElementKind = $kind;

            fn wire_encoded(self) -> Self {
                <$t>::from_ne_bytes(self.to_le_bytes())
            }

            fn wire_decoded(self) -> Self {
                <$t>::from_le_bytes(self.to_ne_bytes())
            }

            fn combine(self, other: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Mean => self + other,
                    ReduceOp::Max => self.max(other),
                    ReduceOp::Min => self.min(other),
                }
            }

            fn divide(self, world_size: usize) -> Self {
                self / world_size as $t
            }
        }
    };
}
impl_reduce_element!(f32, ElementKind::F32);
impl_reduce_element!(f64, ElementKind::F64);

/// One rank's handle on a collective group. Not shareable between threads at once (every
/// collective takes `&mut self`); ranks must issue the same collectives in the same order.
pub struct Communicator {
    ring: cpu::Ring,
    #[cfg(feature = "cuda")]
    nccl: Option<nccl::NcclComm>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("group", &self.ring.group())
            .field("rank", &self.ring.rank())
            .field("world_size", &self.ring.world_size())
            .field("backend", &self.backend())
            .finish()
    }
}

impl Communicator {
    /// Joins the group `config` describes; blocks until every rank has joined or the timeout
    /// passes.
    pub fn init(config: CollectiveConfig) -> Result<Communicator, CollectiveError> {
        config.validate()?;
        match config.backend {
            Backend::Cpu => Ok(Communicator {
                ring: cpu::Ring::connect(&config)?,
                #[cfg(feature = "cuda")]
                nccl: None,
            }),
            #[cfg(feature = "cuda")]
            Backend::Nccl => {
                let mut ring = cpu::Ring::connect(&config)?;
                let nccl = nccl::NcclComm::init(&config, &mut ring)?;
                Ok(Communicator { ring, nccl: Some(nccl) })
            }
            #[cfg(not(feature = "cuda"))]
            Backend::Nccl => Err(CollectiveError::BackendUnavailable(
                "the nccl backend needs rtrun built with the `cuda` feature".into(),
            )),
        }
    }

    /// Joins the calling actor's group (its [`GroupMembership`]) on the CPU backend with the
    /// default timeout. Every member of the group must call it.
    pub fn from_group_context() -> Result<Communicator, CollectiveError> {
        Communicator::init(CollectiveConfig::from_group_context()?)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.ring.rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.ring.world_size()
    }

    /// The group's name.
    pub fn group_name(&self) -> &str {
        self.ring.group()
    }

    /// The backend carrying float collectives.
    pub fn backend(&self) -> Backend {
        #[cfg(feature = "cuda")]
        if self.nccl.is_some() {
            return Backend::Nccl;
        }
        Backend::Cpu
    }

    /// The CUDA device ordinal the NCCL backend runs on; `None` for the CPU backend.
    pub fn cuda_device(&self) -> Option<usize> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = &self.nccl {
            return Some(nccl.device());
        }
        None
    }

    /// All-reduces `buffer` in place: afterwards every rank holds the element-wise
    /// combination of all ranks' buffers. Every rank must pass a buffer of the same length.
    pub fn all_reduce<T: ReduceElement>(
        &mut self,
        buffer: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = &mut self.nccl {
            return nccl.all_reduce_host(buffer, op);
        }
        self.ring.all_reduce(buffer, op)
    }

    /// [`Communicator::all_reduce`] on `f32`.
    pub fn all_reduce_f32(
        &mut self,
        buffer: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.all_reduce(buffer, op)
    }

    /// [`Communicator::all_reduce`] on `f64`.
    pub fn all_reduce_f64(
        &mut self,
        buffer: &mut [f64],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.all_reduce(buffer, op)
    }

    /// Reduce-scatter (ZeRO's gradient reduction): every rank passes a buffer of the same
    /// length; afterwards this rank's chunk of it, `buffer[shard_range(len, world_size, rank)]`
    /// (the returned range), holds the combination of every rank's values there. The rest of
    /// the buffer is left holding partial results. It is the first half of
    /// [`Communicator::all_reduce`], so it sends `(n − 1)/n` of the buffer per rank.
    ///
    /// Host buffers always go over the ring (with NCCL and the `cuda` feature, device buffers
    /// use `Communicator::reduce_scatter_device_f32`).
    pub fn reduce_scatter<T: ReduceElement>(
        &mut self,
        buffer: &mut [T],
        op: ReduceOp,
    ) -> Result<std::ops::Range<usize>, CollectiveError> {
        self.ring.reduce_scatter(buffer, op)
    }

    /// [`Communicator::reduce_scatter`] on `f32`.
    pub fn reduce_scatter_f32(
        &mut self,
        buffer: &mut [f32],
        op: ReduceOp,
    ) -> Result<std::ops::Range<usize>, CollectiveError> {
        self.reduce_scatter(buffer, op)
    }

    /// In-place all-gather (ZeRO's parameter gather): this rank's chunk of `buffer`,
    /// `shard_range(len, world_size, rank)`, is its contribution; afterwards every chunk holds
    /// its owner's values on every rank. Every rank passes a buffer of the same length. Any
    /// plain element type (f32, bf16 bits, bytes) works: nothing is combined.
    pub fn all_gather_into<T: bytemuck::Pod>(
        &mut self,
        buffer: &mut [T],
    ) -> Result<(), CollectiveError> {
        let element_bytes = std::mem::size_of::<T>();
        self.ring.all_gather_into(bytemuck::cast_slice_mut(buffer), element_bytes)
    }

    /// Copies `root`'s `buffer` into every other rank's `buffer`; all buffers must have the
    /// same length (a mismatch is an error on the rank that has it).
    pub fn broadcast(&mut self, buffer: &mut [u8], root: usize) -> Result<(), CollectiveError> {
        self.check_root(root)?;
        #[cfg(feature = "cuda")]
        if let Some(nccl) = &mut self.nccl {
            return nccl.broadcast_host(buffer, root);
        }
        self.ring.broadcast(cpu::BroadcastTarget::Fixed(buffer), root)
    }

    /// Copies `root`'s bytes to every other rank, resizing their vectors to `root`'s length.
    pub fn broadcast_bytes(
        &mut self,
        buffer: &mut Vec<u8>,
        root: usize,
    ) -> Result<(), CollectiveError> {
        self.check_root(root)?;
        self.ring.broadcast(cpu::BroadcastTarget::Resizable(buffer), root)
    }

    /// Gathers every rank's bytes (of any length) on every rank, indexed by rank.
    pub fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.ring.all_gather(mine)
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.ring.all_gather(&[]).map(|_| ())
    }

    /// All-reduces `count` `f32` values in device memory at `device_ptr` in place with NCCL.
    ///
    /// # Safety
    /// `device_ptr` must point to `count` `f32` values of live memory on this communicator's
    /// CUDA device, not used by anything else until this returns (it synchronises the stream).
    #[cfg(feature = "cuda")]
    #[allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.
    pub unsafe fn all_reduce_device_f32(
        &mut self,
        device_ptr: u64,
        count: usize,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        match &mut self.nccl {
            // SAFETY: forwarded from this function's contract.
            Some(nccl) => unsafe { nccl.all_reduce_device_f32(device_ptr, count, op) },
            None => Err(CollectiveError::BackendUnavailable(
                "device all-reduce needs a communicator created with the nccl backend".into(),
            )),
        }
    }

    /// In-place reduce-scatter of `count_per_rank × world_size` f32 values in device memory
    /// with NCCL: afterwards this rank's chunk (from `rank × count_per_rank`) holds the result.
    ///
    /// # Safety
    /// `device_ptr` must point to `count_per_rank × world_size` `f32` values of live memory on
    /// this communicator's CUDA device, not used by anything else until this returns.
    #[cfg(feature = "cuda")]
    #[allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.
    pub unsafe fn reduce_scatter_device_f32(
        &mut self,
        device_ptr: u64,
        count_per_rank: usize,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        match &mut self.nccl {
            // SAFETY: forwarded from this function's contract.
            Some(nccl) => unsafe { nccl.reduce_scatter_device_f32(device_ptr, count_per_rank, op) },
            None => Err(CollectiveError::BackendUnavailable(
                "device reduce-scatter needs a communicator created with the nccl backend".into(),
            )),
        }
    }

    /// In-place all-gather of `bytes_per_rank × world_size` bytes in device memory with NCCL:
    /// this rank's chunk (from `rank × bytes_per_rank`) is its contribution.
    ///
    /// # Safety
    /// As [`Communicator::reduce_scatter_device_f32`], for `bytes_per_rank × world_size` bytes.
    #[cfg(feature = "cuda")]
    #[allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.
    pub unsafe fn all_gather_device(
        &mut self,
        device_ptr: u64,
        bytes_per_rank: usize,
    ) -> Result<(), CollectiveError> {
        match &mut self.nccl {
            // SAFETY: forwarded from this function's contract.
            Some(nccl) => unsafe { nccl.all_gather_device(device_ptr, bytes_per_rank) },
            None => Err(CollectiveError::BackendUnavailable(
                "device all-gather needs a communicator created with the nccl backend".into(),
            )),
        }
    }

    fn check_root(&self, root: usize) -> Result<(), CollectiveError> {
        if root >= self.world_size() {
            return Err(CollectiveError::InvalidArgument(format!(
                "broadcast root must be below world size {}, found {root}",
                self.world_size()
            )));
        }
        Ok(())
    }
}

/// The chunk of a buffer of `len` elements that `rank` of `world_size` owns in
/// [`Communicator::reduce_scatter`] and contributes to [`Communicator::all_gather_into`]:
/// sizes differ by at most one, larger chunks first (equal when `len` is a multiple of the
/// world size, as ZeRO's padded flat buffers are).
pub fn shard_range(len: usize, world_size: usize, rank: usize) -> std::ops::Range<usize> {
    cpu::chunk_range(len, world_size.max(1), rank)
}

/// The first two ranks whose GPU UUIDs (as all-gathered before NCCL starts) are equal.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn shared_gpu(uuids: &[Vec<u8>]) -> Option<(usize, usize)> {
    (0..uuids.len()).find_map(|b| (0..b).find(|&a| uuids[a] == uuids[b]).map(|a| (a, b)))
}

/// The error for two ranks of an NCCL group on one GPU.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn shared_gpu_message(group: &str, a: usize, b: usize, uuid: &[u8]) -> String {
    let name = <[u8; 16]>::try_from(uuid)
        .map(|u| crate::cuda_ipc::format_uuid(&u))
        .unwrap_or_else(|_| "the same GPU".to_owned());
    format!(
        "ranks {a} and {b} of NCCL group `{group}` are both on {name}; NCCL needs one GPU per \
         rank. Give each rank its own GPU, or use the CPU backend; for weight sync to engines \
         on the policy's GPU use `rollout.weight_sync_backend: cuda_ipc`"
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_ranks_on_one_gpu_are_named() {
        let uuids = vec![vec![1u8; 16], vec![2u8; 16], vec![1u8; 16]];
        assert_eq!(super::shared_gpu(&uuids), Some((0, 2)));
        assert_eq!(super::shared_gpu(&uuids[..2]), None);
        let message = super::shared_gpu_message("g", 0, 2, &uuids[0]);
        assert!(message.contains("ranks 0 and 2") && message.contains("GPU-01010101"), "{message}");
        assert!(message.contains("cuda_ipc"), "{message}");
    }

    use super::*;
    use proptest::prelude::*;

    /// A port that was free a moment ago, for one test group's master.
    fn free_port() -> u16 {
        let listener =
            std::net::TcpListener::bind(("127.0.0.1", 0)).expect("bind an ephemeral port");
        listener.local_addr().expect("a bound listener has an address").port()
    }

    /// Runs `body` on `world` threads, each with its own communicator of one group, and
    /// returns their results by rank.
    fn on_ranks<R: Send>(
        world: usize,
        segment_bytes: usize,
        body: impl Fn(&mut Communicator) -> R + Sync,
    ) -> Vec<R> {
        let port = free_port();
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let body = &body;
                    scope.spawn(move || {
                        let config = CollectiveConfig {
                            segment_bytes,
                            timeout: Duration::from_secs(30),
                            ..CollectiveConfig::new("threads", rank, world, "127.0.0.1", port)
                        };
                        let mut comm = Communicator::init(config).expect("every rank joins");
                        body(&mut comm)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Every length (shorter than the world, uneven chunks, many tiny segments) and every
        /// operation gives each rank exactly the element-wise combination.
        #[test]
        fn ring_collectives_match_a_direct_computation(
            world in 1usize..6,
            len in 0usize..200,
            segment_bytes in prop::sample::select(vec![8usize, 12, 64, 1 << 20]),
            root_seed: usize,
        ) {
            let value = |rank: usize, i: usize| ((rank * 7 + i * 3) % 11) as f32 - 5.0;
            let root = root_seed % world;
            let results = on_ranks(world, segment_bytes, |comm| {
                let rank = comm.rank();
                let mut outputs = Vec::new();
                for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
                    let mut data: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                    comm.all_reduce_f32(&mut data, op).expect("all-reduce");
                    outputs.push(data);
                }
                let mut bytes = if rank == root { vec![root as u8; len] } else { Vec::new() };
                comm.broadcast_bytes(&mut bytes, root).expect("broadcast");
                let gathered = comm.all_gather_bytes(&vec![rank as u8; rank]).expect("all-gather");
                comm.barrier().expect("barrier");
                (outputs, bytes, gathered)
            });
            let column = |i: usize| (0..world).map(move |r| value(r, i));
            let sum: Vec<f32> = (0..len).map(|i| column(i).sum()).collect();
            let mean: Vec<f32> = sum.iter().map(|s| s / world as f32).collect();
            let max: Vec<f32> = (0..len).map(|i| column(i).fold(f32::MIN, f32::max)).collect();
            let min: Vec<f32> = (0..len).map(|i| column(i).fold(f32::MAX, f32::min)).collect();
            let gathered: Vec<Vec<u8>> = (0..world).map(|r| vec![r as u8; r]).collect();
            for (outputs, bytes, all) in results {
                prop_assert_eq!(&outputs, &vec![sum.clone(), mean.clone(), max.clone(), min.clone()]);
                prop_assert_eq!(bytes, vec![root as u8; len]);
                prop_assert_eq!(&all, &gathered);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Reduce-scatter leaves rank r exactly the combination of every rank's chunk r (its
        /// shard_range), and the in-place all-gather of those chunks rebuilds the whole
        /// reduced buffer on every rank: together they equal an all-reduce.
        #[test]
        fn reduce_scatter_then_all_gather_is_an_all_reduce(
            world in 1usize..6,
            len in 0usize..200,
            segment_bytes in prop::sample::select(vec![8usize, 12, 64, 1 << 20]),
            mean: bool,
        ) {
            let value = |rank: usize, i: usize| ((rank * 5 + i * 7) % 13) as f32 - 6.0;
            let op = if mean { ReduceOp::Mean } else { ReduceOp::Sum };
            let results = on_ranks(world, segment_bytes, |comm| {
                let rank = comm.rank();
                let mut data: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                let owned = comm.reduce_scatter_f32(&mut data, op).expect("reduce-scatter");
                let shard = data[owned.clone()].to_vec();
                comm.all_gather_into(&mut data).expect("all-gather");
                let mut bytes: Vec<u8> = vec![0; 3 * len];
                for b in &mut bytes[shard_range(3 * len, world, rank)] {
                    *b = rank as u8 + 1;
                }
                comm.all_gather_into(&mut bytes).expect("byte all-gather");
                (owned, shard, data, bytes)
            });
            let sum: Vec<f32> = (0..len).map(|i| (0..world).map(|r| value(r, i)).sum()).collect();
            let reduced: Vec<f32> =
                if mean { sum.iter().map(|s| s / world as f32).collect() } else { sum };
            let owners: Vec<u8> = (0..world)
                .flat_map(|r| std::iter::repeat_n(r as u8 + 1, shard_range(3 * len, world, r).len()))
                .collect();
            for (rank, (owned, shard, data, bytes)) in results.into_iter().enumerate() {
                prop_assert_eq!(owned.clone(), shard_range(len, world, rank));
                prop_assert_eq!(&shard[..], &reduced[owned]);
                prop_assert_eq!(&data, &reduced);
                prop_assert_eq!(&bytes, &owners);
            }
        }
    }

    #[test]
    fn nccl_without_the_cuda_feature_or_a_gpu_is_a_clear_error() {
        let config = CollectiveConfig::new("g", 0, 1, "127.0.0.1", 0).with_backend(Backend::Nccl);
        let err = Communicator::init(config).unwrap_err();
        assert!(
            matches!(err, CollectiveError::BackendUnavailable(_) | CollectiveError::Nccl(_)),
            "{err}"
        );
    }
}
