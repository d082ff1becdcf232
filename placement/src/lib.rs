//! Placement logic for rtrun: resource quantities and sets, and (as it grows) GPU instances,
//! placement groups and the colocation specs that map role groups onto them.
//!
//! Everything here is pure: no I/O, no clocks, no threads. The runtime feeds it the cluster's
//! state and gets decisions back, which is what makes it property-testable.
#![forbid(unsafe_code)]

pub mod resources;

pub use resources::{Quantity, QuantityError, ResourceSet, CPU, GPU, MEMORY};
