//! Chunked, resumable object pulls over one QUIC stream, driven by the object store's pure
//! [`PullState`] bookkeeping.
//!
//! ```text
//! puller                                   holder
//! PullOpen {object, chunk_size}  ───────▶
//!                                 ◀─────── PullMeta {size}        (or Error: not here)
//! PullWant {chunks: [..]}        ───────▶  (up to max_in_flight chunks outstanding)
//!                                 ◀─────── PullChunk {index} + 1 part (the chunk's bytes)
//! ... more wants as chunks arrive; the puller finishes its side when complete
//! ```
//!
//! Each chunk is read straight into its place in the destination buffer. When the stream or
//! connection fails, the state keeps every received chunk; a new [`ObjectPull`] (possibly from
//! another holder) continues with only the missing ones.

use std::sync::Arc;

use rtrun_object_store::pull::chunk_range;
use rtrun_object_store::{ObjectId, PullConfig, PullState};
use tracing::debug;

use crate::connection::{Connection, reject_stream, remote_error};
use crate::endpoint::{Shared, connection_error};
use crate::error::{NetError, Result};
use crate::frame::{
    Frame, FrameHeader, FrameKind, FrameLimits, PRELUDE_LEN, expect_frame, read_frame, read_header,
    read_part_into, write_frame,
};
use crate::protocol::{PullChunk, PullMeta, PullOpen, PullWant, decode, decode_head, frame};

/// Bytes of a chunk frame besides the data: prelude, one part length, a small head.
const CHUNK_FRAME_OVERHEAD: u64 = PRELUDE_LEN as u64 + 8 + 64;

/// The puller's side of one pull stream.
#[derive(Debug)]
pub struct ObjectPull {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    connection: Connection,
    object: ObjectId,
    size: u64,
    chunk_size: u64,
}

impl Connection {
    /// Opens a pull of `object` in chunks of `chunk_size` bytes and learns its size.
    pub async fn open_pull(&self, object: ObjectId, chunk_size: u64) -> Result<ObjectPull> {
        let peer = self.peer_name().to_string();
        let (mut send, mut recv) =
            self.quinn().open_bi().await.map_err(|e| connection_error(&peer, e))?;
        let correlation = self.next_correlation();
        let open = PullOpen { object: object.0, chunk_size };
        write_frame(&mut send, &frame(FrameKind::PullOpen, correlation, &open), self.limits())
            .await
            .map_err(|e| self.lost(e.into()))?;
        let reply = expect_frame(&mut recv, &FrameLimits::HANDSHAKE)
            .await
            .map_err(|e| self.lost(e.into()))?;
        let meta: PullMeta = match decode(&reply, FrameKind::PullMeta) {
            Ok(meta) => meta,
            Err(Ok(message)) => return Err(NetError::Remote { peer, message }),
            Err(Err(e)) => return Err(NetError::Protocol { peer, reason: e.to_string() }),
        };
        Ok(ObjectPull { send, recv, connection: self.clone(), object, size: meta.size, chunk_size })
    }

    /// Pulls a whole object into a new buffer (one stream, no resumption).
    pub async fn pull_object(&self, object: ObjectId, config: PullConfig) -> Result<Vec<u8>> {
        let mut pull = self.open_pull(object, config.chunk_size).await?;
        let mut state = PullState::new(object, pull.size(), config)?;
        let size = usize::try_from(pull.size()).map_err(|_| NetError::Protocol {
            peer: self.peer_name().to_string(),
            reason: format!("object of {} bytes does not fit in memory", pull.size()),
        })?;
        let mut buffer = vec![0u8; size];
        pull.run(&mut state, &mut buffer).await?;
        Ok(buffer)
    }
}

impl ObjectPull {
    /// The object's size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Requests the chunks `state` says are missing and writes each arriving chunk into
    /// `destination` (exactly the object's size), until the object is complete. On failure the
    /// chunks in flight are marked missing again, so `state` can resume on another stream.
    pub async fn run(&mut self, state: &mut PullState, destination: &mut [u8]) -> Result<()> {
        let result = self.run_inner(state, destination).await;
        if result.is_err() {
            state.on_disconnect();
        }
        result
    }

    async fn run_inner(&mut self, state: &mut PullState, destination: &mut [u8]) -> Result<()> {
        let peer = self.connection.peer_name().to_string();
        let protocol = |reason: String| NetError::Protocol { peer: peer.clone(), reason };
        if destination.len() as u64 != self.size
            || state.id() != self.object
            || state.chunk_count() != self.size.div_ceil(self.chunk_size)
        {
            return Err(protocol(format!(
                "pull state for {} ({} chunks) and a {}-byte buffer do not fit object {} of {} bytes in {}-byte chunks",
                state.id(),
                state.chunk_count(),
                destination.len(),
                self.object,
                self.size,
                self.chunk_size
            )));
        }
        let limits = *self.connection.limits();
        // Once the holder stops reading (it answered with an error), the chunks and the error
        // frame it sent before are still read: they carry data and the reason.
        let mut holder_stopped = false;
        loop {
            let wanted: Vec<u64> = state.next_requests().iter().map(|c| c.index).collect();
            if !wanted.is_empty() && !holder_stopped {
                let want = frame(FrameKind::PullWant, 0, &PullWant { chunks: wanted });
                if let Err(error) = write_frame(&mut self.send, &want, &limits).await {
                    debug!(%peer, %error, "holder stopped reading the pull stream");
                    holder_stopped = true;
                }
            }
            if state.is_complete() {
                let _ = self.send.finish();
                return Ok(());
            }
            let header = read_header(&mut self.recv, &limits)
                .await
                .map_err(|e| self.connection.lost(e.into()))?
                .ok_or_else(|| protocol("the holder ended the pull stream early".into()))?;
            match header.kind {
                FrameKind::PullChunk => {}
                FrameKind::Error => {
                    let frame = Frame::new(header.kind, header.correlation, header.head);
                    return Err(remote_error(&peer, &frame));
                }
                other => {
                    return Err(protocol(format!("expected a PullChunk frame, found {other:?}")));
                }
            }
            let chunk: PullChunk = decode_head(&Frame::new(header.kind, 0, header.head.clone()))?;
            let (offset, len) = chunk_range(self.size, self.chunk_size, chunk.index)
                .ok_or_else(|| protocol(format!("chunk {} is out of range", chunk.index)))?;
            if header.part_lens != [len] {
                return Err(protocol(format!(
                    "chunk {} should carry one part of {len} bytes, found parts {:?}",
                    chunk.index, header.part_lens
                )));
            }
            // `chunk_range` keeps `offset + len <= size == destination.len()`.
            let slot = &mut destination[offset as usize..(offset + len) as usize];
            read_part_into(&mut self.recv, 0, len, slot)
                .await
                .map_err(|e| self.connection.lost(e.into()))?;
            state.on_chunk(chunk.index, len)?;
        }
    }
}

/// The holder's side: answers one pull stream from the endpoint's object source.
pub(crate) async fn serve_pull(
    shared: &Arc<Shared>,
    peer: &str,
    header: FrameHeader,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let correlation = header.correlation;
    let limits = shared.config.frames;
    let open = Frame::new(header.kind, correlation, header.head);
    let open: PullOpen = match decode_head(&open) {
        Ok(open) if header.part_lens.is_empty() => open,
        Ok(_) => {
            return reject_stream(
                peer,
                &mut send,
                &mut recv,
                correlation,
                "PullOpen takes no parts",
            )
            .await;
        }
        Err(e) => {
            return reject_stream(peer, &mut send, &mut recv, correlation, &e.to_string()).await;
        }
    };
    let object = ObjectId(open.object);
    let Some(source) = shared.source.clone() else {
        let reason = format!("node {} serves no objects", shared.node_name);
        return reject_stream(peer, &mut send, &mut recv, correlation, &reason).await;
    };
    let Some(size) = source.size(object) else {
        let reason = format!("object {object} is not on node {}", shared.node_name);
        return reject_stream(peer, &mut send, &mut recv, correlation, &reason).await;
    };
    let largest = limits.max_frame_size.saturating_sub(CHUNK_FRAME_OVERHEAD);
    if open.chunk_size == 0 || open.chunk_size > largest {
        let reason = format!("chunk size must be 1 to {largest} bytes, found {}", open.chunk_size);
        return reject_stream(peer, &mut send, &mut recv, correlation, &reason).await;
    }
    let meta = frame(FrameKind::PullMeta, correlation, &PullMeta { size });
    if write_frame(&mut send, &meta, &limits).await.is_err() {
        return;
    }
    loop {
        let want = match read_frame(&mut recv, &limits).await {
            Ok(Some(frame)) if frame.kind == FrameKind::PullWant => frame,
            Ok(None) => return,
            Ok(Some(frame)) => {
                let reason = format!("expected a PullWant frame, found {:?}", frame.kind);
                return reject_stream(peer, &mut send, &mut recv, correlation, &reason).await;
            }
            Err(e) => {
                return reject_stream(peer, &mut send, &mut recv, correlation, &e.to_string())
                    .await;
            }
        };
        let want: PullWant = match decode_head::<PullWant>(&want) {
            Ok(want) if want.chunks.len() <= shared.config.max_pull_want => want,
            Ok(want) => {
                let reason = format!(
                    "at most {} chunks per request, found {}",
                    shared.config.max_pull_want,
                    want.chunks.len()
                );
                return reject_stream(peer, &mut send, &mut recv, correlation, &reason).await;
            }
            Err(e) => {
                return reject_stream(peer, &mut send, &mut recv, correlation, &e.to_string())
                    .await;
            }
        };
        for index in want.chunks {
            let Some((offset, len)) = chunk_range(size, open.chunk_size, index) else {
                let reason = format!("chunk {index} of object {object} does not exist");
                return reject_stream(peer, &mut send, &mut recv, correlation, &reason).await;
            };
            let data = match source.read(object, offset, len) {
                Ok(data) if data.len() as u64 == len => data,
                Ok(data) => {
                    let reason = format!(
                        "object source returned {} bytes for chunk {index}, expected {len}",
                        data.len()
                    );
                    return reject_stream(peer, &mut send, &mut recv, correlation, &reason).await;
                }
                Err(reason) => {
                    let reason = format!("reading chunk {index} of object {object}: {reason}");
                    return reject_stream(peer, &mut send, &mut recv, correlation, &reason).await;
                }
            };
            let mut chunk = frame(FrameKind::PullChunk, correlation, &PullChunk { index });
            chunk.parts.push(data);
            if let Err(error) = write_frame(&mut send, &chunk, &limits).await {
                return debug!(%peer, %error, "pull stream ended");
            }
        }
    }
}
