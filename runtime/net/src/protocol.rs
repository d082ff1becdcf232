//! The network layer's own messages (the heads of its control frames), encoded with bitcode.
//! Application requests carry opaque heads the runtime encodes itself.

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::frame::{Frame, FrameError, FrameKind};

/// The version of this message set, checked in [`Hello`] and [`BootstrapRequest`].
pub const PROTOCOL_VERSION: u32 = 2;

/// The first frame on a connection from a certified peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol: u32,
    /// The join token's secret.
    pub token_secret: Vec<u8>,
}

/// The answer to a valid hello.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The accepting node's name.
    pub node_name: String,
}

/// A node holding only the join token asks the head for a certificate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapRequest {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol: u32,
    /// The join token's secret.
    pub token_secret: Vec<u8>,
    /// The name the node wants in its certificate.
    pub node_name: String,
    /// A PKCS#10 certificate signing request (DER) for the key the node made for itself.
    pub csr_der: Vec<u8>,
    /// A validity shorter than a node's, in seconds, for a short-lived client (`None`: a
    /// node's). The head never issues longer than a node's validity.
    pub validity_s: Option<u64>,
}

/// The head's answer to a valid bootstrap request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Issued {
    /// The node's new certificate (DER).
    pub cert_der: Vec<u8>,
    /// The cluster CA certificate (DER).
    pub ca_der: Vec<u8>,
}

/// The head of an error frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for the peer's logs and error messages.
    pub message: String,
}

/// One heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Counts up from 0 on each heartbeat stream.
    pub sequence: u64,
}

/// Opens an object pull stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullOpen {
    /// The object.
    pub object: u128,
    /// Bytes per chunk (the puller's [`rtrun_object_store::PullConfig::chunk_size`]).
    pub chunk_size: u64,
}

/// The answer to a pull open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullMeta {
    /// The object's size in bytes.
    pub size: u64,
}

/// Chunks the puller wants next.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullWant {
    /// Chunk numbers.
    pub chunks: Vec<u64>,
}

/// The head of a chunk frame; its single part is the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullChunk {
    /// Chunk number.
    pub index: u64,
}

/// A frame of `kind` whose head is `message`.
pub fn frame<M: Serialize>(kind: FrameKind, correlation: u64, message: &M) -> Frame {
    // bitcode fails only on serde features these plain structs do not use.
    let head = bitcode::serialize(message).expect("protocol messages are plain bitcode structs");
    Frame::new(kind, correlation, Bytes::from(head))
}

/// An error frame answering `correlation`.
pub fn error_frame(correlation: u64, message: impl Into<String>) -> Frame {
    frame(FrameKind::Error, correlation, &ErrorBody { message: message.into() })
}

/// Decodes the head of `frame` as `M` after checking its kind; an error frame becomes its
/// message in `Err(Ok(..))` so callers can report the peer's words.
pub fn decode<M: DeserializeOwned>(
    frame: &Frame,
    expected: FrameKind,
) -> Result<M, Result<String, FrameError>> {
    if frame.kind == FrameKind::Error {
        let body: Result<ErrorBody, _> = bitcode::deserialize(&frame.head);
        return Err(match body {
            Ok(body) => Ok(body.message),
            Err(e) => Err(FrameError::BadHead { kind: FrameKind::Error, reason: e.to_string() }),
        });
    }
    if frame.kind != expected {
        return Err(Err(FrameError::UnexpectedKind { expected, found: frame.kind }));
    }
    decode_head(frame).map_err(Err)
}

/// Decodes the head of `frame` as `M` (no kind check).
pub fn decode_head<M: DeserializeOwned>(frame: &Frame) -> Result<M, FrameError> {
    bitcode::deserialize(&frame.head)
        .map_err(|e| FrameError::BadHead { kind: frame.kind, reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_heads_are_errors() {
        let want = PullWant { chunks: vec![1, 2, 3] };
        let f = frame(FrameKind::PullWant, 4, &want);
        assert_eq!(decode::<PullWant>(&f, FrameKind::PullWant).unwrap(), want);
        assert!(matches!(
            decode::<PullWant>(&f, FrameKind::PullMeta),
            Err(Err(FrameError::UnexpectedKind { .. }))
        ));
        let e = error_frame(4, "no such object");
        assert!(matches!(
            decode::<PullWant>(&e, FrameKind::PullWant),
            Err(Ok(message)) if message == "no such object"
        ));
        let garbage = Frame::new(FrameKind::PullWant, 4, Bytes::from_static(&[0xff; 3]));
        assert!(matches!(decode::<PullWant>(&garbage, FrameKind::PullWant), Err(Err(_))));
    }
}
