//! The RLHF application on rtrun: role groups (policy, critic, reference, reward) built on the
//! runtime's actor groups, the trainer's `fit()` loop and the PPO/GRPO driver binary.
//!
//! - [`task`]: the synthetic verifiable tasks, their tokenizer and JSONL datasets.
//! - [`data`]: prompt datasets: the synthetic task or JSONL / Parquet files, chat templates.
//! - [`tokenizer`]: the tokenizer abstraction (character or Hugging Face) the trainer uses.
//! - [`config`]: the YAML config with `--set` overrides.
//! - [`warmup`]: the initial policy (tiny model + supervised warm-up).
//! - [`experience`]: rows on the wire and their padded tensor layout.
//! - [`reward`]: reward functions registered by name (`math_answer`, `format`, …), run as
//!   tasks; the remote HTTP reward.
//! - [`roles`]: the role actors (policy / reference, critic, reward model).
//! - [`placement_map`]: placement spec → actor options and colocation mode.
//! - [`trainer`]: `fit()`, experience making, PPO training, checkpoints.
//! - [`trainer_actor`]: the actor a `train` run lives in (`--detach`, `--attach`).
//! - [`run`]: a whole run as the `train` binary performs it.
//! - [`stage`]: the supervised trainers beside RL (`train --mode sft`): config, datasets,
//!   packing, the SFT loop.
//! - [`walkthrough`]: a local HF checkpoint and GSM8K-format data for the no-download walkthrough.
//!
//! This crate uses only the public runtime API (`rtrun`), never its internals.
// No `forbid(unsafe_code)`: link-time registration of actors, tasks and reward functions
// (`linkme`) declares statics with `link_section`, which that lint counts. The crate has no
// `unsafe` block.

pub mod algo;
pub mod config;
pub mod data;
pub mod error;
pub mod experience;
pub mod placement_map;
pub mod reward;
pub mod rng;
pub mod roles;
pub mod run;
pub mod stage;
pub mod task;
pub mod tokenizer;
pub mod trainer;
pub mod trainer_actor;
pub mod walkthrough;
pub mod warmup;

pub use config::{TrainConfig, WeightSyncBackend};
pub use error::{Result, TrainError};
