//! The network layer of rtrun: QUIC (quinn) between nodes with mutual TLS against a cluster CA,
//! a join token checked in the first frame of every connection, token-only bootstrap of new
//! nodes, length-prefixed multipart frames, chunked resumable object pulls, and heartbeat
//! failure detection.
//!
//! How the runtime uses it: the head loads or creates its credentials
//! ([`CredentialsDir::load_or_create_head`]) and binds an [`Endpoint`] with the CA
//! ([`EndpointOptions::authority`]), its object store as [`ObjectSource`] ([`StoreSource`]) and a
//! [`HeartbeatMonitor`]. A joining node either loads credentials or calls [`bootstrap()`] with the
//! token, saves them, binds its own endpoint and [`Endpoint::connect`]s to the head, then
//! [`Connection::start_heartbeats`]. Control messages travel as [`Connection::request`] with the
//! runtime's own encoded head; objects move by [`pull_into_store`] ([`Connection::open_pull`]
//! into object-store allocations using the store's
//! [`PullState`](rtrun_object_store::PullState)).
//!
//! The crate does not depend on `rtrun`; only [`frame`] knows the wire format.

#![forbid(unsafe_code)]

pub mod bootstrap;
pub mod config;
pub mod connection;
pub mod credentials;
pub mod endpoint;
pub mod error;
pub mod failure;
pub mod frame;
pub mod heartbeat;
pub mod protocol;
pub mod pull;
pub mod store_transfer;
pub mod tls;

pub use bootstrap::{bootstrap, bootstrap_with_validity};
pub use config::NetConfig;
pub use connection::{
    Connection, HeartbeatSender, IncomingChannel, IncomingRequest, ObjectSource, Responder,
};
pub use credentials::{
    CLUSTER_SERVER_NAME, ClusterAuthority, CredentialsDir, HeadCredentials, JoinToken,
    NodeCredentials, TOKEN_ENV,
};
pub use endpoint::{Endpoint, EndpointOptions};
pub use error::{NetError, Result};
pub use failure::{FailureDetector, HeartbeatConfig, HeartbeatOutcome};
pub use frame::{Frame, FrameError, FrameKind, FrameLimits};
pub use heartbeat::HeartbeatMonitor;
pub use pull::ObjectPull;
pub use store_transfer::{StoreSource, pull_into_store};
