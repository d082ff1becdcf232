//! The RLHF application on rtrun: role groups (policy, critic, reference, reward) built on the
//! runtime's actor groups, the trainer's `fit()` loop and the PPO/GRPO driver binary.
//!
//! This crate uses only the public runtime API (`rtrun`), never its internals.
#![forbid(unsafe_code)]
