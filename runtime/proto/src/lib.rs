//! rtrun's wire types, the way `quinn-proto` sits beside `quinn`: the frames processes exchange
//! ([`protocol::Frame`]), the control plane's requests and answers, the specs they carry
//! (actors, tasks, placement groups), ids, errors and addresses. Data and its serde form only:
//! no async runtime, no I/O. The runtime (`rtrun`) encodes, sends and receives these, and
//! re-exports the ones its API shows; the head core (`rtrun-head-core`) decides on them.
//!
//! One thing is process-local: a [`object::StoredValue`]'s hold (its reference on the store),
//! which never travels; the runtime attaches its own when a frame arrives.

#![deny(unsafe_code)]
#![warn(unreachable_pub)]

pub mod actor;
pub mod address;
pub mod context;
pub mod env;
pub mod error;
pub mod ids;
pub mod object;
pub mod placement_group;
pub mod protocol;
pub mod task;
