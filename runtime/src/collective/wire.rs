//! The collectives' wire format: the rendezvous frames (length-prefixed values through the
//! runtime codec) and the fixed 24-byte header that precedes every ring message.
//!
//! Ring header: magic `RTCL` (u32), operation (u8), 3 zero bytes, the collective's sequence
//! number (u64), payload length (u64), all little-endian. The sequence number and operation let
//! a rank notice that its neighbour is running a different collective.

use std::io::{Read, Write};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// First four bytes of every ring header and value of every rendezvous frame's `magic`.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"RTCL");

/// Bytes of a ring header.
pub(crate) const HEADER_BYTES: usize = 24;

/// The largest rendezvous frame accepted (a table of many ranks' addresses fits easily).
pub(crate) const MAX_FRAME_BYTES: usize = 1 << 20;

/// Which collective a ring message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Op {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
    ReduceScatter = 4,
    AllGatherChunks = 5,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::Broadcast => "broadcast",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGatherChunks => "all_gather_into",
        }
    }

    fn from_code(code: u8) -> Option<Op> {
        match code {
            1 => Some(Op::AllReduce),
            2 => Some(Op::Broadcast),
            3 => Some(Op::AllGather),
            4 => Some(Op::ReduceScatter),
            5 => Some(Op::AllGatherChunks),
            _ => None,
        }
    }
}

/// A decoded ring header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) op: Op,
    pub(crate) seq: u64,
    pub(crate) len: u64,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4] = self.op as u8;
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes a header, describing what is wrong with a malformed one.
    pub(crate) fn decode(bytes: &[u8; HEADER_BYTES]) -> Result<Header, String> {
        let word = |range: std::ops::Range<usize>| {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(&bytes[range]);
            u64::from_le_bytes(raw)
        };
        let magic = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        if magic != MAGIC {
            return Err(format!("expected a collective message header, found magic {magic:#010x}"));
        }
        let op = Op::from_code(bytes[4])
            .ok_or_else(|| format!("unknown collective operation code {}", bytes[4]))?;
        Ok(Header { op, seq: word(8..16), len: word(16..24) })
    }
}

/// A rank's announcement to the master.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Hello {
    pub(crate) magic: u32,
    pub(crate) group: String,
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    /// Where this rank accepts its left neighbour's ring connection.
    pub(crate) ring_addr: String,
}

/// The master's answer to a [`Hello`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum MasterReply {
    /// Everyone joined: the ring addresses by rank and a nonce that identifies this rendezvous.
    Table { nonce: u64, ring_addrs: Vec<String> },
    /// The rendezvous failed.
    Reject { reason: String },
}

/// The first frame on a ring connection.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RingHello {
    pub(crate) magic: u32,
    pub(crate) group: String,
    pub(crate) nonce: u64,
    pub(crate) from_rank: usize,
}

/// Writes a length-prefixed value.
pub(crate) fn write_frame<T: Serialize>(mut stream: impl Write, value: &T) -> Result<(), String> {
    let bytes = crate::codec::encode(value).map_err(|e| e.to_string())?;
    let len = u32::try_from(bytes.len())
        .map_err(|_| format!("frame of {} bytes is too large", bytes.len()))?;
    let mut frame = Vec::with_capacity(4 + bytes.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&bytes);
    stream.write_all(&frame).map_err(|e| format!("cannot send: {e}"))
}

/// Reads a length-prefixed value of at most [`MAX_FRAME_BYTES`].
pub(crate) fn read_frame<T: DeserializeOwned>(mut stream: impl Read) -> Result<T, String> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(|e| format!("cannot receive: {e}"))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(format!("frame of {len} bytes exceeds the limit of {MAX_FRAME_BYTES}"));
    }
    let mut bytes = vec![0u8; len];
    stream.read_exact(&mut bytes).map_err(|e| format!("cannot receive: {e}"))?;
    crate::codec::decode(&bytes).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn headers_round_trip(code in 1u8..4, seq: u64, len: u64) {
            let op = Op::from_code(code).unwrap();
            let header = Header { op, seq, len };
            prop_assert_eq!(Header::decode(&header.encode()).unwrap(), header);
        }

        #[test]
        fn garbage_headers_are_errors_not_panics(bytes in proptest::array::uniform24(any::<u8>())) {
            if let Ok(h) = Header::decode(&bytes) {
                prop_assert_eq!(h.encode(), {
                    let mut canonical = bytes;
                    canonical[5..8].fill(0);
                    canonical
                });
            }
        }

        #[test]
        fn garbage_frames_are_errors_not_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = read_frame::<Hello>(bytes.as_slice());
            let _ = read_frame::<MasterReply>(bytes.as_slice());
        }
    }

    #[test]
    fn frames_round_trip_and_oversized_frames_are_rejected() {
        let mut buf = Vec::new();
        let hello = Hello {
            magic: MAGIC,
            group: "g".into(),
            rank: 3,
            world_size: 4,
            ring_addr: "1.2.3.4:5".into(),
        };
        write_frame(&mut buf, &hello).unwrap();
        let back: Hello = read_frame(buf.as_slice()).unwrap();
        assert_eq!((back.rank, back.world_size, back.ring_addr.as_str()), (3, 4, "1.2.3.4:5"));
        let huge = ((MAX_FRAME_BYTES + 1) as u32).to_le_bytes();
        let err = read_frame::<Hello>(huge.as_slice()).unwrap_err();
        assert!(err.contains("exceeds the limit"), "{err}");
    }
}
