//! `rtrun head`: the cluster head's process — its credentials, its endpoint and heartbeat
//! monitor, the control plane made a cluster head, and the network service that answers joins
//! and job binaries.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use rtrun_net::{CredentialsDir, EndpointOptions, HeartbeatConfig, NetConfig};

use super::binaries::BinaryCache;
use super::{
    LateSource, Member, NetReply, NetRequest, NetService, net_config, net_error, net_runtime,
};
use crate::error::{Error, Result};
use crate::head::{ClusterHead, Head, JoinAs};
use crate::ids::WorkerId;
use crate::runtime::{Config, Runtime};
use crate::transport::{NetLink, Route};

/// Options of `rtrun head`.
#[derive(Debug, Clone)]
pub struct HeadOptions {
    /// Where to listen (UDP), e.g. `0.0.0.0:6379`.
    pub bind: SocketAddr,
    /// The IP other nodes reach this head at (default: the bind IP, or 127.0.0.1 for 0.0.0.0).
    pub advertise: Option<IpAddr>,
    /// The head node's name (its certificate's name).
    pub node_name: String,
    /// Credentials directory (created with new cluster credentials on first start).
    pub credentials_dir: PathBuf,
    /// Job binaries and logs go under here.
    pub data_dir: PathBuf,
    /// The head node's resources and store.
    pub config: Config,
    /// Silence after which a node is dead.
    pub heartbeat_timeout: Duration,
    /// Where the head persists its durable state (`--state-dir`): a head restarted on the same
    /// directory and address recovers its cluster. `None`: today's head, whose nodes exit
    /// when they lose it.
    pub state_dir: Option<PathBuf>,
    /// How long nodes and drivers reconnect to a head with a state directory after losing it
    /// (`--reconnect-window`; default [`DEFAULT_RECONNECT_WINDOW`]).
    pub reconnect_window: Duration,
}

/// How long nodes, workers and drivers reconnect to a restarting head by default (Ray's
/// raylets wait 60 s for a restarted GCS).
pub const DEFAULT_RECONNECT_WINDOW: Duration = Duration::from_secs(60);

/// A running head.
pub struct HeadHandle {
    /// `host:port` to pass to `rtrun join --address`.
    pub address: SocketAddr,
    /// The join token.
    pub token: String,
    /// Whether the credentials were created now.
    pub created_credentials: bool,
    /// The credentials directory.
    pub credentials_dir: PathBuf,
}

/// Starts a cluster head in this process: control plane, the head's node (store, workers) and
/// the network service. Returns once it is listening.
pub fn start_head(options: HeadOptions) -> Result<HeadHandle> {
    let dir = CredentialsDir::new(&options.credentials_dir);
    let (credentials, created) =
        dir.load_or_create_head(&options.node_name).map_err(net_error("cluster credentials"))?;
    let net = net_runtime()?;
    let config = NetConfig {
        heartbeat: HeartbeatConfig {
            interval: (options.heartbeat_timeout / 5).max(Duration::from_millis(100)),
            timeout: options.heartbeat_timeout,
        },
        // Every connection of the head is a control-plane one, those it opens too.
        idle_timeout: super::HEAD_IDLE_TIMEOUT,
        ..net_config()
    };
    let (monitor, mut dead) = {
        let _guard = net.enter();
        rtrun_net::HeartbeatMonitor::start(config.heartbeat)
    };
    let store_source: Arc<OnceLock<Arc<dyn rtrun_net::ObjectSource>>> = Arc::new(OnceLock::new());
    let endpoint = {
        let _guard = net.enter();
        rtrun_net::Endpoint::bind(
            options.bind,
            credentials.node.clone(),
            EndpointOptions {
                config,
                authority: Some(credentials.authority.clone()),
                object_source: Some(Arc::new(LateSource(store_source.clone()))),
                monitor: Some(monitor.clone()),
            },
        )
        .map_err(net_error("binding the head's endpoint"))?
    };
    let bound = endpoint.local_addr().map_err(net_error("binding the head's endpoint"))?;
    let ip = options.advertise.unwrap_or(if bound.ip().is_unspecified() {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        bound.ip()
    });
    let advertised = SocketAddr::new(ip, bound.port());
    // A head with a state directory takes the session (and so its processes' addresses) of the
    // cluster it recovers.
    let cluster_id: String =
        credentials.authority.fingerprint().iter().map(|b| format!("{b:02x}")).collect();
    let state = match &options.state_dir {
        Some(dir) => Some((dir.clone(), crate::head::state_dir::StateDir::read(dir, &cluster_id)?)),
        None => None,
    };
    let recovered_meta =
        state.as_ref().and_then(|(_, (_, found))| found.as_ref().map(|f| f.meta.clone()));
    let session = match &recovered_meta {
        Some(meta) => meta.session.clone(),
        None => format!("{:016x}", crate::runtime::random_u64()),
    };
    if let Some(meta) = &recovered_meta
        && meta.address != advertised.to_string()
    {
        tracing::warn!(
            "this head was at {} before it restarted and is at {advertised} now: its nodes and \
             drivers reconnect to the address they joined, so they cannot find it (restart it \
             with --port {} and the same --advertise)",
            meta.address,
            meta.address.rsplit(':').next().unwrap_or("?")
        );
    }
    let worker = crate::ids::DRIVER_WORKER_ID;
    let address = Route::quic(advertised, 0, &crate::runtime::socket_name(&session, worker));
    let link = Arc::new(NetLink {
        node: 0.into(),
        endpoint,
        handle: net.handle().clone(),
        requests: OnceLock::new(),
    });
    let member = Member::new(
        link.clone(),
        None,
        None,
        ip,
        Some(address.clone()),
        options.credentials_dir.clone(),
        net.clone(),
    );
    member.install();
    // A head that persists its state runs no workers on its own node: they would end with it.
    let workers_on_head = options.state_dir.is_none();
    let runtime = Runtime::start_cluster_head(
        &options.config,
        session.clone(),
        address.clone(),
        workers_on_head,
    )?;
    runtime.endpoint().attach_net(link.clone());
    let _ = store_source.set(runtime.store_client()?.object_source()?);
    let binaries = Arc::new(BinaryCache::open(options.data_dir.join("binaries"))?);
    let log_dir = options.data_dir.join("logs");
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| Error::System(format!("cannot create {}: {e}", log_dir.display())))?;
    let jobs_dir = options.data_dir.join("jobs");
    let head = runtime.head().cloned().ok_or(Error::NotInitialised)?;
    head.enable_cluster(
        Arc::new(ClusterHead {
            address: address.clone(),
            binaries: binaries.clone(),
            log_dir,
            jobs_dir,
        }),
        options.node_name.clone(),
    );
    if let Some((dir, (lock, found))) = state {
        let generation = found.as_ref().map_or(0, |f| f.meta.generation) + 1;
        if let Some(found) = &found {
            tracing::info!(
                dir = %dir.display(),
                generation = found.meta.generation,
                log_records = found.log_records,
                "recovering the cluster: {}",
                found.state.summary()
            );
        }
        head.enable_persistence(crate::head::Persistence {
            dir,
            lock,
            meta: crate::head::state_dir::Meta {
                cluster: cluster_id,
                session: session.clone(),
                address: advertised.to_string(),
                generation,
            },
            recovered: found.map(|f| f.state),
            reconnect_window: options.reconnect_window,
        })?;
    }
    // The network service: joins and job binaries.
    let drivers: Arc<parking_lot::Mutex<HashMap<String, WorkerId>>> = Arc::default();
    let service = Arc::new(HeadService {
        head: Arc::downgrade(&head),
        session,
        binaries,
        monitor: monitor.clone(),
        drivers: drivers.clone(),
    });
    let _ = link.requests.set(service);
    let dead_head = Arc::downgrade(&head);
    let timeout = options.heartbeat_timeout;
    net.spawn(async move {
        while let Some(name) = dead.recv().await {
            let Some(head) = dead_head.upgrade() else { continue };
            // A silent driver (killed, paused, cut off) takes its actors and groups with it
            // now, not when its connection times out.
            // Drivers are watched by link name (`PEER#ID`; `#` is never in a node's name).
            let driver = drivers.lock().remove(&name);
            match driver {
                Some(driver) => {
                    tracing::warn!(%name, "driver declared dead: no heartbeat for {timeout:?}");
                    head.on_driver_gone(driver);
                }
                // A driver whose connection closed meanwhile (it was handled then).
                None if name.contains('#') => {}
                None => head.on_node_dead(&name, &format!("no heartbeat for {timeout:?}")),
            }
        }
    });
    Ok(HeadHandle {
        address: advertised,
        token: credentials.node.token.to_string(),
        created_credentials: created,
        credentials_dir: options.credentials_dir,
    })
}

/// Answers the head's `rtrun-net` requests.
struct HeadService {
    head: std::sync::Weak<Head>,
    session: String,
    binaries: Arc<BinaryCache>,
    monitor: rtrun_net::HeartbeatMonitor,
    /// Drivers watched by the heartbeat monitor, by link name (`PEER#ID`).
    drivers: Arc<parking_lot::Mutex<HashMap<String, WorkerId>>>,
}

impl NetService for HeadService {
    fn serve(
        self: Arc<Self>,
        peer: String,
        link: String,
        frame: rtrun_net::Frame,
    ) -> Result<(NetReply, Vec<Bytes>)> {
        let request: NetRequest = crate::codec::decode(&frame.head)?;
        let head = self.head.upgrade().ok_or(Error::NotInitialised)?;
        match request {
            NetRequest::JoinNode { resources, endpoint } => {
                let joined = head.join(
                    &self.session,
                    JoinAs::Node { name: peer.clone(), resources, endpoint },
                )?;
                self.monitor.watch(&peer);
                Ok((joined.into(), Vec::new()))
            }
            NetRequest::RejoinNode { node, workers, endpoint: _ } => {
                let (head_address, window) = head.rejoin_node(node, &peer, &workers)?;
                self.monitor.watch(&peer);
                let reconnect_ms = window.map(|w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX));
                Ok((NetReply::Rejoined { head: head_address, reconnect_ms }, Vec::new()))
            }
            NetRequest::JoinDriver { binary, resume: Some(worker), .. } => {
                // A client (no binary) sends no heartbeats and is not watched.
                let joined = head.join(&self.session, JoinAs::ResumedDriver { worker })?;
                if binary.is_some() {
                    self.drivers.lock().insert(link.clone(), joined.worker);
                    self.monitor.watch(&link);
                }
                Ok((joined.into(), Vec::new()))
            }
            NetRequest::JoinDriver { binary, job, endpoint, .. } => {
                if let Some(digest) = &binary
                    && !self.binaries.contains(digest)
                {
                    return Err(Error::Invalid(format!(
                        "driver binary {digest} must be uploaded before joining"
                    )));
                }
                let watch = binary.is_some();
                let joined = head.join(&self.session, JoinAs::Driver { binary, job, endpoint })?;
                // A driver (not a command-line client) sends heartbeats; it is watched like
                // a node, by its connection: drivers with the same credentials share a peer
                // name, and one's beats must not keep another alive.
                if watch {
                    self.drivers.lock().insert(link.clone(), joined.worker);
                    self.monitor.watch(&link);
                }
                Ok((joined.into(), Vec::new()))
            }
            NetRequest::HasBinary { digest } => {
                Ok((NetReply::Present(self.binaries.contains(&digest)), Vec::new()))
            }
            NetRequest::UploadBinary { digest } => {
                let bytes = frame.parts.first().ok_or_else(|| {
                    Error::Invalid("an upload carries the binary as its only part".into())
                })?;
                self.binaries.insert(&digest, bytes)?;
                Ok((NetReply::Done, Vec::new()))
            }
            NetRequest::FetchBinary { digest } => {
                let bytes = self.binaries.read(&digest)?;
                Ok((NetReply::Done, vec![Bytes::from(bytes)]))
            }
        }
    }

    /// A driver's connection closed: it exited (its connections close with it) or it was cut
    /// off; its actors and groups go now, and the monitor stops watching it.
    fn link_closed(&self, link: &rtrun_net::Connection) {
        let name = link.link_name();
        let Some(driver) = self.drivers.lock().remove(&name) else { return };
        self.monitor.forget(&name);
        match link.quinn().close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(_)) => {
                tracing::debug!(link = %name, "driver disconnected");
            }
            reason => {
                let reason = reason.map_or_else(|| "closed".to_owned(), |r| r.to_string());
                tracing::warn!(link = %name, "driver's connection lost: {reason}");
            }
        }
        if let Some(head) = self.head.upgrade() {
            head.on_driver_gone(driver);
        }
    }
}

impl From<crate::head::Joined> for NetReply {
    fn from(joined: crate::head::Joined) -> NetReply {
        NetReply::Joined {
            session: joined.session,
            worker: joined.worker,
            node: joined.node,
            head: joined.head,
            reconnect_ms: joined
                .reconnect_window
                .map(|w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX)),
        }
    }
}
