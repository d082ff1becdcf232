//! A node's QUIC endpoint: it listens (accepting peers that pass mutual TLS and the hello, and
//! serving bootstrap exchanges on a head) and connects to other nodes.
//!
//! Admission is decided before the application sees a connection: the handshake requires a
//! certificate from the cluster CA (a head alone admits certificate-less handshakes, which may
//! only bootstrap), then the first stream must carry a [`Hello`] with the join token's secret.
//! Anything else closes the connection with [`CLOSE_REFUSED`] and a reason.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::bootstrap::serve_bootstrap;
use crate::config::NetConfig;
use crate::connection::{Connection, ObjectSource};
use crate::credentials::{CLUSTER_SERVER_NAME, ClusterAuthority, NodeCredentials, node_name_of};
use crate::error::{NetError, Result};
use crate::frame::{FrameKind, FrameLimits, expect_frame, write_frame};
use crate::heartbeat::HeartbeatMonitor;
use crate::protocol::{Hello, PROTOCOL_VERSION, Welcome, decode, frame};
use crate::tls;

/// Application close code: the peer was refused (credentials, token, protocol).
pub const CLOSE_REFUSED: u32 = 1;
/// Application close code: the connection was closed normally.
pub const CLOSE_NORMAL: u32 = 0;

/// What an endpoint needs besides its credentials.
#[derive(Default)]
pub struct EndpointOptions {
    /// Tunables.
    pub config: NetConfig,
    /// The cluster CA with its key: only the head has it, and only then are certificate-less
    /// peers admitted to bootstrap.
    pub authority: Option<Arc<ClusterAuthority>>,
    /// Where object pulls are served from; without one, pulls are answered with an error.
    pub object_source: Option<Arc<dyn ObjectSource>>,
    /// Fed with the heartbeats of every connection; the application decides whom it watches.
    pub monitor: Option<HeartbeatMonitor>,
}

/// State every connection of an endpoint shares.
pub(crate) struct Shared {
    pub(crate) config: NetConfig,
    pub(crate) node: NodeCredentials,
    pub(crate) node_name: String,
    pub(crate) authority: Option<Arc<ClusterAuthority>>,
    pub(crate) source: Option<Arc<dyn ObjectSource>>,
    pub(crate) monitor: Option<HeartbeatMonitor>,
    /// Client configurations: `[loopback as usize][control as usize]`.
    client_configs: [[quinn::ClientConfig; 2]; 2],
    loopback_server_config: Arc<quinn::ServerConfig>,
}

/// A node's endpoint.
pub struct Endpoint {
    quinn: quinn::Endpoint,
    shared: Arc<Shared>,
    accepted: Mutex<mpsc::Receiver<Connection>>,
    acceptor: JoinHandle<()>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("node", &self.shared.node_name)
            .field("local_addr", &self.quinn.local_addr().ok())
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// Binds `addr` (port 0 picks one) and starts accepting. Must run inside a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        node: NodeCredentials,
        options: EndpointOptions,
    ) -> Result<Endpoint> {
        let node_name = node.node_name()?;
        let config = &options.config;
        let bootstrap = options.authority.is_some();
        // A server offers the longer timeout; the client's choice is the one that holds.
        let serving = config.idle_timeout.max(config.control_idle_timeout);
        let server_config =
            tls::server_config(&node, bootstrap, config.transport_for(false, serving)?)?;
        let loopback_server_config =
            Arc::new(tls::server_config(&node, bootstrap, config.transport_for(true, serving)?)?);
        let client = |loopback, idle| -> Result<quinn::ClientConfig> {
            tls::client_config(&node, config.transport_for(loopback, idle)?)
        };
        let (idle, control) = (config.idle_timeout, config.control_idle_timeout);
        let client_configs = [
            [client(false, idle)?, client(false, control)?],
            [client(true, idle)?, client(true, control)?],
        ];
        let bind_error = |e| NetError::io(format!("binding a QUIC endpoint on {addr}"), e);
        let socket = std::net::UdpSocket::bind(addr).map_err(bind_error)?;
        let buffers = socket2::SockRef::from(&socket);
        let size = options.config.udp_buffer_bytes;
        if let Err(error) =
            buffers.set_recv_buffer_size(size).and_then(|()| buffers.set_send_buffer_size(size))
        {
            warn!(%error, size, "could not enlarge the UDP socket buffers");
        }
        let runtime: Arc<dyn quinn::Runtime> = Arc::new(quinn::TokioRuntime);
        let quinn =
            quinn::Endpoint::new(options.config.endpoint(), Some(server_config), socket, runtime)
                .map_err(bind_error)?;
        let shared = Arc::new(Shared {
            config: options.config,
            node,
            node_name,
            authority: options.authority,
            source: options.object_source,
            monitor: options.monitor,
            client_configs,
            loopback_server_config,
        });
        let (tx, rx) = mpsc::channel(64);
        let acceptor = tokio::spawn(accept_loop(quinn.clone(), shared.clone(), tx));
        Ok(Endpoint { quinn, shared, accepted: Mutex::new(rx), acceptor })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.quinn.local_addr().map_err(|e| NetError::io("reading the endpoint's address", e))
    }

    /// This node's name (from its certificate).
    pub fn node_name(&self) -> &str {
        &self.shared.node_name
    }

    /// The configuration.
    pub fn config(&self) -> &NetConfig {
        &self.shared.config
    }

    /// The next admitted peer connection; `None` once the endpoint is closed.
    pub async fn accept(&self) -> Option<Connection> {
        self.accepted.lock().await.recv().await
    }

    /// Connects to the node at `addr`: mutual TLS, then the hello with the join token.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Connection> {
        self.connect_as(addr, false).await
    }

    /// [`Endpoint::connect`] for a control-plane connection (to the cluster head): idle for
    /// `control_idle_timeout` instead of `idle_timeout` before it is dropped.
    pub async fn connect_control(&self, addr: SocketAddr) -> Result<Connection> {
        self.connect_as(addr, true).await
    }

    async fn connect_as(&self, addr: SocketAddr, control: bool) -> Result<Connection> {
        let timeout = self.shared.config.handshake_timeout;
        tokio::time::timeout(timeout, self.connect_inner(addr, control)).await.map_err(|_| {
            NetError::Timeout {
                during: "connecting (handshake and hello)",
                after_ms: timeout.as_millis(),
            }
        })?
    }

    async fn connect_inner(&self, addr: SocketAddr, control: bool) -> Result<Connection> {
        let peer = addr.to_string();
        let client_config = self.shared.client_configs[usize::from(addr.ip().is_loopback())]
            [usize::from(control)]
        .clone();
        let connecting = self
            .quinn
            .connect_with(client_config, addr, CLUSTER_SERVER_NAME)
            .map_err(|e| NetError::Connection { peer: peer.clone(), reason: e.to_string() })?;
        let quinn = connecting.await.map_err(|e| connection_error(&peer, e))?;
        let exchange = async {
            let certs = tls::peer_certificates(&quinn);
            let peer_name =
                certs.first().map(node_name_of).transpose()?.ok_or_else(|| NetError::Protocol {
                    peer: peer.clone(),
                    reason: "server presented no certificate".into(),
                })?;
            let (mut send, mut recv) =
                quinn.open_bi().await.map_err(|e| connection_error(&peer, e))?;
            let hello = Hello {
                protocol: PROTOCOL_VERSION,
                token_secret: self.shared.node.token.secret().to_vec(),
            };
            write_frame(&mut send, &frame(FrameKind::Hello, 0, &hello), &FrameLimits::HANDSHAKE)
                .await?;
            let _ = send.finish();
            let reply = expect_frame(&mut recv, &FrameLimits::HANDSHAKE).await?;
            match decode::<Welcome>(&reply, FrameKind::Welcome) {
                Ok(_) => Ok(peer_name),
                Err(Ok(reason)) => Err(NetError::Refused { peer: peer.clone(), reason }),
                Err(Err(e)) => Err(e.into()),
            }
        };
        match exchange.await {
            Ok(peer_name) => Ok(Connection::start(self.shared.clone(), quinn, peer_name)),
            // A refusal closes the connection; its reason beats the stream error it caused.
            Err(error) => {
                Err(quinn.close_reason().map(|e| connection_error(&peer, e)).unwrap_or(error))
            }
        }
    }

    /// Closes every connection and stops accepting.
    pub fn close(&self) {
        self.acceptor.abort();
        self.quinn.close(quinn::VarInt::from_u32(CLOSE_NORMAL), b"endpoint closed");
    }

    /// Waits until every connection's close has been sent (after [`Endpoint::close`]), so that
    /// peers learn of it at once rather than after their idle timeout.
    pub async fn wait_idle(&self) {
        self.quinn.wait_idle().await;
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

async fn accept_loop(quinn: quinn::Endpoint, shared: Arc<Shared>, tx: mpsc::Sender<Connection>) {
    while let Some(incoming) = quinn.accept().await {
        let shared = shared.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            let timeout = shared.config.handshake_timeout;
            match tokio::time::timeout(timeout, admit(shared, incoming)).await {
                Ok(Ok(Some(connection))) => {
                    debug!(peer = %connection.peer_name(), %remote, "peer admitted");
                    let _ = tx.send(connection).await;
                }
                Ok(Ok(None)) => {}
                Ok(Err(error)) => warn!(%remote, %error, "peer refused"),
                Err(_) => {
                    warn!(%remote, "peer refused: handshake not completed within {timeout:?}")
                }
            }
        });
    }
}

/// Runs the handshake and the first exchange of an incoming connection: `Some` for an admitted
/// peer, `None` for a completed bootstrap.
async fn admit(shared: Arc<Shared>, incoming: quinn::Incoming) -> Result<Option<Connection>> {
    let remote_addr = incoming.remote_address();
    let remote = remote_addr.to_string();
    let connecting = if remote_addr.ip().is_loopback() {
        incoming.accept_with(shared.loopback_server_config.clone())
    } else {
        incoming.accept()
    };
    let quinn = connecting
        .map_err(|e| connection_error(&remote, e))?
        .await
        .map_err(|e| connection_error(&remote, e))?;
    let certs = tls::peer_certificates(&quinn);
    let Some(cert) = certs.first() else {
        serve_bootstrap(&shared, &quinn).await?;
        return Ok(None);
    };
    let peer_name = node_name_of(cert)?;
    let (mut send, mut recv) = quinn.accept_bi().await.map_err(|e| connection_error(&remote, e))?;
    let outcome = async {
        let hello =
            expect_frame(&mut recv, &FrameLimits::HANDSHAKE).await.map_err(|e| e.to_string())?;
        let hello: Hello = match decode(&hello, FrameKind::Hello) {
            Ok(hello) => hello,
            Err(Ok(message)) => return Err(format!("expected a hello, found an error: {message}")),
            Err(Err(e)) => return Err(format!("expected a hello: {e}")),
        };
        if hello.protocol != PROTOCOL_VERSION {
            return Err(format!("expected protocol {PROTOCOL_VERSION}, found {}", hello.protocol));
        }
        if !shared.node.token.secret_matches(&hello.token_secret) {
            return Err("wrong join token".to_string());
        }
        Ok(())
    }
    .await;
    if let Err(reason) = outcome {
        refuse(&quinn, &reason);
        return Err(NetError::Refused { peer: format!("{peer_name} at {remote}"), reason });
    }
    let welcome = Welcome { node_name: shared.node_name.clone() };
    write_frame(&mut send, &frame(FrameKind::Welcome, 0, &welcome), &FrameLimits::HANDSHAKE)
        .await?;
    let _ = send.finish();
    Ok(Some(Connection::start(shared, quinn, peer_name)))
}

/// Closes a connection with [`CLOSE_REFUSED`] and `reason` (the peer's error message).
pub(crate) fn refuse(connection: &quinn::Connection, reason: &str) {
    let reason: String = reason.chars().take(512).collect();
    connection.close(quinn::VarInt::from_u32(CLOSE_REFUSED), reason.as_bytes());
}

/// Maps a quinn connection error to ours: refusals (by us or by TLS) become [`NetError::Refused`].
pub(crate) fn connection_error(peer: &str, error: quinn::ConnectionError) -> NetError {
    use quinn::ConnectionError::*;
    match error {
        ApplicationClosed(close) if close.error_code == quinn::VarInt::from_u32(CLOSE_REFUSED) => {
            NetError::Refused {
                peer: peer.to_string(),
                reason: String::from_utf8_lossy(&close.reason).into_owned(),
            }
        }
        TransportError(e) => NetError::Refused { peer: peer.to_string(), reason: e.to_string() },
        ConnectionClosed(close) => {
            NetError::Refused { peer: peer.to_string(), reason: close.to_string() }
        }
        other => NetError::Connection { peer: peer.to_string(), reason: other.to_string() },
    }
}
