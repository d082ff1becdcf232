//! Connections between processes: abstract Unix sockets between processes of one node (no file
//! is ever created, so nothing is left behind when a process is killed) and, in a cluster, QUIC
//! channels (`rtrun-net`: mutual TLS + join token) between processes of different nodes. Both
//! carry the same length-prefixed frames, with one reader thread per connection and writes
//! straight from the sending thread, so everything above this module is the same on one node
//! and across nodes.
//!
//! A frame is a little-endian `u32` length followed by that many bytes of the codec's encoding
//! of [`Frame`]. Frames longer than [`TransportConfig::max_frame_bytes`] are refused on both
//! sides; a malformed frame closes the connection with an error, never a panic.
//!
//! Addresses: `unix:@<name>` (a process of an embedded session) or
//! `quic://<ip>:<port>/<node>/<name>` (a process of a cluster: its QUIC endpoint, its node's
//! id and its abstract socket name). A connection to a cluster address on the local node goes
//! over the Unix socket `@<name>`; to another node, over QUIC.

use std::io::{BufReader, Read, Write};
use std::net::SocketAddr as NetAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use dashmap::DashMap;
use parking_lot::Mutex;

use crate::codec;
use crate::error::{Error, Result};
pub(crate) use rtrun_proto::address::Route;

use crate::protocol::{Address, Frame};

/// Transport tunables.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// The largest frame accepted or sent. Larger values travel through the object store.
    pub max_frame_bytes: usize,
    /// Read buffer per connection.
    pub read_buffer_bytes: usize,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig { max_frame_bytes: 1 << 30, read_buffer_bytes: 256 * 1024 }
    }
}

/// Receives what arrives on connections.
pub(crate) trait FrameHandler: Send + Sync + 'static {
    /// A frame arrived on `conn`. Must not block for long: it runs on the reader thread.
    fn on_frame(&self, conn: &Arc<Connection>, frame: Frame);
    /// The connection closed (peer exit, error, or malformed input).
    fn on_close(&self, conn: &Arc<Connection>, reason: &str);
    /// `frame` was written to `conn` (for the accounting of references it carries).
    fn on_sent(&self, _conn: &Connection, _frame: &Frame) {}
    /// Whether `frame` may be handled on the network runtime's thread as soon as it arrives
    /// (it never blocks and its order relative to earlier frames does not matter once those
    /// are handled). Only QUIC connections ask.
    fn handles_inline(&self, _frame: &Frame) -> bool {
        false
    }
}

/// The write half of a connection.
enum Writer {
    Unix(UnixStream),
    Quic {
        send: quinn::SendStream,
        /// Keeps the QUIC connection open as long as this runtime connection.
        link: rtrun_net::Connection,
    },
    /// Shut down: its socket (or QUIC stream) is released, so a connection object that lives on
    /// in a cache holds no file descriptor.
    Closed,
}

impl Writer {
    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Writer::Unix(stream) => stream.write_all(buf),
            // quinn's stream futures need no tokio context: the connection's driver task (on
            // the net runtime) moves the bytes, this thread only fills the stream's buffer.
            Writer::Quic { send, .. } => futures::executor::block_on(send.write_all(buf))
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::BrokenPipe, e)),
            Writer::Closed => Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the connection is shut down",
            )),
        }
    }

    fn shutdown(&mut self) {
        match self {
            Writer::Unix(stream) => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            Writer::Quic { send, link } => {
                let _ = send.finish();
                link.close();
            }
            Writer::Closed => {}
        }
        *self = Writer::Closed;
    }
}

/// One bidirectional connection to a peer process.
pub(crate) struct Connection {
    id: u64,
    peer: Mutex<Option<Address>>,
    writer: Mutex<Writer>,
    closed: AtomicBool,
    max_frame_bytes: usize,
    handler: Arc<dyn FrameHandler>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Connection#{}({:?})", self.id, self.peer.lock())
    }
}

static NEXT_CONNECTION_ID: AtomicU64 = AtomicU64::new(1);

impl Connection {
    /// A process-unique id for this connection.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The peer's listening address, when known.
    pub(crate) fn peer(&self) -> Option<Address> {
        self.peer.lock().clone()
    }

    /// Records the peer's listening address (learned from a registration).
    pub(crate) fn set_peer(&self, address: Address) {
        *self.peer.lock() = Some(address);
    }

    /// Whether the connection has closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Sends one frame. Encoding happens outside the write lock; the write is one syscall for
    /// small frames.
    pub(crate) fn send(&self, frame: &Frame) -> Result<()> {
        let mut buf = Vec::with_capacity(128);
        buf.extend_from_slice(&[0u8; 4]);
        let body = codec::encode(frame)?;
        if body.len() > self.max_frame_bytes {
            return Err(Error::Transport(format!(
                "frame of {} bytes exceeds the {} byte limit",
                body.len(),
                self.max_frame_bytes
            )));
        }
        buf.extend_from_slice(&body);
        let len = u32::try_from(body.len()).map_err(|_| {
            Error::Transport(format!("frame of {} bytes does not fit a u32 length", body.len()))
        })?;
        buf[..4].copy_from_slice(&len.to_le_bytes());
        if self.is_closed() {
            return Err(Error::Transport("connection is closed".into()));
        }
        let mut writer = self.writer.lock();
        writer.write_all(&buf).map_err(|e| {
            self.closed.store(true, Ordering::Release);
            Error::Transport(format!("write failed: {e}"))
        })?;
        drop(writer);
        self.handler.on_sent(self, frame);
        Ok(())
    }

    /// Closes both directions; the reader thread then reports the close.
    pub(crate) fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
        self.writer.lock().shutdown();
    }
}

/// The QUIC side of a cluster process's endpoint: its `rtrun-net` endpoint, the tokio runtime
/// that drives it, and its node's id (to tell local addresses from remote ones).
pub(crate) struct NetLink {
    /// The node this process runs on (set once the head has assigned it).
    pub node: AtomicU64,
    /// The endpoint (bound on the node's address).
    pub endpoint: rtrun_net::Endpoint,
    /// Drives QUIC; separate from the runtime's async runtime so that blocking waits on QUIC
    /// work from any thread.
    pub handle: tokio::runtime::Handle,
    /// Answers `rtrun-net` requests peers send (the head's joins and binaries).
    pub requests: std::sync::OnceLock<Arc<dyn crate::cluster::protocol::NetService>>,
}

impl NetLink {
    /// Runs `future` on the net runtime and waits for it from any thread (also from a thread
    /// of another tokio runtime, where `block_on` would panic).
    pub(crate) fn wait<T: Send + 'static>(
        &self,
        future: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Result<T> {
        // On one of the net runtime's own threads (a frame handled inline), blocking on a
        // channel could leave no thread to run `future`; hand the thread's other work over.
        if tokio::runtime::Handle::try_current().is_ok_and(|h| h.id() == self.handle.id()) {
            return Ok(tokio::task::block_in_place(|| self.handle.block_on(future)));
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.handle.spawn(async move {
            let _ = tx.send(future.await);
        });
        rx.recv().map_err(|_| Error::Transport("the network runtime stopped".into()))
    }
}

/// Connects to a QUIC endpoint, trying again when a handshake times out: on a loaded host a
/// lost Initial packet is only retransmitted after a backed-off probe timeout, which can
/// exhaust one attempt's budget although the peer is there. Refusals are not retried.
/// A `control` connection (to the head) gets the control plane's longer idle timeout
/// ([`rtrun_net::Endpoint::connect_control`]).
pub(crate) async fn connect_with_retries(
    endpoint: &rtrun_net::Endpoint,
    addr: NetAddr,
    control: bool,
) -> std::result::Result<rtrun_net::Connection, rtrun_net::NetError> {
    const ATTEMPTS: usize = 3;
    let mut attempt = 1;
    loop {
        let connected = if control {
            endpoint.connect_control(addr).await
        } else {
            endpoint.connect(addr).await
        };
        match connected {
            Err(rtrun_net::NetError::Timeout { .. }) if attempt < ATTEMPTS => {
                tracing::warn!(%addr, attempt, "QUIC handshake timed out; trying again");
                attempt += 1;
            }
            result => return result,
        }
    }
}

/// A process's endpoint: its listener, and a cache of connections by peer address.
pub(crate) struct Endpoint {
    address: Address,
    handler: Arc<dyn FrameHandler>,
    connections: DashMap<Address, Arc<Connection>>,
    config: TransportConfig,
    net: std::sync::OnceLock<Arc<NetLink>>,
    /// The head's address, once [`Endpoint::connect_head`] named it: connections to it are the
    /// control plane's.
    head: std::sync::OnceLock<Address>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Endpoint({})", self.address)
    }
}

/// Whether the process at the other end of `stream` runs as this process's user (or as root,
/// which can reach every process anyway): the only peers a local socket admits. Processes of
/// other nodes and cluster clients come in over QUIC with the cluster's credentials instead.
pub(crate) fn same_user(stream: &UnixStream) -> bool {
    match rustix::net::sockopt::socket_peercred(stream) {
        Ok(peer) => peer.uid == rustix::process::geteuid() || peer.uid.is_root(),
        Err(_) => false,
    }
}

/// The peer's pid and uid, for a log line.
pub(crate) fn describe_peer(stream: &UnixStream) -> String {
    match rustix::net::sockopt::socket_peercred(stream) {
        Ok(peer) => format!("pid {} uid {}", peer.pid.as_raw_nonzero(), peer.uid.as_raw()),
        Err(e) => format!("unknown peer: {e}"),
    }
}

/// The user id the process listening on the abstract socket of `address` runs as, or why it
/// cannot be told (nobody listens there).
pub(crate) fn listener_uid(address: &str) -> Result<u32> {
    let stream = UnixStream::connect_addr(&socket_addr(address)?)
        .map_err(|e| Error::Transport(format!("cannot connect to {address}: {e}")))?;
    let peer = rustix::net::sockopt::socket_peercred(&stream)
        .map_err(|e| Error::Transport(format!("cannot read the credentials of {address}: {e}")))?;
    Ok(peer.uid.as_raw())
}

/// Builds the abstract socket address of an address's process.
fn socket_addr(address: &str) -> Result<SocketAddr> {
    let route = Route::parse(address)?;
    let name = route.socket_name();
    SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| Error::Invalid(format!("bad socket name `{name}`: {e}")))
}

impl Endpoint {
    /// Listens on `address` and starts the accept thread.
    pub(crate) fn bind(
        address: Address,
        handler: Arc<dyn FrameHandler>,
        config: TransportConfig,
    ) -> Result<Arc<Endpoint>> {
        let listener = UnixListener::bind_addr(&socket_addr(&address)?)
            .map_err(|e| Error::Transport(format!("cannot listen on {address}: {e}")))?;
        let endpoint = Arc::new(Endpoint {
            address,
            handler,
            connections: DashMap::new(),
            config,
            net: std::sync::OnceLock::new(),
            head: std::sync::OnceLock::new(),
        });
        let weak = Arc::downgrade(&endpoint);
        std::thread::Builder::new()
            .name("rtrun-accept".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    let Some(endpoint) = weak.upgrade() else { return };
                    match stream {
                        Ok(stream) if !same_user(&stream) => {
                            // Abstract sockets have no file permissions: anyone in the network
                            // namespace can connect. Only this user's processes may.
                            tracing::warn!(
                                "refused a local connection from another user ({})",
                                describe_peer(&stream)
                            );
                        }
                        Ok(stream) => {
                            if let Err(e) = endpoint.adopt(stream, None) {
                                tracing::warn!("dropping incoming connection: {e}");
                            }
                        }
                        Err(e) => tracing::warn!("accept failed: {e}"),
                    }
                }
            })
            .map_err(|e| Error::System(format!("cannot start accept thread: {e}")))?;
        Ok(endpoint)
    }

    /// Gives this endpoint its QUIC side (cluster processes) and starts accepting the channels
    /// other nodes' processes open to it.
    pub(crate) fn attach_net(self: &Arc<Self>, net: Arc<NetLink>) {
        if self.net.set(net.clone()).is_err() {
            return;
        }
        let weak = Arc::downgrade(self);
        net.handle.clone().spawn(async move {
            while let Some(link) = net.endpoint.accept().await {
                let weak = weak.clone();
                let net_for_links = net.clone();
                match net.requests.get() {
                    Some(service) => {
                        tokio::spawn(crate::cluster::protocol::serve_requests(
                            link.clone(),
                            service.clone(),
                        ));
                    }
                    None => {
                        let link = link.clone();
                        tokio::spawn(async move {
                            while let Some(request) = link.next_request().await {
                                let _ =
                                    request.respond_error("this process serves no requests").await;
                            }
                        });
                    }
                }
                tokio::spawn(async move {
                    while let Some(channel) = link.next_channel().await {
                        let Some(endpoint) = weak.upgrade() else { return };
                        let writer = Writer::Quic { send: channel.send, link: link.clone() };
                        let net = net_for_links.clone();
                        if let Err(e) = endpoint.adopt_quic(net, writer, channel.recv, None) {
                            tracing::warn!("dropping a channel from {}: {e}", link.peer_name());
                        }
                    }
                });
            }
        });
    }

    /// The connection to the cluster head at `head`: [`Endpoint::connect`], and every later
    /// connection to it, with the control plane's idle timeout, so that a head that stalls for
    /// longer than the ordinary idle timeout does not lose every peer.
    /// The head's address, once [`Endpoint::connect_head`] named it.
    pub(crate) fn head_address(&self) -> Option<&Address> {
        self.head.get()
    }

    pub(crate) fn connect_head(&self, head: &Address) -> Result<Arc<Connection>> {
        let _ = self.head.set(head.clone());
        self.connect(head)
    }

    /// The connection to `peer`, connecting when there is none (or the cached one closed).
    pub(crate) fn connect(&self, peer: &Address) -> Result<Arc<Connection>> {
        if let Some(conn) = self.connections.get(peer)
            && !conn.is_closed()
        {
            return Ok(conn.clone());
        }
        let route = Route::parse(peer)?;
        let remote = match (&route, self.net.get()) {
            (Route::Quic { addr, node, .. }, Some(net))
                if *node != net.node.load(Ordering::Acquire) =>
            {
                Some((*addr, net.clone()))
            }
            (Route::Quic { .. }, None) => {
                return Err(Error::Transport(format!(
                    "cannot connect to {peer}: this process is not part of a cluster"
                )));
            }
            _ => None,
        };
        let control = self.head.get() == Some(peer);
        let conn = match remote {
            Some((addr, net)) => {
                let opened = net.wait({
                    let net = net.clone();
                    async move {
                        let link = connect_with_retries(&net.endpoint, addr, control).await?;
                        let (send, recv) = link.open_channel(bytes::Bytes::new()).await?;
                        Ok::<_, rtrun_net::NetError>((link, send, recv))
                    }
                })?;
                let (link, send, recv) = opened
                    .map_err(|e| Error::Transport(format!("cannot connect to {peer}: {e}")))?;
                self.adopt_quic(net, Writer::Quic { send, link }, recv, Some(peer.clone()))?
            }
            None => {
                let stream = UnixStream::connect_addr(&socket_addr(peer)?)
                    .map_err(|e| Error::Transport(format!("cannot connect to {peer}: {e}")))?;
                self.adopt(stream, Some(peer.clone()))?
            }
        };
        // The acceptor learns who we are from the first frame.
        conn.send(&Frame::Hello { address: self.address.clone() })?;
        self.cache(peer.clone(), conn.clone());
        Ok(conn)
    }

    /// Makes `conn` the cached connection for `peer` (a peer that connected to us).
    pub(crate) fn remember(&self, peer: Address, conn: Arc<Connection>) {
        conn.set_peer(peer.clone());
        self.cache(peer, conn);
    }

    /// Caches `conn` for `peer`, dropping the closed connections of peers that went away (a
    /// head kept one per actor ever created: 200 actors created and killed left 200).
    fn cache(&self, peer: Address, conn: Arc<Connection>) {
        self.connections.retain(|_, cached| !cached.is_closed());
        self.connections.insert(peer, conn);
    }

    fn new_connection(&self, writer: Writer, peer: Option<Address>) -> Arc<Connection> {
        Arc::new(Connection {
            id: NEXT_CONNECTION_ID.fetch_add(1, Ordering::Relaxed),
            peer: Mutex::new(peer),
            writer: Mutex::new(writer),
            closed: AtomicBool::new(false),
            max_frame_bytes: self.config.max_frame_bytes,
            handler: self.handler.clone(),
        })
    }

    /// Wraps a stream in a connection and starts its reader thread.
    fn adopt(&self, stream: UnixStream, peer: Option<Address>) -> Result<Arc<Connection>> {
        let reader = stream.try_clone()?;
        let conn = self.new_connection(Writer::Unix(stream), peer);
        let reader = BufReader::with_capacity(self.config.read_buffer_bytes, reader);
        self.start_reader(&conn, reader)?;
        Ok(conn)
    }

    /// Wraps a QUIC channel in a connection and starts its reader thread.
    fn adopt_quic(
        &self,
        net: Arc<NetLink>,
        writer: Writer,
        recv: quinn::RecvStream,
        peer: Option<Address>,
    ) -> Result<Arc<Connection>> {
        let conn = self.new_connection(writer, peer);
        // Frames are read by a task of the net runtime. Those the handler takes inline (replies,
        // calls to a hosted actor: they only complete a slot or queue work) are handled there
        // at once, which saves a thread hand-off per frame; every other frame goes, in order,
        // to the connection's thread, like a Unix connection's frames.
        let (tx, rx) = crossbeam_channel::unbounded::<std::result::Result<Frame, String>>();
        // Frames given to the thread and not yet handled: a frame is handled inline only when
        // none is, so frames are still handled in the order they arrived.
        let queued = Arc::new(AtomicU64::new(0));
        let thread_queued = queued.clone();
        let handler = self.handler.clone();
        let thread_conn = conn.clone();
        std::thread::Builder::new()
            .name(format!("rtrun-conn-{}", conn.id))
            .spawn(move || {
                let reason = loop {
                    match rx.recv() {
                        Ok(Ok(frame)) => {
                            handler.on_frame(&thread_conn, frame);
                            thread_queued.fetch_sub(1, Ordering::AcqRel);
                        }
                        Ok(Err(reason)) => break reason,
                        Err(_) => break "the connection's reader stopped".to_owned(),
                    }
                };
                thread_conn.shutdown();
                handler.on_close(&thread_conn, &reason);
            })
            .map_err(|e| Error::System(format!("cannot start reader thread: {e}")))?;
        let handler = self.handler.clone();
        let reader_conn = conn.clone();
        let max_frame_bytes = self.config.max_frame_bytes;
        let mut recv = recv;
        net.handle.spawn(async move {
            let reason = loop {
                match read_frame_async(&mut recv, max_frame_bytes).await {
                    Ok(Some(frame))
                        if queued.load(Ordering::Acquire) == 0
                            && handler.handles_inline(&frame) =>
                    {
                        handler.on_frame(&reader_conn, frame)
                    }
                    Ok(Some(frame)) => {
                        queued.fetch_add(1, Ordering::AcqRel);
                        if tx.send(Ok(frame)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => break "peer closed the connection".to_owned(),
                    // A peer process that exits (or is killed) cannot close its QUIC
                    // connection cleanly: like a Unix socket's end of file, that is news for
                    // the liveness checks, not a warning.
                    Err(ReadEnd::Lost(reason)) => {
                        tracing::debug!(connection = reader_conn.id, "connection lost: {reason}");
                        break format!("connection lost: {reason}");
                    }
                    Err(ReadEnd::Failed(e)) => {
                        tracing::warn!(connection = reader_conn.id, "closing connection: {e}");
                        break e.to_string();
                    }
                }
            };
            let _ = tx.send(Err(reason));
        });
        Ok(conn)
    }

    fn start_reader(
        &self,
        conn: &Arc<Connection>,
        reader: impl Read + Send + 'static,
    ) -> Result<()> {
        let handler = self.handler.clone();
        let reader_conn = conn.clone();
        let max_frame_bytes = self.config.max_frame_bytes;
        std::thread::Builder::new()
            .name(format!("rtrun-conn-{}", conn.id))
            .spawn(move || read_loop(reader, reader_conn, handler, max_frame_bytes))
            .map_err(|e| Error::System(format!("cannot start reader thread: {e}")))?;
        Ok(())
    }
}

fn read_loop(
    mut reader: impl Read,
    conn: Arc<Connection>,
    handler: Arc<dyn FrameHandler>,
    max_frame_bytes: usize,
) {
    let reason = loop {
        match read_frame(&mut reader, max_frame_bytes) {
            Ok(Some(frame)) => handler.on_frame(&conn, frame),
            Ok(None) => break "peer closed the connection".to_owned(),
            Err(e) => {
                tracing::warn!(connection = conn.id, "closing connection: {e}");
                break e.to_string();
            }
        }
    };
    conn.shutdown();
    handler.on_close(&conn, &reason);
}

/// Reads one frame from a QUIC stream; `Ok(None)` on a clean end of stream between frames.
/// Why a QUIC stream's reader stopped.
enum ReadEnd {
    /// The connection went away between frames (the peer exited, or this process is closing).
    Lost(String),
    /// A broken or oversized frame, or a loss in the middle of one.
    Failed(Error),
}

async fn read_frame_async(
    recv: &mut quinn::RecvStream,
    max_frame_bytes: usize,
) -> std::result::Result<Option<Frame>, ReadEnd> {
    let mut header = [0u8; 4];
    match recv.read_exact(&mut header).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(quinn::ReadExactError::ReadError(
            e @ (quinn::ReadError::ConnectionLost(_) | quinn::ReadError::Reset(_)),
        )) => return Err(ReadEnd::Lost(e.to_string())),
        Err(e) => return Err(ReadEnd::Failed(Error::Transport(format!("read failed: {e}")))),
    }
    let len = u32::from_le_bytes(header) as usize;
    if len > max_frame_bytes {
        return Err(ReadEnd::Failed(Error::Transport(format!(
            "frame length {len} exceeds the {max_frame_bytes} byte limit"
        ))));
    }
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body).await.map_err(|e| {
        ReadEnd::Failed(Error::Transport(format!("truncated frame of {len} bytes: {e}")))
    })?;
    codec::decode(&body).map(Some).map_err(ReadEnd::Failed)
}

/// Reads one frame; `Ok(None)` on a clean end of stream between frames.
pub(crate) fn read_frame(reader: &mut impl Read, max_frame_bytes: usize) -> Result<Option<Frame>> {
    let mut header = [0u8; 4];
    match reader.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::Transport(format!("read failed: {e}"))),
    }
    let len = u32::from_le_bytes(header) as usize;
    if len > max_frame_bytes {
        return Err(Error::Transport(format!(
            "frame length {len} exceeds the {max_frame_bytes} byte limit"
        )));
    }
    let mut body = vec![0u8; len];
    reader
        .read_exact(&mut body)
        .map_err(|e| Error::Transport(format!("truncated frame of {len} bytes: {e}")))?;
    codec::decode(&body).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{HeadRequest, Request};

    #[test]
    fn malformed_and_oversized_frames_are_errors() {
        let mut garbage: &[u8] = &[3, 0, 0, 0, 0xff, 0xfe, 0xfd];
        assert!(read_frame(&mut garbage, 1024).is_err());
        let mut huge: &[u8] = &[0xff, 0xff, 0xff, 0x7f];
        assert!(read_frame(&mut huge, 1024).unwrap_err().to_string().contains("exceeds"));
        let mut truncated: &[u8] = &[10, 0, 0, 0, 1, 2];
        assert!(read_frame(&mut truncated, 1024).unwrap_err().to_string().contains("truncated"));
        let mut empty: &[u8] = &[];
        assert!(read_frame(&mut empty, 1024).unwrap().is_none());
    }

    #[test]
    fn frames_round_trip() {
        let frame = Frame::Request { req_id: 7, body: Request::Head(HeadRequest::ClusterInfo) };
        let body = codec::encode(&frame).unwrap();
        let mut bytes = (body.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&body);
        let mut slice: &[u8] = &bytes;
        match read_frame(&mut slice, 1024).unwrap() {
            Some(Frame::Request { req_id: 7, body: Request::Head(HeadRequest::ClusterInfo) }) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}
