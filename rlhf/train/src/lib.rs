//! The RLHF application on rtrun: role groups (policy, critic, reference, reward) built on the
//! runtime's actor groups, the trainer's `fit()` loop and the PPO/GRPO driver binary.
//!
//! - [`task`]: the synthetic verifiable tasks, their tokenizer and JSONL datasets.
//! - [`config`]: the YAML config with `--set` overrides.
//! - [`warmup`]: the initial policy (tiny model + supervised warm-up).
//! - [`experience`]: rows on the wire and their padded tensor layout.
//! - [`reward`]: reward functions registered by name, run as tasks.
//!
//! This crate uses only the public runtime API (`rtrun`), never its internals.
// No `forbid(unsafe_code)`: link-time registration of actors, tasks and reward functions
// (`linkme`) declares statics with `link_section`, which that lint counts. The crate has no
// `unsafe` block.

pub mod algo;
pub mod config;
pub mod error;
pub mod experience;
pub mod reward;
pub mod rng;
// pub mod roles;
pub mod task;
pub mod warmup;
// pub mod weights;

pub use config::TrainConfig;
pub use error::{Result, TrainError};
