//! How each kind of process starts its runtime: an embedded session's driver (which holds the
//! control plane and the node's store), a cluster head, a node daemon, a cluster driver or
//! client, and a worker (which attaches to its node's store and registers with the head).

use std::sync::{Arc, OnceLock};

use dashmap::DashMap;

use super::frames::Handler;
use super::{CURRENT, Config, ProcessKind, Runtime, random_u64, socket_name, worker_address};
use crate::error::{Error, Result};
use crate::head::{Head, HeadConfig};
use crate::ids::{Counter, DRIVER_WORKER_ID, NodeId, WorkerId};
use crate::object::ObjectTable;
use crate::protocol::Address;
use crate::store::{DEFAULT_MAX_INLINE_OBJECT_BYTES, StoreClient};
use crate::submit::Submitters;
use crate::transport::{Endpoint, TransportConfig};
use crate::worker::WorkerSpec;

impl Runtime {
    #[allow(clippy::too_many_arguments)]
    fn new(
        kind: ProcessKind,
        session: String,
        worker_id: WorkerId,
        node_id: NodeId,
        address: Address,
        namespace: String,
        transport: TransportConfig,
        tokio_threads: usize,
    ) -> Result<Arc<Runtime>> {
        let tokio = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(tokio_threads)
            .thread_name("rtrun-async")
            .enable_all()
            .build()
            .map_err(|e| Error::System(format!("cannot start the async runtime: {e}")))?;
        let runtime = Arc::new(Runtime {
            kind,
            head_exit_expected: std::sync::atomic::AtomicBool::new(false),
            session,
            worker_id,
            node_id,
            address: address.clone(),
            object_prefix: random_u64(),
            counter: Counter::starting_at(1),
            endpoint: OnceLock::new(),
            objects: ObjectTable::default(),
            calls: DashMap::new(),
            submitters: Submitters::default(),
            requests: DashMap::new(),
            head: OnceLock::new(),
            head_connection: OnceLock::new(),
            node_connection: OnceLock::new(),
            node_agent: OnceLock::new(),
            hosted: OnceLock::new(),
            tasks: OnceLock::new(),
            actor_context: parking_lot::Mutex::new(None),
            store: OnceLock::new(),
            namespace,
            tokio,
        });
        let handler = Arc::new(Handler(Arc::downgrade(&runtime)));
        let endpoint = Endpoint::bind(address, handler, transport)?;
        let _ = runtime.endpoint.set(endpoint);
        if let Some(member) = crate::cluster::member() {
            runtime.endpoint()?.attach_net(member.link.clone());
        }
        Ok(runtime)
    }

    pub(super) fn start_driver(config: Config) -> Result<Arc<Runtime>> {
        let session = format!("{:016x}", random_u64());
        let address = worker_address(&session, DRIVER_WORKER_ID);
        Runtime::start_head_process(ProcessKind::EmbeddedDriver, &config, session, address)
    }

    /// A cluster head's runtime: an embedded session's, at a cluster address.
    pub(crate) fn start_cluster_head(
        config: &Config,
        session: String,
        address: Address,
    ) -> Result<Arc<Runtime>> {
        let runtime =
            Runtime::start_head_process(ProcessKind::ClusterHead, config, session, address)?;
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
        let namespace = config.namespace.clone().unwrap_or_else(|| "default".to_owned());
        let runtime = Runtime::new(
            ProcessKind::NodeDaemon,
            session,
            worker,
            NodeId(node),
            address,
            namespace,
            config.transport.clone(),
            2,
        )?;
        runtime.open_store(config, worker)?;
        let agent = crate::cluster::node::NodeAgent::start(&runtime, agent)?;
        let _ = runtime.node_agent.set(agent);
        let conn = runtime.endpoint()?.connect(&head_address)?;
        let _ = runtime.head_connection.set(conn);
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
        let namespace = config.namespace.clone().unwrap_or_else(|| "default".to_owned());
        let runtime = Runtime::new(
            ProcessKind::ClusterDriver,
            session,
            worker,
            NodeId(node),
            address,
            namespace,
            config.transport.clone(),
            2,
        )?;
        let conn = runtime.endpoint()?.connect(&head_address)?;
        let _ = runtime.head_connection.set(conn);
        Ok(runtime)
    }

    /// Opens the node's object store in this process (an embedded driver, a head, a node).
    fn open_store(self: &Arc<Self>, config: &Config, worker: WorkerId) -> Result<()> {
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
        let store = StoreClient::open_node(
            Arc::downgrade(self),
            crate::store::holder_of(worker),
            store_config,
            max_inline,
        )?;
        let _ = self.store.set(store);
        Ok(())
    }

    fn start_head_process(
        kind: ProcessKind,
        config: &Config,
        session: String,
        address: Address,
    ) -> Result<Arc<Runtime>> {
        let namespace = config.namespace.clone().unwrap_or_else(|| "default".to_owned());
        let runtime = Runtime::new(
            kind,
            session.clone(),
            DRIVER_WORKER_ID,
            NodeId(0),
            address,
            namespace,
            config.transport.clone(),
            2,
        )?;
        runtime.open_store(config, DRIVER_WORKER_ID)?;
        let head = Head::start(&runtime, HeadConfig::from_runtime_config(config)?)?;
        let _ = runtime.head.set(head);
        tracing::debug!(session = %session, "embedded runtime started");
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
            ProcessKind::Worker,
            spec.session.clone(),
            spec.worker,
            node,
            address,
            spec.namespace.clone(),
            TransportConfig::default(),
            2,
        )?;
        let holder = crate::store::holder_of(spec.worker);
        if let Some(store) = StoreClient::attach_worker(Arc::downgrade(&runtime), holder)? {
            let _ = runtime.store.set(store);
        }
        if let Some(node_address) = node_address {
            let conn = runtime.endpoint()?.connect(&node_address)?;
            let _ = runtime.node_connection.set(conn);
        }
        let conn = runtime.endpoint()?.connect(&spec.head_address)?;
        let _ = runtime.head_connection.set(conn);
        let _ = CURRENT.set(runtime.clone());
        Ok(runtime)
    }
}
