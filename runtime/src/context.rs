//! The runtime context: who and where the current process is (Ray's `get_runtime_context`).

use rtrun_placement::{BundleRef, GpuShare, ResourceSet};

pub use rtrun_proto::context::GroupMembership;

use crate::ids::{ActorId, NodeId, WorkerId};

/// What the current process is.
#[derive(Debug, Clone)]
pub struct RuntimeContext {
    /// The node it runs on.
    pub node_id: NodeId,
    /// Its worker id (the driver is worker 0).
    pub worker_id: WorkerId,
    /// The actor it hosts, if any.
    pub actor_id: Option<ActorId>,
    /// Which start of the actor this is (0 for the first).
    pub incarnation: u64,
    /// The actor's name, if it has one.
    pub actor_name: Option<String>,
    /// Actor group membership, if any.
    pub group: Option<GroupMembership>,
    /// The session this process belongs to.
    pub session: String,
    /// The node's name in the placement tables (the `node` column of a bundle table).
    pub placement_node: Option<String>,
    /// The GPUs given to this actor, each with its share (1 for a whole GPU, 0.2 for a
    /// hybrid-engine share), ascending by index. `CUDA_VISIBLE_DEVICES` lists their indices
    /// unless `RTRUN_NOSET_CUDA_VISIBLE_DEVICES` is set.
    pub gpus: Vec<GpuShare>,
    /// Everything the actor holds (CPU, GPU, memory, custom resources).
    pub resources: ResourceSet,
    /// The placement-group bundle it lives in, if any.
    pub bundle: Option<BundleRef>,
    /// The IP other nodes reach this process's node at (Ray's `get_node_ip_address()`);
    /// loopback in an embedded session.
    pub node_ip: std::net::IpAddr,
}

impl RuntimeContext {
    /// The device indices of its GPUs (what `CUDA_VISIBLE_DEVICES` lists).
    pub fn gpu_ids(&self) -> Vec<u32> {
        self.gpus.iter().map(|share| share.gpu.index).collect()
    }

    /// The UUIDs of its GPUs, in the order of [`RuntimeContext::gpu_ids`].
    pub fn gpu_uuids(&self) -> Vec<String> {
        self.gpus.iter().map(|share| share.gpu.uuid.clone()).collect()
    }
}

/// The current process's context.
pub fn context() -> crate::Result<RuntimeContext> {
    Ok(crate::runtime::current()?.context())
}

impl crate::runtime::Runtime {
    /// Who and where this process is.
    pub(crate) fn context(&self) -> RuntimeContext {
        let start = self.actor_context.lock();
        let allocation = start.as_ref().and_then(|s| s.allocation.as_ref());
        RuntimeContext {
            node_id: self.node_id,
            worker_id: self.worker_id,
            actor_id: start.as_ref().map(|s| s.actor),
            incarnation: start.as_ref().map(|s| s.incarnation).unwrap_or(0),
            actor_name: start.as_ref().and_then(|s| s.name.clone()),
            group: start.as_ref().and_then(|s| s.group.clone()),
            session: self.session.clone(),
            placement_node: allocation.map(|a| a.node.to_string()),
            gpus: allocation.map(|a| a.gpus.clone()).unwrap_or_default(),
            resources: allocation.map(|a| a.resources.clone()).unwrap_or_default(),
            bundle: allocation.and_then(|a| a.bundle),
            node_ip: crate::cluster::member()
                .map_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), |member| {
                    member.bind_ip
                }),
        }
    }
}
