//! The trainers of the stages around RL, on the same runtime, model layer, collectives,
//! checkpoints and telemetry: supervised fine-tuning (`train --mode sft`; OpenRLHF's
//! `train_sft`, TRL's `SFTTrainer`). One driver and one config style for every trainer: the
//! YAML's `mode:` picks it.

pub mod config;
pub mod data;
pub mod pack;
pub mod sft;

pub use config::StageConfig;
