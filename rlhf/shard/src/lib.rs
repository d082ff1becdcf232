//! Sharded data parallelism for the RLHF roles: ZeRO stages 1-3 (DeepSpeed's names, what
//! OpenRLHF runs with `--zero_stage`; stage 3 is what verl and TRL call FSDP's full shard) and
//! activation checkpointing, over a data-parallel group's collective.
//!
//! - [`plan`]: the flat units (embedding, each decoder layer, head) and every rank's shard.
//! - [`ShardedModel`]: a rank's view of one model at a [`ZeroStage`] — the hooks installed on
//!   the model's [`rtrun_rlhf_model::Backbone`] that gather a unit before it is read and
//!   release it after (stage 3) and reduce-scatter its gradients as soon as its backward is
//!   done (stages 2-3), the optimizer step (stage 0: all-reduce and AdamW as before; 1-3:
//!   AdamW on the rank's shards), pass balancing between ranks, sharded checkpoints that
//!   resume on another number of ranks, and the bytes held.
//! - [`manager`]: the sharding manager of a colocated (hybrid-engine) rank — per-dtype flat
//!   buffers of the parameters, gradients and AdamW moments, and the train / infer / forward
//!   state machine that offloads them to host memory and back.
//!
//! Every rank must run the same sequence of forwards and backwards (the collectives are
//! issued per segment): [`ShardedModel::balance`] and the idle passes make ranks with fewer
//! micro-batches take part in the others' collectives.

// Denied, not forbidden: `device` (NCCL on a tensor's memory, feature `cuda`) allows it.
#![deny(unsafe_code)]

pub mod checkpoint;
mod comm;
#[cfg(feature = "cuda")]
pub mod device;
mod error;
pub mod manager;
mod model;
mod optim;
pub mod plan;
mod state;

pub use comm::GroupComm;
pub use error::{Result, ShardError};
pub use model::{ShardConfig, ShardedModel};
pub use state::{HeldBytes, ShardStats};

use serde::{Deserialize, Serialize};

/// What a data-parallel rank shards (`train.zero_stage`, OpenRLHF's `--zero_stage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ZeroStage {
    /// Every rank holds the whole model, its gradients and optimizer state (plain DDP).
    #[default]
    Zero,
    /// AdamW's moments are sharded.
    One,
    /// Also the gradients: reduce-scattered into the rank's shard as the backward goes.
    Two,
    /// Also the parameters: a unit is gathered just before it is read and freed after.
    Three,
}

impl ZeroStage {
    /// The stage numbered `n`.
    pub fn from_number(n: u64) -> Option<Self> {
        match n {
            0 => Some(Self::Zero),
            1 => Some(Self::One),
            2 => Some(Self::Two),
            3 => Some(Self::Three),
            _ => None,
        }
    }

    /// Its number.
    pub fn number(self) -> u8 {
        match self {
            Self::Zero => 0,
            Self::One => 1,
            Self::Two => 2,
            Self::Three => 3,
        }
    }
}

impl std::fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.number())
    }
}

impl Serialize for ZeroStage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.number())
    }
}

impl schemars::JsonSchema for ZeroStage {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ZeroStage".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "anyOf": [
                {"type": "integer", "enum": [0, 1, 2, 3]},
                {"enum": ["no_shard", "shard_grad_op", "full_shard", "fsdp", "fsdp2"]}
            ]
        })
    }
}

/// `0`–`3`, or verl's spellings: `fsdp` / `fsdp2` / `full_shard` (stage 3), `shard_grad_op`
/// (stage 2), `no_shard` (stage 0).
impl<'de> Deserialize<'de> for ZeroStage {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ZeroStage;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a ZeRO stage 0, 1, 2 or 3 (or `fsdp`, `shard_grad_op`, `no_shard`)")
            }

            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ZeroStage, E> {
                ZeroStage::from_number(v).ok_or_else(|| {
                    E::custom(format!("zero_stage should be 0, 1, 2 or 3, found {v}"))
                })
            }

            fn visit_u8<E: serde::de::Error>(self, v: u8) -> Result<ZeroStage, E> {
                self.visit_u64(u64::from(v))
            }

            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ZeroStage, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => {
                        Err(E::custom(format!("zero_stage should be 0, 1, 2 or 3, found {v}")))
                    }
                }
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ZeroStage, E> {
                match v.to_ascii_lowercase().as_str() {
                    "0" | "no_shard" => Ok(ZeroStage::Zero),
                    "1" => Ok(ZeroStage::One),
                    "2" | "shard_grad_op" => Ok(ZeroStage::Two),
                    "3" | "fsdp" | "fsdp2" | "full_shard" => Ok(ZeroStage::Three),
                    _ => Err(E::custom(format!(
                        "zero_stage should be 0, 1, 2 or 3 (or `fsdp`, `shard_grad_op`, \
                         `no_shard`), found `{v}`"
                    ))),
                }
            }
        }
        if d.is_human_readable() {
            d.deserialize_any(Visitor)
        } else {
            // Binary codecs (the runtime's) are not self-describing: the number it was written as.
            d.deserialize_u8(Visitor)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_parse_from_numbers_and_verl_names() {
        let parse = |s: &str| serde_json::from_str::<ZeroStage>(s);
        assert_eq!(parse("3").unwrap(), ZeroStage::Three);
        assert_eq!(parse("\"fsdp\"").unwrap(), ZeroStage::Three);
        assert_eq!(parse("\"shard_grad_op\"").unwrap(), ZeroStage::Two);
        assert_eq!(parse("0").unwrap(), ZeroStage::Zero);
        let err = parse("4").unwrap_err().to_string();
        assert!(err.contains("0, 1, 2 or 3") && err.contains('4'), "{err}");
        assert!(parse("-1").is_err() && parse("\"zero9\"").is_err());
        assert_eq!(serde_json::to_string(&ZeroStage::Two).unwrap(), "2");
        // The runtime's binary codec (not self-describing) round-trips it too.
        let bytes = bitcode::serialize(&ZeroStage::Three).unwrap();
        assert_eq!(bitcode::deserialize::<ZeroStage>(&bytes).unwrap(), ZeroStage::Three);
    }
}
