//! Multi-node clusters: `rtrun head`, `rtrun join`, drivers that `init` with an address, and
//! workers of a cluster.
//!
//! Every process of a cluster has a QUIC endpoint (`rtrun-net`: mutual TLS with the cluster
//! CA, then the join token) next to its abstract Unix socket; its address says both
//! (`quic://ip:port/node/name`, see [`crate::transport`]). Processes of one node talk over
//! Unix sockets, processes of different nodes over QUIC channels, with the same frames, so
//! actor calls and replies go straight from caller to callee across nodes as on one node.
//!
//! Joining is one `rtrun-net` request to the head (`NetRequest::Join`) answered with the
//! session, the process's id and its node id; then the process opens its runtime connection to
//! the head like any worker. Node daemons and drivers also send heartbeats on that first
//! connection; the head's monitor declares a node dead (or a driver gone, with its actors and
//! groups) after `heartbeat_timeout` of silence. Job binaries move
//! as `rtrun-net` requests too, content-addressed ([`binaries`]).

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

pub mod binaries;
pub mod client;
pub(crate) mod node;
pub mod working_dir;

pub use client::Client;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use rtrun_net::{CredentialsDir, EndpointOptions, HeartbeatConfig, JoinToken, NetConfig};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::head::{ClusterHead, Head, JoinAs};
use crate::ids::WorkerId;
use crate::protocol::Address;
use crate::runtime::{Config, Runtime};
use crate::transport::{NetLink, Route};

use binaries::BinaryCache;

/// The head address a driver connects to (`host:port`); `init()` joins that cluster instead of
/// starting an embedded one.
pub const ADDRESS_ENV: &str = "RTRUN_ADDRESS";
/// Environment variable the head sets for a submitted job's driver: the job's number.
pub const JOB_ENV: &str = "RTRUN_JOB_ID";
/// Environment variable the head sets for a submitted job's driver that has a working
/// directory: where it was unpacked (the driver's current directory).
pub const WORKING_DIR_ENV: &str = "RTRUN_WORKING_DIR";
/// The credentials directory of a cluster process.
pub const CREDENTIALS_ENV: &str = "RTRUN_CREDENTIALS_DIR";
/// Set in workers of a cluster: `<node id>;<node daemon address>;<bind ip>`.
pub(crate) const NODE_ENV: &str = "RTRUN_NODE";
/// Seconds a process joining a cluster waits for the head (see [`Config::connect_timeout`]).
pub const CONNECT_TIMEOUT_ENV: &str = "RTRUN_CONNECT_TIMEOUT";
/// How long joining a cluster waits for the head by default: a live head on a LAN answers a
/// QUIC handshake in milliseconds, so a few seconds is a generous bound for a dead one.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the certificate of a token-only command-line client is valid: it lives for one
/// command, and is never written to disk.
const CLIENT_CERTIFICATE_VALIDITY: Duration = Duration::from_secs(3600);
/// How long the certificate of a token-only driver is valid: one job; a driver that must run
/// longer uses a credentials directory (a node certificate).
const DRIVER_CERTIFICATE_VALIDITY: Duration = Duration::from_secs(7 * 24 * 3600);

/// The connect timeout of `config`: its field, else [`CONNECT_TIMEOUT_ENV`], else the default.
fn connect_timeout(config: &Config) -> Result<Duration> {
    if let Some(timeout) = config.connect_timeout {
        return Ok(timeout);
    }
    match std::env::var(CONNECT_TIMEOUT_ENV) {
        Ok(value) if !value.trim().is_empty() => value
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "{CONNECT_TIMEOUT_ENV}: expected a positive number of seconds, found `{value}`"
                ))
            }),
        _ => Ok(DEFAULT_CONNECT_TIMEOUT),
    }
}

/// The error for a head that did not answer within `timeout`.
fn head_unreachable(head: SocketAddr, timeout: Duration) -> Error {
    Error::Transport(format!(
        "cannot reach the cluster head at {head}: no answer within {:.1} s (is `rtrun head` \
         running there and is UDP port {} reachable? --connect-timeout or {CONNECT_TIMEOUT_ENV} \
         waits longer)",
        timeout.as_secs_f64(),
        head.port()
    ))
}

/// The default credentials directory: `$RTRUN_CREDENTIALS_DIR`, else `~/.rtrun/credentials`.
pub fn default_credentials_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(CREDENTIALS_ENV) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".rtrun").join("credentials")
}

/// What the head's network service answers (`rtrun-net` requests; heads encoded with the
/// runtime codec).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum NetRequest {
    /// Register a node daemon.
    JoinNode {
        /// Its resources (ids are reassigned by the head).
        resources: rtrun_placement::NodeResources,
        /// Its QUIC endpoint.
        endpoint: SocketAddr,
    },
    /// Register a driver (or a command-line client when `binary` is `None`).
    JoinDriver {
        /// The digest of the driver's executable.
        binary: Option<String>,
        /// Its QUIC endpoint.
        endpoint: SocketAddr,
        /// The submitted job it is the driver of ([`JOB_ENV`]), if any.
        job: Option<u64>,
    },
    /// Whether the head has a job binary.
    HasBinary {
        /// Its digest.
        digest: String,
    },
    /// A job binary (one part).
    UploadBinary {
        /// Its digest.
        digest: String,
    },
    /// Send a job binary (answered with one part).
    FetchBinary {
        /// Its digest.
        digest: String,
    },
}

/// Answers to [`NetRequest`]s.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum NetReply {
    /// Registered.
    Joined {
        /// The cluster's session.
        session: String,
        /// The joining process's id.
        worker: WorkerId,
        /// Its node id.
        node: u64,
        /// The control plane's address.
        head: Address,
    },
    /// Yes or no.
    Present(bool),
    /// Done (a binary follows as a part when asked for).
    Done,
}

/// This process's membership in a cluster.
pub(crate) struct Member {
    /// Its QUIC side.
    pub(crate) link: Arc<NetLink>,
    /// Its connection to the head's endpoint (joins, binaries, a node's heartbeats).
    pub(crate) control: Option<rtrun_net::Connection>,
    /// Keeps a node daemon's heartbeats going.
    _heartbeats: Option<rtrun_net::HeartbeatSender>,
    /// The IP it binds and advertises.
    pub(crate) bind_ip: IpAddr,
    /// The node daemon's address (store operations go there).
    pub(crate) node_address: Option<Address>,
    /// Its credentials directory.
    pub(crate) credentials_dir: PathBuf,
    /// Keeps the net runtime alive.
    _net: Arc<tokio::runtime::Runtime>,
    /// Connections to other nodes' endpoints for object pulls.
    pulls: dashmap::DashMap<SocketAddr, rtrun_net::Connection>,
}

static MEMBER: OnceLock<Arc<Member>> = OnceLock::new();

/// This process's cluster membership, when it is part of one.
pub(crate) fn member() -> Option<&'static Arc<Member>> {
    MEMBER.get()
}

/// The environment a worker spawned on node `node` (whose daemon is at `node_address`) needs
/// to take part in the cluster.
pub(crate) fn node_env(node: u64, node_address: &str) -> Vec<(String, String)> {
    let Some(member) = member() else { return Vec::new() };
    vec![
        (NODE_ENV.into(), format!("{node};{node_address};{}", member.bind_ip)),
        (CREDENTIALS_ENV.into(), member.credentials_dir.display().to_string()),
    ]
}

/// The network settings of cluster processes: `rtrun-net`'s defaults with a 10 s idle timeout
/// (2 s keep-alives), so that a peer process killed without closing its connections (a worker
/// of a dead node, a SIGKILLed driver) is noticed within seconds by those connected to it.
fn net_config() -> NetConfig {
    NetConfig {
        idle_timeout: Duration::from_secs(10),
        keep_alive: Duration::from_secs(2),
        ..NetConfig::default()
    }
}

fn net_runtime() -> Result<Arc<tokio::runtime::Runtime>> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("rtrun-net")
        .enable_all()
        .build()
        .map(Arc::new)
        .map_err(|e| Error::System(format!("cannot start the network runtime: {e}")))
}

fn net_error(what: &str) -> impl Fn(rtrun_net::NetError) -> Error + '_ {
    move |e| Error::Transport(format!("{what}: {e}"))
}

/// Resolves `host:port` to a socket address.
pub fn resolve(address: &str) -> Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    address
        .to_socket_addrs()
        .map_err(|e| Error::Invalid(format!("cannot resolve head address `{address}`: {e}")))?
        .next()
        .ok_or_else(|| Error::Invalid(format!("head address `{address}` resolves to nothing")))
}

/// The local IP that routes to `peer` (what this process advertises to the cluster).
fn local_ip_towards(peer: SocketAddr) -> IpAddr {
    if peer.ip().is_loopback() {
        return peer.ip();
    }
    let probe = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .and_then(|socket| socket.connect(peer).map(|()| socket))
        .and_then(|socket| socket.local_addr());
    probe.map(|addr| addr.ip()).unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

fn encode_request(request: &NetRequest) -> Result<Bytes> {
    crate::codec::encode(request).map(Bytes::from)
}

/// Sends a request on the control connection.
pub(crate) fn control_request(
    member: &Member,
    request: NetRequest,
    parts: Vec<Bytes>,
) -> Result<(NetReply, Vec<Bytes>)> {
    let control = member
        .control
        .clone()
        .ok_or_else(|| Error::Invalid("this process has no connection to the head".into()))?;
    let head = encode_request(&request)?;
    let frame = member
        .link
        .wait(async move { control.request(head, parts).await })?
        .map_err(net_error("request to the head"))?;
    let reply: NetReply = crate::codec::decode(&frame.head)?;
    Ok((reply, frame.parts))
}

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
}

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
    let session = format!("{:016x}", crate::runtime::random_u64());
    let worker = crate::ids::DRIVER_WORKER_ID;
    let address = Route::quic(advertised, 0, &crate::runtime::socket_name(&session, worker));
    let link = Arc::new(NetLink {
        node: 0.into(),
        endpoint,
        handle: net.handle().clone(),
        requests: OnceLock::new(),
    });
    let member = Arc::new(Member {
        link: link.clone(),
        control: None,
        _heartbeats: None,
        bind_ip: ip,
        node_address: Some(address.clone()),
        credentials_dir: options.credentials_dir.clone(),
        _net: net.clone(),
        pulls: Default::default(),
    });
    let _ = MEMBER.set(member);
    let runtime = Runtime::start_cluster_head(&options.config, session.clone(), address.clone())?;
    runtime.endpoint()?.attach_net(link.clone());
    let _ = store_source.set(runtime.store_client()?.object_source()?);
    let binaries = Arc::new(BinaryCache::open(options.data_dir.join("binaries"))?);
    let log_dir = options.data_dir.join("logs");
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| Error::System(format!("cannot create {}: {e}", log_dir.display())))?;
    let jobs_dir = options.data_dir.join("jobs");
    let head = runtime.head.get().cloned().ok_or(Error::NotInitialised)?;
    head.enable_cluster(
        Arc::new(ClusterHead {
            address: address.clone(),
            binaries: binaries.clone(),
            log_dir,
            jobs_dir,
        }),
        options.node_name.clone(),
    );
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
            let driver = drivers.lock().remove(&name);
            match driver {
                Some(driver) => {
                    tracing::warn!(%name, "driver declared dead: no heartbeat for {timeout:?}");
                    head.on_driver_gone(driver);
                }
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

/// An object source installed once the store exists (the endpoint is bound before).
struct LateSource(Arc<OnceLock<Arc<dyn rtrun_net::ObjectSource>>>);

impl rtrun_net::ObjectSource for LateSource {
    fn size(&self, object: rtrun_object_store::ObjectId) -> Option<u64> {
        self.0.get().and_then(|source| source.size(object))
    }

    fn read(
        &self,
        object: rtrun_object_store::ObjectId,
        offset: u64,
        len: u64,
    ) -> std::result::Result<Bytes, String> {
        match self.0.get() {
            Some(source) => source.read(object, offset, len),
            None => Err("the node's object store is not open yet".into()),
        }
    }
}

/// Answers the head's `rtrun-net` requests.
struct HeadService {
    head: std::sync::Weak<Head>,
    session: String,
    binaries: Arc<BinaryCache>,
    monitor: rtrun_net::HeartbeatMonitor,
    /// Drivers watched by the heartbeat monitor, by peer name.
    drivers: Arc<parking_lot::Mutex<HashMap<String, WorkerId>>>,
}

/// What a [`NetLink`] does with requests peers send it.
pub(crate) trait NetService: Send + Sync + 'static {
    /// Answers one request (runs on the net runtime; blocking work goes to a thread).
    fn serve(
        self: Arc<Self>,
        peer: String,
        frame: rtrun_net::Frame,
    ) -> Result<(NetReply, Vec<Bytes>)>;
}

impl NetService for HeadService {
    fn serve(
        self: Arc<Self>,
        peer: String,
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
                Ok((
                    NetReply::Joined {
                        session: joined.session,
                        worker: joined.worker,
                        node: joined.node,
                        head: joined.head,
                    },
                    Vec::new(),
                ))
            }
            NetRequest::JoinDriver { binary, job, .. } => {
                if let Some(digest) = &binary
                    && !self.binaries.contains(digest)
                {
                    return Err(Error::Invalid(format!(
                        "driver binary {digest} must be uploaded before joining"
                    )));
                }
                let watch = binary.is_some();
                let joined = head.join(&self.session, JoinAs::Driver { binary, job })?;
                // A driver (not a command-line client) sends heartbeats; it is watched like
                // a node.
                if watch {
                    self.drivers.lock().insert(peer.clone(), joined.worker);
                    self.monitor.watch(&peer);
                }
                Ok((
                    NetReply::Joined {
                        session: joined.session,
                        worker: joined.worker,
                        node: joined.node,
                        head: joined.head,
                    },
                    Vec::new(),
                ))
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
}

/// Serves a link's requests with `service` (spawned per link by the endpoint).
pub(crate) async fn serve_requests(link: rtrun_net::Connection, service: Arc<dyn NetService>) {
    while let Some(request) = link.next_request().await {
        let service = service.clone();
        let peer = request.peer().to_owned();
        let (frame, responder) = request.into_parts();
        tokio::spawn(async move {
            let answer = tokio::task::spawn_blocking(move || service.serve(peer, frame)).await;
            let result = match answer {
                Ok(Ok((reply, parts))) => match crate::codec::encode(&reply) {
                    Ok(head) => responder.respond(head, parts).await,
                    Err(e) => responder.error(e.to_string()).await,
                },
                Ok(Err(e)) => responder.error(e.to_string()).await,
                Err(e) => responder.error(format!("the request failed: {e}")).await,
            };
            if let Err(e) = result {
                tracing::debug!("could not answer a request: {e}");
            }
        });
    }
}

/// Options of `rtrun join`.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// The head's `host:port`.
    pub address: String,
    /// The join token (flag); else `RTRUN_TOKEN`, else the credentials directory's token file.
    pub token: Option<String>,
    /// This node's name (its certificate's name when bootstrapping).
    pub node_name: String,
    /// Credentials directory (bootstrapped with the token when empty).
    pub credentials_dir: PathBuf,
    /// Job binaries and worker logs go under here.
    pub data_dir: PathBuf,
    /// The node's resources and store.
    pub config: Config,
    /// The IP to bind and advertise (default: the one that routes to the head).
    pub bind_ip: Option<IpAddr>,
}

/// How a process without credentials of its own gets them.
enum Bootstrap {
    /// A node: a certificate with the node validity, saved in the credentials directory.
    SaveNode,
    /// A driver or client: a certificate valid this long, kept in memory only.
    InMemory(Duration),
}

/// Loads the credentials in `dir`, or bootstraps them from the head with the token, within
/// `timeout` in all.
fn credentials(
    dir: &Path,
    token: Option<&str>,
    node_name: &str,
    head: SocketAddr,
    bootstrap: Bootstrap,
    timeout: Duration,
) -> Result<rtrun_net::NodeCredentials> {
    let credentials_dir = CredentialsDir::new(dir);
    if dir.join("node.pem").exists() {
        return credentials_dir.load_node().map_err(net_error("loading credentials"));
    }
    let token = JoinToken::resolve(token, Some(&credentials_dir.token_path()))
        .map_err(net_error("the join token"))?;
    let validity = match bootstrap {
        Bootstrap::SaveNode => None,
        Bootstrap::InMemory(validity) => Some(validity),
    };
    let net = net_runtime()?;
    let name = node_name.to_owned();
    // Retried on a timeout like every handshake (see `transport::connect_with_retries`), all
    // within `timeout`; the head signs a fresh request each time, so a retry after a lost
    // answer is harmless.
    let node = net
        .block_on(async move {
            let attempts = async {
                let mut attempt = 1;
                loop {
                    let config = net_config();
                    match rtrun_net::bootstrap_with_validity(head, &token, &name, validity, &config)
                        .await
                    {
                        Err(rtrun_net::NetError::Timeout { .. }) if attempt < 3 => {
                            tracing::warn!(%head, attempt, "bootstrap timed out; trying again");
                            attempt += 1;
                        }
                        result => return result,
                    }
                }
            };
            tokio::time::timeout(timeout, attempts).await
        })
        .map_err(|_| head_unreachable(head, timeout))?
        .map_err(net_error(&format!("bootstrapping credentials with the head at {head}")))?;
    if matches!(bootstrap, Bootstrap::SaveNode) {
        credentials_dir.save_node(&node).map_err(net_error("saving credentials"))?;
    }
    Ok(node)
}

/// A joined process's network side, before its runtime exists.
struct Joining {
    link: Arc<NetLink>,
    control: rtrun_net::Connection,
    net: Arc<tokio::runtime::Runtime>,
    bind_ip: IpAddr,
    endpoint: SocketAddr,
}

fn connect_to_head(
    head: SocketAddr,
    node: rtrun_net::NodeCredentials,
    bind_ip: Option<IpAddr>,
    object_source: Option<Arc<dyn rtrun_net::ObjectSource>>,
    timeout: Duration,
) -> Result<Joining> {
    let net = net_runtime()?;
    let bind_ip = bind_ip.unwrap_or_else(|| local_ip_towards(head));
    let endpoint = {
        let _guard = net.enter();
        rtrun_net::Endpoint::bind(
            SocketAddr::new(bind_ip, 0),
            node,
            EndpointOptions { object_source, config: net_config(), ..EndpointOptions::default() },
        )
        .map_err(net_error("binding this process's endpoint"))?
    };
    let local = endpoint.local_addr().map_err(net_error("binding this process's endpoint"))?;
    let link = Arc::new(NetLink {
        node: u64::MAX.into(),
        endpoint,
        handle: net.handle().clone(),
        requests: OnceLock::new(),
    });
    let connect_link = link.clone();
    let control = link
        .wait(async move {
            let connect = crate::transport::connect_with_retries(&connect_link.endpoint, head);
            tokio::time::timeout(timeout, connect).await
        })?
        .map_err(|_| head_unreachable(head, timeout))?
        .map_err(net_error(&format!("connecting to the head at {head}")))?;
    Ok(Joining { link, control, net, bind_ip, endpoint: local })
}

/// Starts a node daemon in this process and returns once it has joined.
pub fn start_node(options: JoinOptions) -> Result<Arc<Runtime>> {
    let head = resolve(&options.address)?;
    let timeout = connect_timeout(&options.config)?;
    let node = credentials(
        &options.credentials_dir,
        options.token.as_deref(),
        &options.node_name,
        head,
        Bootstrap::SaveNode,
        timeout,
    )?;
    let resources = crate::head::node_resources(&options.config, "joining")?;
    let source: Arc<OnceLock<Arc<dyn rtrun_net::ObjectSource>>> = Arc::new(OnceLock::new());
    let source_for_endpoint: Arc<dyn rtrun_net::ObjectSource> =
        Arc::new(LateSource(source.clone()));
    let joining = connect_to_head(head, node, options.bind_ip, Some(source_for_endpoint), timeout)?;
    let control = joining.control.clone();
    let request = encode_request(&NetRequest::JoinNode { resources, endpoint: joining.endpoint })?;
    let frame = joining
        .link
        .wait(async move { control.request(request, Vec::new()).await })?
        .map_err(net_error("joining the cluster"))?;
    let NetReply::Joined { session, worker, node: node_id, head: head_address } =
        crate::codec::decode(&frame.head)?
    else {
        return Err(Error::Transport("unexpected answer to a join".into()));
    };
    let link = joining.link.clone();
    link.node.store(node_id, std::sync::atomic::Ordering::Release);
    let address =
        Route::quic(joining.endpoint, node_id, &crate::runtime::socket_name(&session, worker));
    let heartbeats = {
        let _guard = joining.net.enter();
        joining.control.start_heartbeats()
    };
    let member = Arc::new(Member {
        link: link.clone(),
        control: Some(joining.control),
        _heartbeats: Some(heartbeats),
        bind_ip: joining.bind_ip,
        node_address: Some(address.clone()),
        credentials_dir: options.credentials_dir.clone(),
        _net: joining.net,
        pulls: Default::default(),
    });
    let _ = MEMBER.set(member);
    let cache = Arc::new(BinaryCache::open(options.data_dir.join("binaries"))?);
    let log_dir = options.data_dir.join("logs");
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| Error::System(format!("cannot create {}: {e}", log_dir.display())))?;
    let runtime = Runtime::start_cluster_node(
        &options.config,
        session,
        worker,
        node_id,
        address,
        head_address,
        node::NodeAgentConfig { binaries: cache, log_dir },
    )?;
    let _ = source.set(runtime.store_client()?.object_source()?);
    // The head hears a stopping node's last answers and its leaving at once.
    close_connections_at_exit();
    Ok(runtime)
}

/// Joins the cluster at `address` as a driver (`init` with an address) or a command-line
/// client (`binary: false`).
pub(crate) fn start_driver(config: &Config, address: &str, binary: bool) -> Result<Arc<Runtime>> {
    let head = resolve(address)?;
    let timeout = connect_timeout(config)?;
    let dir = config.credentials_dir.clone().unwrap_or_else(default_credentials_dir);
    // A driver or client with only a token gets a short-lived certificate of its own, kept in
    // memory: nothing that grants access to the cluster outlives the process.
    let validity = if binary { DRIVER_CERTIFICATE_VALIDITY } else { CLIENT_CERTIFICATE_VALIDITY };
    // Unique in the cluster: the head watches drivers' heartbeats by this name.
    let name = format!("driver-{}-{:08x}", std::process::id(), crate::runtime::random_u64() as u32);
    let node = credentials(
        &dir,
        config.token.as_deref(),
        &name,
        head,
        Bootstrap::InMemory(validity),
        timeout,
    )?;
    let joining = connect_to_head(head, node, None, None, timeout)?;
    let endpoint = joining.endpoint;
    // A driver's heartbeats let the head notice it died within the heartbeat timeout.
    let heartbeats = binary.then(|| {
        let _guard = joining.net.enter();
        joining.control.start_heartbeats()
    });
    let member = Arc::new(Member {
        link: joining.link,
        control: Some(joining.control),
        _heartbeats: heartbeats,
        bind_ip: joining.bind_ip,
        node_address: None,
        credentials_dir: dir,
        _net: joining.net,
        pulls: Default::default(),
    });
    let digest = if binary {
        let exe = std::env::current_exe()
            .map_err(|e| Error::System(format!("cannot find this executable: {e}")))?;
        let digest = binaries::digest_file(&exe)?;
        upload_binary(&member, &exe, &digest)?;
        Some(digest)
    } else {
        None
    };
    // A driver the head started for `rtrun submit` says which job it is.
    let job = std::env::var(JOB_ENV).ok().and_then(|job| job.parse().ok()).filter(|_| binary);
    let (reply, _) = control_request(
        &member,
        NetRequest::JoinDriver { binary: digest, endpoint, job },
        Vec::new(),
    )?;
    let NetReply::Joined { session, worker, node: node_id, head: head_address } = reply else {
        return Err(Error::Transport("unexpected answer to a join".into()));
    };
    member.link.node.store(node_id, std::sync::atomic::Ordering::Release);
    let address = Route::quic(endpoint, node_id, &crate::runtime::socket_name(&session, worker));
    let _ = MEMBER.set(member);
    // Peers (the head above all, which ends the job's actors) learn of a normal exit at once;
    // a killed driver is noticed when its heartbeats stop.
    close_connections_at_exit();
    let runtime =
        Runtime::start_cluster_driver(config, session, worker, node_id, address, head_address)?;
    if binary {
        client::stream_actor_output(runtime.clone());
    }
    Ok(runtime)
}

/// Set once this process has begun to exit.
static EXITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process is exiting (its connections closing is then no failure).
pub(crate) fn exiting() -> bool {
    EXITING.load(std::sync::atomic::Ordering::Acquire)
}

/// Registers [`close_on_exit`] (a driver, a client, a node daemon).
fn close_connections_at_exit() {
    // SAFETY: `atexit` registers a plain `extern "C"` function with no preconditions.
    unsafe {
        libc::atexit(close_on_exit);
    }
}

/// Closes this process's QUIC connections with a close frame when the process exits normally.
extern "C" fn close_on_exit() {
    // A driver's actors are still alive here (its connections close below): their last lines.
    client::flush_actor_output(Duration::from_millis(500));
    EXITING.store(true, std::sync::atomic::Ordering::Release);
    let Some(member) = member() else { return };
    let link = member.link.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    member.link.handle.spawn(async move {
        link.endpoint.close();
        let _ = tokio::time::timeout(Duration::from_millis(300), link.endpoint.wait_idle()).await;
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(Duration::from_millis(500));
}

/// A connection to the endpoint of the node daemon at `home` (for pulls), reused.
fn pull_link(member: &Member, home: &str) -> Result<rtrun_net::Connection> {
    let Route::Quic { addr, .. } = Route::parse(home)? else {
        return Err(Error::Invalid(format!("`{home}` is not another node's address")));
    };
    if let Some(link) = member.pulls.get(&addr)
        && link.quinn().close_reason().is_none()
    {
        return Ok(link.clone());
    }
    let link = member.link.clone();
    let connection = member
        .link
        .wait(async move { crate::transport::connect_with_retries(&link.endpoint, addr).await })?
        .map_err(net_error(&format!("connecting to the node at {addr}")))?;
    member.pulls.insert(addr, connection.clone());
    Ok(connection)
}

/// Pulls an object from the store of the node daemon at `home` into memory (a process of a
/// cluster without a store of its own: a driver).
pub(crate) fn pull_to_memory(home: &str, id: rtrun_object_store::ObjectId) -> Result<Vec<u8>> {
    let member = member().ok_or(Error::NotInitialised)?;
    let link = pull_link(member, home)?;
    member
        .link
        .wait(async move { link.pull_object(id, rtrun_object_store::PullConfig::default()).await })?
        .map_err(net_error(&format!("pulling {id} from {home}")))
}

/// Copies an object from the store of the node daemon at `home` into this node's store and
/// gives `holder` a count on the copy (this process is the node).
pub(crate) fn pull_into_node(
    runtime: &Runtime,
    id: rtrun_object_store::ObjectId,
    home: &str,
    holder: rtrun_object_store::HolderId,
) -> Result<()> {
    let member = member().ok_or(Error::NotInitialised)?;
    let store = runtime
        .store_client()?
        .node_store()
        .cloned()
        .ok_or_else(|| Error::ObjectStore("only a node process pulls into its store".into()))?;
    let link = pull_link(member, home)?;
    let start = std::time::Instant::now();
    let bytes = member
        .link
        .wait(async move {
            rtrun_net::pull_into_store(
                &link,
                &store,
                id,
                holder,
                rtrun_object_store::PullConfig::default(),
            )
            .await
        })?
        .map_err(net_error(&format!("copying {id} from {home}")))?;
    if bytes > 0 {
        crate::metrics::record_pull(bytes, start.elapsed());
    }
    Ok(())
}

/// Uploads a job binary unless the head has it.
pub(crate) fn upload_binary(member: &Member, path: &Path, digest: &str) -> Result<()> {
    upload_bytes(member, digest, || {
        std::fs::read(path)
            .map_err(|e| Error::System(format!("cannot read {}: {e}", path.display())))
    })
}

/// Uploads the content `digest` to the head's content-addressed cache unless it is there;
/// `bytes` reads it only when needed.
pub(crate) fn upload_bytes(
    member: &Member,
    digest: &str,
    bytes: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<()> {
    let (reply, _) =
        control_request(member, NetRequest::HasBinary { digest: digest.to_owned() }, Vec::new())?;
    if matches!(reply, NetReply::Present(true)) {
        return Ok(());
    }
    let bytes = bytes()?;
    control_request(
        member,
        NetRequest::UploadBinary { digest: digest.to_owned() },
        vec![Bytes::from(bytes)],
    )?;
    Ok(())
}

/// Sets up a worker of a cluster (its environment has [`NODE_ENV`]): its endpoint with its
/// node's credentials; returns its node id, node daemon address and QUIC address for `name`.
pub(crate) fn start_worker_link(name: &str) -> Result<Option<(u64, Address, Address)>> {
    let Ok(value) = std::env::var(NODE_ENV) else { return Ok(None) };
    let mut parts = value.splitn(3, ';');
    let bad = || Error::Invalid(format!("{NODE_ENV} must be `node;address;ip`, found `{value}`"));
    let node: u64 = parts.next().and_then(|n| n.parse().ok()).ok_or_else(bad)?;
    let node_address = parts.next().ok_or_else(bad)?.to_owned();
    let bind_ip: IpAddr = parts.next().and_then(|ip| ip.parse().ok()).ok_or_else(bad)?;
    let dir = default_credentials_dir();
    let credentials =
        CredentialsDir::new(&dir).load_node().map_err(net_error("loading credentials"))?;
    let net = net_runtime()?;
    let endpoint = {
        let _guard = net.enter();
        rtrun_net::Endpoint::bind(
            SocketAddr::new(bind_ip, 0),
            credentials,
            EndpointOptions { config: net_config(), ..EndpointOptions::default() },
        )
        .map_err(net_error("binding this worker's endpoint"))?
    };
    let local = endpoint.local_addr().map_err(net_error("binding this worker's endpoint"))?;
    let link = Arc::new(NetLink {
        node: node.into(),
        endpoint,
        handle: net.handle().clone(),
        requests: OnceLock::new(),
    });
    let member = Arc::new(Member {
        link,
        control: None,
        _heartbeats: None,
        bind_ip,
        node_address: Some(node_address.clone()),
        credentials_dir: dir,
        _net: net,
        pulls: Default::default(),
    });
    let _ = MEMBER.set(member);
    Ok(Some((node, node_address, Route::quic(local, node, name))))
}
