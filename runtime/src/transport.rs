//! Connections between processes on a node: abstract Unix sockets (no file is ever created, so
//! nothing is left behind when a process is killed), length-prefixed frames, one reader thread
//! per connection and writes straight from the sending thread.
//!
//! A frame is a little-endian `u32` length followed by that many bytes of the codec's encoding
//! of [`Frame`]. Frames longer than [`TransportConfig::max_frame_bytes`] are refused on both
//! sides; a malformed frame closes the connection with an error, never a panic.

use std::io::{BufReader, Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use dashmap::DashMap;
use parking_lot::Mutex;

use crate::codec;
use crate::error::{Error, Result};
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
pub trait FrameHandler: Send + Sync + 'static {
    /// A frame arrived on `conn`. Must not block for long: it runs on the reader thread.
    fn on_frame(&self, conn: &Arc<Connection>, frame: Frame);
    /// The connection closed (peer exit, error, or malformed input).
    fn on_close(&self, conn: &Arc<Connection>, reason: &str);
    /// `frame` was written to `conn` (for the accounting of references it carries).
    fn on_sent(&self, _conn: &Connection, _frame: &Frame) {}
}

/// One bidirectional connection to a peer process.
pub struct Connection {
    id: u64,
    peer: Mutex<Option<Address>>,
    writer: Mutex<UnixStream>,
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
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The peer's listening address, when known.
    pub fn peer(&self) -> Option<Address> {
        self.peer.lock().clone()
    }

    /// Records the peer's listening address (learned from a registration).
    pub fn set_peer(&self, address: Address) {
        *self.peer.lock() = Some(address);
    }

    /// Whether the connection has closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Sends one frame. Encoding happens outside the write lock; the write is one syscall for
    /// small frames.
    pub fn send(&self, frame: &Frame) -> Result<()> {
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
    pub fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
        let _ = self.writer.lock().shutdown(std::net::Shutdown::Both);
    }
}

/// A process's endpoint: its listener, and a cache of connections by peer address.
pub struct Endpoint {
    address: Address,
    handler: Arc<dyn FrameHandler>,
    connections: DashMap<Address, Arc<Connection>>,
    config: TransportConfig,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Endpoint({})", self.address)
    }
}

/// Builds the abstract socket address for `unix:@name`.
fn socket_addr(address: &str) -> Result<SocketAddr> {
    let name = address.strip_prefix("unix:@").ok_or_else(|| {
        Error::Invalid(format!("expected an address of the form unix:@name, found `{address}`"))
    })?;
    SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| Error::Invalid(format!("bad socket name `{name}`: {e}")))
}

impl Endpoint {
    /// Listens on `address` and starts the accept thread.
    pub fn bind(
        address: Address,
        handler: Arc<dyn FrameHandler>,
        config: TransportConfig,
    ) -> Result<Arc<Endpoint>> {
        let listener = UnixListener::bind_addr(&socket_addr(&address)?)
            .map_err(|e| Error::Transport(format!("cannot listen on {address}: {e}")))?;
        let endpoint = Arc::new(Endpoint { address, handler, connections: DashMap::new(), config });
        let weak = Arc::downgrade(&endpoint);
        std::thread::Builder::new()
            .name("rtrun-accept".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    let Some(endpoint) = weak.upgrade() else { return };
                    match stream {
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

    /// This endpoint's address.
    pub fn address(&self) -> &Address {
        &self.address
    }

    /// The connection to `peer`, connecting when there is none (or the cached one closed).
    pub fn connect(&self, peer: &Address) -> Result<Arc<Connection>> {
        if let Some(conn) = self.connections.get(peer)
            && !conn.is_closed()
        {
            return Ok(conn.clone());
        }
        let stream = UnixStream::connect_addr(&socket_addr(peer)?)
            .map_err(|e| Error::Transport(format!("cannot connect to {peer}: {e}")))?;
        let conn = self.adopt(stream, Some(peer.clone()))?;
        // The acceptor learns who we are from the first frame.
        conn.send(&Frame::Hello { address: self.address.clone() })?;
        self.connections.insert(peer.clone(), conn.clone());
        Ok(conn)
    }

    /// Makes `conn` the cached connection for `peer` (a peer that connected to us).
    pub fn remember(&self, peer: Address, conn: Arc<Connection>) {
        conn.set_peer(peer.clone());
        self.connections.insert(peer, conn);
    }

    /// Wraps a stream in a connection and starts its reader thread.
    fn adopt(&self, stream: UnixStream, peer: Option<Address>) -> Result<Arc<Connection>> {
        let reader = stream.try_clone()?;
        let conn = Arc::new(Connection {
            id: NEXT_CONNECTION_ID.fetch_add(1, Ordering::Relaxed),
            peer: Mutex::new(peer),
            writer: Mutex::new(stream),
            closed: AtomicBool::new(false),
            max_frame_bytes: self.config.max_frame_bytes,
            handler: self.handler.clone(),
        });
        let handler = self.handler.clone();
        let reader_conn = conn.clone();
        let config = self.config.clone();
        std::thread::Builder::new()
            .name(format!("rtrun-conn-{}", conn.id))
            .spawn(move || read_loop(reader, reader_conn, handler, config))
            .map_err(|e| Error::System(format!("cannot start reader thread: {e}")))?;
        Ok(conn)
    }
}

fn read_loop(
    stream: UnixStream,
    conn: Arc<Connection>,
    handler: Arc<dyn FrameHandler>,
    config: TransportConfig,
) {
    let mut reader = BufReader::with_capacity(config.read_buffer_bytes, stream);
    let reason = loop {
        match read_frame(&mut reader, config.max_frame_bytes) {
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

/// Reads one frame; `Ok(None)` on a clean end of stream between frames.
pub fn read_frame(reader: &mut impl Read, max_frame_bytes: usize) -> Result<Option<Frame>> {
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
    use crate::protocol::Request;

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
        let frame = Frame::Request { req_id: 7, body: Request::ClusterInfo };
        let body = codec::encode(&frame).unwrap();
        let mut bytes = (body.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&body);
        let mut slice: &[u8] = &bytes;
        match read_frame(&mut slice, 1024).unwrap() {
            Some(Frame::Request { req_id: 7, body: Request::ClusterInfo }) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}
