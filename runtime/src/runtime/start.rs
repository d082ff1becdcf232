//! How each kind of process starts its runtime: an embedded session's driver (which holds the
//! control plane and the node's store), a cluster head, a node daemon, a cluster driver or
//! client, and a worker (which attaches to its node's store and registers with the head). Each
//! builds its [`ProcessRole`] once and installs it before the runtime is published.

use std::sync::{Arc, OnceLock};

use dashmap::DashMap;

use super::frames::Handler;
use super::role::EndSignal;
use super::role::HeadLink;
use super::{
    CURRENT, Config, ProcessRole, Runtime, WorkerRole, current, random_u64, socket_name,
    worker_address,
};
use crate::error::{Error, Result};
use crate::head::Head;
use crate::ids::{Counter, DRIVER_WORKER_ID, NodeId, WorkerId};
use crate::object::ObjectTable;
use crate::protocol::Address;
use crate::store::{DEFAULT_MAX_INLINE_OBJECT_BYTES, StoreClient};
use crate::submit::Submitters;
use crate::transport::{Endpoint, TransportConfig};
use crate::worker::WorkerSpec;

/// Starts the runtime with default settings: in a driver, an embedded control plane and node
/// with this machine's resources (like `ray.init()`); in a worker process, serves the worker's
/// assignment and never returns.
pub fn init() -> Result<()> {
    init_with(Config::default())
}

/// Like [`init`], with settings. Calling it again in the same process is a no-op.
pub fn init_with(config: Config) -> Result<()> {
    // Already a driver, or a worker (whose actor may call this): nothing to start.
    if CURRENT.get().is_some() {
        return Ok(());
    }
    run_worker_if_requested();
    let address = config.address.clone().or_else(|| {
        std::env::var(crate::cluster::ADDRESS_ENV).ok().filter(|a| !a.trim().is_empty())
    });
    let runtime = match address {
        Some(address) => crate::cluster::start_driver(&config, &address, true)?,
        None => Runtime::start_driver(config)?,
    };
    let _ = CURRENT.set(runtime);
    Ok(())
}

/// Turns this process into a worker when it was started as one (the environment says so), and
/// never returns in that case. Test binaries call this before their harness starts (for
/// example from a `#[ctor]`), since their `main` is not theirs.
pub fn run_worker_if_requested() {
    // A worker's own code calling this (through `init`) is already served.
    if CURRENT.get().is_some() {
        return;
    }
    if let Some(spec) = crate::worker::worker_spec_from_env() {
        crate::worker::run(spec);
    }
}

/// Stops every worker process of an embedded session. Later calls fail.
pub fn shutdown() {
    if let Some(head) = current().ok().and_then(|runtime| runtime.head()) {
        head.shutdown();
    }
}

impl Runtime {
    /// The parts every process has: its endpoint (bound here, its frames handled once the
    /// role is installed), object table and async runtime. The start functions below add the
    /// role.
    fn new(
        session: String,
        worker_id: WorkerId,
        node_id: NodeId,
        address: Address,
        namespace: String,
        transport: TransportConfig,
    ) -> Result<Arc<Runtime>> {
        let tokio = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("rtrun-async")
            .enable_all()
            .build()
            .map_err(|e| Error::System(format!("cannot start the async runtime: {e}")))?;
        let handler = Arc::new(Handler::default());
        let endpoint = Endpoint::bind(address.clone(), handler.clone(), transport)?;
        if let Some(member) = crate::cluster::member() {
            endpoint.attach_net(member.link.clone());
        }
        let runtime = Arc::new_cyclic(|me| Runtime {
            me: me.clone(),
            role: OnceLock::new(),
            ended: EndSignal::default(),
            head_exit_expected: std::sync::atomic::AtomicBool::new(false),
            session,
            worker_id,
            node_id,
            address,
            object_prefix: random_u64(),
            counter: Counter::starting_at(1),
            endpoint,
            objects: ObjectTable::default(),
            calls: DashMap::new(),
            submitters: Submitters::default(),
            requests: DashMap::new(),
            parked: parking_lot::Mutex::new(Vec::new()),
            actor_context: parking_lot::Mutex::new(None),
            namespace,
            tokio,
        });
        handler.serve(&runtime);
        Ok(runtime)
    }

    pub(super) fn start_driver(config: Config) -> Result<Arc<Runtime>> {
        let session = format!("{:016x}", random_u64());
        let address = worker_address(&session, DRIVER_WORKER_ID);
        Runtime::start_control_plane(false, &config, session, address, true)
    }

    /// A cluster head's runtime: an embedded session's, at a cluster address.
    pub(crate) fn start_cluster_head(
        config: &Config,
        session: String,
        address: Address,
        workers_on_head: bool,
    ) -> Result<Arc<Runtime>> {
        let runtime =
            Runtime::start_control_plane(true, config, session, address, workers_on_head)?;
        let _ = CURRENT.set(runtime.clone());
        Ok(runtime)
    }

    /// A node daemon's runtime: the node's store and worker supervision, connected to the head.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_cluster_node(
        config: &Config,
        session: String,
        worker: WorkerId,
        node: u64,
        address: Address,
        head_address: Address,
        agent: crate::cluster::node::NodeAgentConfig,
    ) -> Result<Arc<Runtime>> {
        let runtime = Runtime::new(
            session,
            worker,
            NodeId(node),
            address,
            namespace_of(config),
            config.transport.clone(),
        )?;
        let store = runtime.open_store(config, worker)?;
        let agent = crate::cluster::node::NodeAgent::start(&runtime, agent)?;
        let head = runtime.endpoint().connect_head(&head_address)?;
        runtime.install_role(ProcessRole::NodeDaemon {
            head: HeadLink::new(head),
            store,
            agent,
        })?;
        let _ = CURRENT.set(runtime.clone());
        Ok(runtime)
    }

    /// A driver (or command-line client) of a cluster: no store of its own, the head remote.
    pub(crate) fn start_cluster_driver(
        config: &Config,
        session: String,
        worker: WorkerId,
        node: u64,
        address: Address,
        head_address: Address,
    ) -> Result<Arc<Runtime>> {
        let runtime = Runtime::new(
            session,
            worker,
            NodeId(node),
            address,
            namespace_of(config),
            config.transport.clone(),
        )?;
        let head = runtime.endpoint().connect_head(&head_address)?;
        runtime.install_role(ProcessRole::ClusterDriver { head: HeadLink::new(head) })?;
        Ok(runtime)
    }

    /// Opens the node's object store in this process (an embedded driver, a head, a node).
    fn open_store(self: &Arc<Self>, config: &Config, worker: WorkerId) -> Result<Arc<StoreClient>> {
        // An explicit capacity is reserved up front (an error now rather than memory pressure
        // later); the default one, 30 % of RAM, is only address space until objects use it, as
        // in Ray, so that a driver does not take gigabytes it may never need.
        let mut store_config = match config.object_store_memory {
            Some(bytes) => rtrun_object_store::StoreConfig::with_capacity(bytes),
            None => rtrun_object_store::StoreConfig {
                reserve: false,
                ..rtrun_object_store::StoreConfig::default()
            },
        };
        store_config.spill_dir = config.object_spill_dir.clone();
        let max_inline = config.max_inline_object_bytes.unwrap_or(DEFAULT_MAX_INLINE_OBJECT_BYTES);
        StoreClient::open_node(
            Arc::downgrade(self),
            rtrun_proto::address::holder_of(worker),
            store_config,
            max_inline,
        )
    }

    /// The process that holds the control plane and the node's store: an embedded session's
    /// driver, or a cluster's head (`cluster`).
    fn start_control_plane(
        cluster: bool,
        config: &Config,
        session: String,
        address: Address,
        workers_on_head: bool,
    ) -> Result<Arc<Runtime>> {
        let runtime = Runtime::new(
            session.clone(),
            DRIVER_WORKER_ID,
            NodeId(0),
            address,
            namespace_of(config),
            config.transport.clone(),
        )?;
        let store = runtime.open_store(config, DRIVER_WORKER_ID)?;
        let head_config =
            crate::head::HeadConfig { workers_on_head, ..crate::head::head_config(config)? };
        let head = Head::start(&runtime, head_config)?;
        runtime.install_role(ProcessRole::ControlPlane { head, store })?;
        tracing::debug!(session = %session, cluster, "control plane started");
        Ok(runtime)
    }

    /// Starts a worker process's runtime and connects it to the head.
    pub(crate) fn start_worker(spec: &WorkerSpec) -> Result<Arc<Runtime>> {
        let name = socket_name(&spec.session, spec.worker);
        let (node, node_address, address) = match crate::cluster::start_worker_link(&name)? {
            Some((node, node_address, address)) => (NodeId(node), Some(node_address), address),
            None => (NodeId(0), None, worker_address(&spec.session, spec.worker)),
        };
        let runtime = Runtime::new(
            spec.session.clone(),
            spec.worker,
            node,
            address,
            spec.namespace.clone(),
            TransportConfig::default(),
        )?;
        let holder = rtrun_proto::address::holder_of(spec.worker);
        let store = StoreClient::attach_worker(Arc::downgrade(&runtime), holder)?;
        let node_connection = match node_address {
            Some(node_address) => Some(runtime.endpoint().connect(&node_address)?),
            None => None,
        };
        let head = runtime.endpoint().connect_head(&spec.head_address)?;
        runtime.install_role(ProcessRole::Worker(WorkerRole::new(head, node_connection, store)))?;
        let _ = CURRENT.set(runtime.clone());
        Ok(runtime)
    }
}

fn namespace_of(config: &Config) -> String {
    config.namespace.clone().unwrap_or_else(|| "default".to_owned())
}
