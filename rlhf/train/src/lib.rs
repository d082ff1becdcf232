//! The RLHF application on rtrun: role groups (policy, critic, reference, reward) built on the
//! runtime's actor groups, the trainer's `fit()` loop and the PPO/GRPO driver binary.
//!
//! - [`prompts`]: prompt records and the seeded, resumable order a run draws them in.
//! - [`data`]: prompt datasets: the synthetic task or JSONL / Parquet files, chat templates.
//! - [`tokenizer`]: the tokenizer abstraction (character or Hugging Face) the trainer uses.
//! - [`config`]: the YAML config with `--set` overrides.
//! - [`experience`]: rows on the wire and their padded tensor layout.
//! - [`python_reward`]: `reward.kind: python`, Python reward functions in worker processes.
//! - [`reward`]: reward functions registered by name (`math_answer`, `format`, …), run as
//!   tasks; the remote HTTP reward.
//! - [`roles`]: the role actors (policy / reference, critic, reward model).
//! - [`paths`]: the layout of a run directory.
//! - [`placement_map`]: placement spec → actor options and colocation mode.
//! - [`trainer`]: `fit()`, experience making, PPO training, checkpoints.
//! - [`trainer_actor`]: the actor a `train` run lives in (`--detach`, `--attach`).
//! - [`run`]: a whole run as the `train` binary performs it.
//! - [`stage`]: the supervised trainers beside RL (`train --mode sft`): config, datasets,
//!   packing, the SFT loop.
//! - [`demo`]: the no-download demo: synthetic digit tasks, their character tokenizer, the tiny
//!   initial policy's warm-up, and the walkthrough's local HF checkpoint and GSM8K-format data.
//!
//! This crate uses only the public runtime API (`rtrun`), never its internals.
// No `forbid(unsafe_code)`: link-time registration of actors, tasks and reward functions
// (`linkme`) declares statics with `link_section`, which that lint counts. The crate has no
// `unsafe` block.

pub mod algo;
pub mod config;
pub mod data;
pub mod demo;
pub mod error;
pub mod experience;
pub mod paths;
pub mod placement_map;
pub mod prompts;
pub mod python_reward;
pub mod reward;
pub mod rng;
pub mod roles;
pub mod run;
pub mod stage;
pub mod tokenizer;
pub mod tools;
pub mod trainer;
pub mod trainer_actor;

pub use config::{TrainConfig, WeightSyncBackend};
pub use error::{Result, TrainError};
