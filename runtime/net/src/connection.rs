//! An admitted peer connection: requests in both directions (one QUIC stream per request,
//! correlated by id), incoming requests handed to the application, object pulls served from the
//! endpoint's [`ObjectSource`], and heartbeats.
//!
//! Every stream a peer opens is read by its own task under [`crate::NetConfig::request_read_timeout`];
//! a malformed, truncated or oversized frame is answered with an error frame (when the stream
//! still allows it) and the rest of the stream is discarded, so a bad stream never affects others.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use rtrun_object_store::ObjectId;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinHandle;
use tracing::{Instrument, debug, warn};

use crate::endpoint::{CLOSE_NORMAL, Shared, connection_error};
use crate::error::{NetError, Result};
use crate::frame::{
    Frame, FrameError, FrameKind, FrameLimits, expect_frame, read_frame, read_header, read_part,
    write_frame,
};
use crate::protocol::{ErrorBody, Heartbeat, decode_head, error_frame, frame};

/// QUIC stream error code used when we stop reading a stream after a bad frame.
pub const STREAM_REFUSED: u32 = 1;

/// Where a node serves object pulls from (the runtime implements it over its object store).
pub trait ObjectSource: Send + Sync + 'static {
    /// The object's size, or `None` when this node has no copy.
    fn size(&self, object: ObjectId) -> Option<u64>;
    /// Bytes `offset..offset + len` of the object. Returning a `Bytes` that borrows the store's
    /// memory (`Bytes::from_owner` over a pinned view) sends without copying. Called on a tokio
    /// worker thread: it must not block (restore a spilled object before serving it), or must
    /// wrap blocking work in `tokio::task::block_in_place` as [`crate::StoreSource`] does.
    fn read(&self, object: ObjectId, offset: u64, len: u64) -> std::result::Result<Bytes, String>;
}

/// A connection to an admitted peer. Cheap to clone; closed when the last clone drops.
#[derive(Clone)]
pub struct Connection {
    inner: Arc<Inner>,
}

struct Inner {
    quinn: quinn::Connection,
    peer_name: String,
    shared: Arc<Shared>,
    requests: Mutex<mpsc::Receiver<IncomingRequest>>,
    channels: Mutex<mpsc::Receiver<IncomingChannel>>,
    next_correlation: AtomicU64,
    server: JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.server.abort();
        self.quinn.close(quinn::VarInt::from_u32(CLOSE_NORMAL), b"connection dropped");
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.inner.peer_name)
            .field("remote", &self.inner.quinn.remote_address())
            .finish_non_exhaustive()
    }
}

impl Connection {
    pub(crate) fn start(
        shared: Arc<Shared>,
        quinn: quinn::Connection,
        peer_name: String,
    ) -> Connection {
        shared.config.open_admitted(&quinn);
        let (tx, rx) = mpsc::channel(shared.config.request_queue.max(1));
        let (channel_tx, channel_rx) = mpsc::channel(64);
        let budget =
            Arc::new(Semaphore::new(budget_units(shared.config.max_unanswered_request_bytes)));
        let peer: Arc<str> = Arc::from(peer_name.as_str());
        // Every log line of this connection's tasks names both ends.
        let span = tracing::info_span!("peer", node = %shared.node_name, peer = %peer_name);
        let server = tokio::spawn(
            serve(shared.clone(), quinn.clone(), peer, tx, channel_tx, budget).instrument(span),
        );
        Connection {
            inner: Arc::new(Inner {
                quinn,
                peer_name,
                shared,
                requests: Mutex::new(rx),
                channels: Mutex::new(channel_rx),
                next_correlation: AtomicU64::new(1),
                server,
            }),
        }
    }

    /// The peer's node name (from its certificate, verified by the cluster CA).
    pub fn peer_name(&self) -> &str {
        &self.inner.peer_name
    }

    /// This connection's name, `PEER#ID`: processes that share credentials (drivers and the
    /// CLI on one node) share a peer name, not a link name. The heartbeats the peer sends on
    /// it count for both names.
    pub fn link_name(&self) -> String {
        link_name(&self.inner.peer_name, &self.inner.quinn)
    }

    /// The underlying QUIC connection (statistics, raw streams for tests and tools).
    pub fn quinn(&self) -> &quinn::Connection {
        &self.inner.quinn
    }

    pub(crate) fn limits(&self) -> &FrameLimits {
        &self.inner.shared.config.frames
    }

    pub(crate) fn next_correlation(&self) -> u64 {
        self.inner.next_correlation.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn lost(&self, fallback: NetError) -> NetError {
        match self.inner.quinn.close_reason() {
            Some(reason) => connection_error(&self.inner.peer_name, reason),
            None => fallback,
        }
    }

    /// Sends a request (a small head and large parts, written from their buffers) on a new
    /// stream and waits for the response frame, whose parts are read into buffers sized once.
    /// There is no deadline here (actor calls may run for hours); a vanished peer ends the wait
    /// through the QUIC idle timeout, and callers wrap it in `tokio::time::timeout` as needed.
    pub async fn request(&self, head: impl Into<Bytes>, parts: Vec<Bytes>) -> Result<Frame> {
        let correlation = self.next_correlation();
        let peer = &self.inner.peer_name;
        let (mut send, mut recv) =
            self.inner.quinn.open_bi().await.map_err(|e| connection_error(peer, e))?;
        let request = Frame::with_parts(FrameKind::Request, correlation, head, parts);
        write_frame(&mut send, &request, self.limits()).await.map_err(|e| self.lost(e.into()))?;
        let _ = send.finish();
        let response =
            expect_frame(&mut recv, self.limits()).await.map_err(|e| self.lost(e.into()))?;
        if response.correlation != correlation {
            return Err(NetError::Protocol {
                peer: peer.clone(),
                reason: format!(
                    "expected a response to request {correlation}, found one to {}",
                    response.correlation
                ),
            });
        }
        match response.kind {
            FrameKind::Response => Ok(response),
            FrameKind::Error => Err(remote_error(peer, &response)),
            other => Err(NetError::Protocol {
                peer: peer.clone(),
                reason: format!("expected a Response frame, found {other:?}"),
            }),
        }
    }

    /// The next request the peer sent; `None` when the connection is closed.
    pub async fn next_request(&self) -> Option<IncomingRequest> {
        self.inner.requests.lock().await.recv().await
    }

    /// Opens a long-lived application channel: a bidirectional stream whose first frame is a
    /// [`FrameKind::Channel`] carrying `head` (what the channel is for), after which both
    /// directions carry whatever the application frames on them. The runtime carries its
    /// frames between processes of different nodes this way.
    pub async fn open_channel(
        &self,
        head: impl Into<Bytes>,
    ) -> Result<(quinn::SendStream, quinn::RecvStream)> {
        let peer = &self.inner.peer_name;
        let (mut send, recv) =
            self.inner.quinn.open_bi().await.map_err(|e| connection_error(peer, e))?;
        let open = Frame::new(FrameKind::Channel, self.next_correlation(), head);
        write_frame(&mut send, &open, self.limits()).await.map_err(|e| self.lost(e.into()))?;
        Ok((send, recv))
    }

    /// The next channel the peer opened; `None` when the connection is closed.
    pub async fn next_channel(&self) -> Option<IncomingChannel> {
        self.inner.channels.lock().await.recv().await
    }

    /// Starts sending heartbeats every [`crate::HeartbeatConfig::interval`] on a dedicated
    /// stream; they stop when the returned handle drops.
    pub fn start_heartbeats(&self) -> HeartbeatSender {
        let quinn = self.inner.quinn.clone();
        let interval = self.inner.shared.config.heartbeat.interval;
        let peer = self.inner.peer_name.clone();
        let task = tokio::spawn(async move {
            let mut stream = match quinn.open_uni().await {
                Ok(stream) => stream,
                Err(error) => return debug!(%peer, %error, "heartbeat stream not opened"),
            };
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for sequence in 0.. {
                ticker.tick().await;
                let beat = frame(FrameKind::Heartbeat, sequence, &Heartbeat { sequence });
                if let Err(error) = write_frame(&mut stream, &beat, &FrameLimits::HANDSHAKE).await {
                    return debug!(%peer, %error, "heartbeats stopped");
                }
            }
        });
        HeartbeatSender { task }
    }

    /// Closes the connection.
    pub fn close(&self) {
        self.inner.quinn.close(quinn::VarInt::from_u32(CLOSE_NORMAL), b"closed");
    }

    /// Waits until the connection is closed (by either side or by the idle timeout).
    pub async fn closed(&self) -> NetError {
        connection_error(&self.inner.peer_name, self.inner.quinn.closed().await)
    }
}

/// Sends heartbeats while alive.
#[derive(Debug)]
pub struct HeartbeatSender {
    task: JoinHandle<()>,
}

impl Drop for HeartbeatSender {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A channel a peer opened with [`Connection::open_channel`].
pub struct IncomingChannel {
    /// The head of the opening frame.
    pub head: Bytes,
    /// The sending node's name.
    pub peer: Arc<str>,
    /// Our direction of the stream.
    pub send: quinn::SendStream,
    /// The peer's direction, positioned after the opening frame.
    pub recv: quinn::RecvStream,
}

impl std::fmt::Debug for IncomingChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingChannel").field("peer", &self.peer).finish_non_exhaustive()
    }
}

/// A request from a peer, with the means to answer it.
pub struct IncomingRequest {
    /// The request frame (head and parts).
    pub frame: Frame,
    peer: Arc<str>,
    link: Arc<str>,
    responder: Responder,
}

impl std::fmt::Debug for IncomingRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingRequest")
            .field("peer", &self.peer)
            .field("correlation", &self.frame.correlation)
            .finish_non_exhaustive()
    }
}

impl IncomingRequest {
    /// The sending node's name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The name of the connection it came on ([`Connection::link_name`]).
    pub fn link(&self) -> &str {
        &self.link
    }

    /// Splits into the frame and the responder (to answer from another task).
    pub fn into_parts(self) -> (Frame, Responder) {
        (self.frame, self.responder)
    }

    /// Answers with a head and parts.
    pub async fn respond(self, head: impl Into<Bytes>, parts: Vec<Bytes>) -> Result<()> {
        self.responder.respond(head, parts).await
    }

    /// Answers with an error message.
    pub async fn respond_error(self, message: impl Into<String>) -> Result<()> {
        self.responder.error(message).await
    }
}

/// Writes the answer to one request. Dropping it unanswered ends the stream, which the
/// requester reports as a truncated response.
pub struct Responder {
    send: quinn::SendStream,
    correlation: u64,
    limits: FrameLimits,
    /// The request's share of the connection's unanswered-bytes budget, returned on answer.
    _budget: Option<OwnedSemaphorePermit>,
}

impl std::fmt::Debug for Responder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Responder({})", self.correlation)
    }
}

impl Responder {
    /// Answers with a head and parts (written straight from their buffers).
    pub async fn respond(mut self, head: impl Into<Bytes>, parts: Vec<Bytes>) -> Result<()> {
        let response = Frame::with_parts(FrameKind::Response, self.correlation, head, parts);
        write_frame(&mut self.send, &response, &self.limits).await?;
        let _ = self.send.finish();
        Ok(())
    }

    /// Answers with an error message.
    pub async fn error(mut self, message: impl Into<String>) -> Result<()> {
        write_frame(&mut self.send, &error_frame(self.correlation, message), &self.limits).await?;
        let _ = self.send.finish();
        Ok(())
    }
}

pub(crate) fn remote_error(peer: &str, frame: &Frame) -> NetError {
    match decode_head::<ErrorBody>(frame) {
        Ok(body) => NetError::Remote { peer: peer.to_string(), message: body.message },
        Err(e) => NetError::Protocol { peer: peer.to_string(), reason: e.to_string() },
    }
}

/// `PEER#ID`: the name of one connection from `peer`.
fn link_name(peer: &str, quinn: &quinn::Connection) -> String {
    format!("{peer}#{}", quinn.stable_id())
}

/// Accepts the peer's streams until the connection closes.
async fn serve(
    shared: Arc<Shared>,
    quinn: quinn::Connection,
    peer: Arc<str>,
    tx: mpsc::Sender<IncomingRequest>,
    channels: mpsc::Sender<IncomingChannel>,
    budget: Arc<Semaphore>,
) {
    let link: Arc<str> = Arc::from(link_name(&peer, &quinn));
    loop {
        tokio::select! {
            bi = quinn.accept_bi() => match bi {
                Ok((send, recv)) => {
                    let stream = serve_stream(shared.clone(), (peer.clone(), link.clone()), send, recv, tx.clone(), channels.clone(), budget.clone());
                    tokio::spawn(stream.in_current_span());
                }
                Err(error) => return debug!(%peer, %error, "connection ended"),
            },
            uni = quinn.accept_uni() => match uni {
                Ok(recv) => {
                    let task = serve_heartbeats(shared.clone(), peer.clone(), link.clone(), recv);
                    tokio::spawn(task.in_current_span());
                }
                Err(error) => return debug!(%peer, %error, "connection ended"),
            },
        }
    }
}

/// Reads the first frame of a stream the peer opened and dispatches on its kind.
async fn serve_stream(
    shared: Arc<Shared>,
    (peer, link): (Arc<str>, Arc<str>),
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    tx: mpsc::Sender<IncomingRequest>,
    channels: mpsc::Sender<IncomingChannel>,
    budget: Arc<Semaphore>,
) {
    let limits = shared.config.frames;
    let timeout = shared.config.request_read_timeout;
    let header = match tokio::time::timeout(timeout, read_header(&mut recv, &limits)).await {
        Ok(Ok(Some(header))) => header,
        Ok(Ok(None)) => return,
        Ok(Err(error)) => {
            return reject_stream(&peer, &mut send, &mut recv, 0, &error.to_string()).await;
        }
        Err(_) => {
            let reason = format!("no frame header within {timeout:?}");
            return reject_stream(&peer, &mut send, &mut recv, 0, &reason).await;
        }
    };
    let correlation = header.correlation;
    match header.kind {
        FrameKind::Request => {
            let bytes: u64 = header.part_lens.iter().sum();
            let units = budget_units(bytes);
            let budget_total = budget_units(shared.config.max_unanswered_request_bytes);
            if units > budget_total {
                let reason = format!(
                    "request parts of {bytes} bytes exceed the connection's budget of {} bytes",
                    shared.config.max_unanswered_request_bytes
                );
                return reject_stream(&peer, &mut send, &mut recv, correlation, &reason).await;
            }
            // `units <= budget_total`, which `budget_units` keeps within u32.
            let permit = budget.acquire_many_owned(units as u32);
            let permit = match tokio::time::timeout(timeout, permit).await {
                Ok(Ok(permit)) => permit,
                _ => {
                    let reason = format!("no room for {bytes} request bytes within {timeout:?}");
                    return reject_stream(&peer, &mut send, &mut recv, correlation, &reason).await;
                }
            };
            let parts = async {
                let mut parts = Vec::with_capacity(header.part_lens.len());
                for &len in &header.part_lens {
                    parts.push(read_part(&mut recv, len).await?);
                }
                Ok::<_, FrameError>(parts)
            };
            let parts = match tokio::time::timeout(timeout, parts).await {
                Ok(Ok(parts)) => parts,
                Ok(Err(error)) => {
                    return reject_stream(
                        &peer,
                        &mut send,
                        &mut recv,
                        correlation,
                        &error.to_string(),
                    )
                    .await;
                }
                Err(_) => {
                    let reason = format!("request parts not received within {timeout:?}");
                    return reject_stream(&peer, &mut send, &mut recv, correlation, &reason).await;
                }
            };
            // A request is its stream's only frame; anything the peer sends after it is ignored.
            let frame = Frame { kind: header.kind, correlation, head: header.head, parts };
            let request = IncomingRequest {
                frame,
                peer: peer.clone(),
                link,
                responder: Responder { send, correlation, limits, _budget: Some(permit) },
            };
            if let Err(unsent) = tx.send(request).await {
                let _ = unsent.0.respond_error("the node is shutting down").await;
            }
        }
        FrameKind::PullOpen => crate::pull::serve_pull(&shared, &peer, header, send, recv).await,
        FrameKind::Channel if header.part_lens.is_empty() => {
            let channel = IncomingChannel { head: header.head, peer: peer.clone(), send, recv };
            if let Err(unsent) = channels.send(channel).await {
                let mut channel = unsent.0;
                let reason = "the node is not accepting channels";
                reject_stream(&peer, &mut channel.send, &mut channel.recv, correlation, reason)
                    .await;
            }
        }
        other => {
            let reason = format!(
                "a stream must start with a Request, PullOpen or part-less Channel frame, found {other:?}"
            );
            reject_stream(&peer, &mut send, &mut recv, correlation, &reason).await;
        }
    }
}

/// Answers a bad stream with an error frame and stops reading it. The write gets a few seconds
/// (a peer that grants no flow-control credit has its stream reset instead).
pub(crate) async fn reject_stream(
    peer: &str,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    correlation: u64,
    reason: &str,
) {
    warn!(%peer, %reason, "bad stream");
    let _ = recv.stop(quinn::VarInt::from_u32(STREAM_REFUSED));
    let reply = error_frame(correlation, reason);
    let limits = FrameLimits::default();
    let write = write_frame(send, &reply, &limits);
    match tokio::time::timeout(REJECT_WRITE_TIMEOUT, write).await {
        Ok(Ok(())) => {
            let _ = send.finish();
        }
        _ => {
            let _ = send.reset(quinn::VarInt::from_u32(STREAM_REFUSED));
        }
    }
}

/// How long an error answer to a bad stream may take to write.
const REJECT_WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The budget is counted in KiB so a `u32` of permits covers up to 4 TiB.
fn budget_units(bytes: u64) -> usize {
    usize::try_from(bytes.div_ceil(1024).min(u64::from(u32::MAX))).unwrap_or(u32::MAX as usize)
}

/// Reads a peer's heartbeat stream and feeds the endpoint's monitor, under the peer's name
/// (nodes are watched so) and the connection's (drivers are: several may share a name).
async fn serve_heartbeats(
    shared: Arc<Shared>,
    peer: Arc<str>,
    link: Arc<str>,
    mut recv: quinn::RecvStream,
) {
    loop {
        match read_frame(&mut recv, &FrameLimits::HANDSHAKE).await {
            Ok(Some(frame)) if frame.kind == FrameKind::Heartbeat => {
                if let Some(monitor) = &shared.monitor {
                    monitor.on_heartbeat(&peer);
                    monitor.on_heartbeat(&link);
                }
            }
            Ok(Some(frame)) => {
                warn!(%peer, kind = ?frame.kind, "unexpected frame on a heartbeat stream");
                let _ = recv.stop(quinn::VarInt::from_u32(STREAM_REFUSED));
                return;
            }
            Ok(None) => return,
            Err(error) => {
                debug!(%peer, %error, "heartbeat stream ended");
                let _ = recv.stop(quinn::VarInt::from_u32(STREAM_REFUSED));
                return;
            }
        }
    }
}
