//! The crate's error type: one enum for credentials, TLS set-up, framing, connections and
//! remote refusals, so callers can tell an authentication failure from a malformed frame.

use std::io;
use std::path::PathBuf;

/// Anything that can go wrong in the network layer.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A credentials file is missing.
    #[error("credentials file `{path}` is missing ({what}); {hint}")]
    MissingCredential {
        /// The file looked for.
        path: PathBuf,
        /// What it should hold.
        what: &'static str,
        /// How to obtain it.
        hint: &'static str,
    },
    /// A credentials file exists but cannot be used.
    #[error("credentials file `{path}` is unusable: {reason}")]
    BadCredential {
        /// The file.
        path: PathBuf,
        /// Why it was refused (what was expected, what was found).
        reason: String,
    },
    /// No join token was given by flag, environment or file.
    #[error(
        "no join token: pass --token, set RTRUN_TOKEN, or point --token-file at the head's token file"
    )]
    MissingToken,
    /// A join token does not parse.
    #[error("malformed join token: {0}")]
    BadToken(String),
    /// Certificate generation or signing failed.
    #[error("certificate generation failed: {0}")]
    Certificate(String),
    /// A configuration value is out of range.
    #[error("invalid network configuration: {0}")]
    Config(String),
    /// The TLS configuration could not be built from the credentials.
    #[error("tls configuration failed: {0}")]
    Tls(String),
    /// A local I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A frame violated the wire format or the configured limits.
    #[error("bad frame: {0}")]
    Frame(#[from] crate::frame::FrameError),
    /// The connection could not be set up or was lost.
    #[error("connection to {peer} failed: {reason}")]
    Connection {
        /// The peer's address or name.
        peer: String,
        /// What happened.
        reason: String,
    },
    /// The peer refused us (bad credentials, wrong token, bootstrap not offered).
    #[error("refused by {peer}: {reason}")]
    Refused {
        /// The peer's address or name.
        peer: String,
        /// The peer's stated reason.
        reason: String,
    },
    /// The peer answered a request with an error frame.
    #[error("remote error from {peer}: {message}")]
    Remote {
        /// The peer's name.
        peer: String,
        /// The peer's message.
        message: String,
    },
    /// The peer sent a well-formed frame that makes no sense at this point of the exchange.
    #[error("protocol violation by {peer}: {reason}")]
    Protocol {
        /// The peer's name.
        peer: String,
        /// Expected vs found.
        reason: String,
    },
    /// An operation took longer than its configured limit.
    #[error("timed out after {after_ms} ms while {during}")]
    Timeout {
        /// What was being waited for.
        during: &'static str,
        /// The limit.
        after_ms: u128,
    },
    /// An object pull failed in its bookkeeping (bad chunk index or length).
    #[error("object pull: {0}")]
    Pull(#[from] rtrun_object_store::PullError),
    /// A call to this node's object store failed.
    #[error("object store: {0}")]
    Store(#[from] rtrun_object_store::StoreError),
    /// Pulling an object into this node's store failed; nothing of it is left in the store.
    #[error("pulling object {object} from {peer}: {source}")]
    ObjectPull {
        /// The object.
        object: rtrun_object_store::ObjectId,
        /// The node it was pulled from.
        peer: String,
        /// What went wrong.
        #[source]
        source: Box<NetError>,
    },
}

/// Result alias of the crate.
pub type Result<T, E = NetError> = std::result::Result<T, E>;

impl NetError {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> NetError {
        NetError::Io { context: context.into(), source }
    }
}
