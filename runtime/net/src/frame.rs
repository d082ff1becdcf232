//! The wire format of one frame on a QUIC stream, and its reader and writer.
//!
//! ```text
//! prelude (18 bytes, little-endian)
//!   magic "rt" | version u8 | kind u8 | head_len u32 | correlation u64 | part_count u16
//! part table: part_count × u64 (length of each part)
//! head: head_len bytes (a small bitcode message, or opaque bytes for the runtime)
//! parts: the part bytes, back to back
//! ```
//!
//! Every length is checked against [`FrameLimits`] before anything is allocated; the head is
//! read into a buffer of its declared size, and parts go either into buffers the caller
//! pre-sized ([`read_part_into`], e.g. a slot in the object store) or into a `Vec` reserved once
//! and filled as bytes arrive. Sending writes the prelude, table and head as one buffer and the
//! parts straight from their own `Bytes` — a large object is never copied through a codec.

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"rt";
/// Wire format version.
pub const VERSION: u8 = 1;
/// Bytes in the fixed prelude.
pub const PRELUDE_LEN: usize = 18;

/// What a frame is; the kind of the first frame on a stream also says what the stream is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// First frame of a connection: the join token secret and the node name.
    Hello = 1,
    /// The answer to a valid hello.
    Welcome = 2,
    /// A bootstrap request: token secret, node name, certificate signing request.
    Bootstrap = 3,
    /// The answer to a bootstrap: the issued certificate and the CA certificate.
    Issued = 4,
    /// An application request (opaque head and parts for the runtime).
    Request = 5,
    /// An application response.
    Response = 6,
    /// An error answer; the head is an [`crate::protocol::ErrorBody`].
    Error = 7,
    /// A heartbeat on a connection's heartbeat stream.
    Heartbeat = 8,
    /// Opens an object pull stream.
    PullOpen = 9,
    /// The size of the object being pulled.
    PullMeta = 10,
    /// Chunk numbers wanted next.
    PullWant = 11,
    /// One chunk of object data (one part).
    PullChunk = 12,
    /// Opens a long-lived application channel: the rest of the stream, both ways, belongs to
    /// the application (the runtime's own framing), see [`crate::Connection::open_channel`].
    Channel = 13,
}

impl FrameKind {
    /// The kind with wire value `value`.
    pub fn from_u8(value: u8) -> Option<FrameKind> {
        use FrameKind::*;
        Some(match value {
            1 => Hello,
            2 => Welcome,
            3 => Bootstrap,
            4 => Issued,
            5 => Request,
            6 => Response,
            7 => Error,
            8 => Heartbeat,
            9 => PullOpen,
            10 => PullMeta,
            11 => PullWant,
            12 => PullChunk,
            13 => Channel,
            _ => return None,
        })
    }
}

/// Hard limits on frames read from (and written to) a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest whole frame (prelude, table, head and parts) in bytes.
    pub max_frame_size: u64,
    /// Largest head in bytes.
    pub max_head_size: u32,
    /// Most parts in one frame.
    pub max_parts: u16,
}

impl FrameLimits {
    /// Limits for frames sent before a peer has authenticated (hello, bootstrap): small, so an
    /// unauthenticated peer can make us hold at most a few KiB.
    pub const HANDSHAKE: FrameLimits =
        FrameLimits { max_frame_size: 64 << 10, max_head_size: 32 << 10, max_parts: 0 };
}

impl Default for FrameLimits {
    /// 512 MiB frames (large objects should use chunked pulls), 1 MiB heads, 64 parts.
    fn default() -> FrameLimits {
        FrameLimits { max_frame_size: 512 << 20, max_head_size: 1 << 20, max_parts: 64 }
    }
}

/// A malformed frame or a failed stream.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The first bytes are not the frame magic.
    #[error("expected frame magic 72 74 (\"rt\"), found {found:02x?}")]
    BadMagic {
        /// The two bytes found.
        found: [u8; 2],
    },
    /// The version is not ours.
    #[error("expected wire format version {VERSION}, found {found}")]
    UnsupportedVersion {
        /// The version found.
        found: u8,
    },
    /// The kind byte names no frame kind.
    #[error("unknown frame kind {found}")]
    UnknownKind {
        /// The byte found.
        found: u8,
    },
    /// The head is longer than allowed.
    #[error("frame head of {found} bytes exceeds the limit of {limit}")]
    HeadTooLarge {
        /// Declared head length.
        found: u64,
        /// The limit.
        limit: u32,
    },
    /// The frame has more parts than allowed.
    #[error("frame has {found} parts, the limit is {limit}")]
    TooManyParts {
        /// Declared part count.
        found: u64,
        /// The limit.
        limit: u16,
    },
    /// The whole frame is larger than allowed.
    #[error("frame of {found} bytes exceeds the limit of {limit}")]
    TooLarge {
        /// Declared frame size.
        found: u128,
        /// The limit.
        limit: u64,
    },
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame while reading its {during}")]
    Truncated {
        /// Which piece was being read.
        during: &'static str,
    },
    /// A part does not fit the buffer the reader provided.
    #[error("part {index} has {declared} bytes, the destination holds {capacity}")]
    PartSize {
        /// The part.
        index: usize,
        /// Declared length.
        declared: u64,
        /// Destination length.
        capacity: u64,
    },
    /// A frame arrived where another kind was expected.
    #[error("expected a {expected:?} frame, found {found:?}")]
    UnexpectedKind {
        /// What the exchange expected.
        expected: FrameKind,
        /// What arrived.
        found: FrameKind,
    },
    /// A frame's head does not decode as the message its kind implies.
    #[error("{kind:?} frame head does not decode: {reason}")]
    BadHead {
        /// The frame kind.
        kind: FrameKind,
        /// The decoder's message.
        reason: String,
    },
    /// The frame has a different number of parts than its kind requires.
    #[error("{kind:?} frame needs {expected} parts, found {found}")]
    PartCount {
        /// The frame kind.
        kind: FrameKind,
        /// Parts required.
        expected: usize,
        /// Parts found.
        found: usize,
    },
    /// The stream failed (reset, connection lost, stopped by the peer).
    #[error("stream failed: {0}")]
    Stream(String),
}

/// A whole frame held in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// What it is.
    pub kind: FrameKind,
    /// The request this frame belongs to (responses echo their request's id).
    pub correlation: u64,
    /// The head.
    pub head: Bytes,
    /// The parts (large payloads), written straight from these buffers.
    pub parts: Vec<Bytes>,
}

impl Frame {
    /// A frame with no parts.
    pub fn new(kind: FrameKind, correlation: u64, head: impl Into<Bytes>) -> Frame {
        Frame { kind, correlation, head: head.into(), parts: Vec::new() }
    }

    /// A frame with parts.
    pub fn with_parts(
        kind: FrameKind,
        correlation: u64,
        head: impl Into<Bytes>,
        parts: Vec<Bytes>,
    ) -> Frame {
        Frame { kind, correlation, head: head.into(), parts }
    }

    /// The frame's size on the wire.
    pub fn encoded_len(&self) -> u128 {
        let parts: u128 = self.parts.iter().map(|p| p.len() as u128).sum();
        (PRELUDE_LEN + 8 * self.parts.len() + self.head.len()) as u128 + parts
    }

    /// Checks the frame against `limits` (senders check too, so a peer's refusal is never the
    /// first sign of an oversized frame).
    pub fn check(&self, limits: &FrameLimits) -> Result<(), FrameError> {
        if self.head.len() as u64 > u64::from(limits.max_head_size) {
            return Err(FrameError::HeadTooLarge {
                found: self.head.len() as u64,
                limit: limits.max_head_size,
            });
        }
        if self.parts.len() > usize::from(limits.max_parts) {
            return Err(FrameError::TooManyParts {
                found: self.parts.len() as u64,
                limit: limits.max_parts,
            });
        }
        if self.encoded_len() > u128::from(limits.max_frame_size) {
            return Err(FrameError::TooLarge {
                found: self.encoded_len(),
                limit: limits.max_frame_size,
            });
        }
        Ok(())
    }

    /// The prelude, part table and head as one buffer; the parts follow on the wire.
    pub fn encode_header(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(PRELUDE_LEN + 8 * self.parts.len() + self.head.len());
        out.put_slice(&MAGIC);
        out.put_u8(VERSION);
        out.put_u8(self.kind as u8);
        // Heads are bounded by `max_head_size: u32` and parts by `max_parts: u16` in `check`;
        // an unchecked frame saturates here and the receiver refuses it.
        out.put_u32_le(u32::try_from(self.head.len()).unwrap_or(u32::MAX));
        out.put_u64_le(self.correlation);
        out.put_u16_le(u16::try_from(self.parts.len()).unwrap_or(u16::MAX));
        for part in &self.parts {
            out.put_u64_le(part.len() as u64);
        }
        out.put_slice(&self.head);
        out.freeze()
    }

    /// The whole frame as one buffer (tests and fuzzers; senders use [`write_frame`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.encode_header().to_vec();
        for part in &self.parts {
            out.extend_from_slice(part);
        }
        out
    }
}

/// A frame whose head has been read and whose parts are still on the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameHeader {
    /// What it is.
    pub kind: FrameKind,
    /// The request id.
    pub correlation: u64,
    /// The head.
    pub head: Bytes,
    /// Lengths of the parts that follow, in order.
    pub part_lens: Vec<u64>,
}

/// Reads the next frame's prelude, part table and head. `Ok(None)` when the stream ended
/// cleanly before a new frame began.
pub async fn read_header<R: AsyncRead + Unpin>(
    stream: &mut R,
    limits: &FrameLimits,
) -> Result<Option<FrameHeader>, FrameError> {
    let mut prelude = [0u8; PRELUDE_LEN];
    let mut filled = 0;
    while filled < PRELUDE_LEN {
        let n = stream.read(&mut prelude[filled..]).await.map_err(stream_error)?;
        if n == 0 {
            if filled == 0 {
                return Ok(None);
            }
            return Err(FrameError::Truncated { during: "prelude" });
        }
        filled += n;
    }
    let decoded = decode_prelude(&prelude, limits)?;
    let mut table = vec![0u8; 8 * usize::from(decoded.part_count)];
    read_exact(stream, &mut table, "part table").await?;
    let part_lens: Vec<u64> = table
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect();
    let total = PRELUDE_LEN as u128
        + table.len() as u128
        + u128::from(decoded.head_len)
        + part_lens.iter().map(|&l| u128::from(l)).sum::<u128>();
    if total > u128::from(limits.max_frame_size) {
        return Err(FrameError::TooLarge { found: total, limit: limits.max_frame_size });
    }
    // `decode_prelude` bounded `head_len` by `max_head_size` before this allocation.
    let mut head = vec![0u8; decoded.head_len as usize];
    read_exact(stream, &mut head, "head").await?;
    Ok(Some(FrameHeader {
        kind: decoded.kind,
        correlation: decoded.correlation,
        head: Bytes::from(head),
        part_lens,
    }))
}

/// The fields of a prelude.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prelude {
    /// Frame kind.
    pub kind: FrameKind,
    /// Head length.
    pub head_len: u32,
    /// Request id.
    pub correlation: u64,
    /// Number of parts.
    pub part_count: u16,
}

/// Decodes and checks a prelude against `limits` (pure; no allocation).
pub fn decode_prelude(
    prelude: &[u8; PRELUDE_LEN],
    limits: &FrameLimits,
) -> Result<Prelude, FrameError> {
    if prelude[0..2] != MAGIC {
        return Err(FrameError::BadMagic { found: [prelude[0], prelude[1]] });
    }
    if prelude[2] != VERSION {
        return Err(FrameError::UnsupportedVersion { found: prelude[2] });
    }
    let kind =
        FrameKind::from_u8(prelude[3]).ok_or(FrameError::UnknownKind { found: prelude[3] })?;
    let head_len = u32::from_le_bytes([prelude[4], prelude[5], prelude[6], prelude[7]]);
    let mut correlation = [0u8; 8];
    correlation.copy_from_slice(&prelude[8..16]);
    let part_count = u16::from_le_bytes([prelude[16], prelude[17]]);
    if head_len > limits.max_head_size {
        return Err(FrameError::HeadTooLarge {
            found: u64::from(head_len),
            limit: limits.max_head_size,
        });
    }
    if part_count > limits.max_parts {
        return Err(FrameError::TooManyParts {
            found: u64::from(part_count),
            limit: limits.max_parts,
        });
    }
    let fixed = PRELUDE_LEN as u128 + 8 * u128::from(part_count) + u128::from(head_len);
    if fixed > u128::from(limits.max_frame_size) {
        return Err(FrameError::TooLarge { found: fixed, limit: limits.max_frame_size });
    }
    Ok(Prelude { kind, head_len, correlation: u64::from_le_bytes(correlation), part_count })
}

/// Reads the next part, of `len` bytes, straight into `destination` (which must be exactly that
/// long: a pre-sized slot such as an object-store allocation).
pub async fn read_part_into<R: AsyncRead + Unpin>(
    stream: &mut R,
    index: usize,
    len: u64,
    destination: &mut [u8],
) -> Result<(), FrameError> {
    if destination.len() as u64 != len {
        return Err(FrameError::PartSize {
            index,
            declared: len,
            capacity: destination.len() as u64,
        });
    }
    read_exact(stream, destination, "parts").await
}

/// Reads the next part, of `len` bytes, into a buffer reserved once (the caller has checked
/// `len` against the frame limits through [`read_header`]); the buffer fills as bytes arrive.
pub async fn read_part<R: AsyncRead + Unpin>(
    stream: &mut R,
    len: u64,
) -> Result<Bytes, FrameError> {
    let len = usize::try_from(len)
        .map_err(|_| FrameError::TooLarge { found: u128::from(len), limit: usize::MAX as u64 })?;
    let mut buffer = Vec::with_capacity(len);
    while buffer.len() < len {
        let remaining = len - buffer.len();
        let mut window = (&mut buffer).limit(remaining);
        let n = stream.read_buf(&mut window).await.map_err(stream_error)?;
        if n == 0 {
            return Err(FrameError::Truncated { during: "parts" });
        }
    }
    Ok(Bytes::from(buffer))
}

/// Reads a whole frame, parts included. `Ok(None)` when the stream ended cleanly first.
pub async fn read_frame<R: AsyncRead + Unpin>(
    stream: &mut R,
    limits: &FrameLimits,
) -> Result<Option<Frame>, FrameError> {
    let Some(header) = read_header(stream, limits).await? else { return Ok(None) };
    let mut parts = Vec::with_capacity(header.part_lens.len());
    for &len in &header.part_lens {
        parts.push(read_part(stream, len).await?);
    }
    Ok(Some(Frame { kind: header.kind, correlation: header.correlation, head: header.head, parts }))
}

/// Reads a whole frame that must be there (a clean end of stream is a truncation).
pub async fn expect_frame<R: AsyncRead + Unpin>(
    stream: &mut R,
    limits: &FrameLimits,
) -> Result<Frame, FrameError> {
    read_frame(stream, limits).await?.ok_or(FrameError::Truncated { during: "prelude" })
}

/// Writes a frame: header buffer, then each part from its own buffer (no copy into a codec).
pub async fn write_frame(
    stream: &mut quinn::SendStream,
    frame: &Frame,
    limits: &FrameLimits,
) -> Result<(), FrameError> {
    frame.check(limits)?;
    let mut chunks = Vec::with_capacity(1 + frame.parts.len());
    chunks.push(frame.encode_header());
    chunks.extend(frame.parts.iter().filter(|p| !p.is_empty()).cloned());
    stream.write_all_chunks(&mut chunks).await.map_err(|e| FrameError::Stream(e.to_string()))
}

async fn read_exact<R: AsyncRead + Unpin>(
    stream: &mut R,
    buffer: &mut [u8],
    during: &'static str,
) -> Result<(), FrameError> {
    match stream.read_exact(buffer).await {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err(FrameError::Truncated { during })
        }
        Err(e) => Err(stream_error(e)),
    }
}

fn stream_error(error: std::io::Error) -> FrameError {
    FrameError::Stream(error.to_string())
}

#[cfg(test)]
mod tests {
    use futures::executor::block_on;
    use proptest::prelude::*;

    use super::*;

    fn limits() -> FrameLimits {
        FrameLimits { max_frame_size: 4096, max_head_size: 512, max_parts: 4 }
    }

    fn frame_strategy() -> impl Strategy<Value = Frame> {
        (
            1u8..=12,
            any::<u64>(),
            prop::collection::vec(any::<u8>(), 0..300),
            prop::collection::vec(prop::collection::vec(any::<u8>(), 0..700), 0..4),
        )
            .prop_map(|(kind, correlation, head, parts)| {
                Frame::with_parts(
                    FrameKind::from_u8(kind).unwrap(),
                    correlation,
                    head,
                    parts.into_iter().map(Bytes::from).collect(),
                )
            })
    }

    #[test]
    fn limits_are_enforced_before_allocation() {
        let mut big = Frame::new(FrameKind::Request, 1, vec![0u8; 600]).encode();
        let err = block_on(read_frame(&mut &big[..], &limits())).unwrap_err();
        assert!(matches!(err, FrameError::HeadTooLarge { found: 600, limit: 512 }), "{err}");
        // A part table that declares 2^64-1 bytes is refused before any part is read.
        big =
            Frame::with_parts(FrameKind::Request, 1, Bytes::new(), vec![Bytes::from_static(b"x")])
                .encode_header()
                .to_vec();
        big[PRELUDE_LEN..PRELUDE_LEN + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = block_on(read_frame(&mut &big[..], &limits())).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");
        let mut many = Frame::new(FrameKind::Request, 1, Bytes::new()).encode();
        many[16..18].copy_from_slice(&u16::MAX.to_le_bytes());
        let err = block_on(read_frame(&mut &many[..], &limits())).unwrap_err();
        assert!(matches!(err, FrameError::TooManyParts { found: 65535, limit: 4 }), "{err}");
        let mut bad = Frame::new(FrameKind::Request, 1, Bytes::new()).encode();
        bad[3] = 200;
        let err = block_on(read_frame(&mut &bad[..], &limits())).unwrap_err();
        assert_eq!(err.to_string(), "unknown frame kind 200");
        assert!(block_on(read_frame(&mut &b""[..], &limits())).unwrap().is_none());
    }

    #[test]
    fn parts_go_into_caller_buffers_of_the_declared_size() {
        let frame = Frame::with_parts(
            FrameKind::Request,
            9,
            Bytes::from_static(b"h"),
            vec![Bytes::from_static(b"abc"), Bytes::from_static(b"defg")],
        );
        let bytes = frame.encode();
        let mut reader = &bytes[..];
        let header = block_on(read_header(&mut reader, &limits())).unwrap().unwrap();
        assert_eq!(header.part_lens, vec![3, 4]);
        let mut first = [0u8; 3];
        block_on(read_part_into(&mut reader, 0, 3, &mut first)).unwrap();
        assert_eq!(&first, b"abc");
        let mut wrong = [0u8; 3];
        let err = block_on(read_part_into(&mut reader, 1, 4, &mut wrong)).unwrap_err();
        assert!(matches!(err, FrameError::PartSize { declared: 4, capacity: 3, .. }));
    }

    proptest! {
        #[test]
        fn frames_round_trip(frame in frame_strategy()) {
            prop_assume!(frame.check(&limits()).is_ok());
            let bytes = frame.encode();
            let decoded = block_on(read_frame(&mut &bytes[..], &limits())).unwrap().unwrap();
            prop_assert_eq!(decoded, frame);
        }

        #[test]
        fn truncated_frames_are_errors(frame in frame_strategy(), cut in any::<prop::sample::Index>()) {
            prop_assume!(frame.check(&limits()).is_ok());
            let bytes = frame.encode();
            let cut = 1 + cut.index(bytes.len() - 1);
            let result = block_on(read_frame(&mut &bytes[..cut], &limits()));
            prop_assert!(result.is_err(), "cut at {} of {} decoded", cut, bytes.len());
        }

        #[test]
        fn arbitrary_and_mutated_bytes_never_panic(
            frame in frame_strategy(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
            noise in prop::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut bytes = frame.encode();
            for (at, value) in flips {
                let i = at.index(bytes.len());
                bytes[i] = value;
            }
            let _ = block_on(read_frame(&mut &bytes[..], &limits()));
            let _ = block_on(read_frame(&mut &noise[..], &limits()));
        }
    }
}
