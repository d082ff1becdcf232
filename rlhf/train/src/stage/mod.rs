//! The trainers of the stages around RL, on the same runtime, model layer, collectives,
//! checkpoints and telemetry: supervised fine-tuning (`mode: sft`; OpenRLHF's `train_sft`,
//! TRL's `SFTTrainer`), reward models on preference pairs (`mode: rm`; `train_rm`,
//! `RewardTrainer`) and DPO (`mode: dpo`; `train_dpo`, `DPOTrainer`). One driver and one config
//! style for every trainer: the YAML's `mode:` (or `train --mode`) picks it.

pub mod config;
pub mod data;
pub mod losses;
pub mod pack;
pub mod trainer;

pub use config::StageConfig;
