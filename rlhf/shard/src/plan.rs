//! Which parameters form each flat unit, where each lies in its unit's flat buffer, and which
//! slice of every unit each rank owns. Pure bookkeeping over names and shapes: no tensors.
//!
//! A unit is a model segment ([`Segment`]): the embedding, one decoder layer, or the head (the
//! final norm, the LM head or scalar head). Its parameters are laid end to end in one flat
//! buffer, padded to a multiple of the world size, so a gather or a reduce-scatter is one
//! collective per unit and every rank's shard has the same length (DeepSpeed's and FSDP's
//! flat parameters).

use serde::{Deserialize, Serialize};

use rtrun_rlhf_model::layerwise::Segment;

use crate::error::{Result, ShardError};

/// One parameter's place in its unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberPlan {
    /// The Hugging Face name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// First element in the unit's flat buffer.
    pub offset: usize,
    /// Elements.
    pub numel: usize,
}

impl MemberPlan {
    /// Whether AdamW's decoupled weight decay applies (matrices, not norms or biases).
    pub fn decays(&self) -> bool {
        self.shape.len() > 1
    }

    /// The member's range in the flat buffer.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// One flat unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitPlan {
    /// `model.embed_tokens`, `model.layers.<i>` or `head`.
    pub name: String,
    /// Its parameters in registration order.
    pub members: Vec<MemberPlan>,
    /// Elements of all members.
    pub numel: usize,
    /// `numel` rounded up to a multiple of the world size.
    pub padded: usize,
    /// Whether its parameters train. A trained model with frozen parameters (LoRA: the base
    /// weights) keeps them in units of their own, which are gathered as the others but have
    /// no gradient shard, no optimizer state and no reduction.
    #[serde(default = "trains_default")]
    pub trains: bool,
}

fn trains_default() -> bool {
    true
}

impl UnitPlan {
    /// Elements of each rank's shard.
    pub fn shard_len(&self, world_size: usize) -> usize {
        self.padded / world_size.max(1)
    }

    /// `rank`'s range of the flat buffer.
    pub fn shard_range(&self, world_size: usize, rank: usize) -> std::ops::Range<usize> {
        let len = self.shard_len(world_size);
        rank * len..(rank + 1) * len
    }
}

/// Every unit of a model and the segments that read each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// Units: the embedding's first, then each layer's in order, then the head's. A segment
    /// whose parameters all train, or all are frozen, is one unit named after it; a segment
    /// with both has its frozen unit under that name and its trained one beside it, named
    /// with a `.trained` suffix.
    pub units: Vec<UnitPlan>,
    /// Ranks the units are padded for.
    pub world_size: usize,
    /// The units of each segment: the embedding, the layers in order, then the head (empty
    /// when the model has no head parameters).
    segments: Vec<Vec<usize>>,
    /// Decoder layers.
    layers: usize,
    /// Whether the head also reads the embedding matrix (tied embeddings).
    tied: bool,
}

/// The segment a parameter belongs to, from its Hugging Face name.
pub fn segment_of(name: &str) -> Segment {
    if name.starts_with("model.embed_tokens.") {
        return Segment::Embedding;
    }
    if let Some(rest) = name.strip_prefix("model.layers.")
        && let Some((index, _)) = rest.split_once('.')
        && let Ok(index) = index.parse::<usize>()
    {
        return Segment::Layer(index);
    }
    Segment::Head
}

impl ShardPlan {
    /// Groups `params` (name and shape, in registration order, all trained) into units for
    /// `world_size` ranks; `tied` says the head reads the embedding matrix.
    pub fn new(params: &[(String, Vec<i64>)], world_size: usize, tied: bool) -> Result<Self> {
        Self::with_frozen(params, &|_| false, world_size, tied)
    }

    /// [`ShardPlan::new`] where the parameters `frozen` names do not train: in a segment with
    /// both kinds, they form a unit of their own.
    pub fn with_frozen(
        params: &[(String, Vec<i64>)],
        frozen: &dyn Fn(&str) -> bool,
        world_size: usize,
        tied: bool,
    ) -> Result<Self> {
        if world_size == 0 {
            return Err(ShardError::Config("the world size should be at least 1, found 0".into()));
        }
        let layers = params
            .iter()
            .filter_map(|(n, _)| match segment_of(n) {
                Segment::Layer(i) => Some(i + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let segment_name = |index: usize| match index {
            0 => "model.embed_tokens".to_owned(),
            i if i <= layers => format!("model.layers.{}", i - 1),
            _ => "head".to_owned(),
        };
        // Per segment: its frozen members and its trained ones.
        let mut groups: Vec<[Vec<MemberPlan>; 2]> = vec![Default::default(); layers + 2];
        for (name, shape) in params {
            let index = match segment_of(name) {
                Segment::Embedding => 0,
                Segment::Layer(i) => i + 1,
                Segment::Head => layers + 1,
            };
            let numel = shape.iter().try_fold(1usize, |acc, &d| {
                usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
            });
            let numel = numel.ok_or_else(|| {
                ShardError::Config(format!("parameter `{name}` has an invalid shape {shape:?}"))
            })?;
            let trains = !frozen(name);
            let members = &mut groups[index][usize::from(trains)];
            let offset = members.last().map_or(0, |m: &MemberPlan| m.offset + m.numel);
            members.push(MemberPlan { name: name.clone(), shape: shape.clone(), offset, numel });
        }
        if groups[0].iter().all(Vec::is_empty) {
            return Err(ShardError::Config(
                "the model should have `model.embed_tokens.weight`, found no such parameter".into(),
            ));
        }
        if let Some(empty) = (1..=layers).find(|&i| groups[i].iter().all(Vec::is_empty)) {
            return Err(ShardError::Config(format!("`{}` has no parameters", segment_name(empty))));
        }
        let mut units = Vec::new();
        let mut segments = Vec::with_capacity(layers + 2);
        for (index, [frozen, trained]) in groups.into_iter().enumerate() {
            let mixed = !frozen.is_empty() && !trained.is_empty();
            let mut of_segment = Vec::new();
            for (members, trains) in [(frozen, false), (trained, true)] {
                if members.is_empty() {
                    continue;
                }
                let name = match mixed && trains {
                    true => format!("{}.trained", segment_name(index)),
                    false => segment_name(index),
                };
                let numel = members.iter().map(|m| m.numel).sum::<usize>();
                let padded = numel.div_ceil(world_size) * world_size;
                of_segment.push(units.len());
                units.push(UnitPlan { name, members, numel, padded, trains });
            }
            segments.push(of_segment);
        }
        Ok(Self { units, world_size, segments, layers, tied })
    }

    /// The units a segment reads, in gather order.
    pub fn units_of(&self, segment: Segment) -> Vec<usize> {
        match segment {
            Segment::Embedding => self.segments[0].clone(),
            Segment::Layer(i) if i < self.layers => self.segments[i + 1].clone(),
            Segment::Layer(_) => Vec::new(),
            Segment::Head => {
                let mut units = self.segments[self.layers + 1].clone();
                if self.tied {
                    units.extend(&self.segments[0]);
                }
                units
            }
        }
    }

    /// Decoder layers.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Whether some parameters are frozen while others train.
    pub fn has_frozen_units(&self) -> bool {
        self.units.iter().any(|u| !u.trains) && self.units.iter().any(|u| u.trains)
    }

    /// Elements of all parameters.
    pub fn numel(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// The largest unit's padded elements (what ZeRO-3 holds gathered at once, beside the
    /// head's).
    pub fn largest_unit(&self) -> usize {
        self.units.iter().map(|u| u.padded).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Vec<(String, Vec<i64>)> {
        let mut p = vec![("model.embed_tokens.weight".to_string(), vec![10, 4])];
        for i in 0..2 {
            p.push((format!("model.layers.{i}.self_attn.q_proj.weight"), vec![4, 4]));
            p.push((format!("model.layers.{i}.input_layernorm.weight"), vec![4]));
        }
        p.push(("model.norm.weight".into(), vec![4]));
        p.push(("lm_head.weight".into(), vec![10, 4]));
        p
    }

    #[test]
    fn units_follow_segments_and_pad_to_the_world() {
        let plan = ShardPlan::new(&params(), 3, false).unwrap();
        let names: Vec<&str> = plan.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["model.embed_tokens", "model.layers.0", "model.layers.1", "head"]);
        assert_eq!((plan.units[1].numel, plan.units[1].padded), (20, 21));
        assert_eq!(plan.units[1].members[1].offset, 16);
        assert_eq!(plan.units[1].shard_range(3, 2), 14..21);
        assert_eq!((plan.units[3].numel, plan.units[3].padded), (44, 45));
        assert_eq!(plan.units_of(Segment::Layer(1)), vec![2]);
        assert_eq!(plan.units_of(Segment::Head), vec![3]);
        assert_eq!(plan.numel(), 40 + 40 + 44);
        assert!(plan.units[1].members[0].decays() && !plan.units[1].members[1].decays());
    }

    #[test]
    fn a_tied_head_reads_the_embedding_too() {
        let mut p = params();
        p.pop();
        let plan = ShardPlan::new(&p, 2, true).unwrap();
        assert_eq!(plan.units_of(Segment::Head), vec![3, 0]);
        assert_eq!(plan.units[3].members.len(), 1);
    }

    #[test]
    fn bad_shapes_and_missing_parts_are_named() {
        let mut p = params();
        p[1].1 = vec![4, -1];
        let err = ShardPlan::new(&p, 2, false).unwrap_err().to_string();
        assert!(err.contains("model.layers.0.self_attn.q_proj.weight"), "{err}");
        let err = ShardPlan::new(&params()[1..], 2, false).unwrap_err().to_string();
        assert!(err.contains("embed_tokens"), "{err}");
        assert!(ShardPlan::new(&params(), 0, false).is_err());
    }

    #[test]
    fn frozen_parameters_get_units_of_their_own_beside_the_trained_ones() {
        let mut p = params();
        p.insert(2, ("model.layers.0.self_attn.q_proj.lora_A.weight".into(), vec![2, 4]));
        p.insert(3, ("model.layers.0.self_attn.q_proj.lora_B.weight".into(), vec![4, 2]));
        let plan = ShardPlan::with_frozen(&p, &|n| !n.contains(".lora_"), 2, false).unwrap();
        let names: Vec<&str> = plan.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.embed_tokens",
                "model.layers.0",
                "model.layers.0.trained",
                "model.layers.1",
                "head"
            ]
        );
        let trains: Vec<bool> = plan.units.iter().map(|u| u.trains).collect();
        assert_eq!(trains, [false, false, true, false, false]);
        assert_eq!(plan.units_of(Segment::Layer(0)), vec![1, 2]);
        assert_eq!(plan.units_of(Segment::Layer(1)), vec![3]);
        assert_eq!(plan.units_of(Segment::Head), vec![4]);
        assert_eq!((plan.units[2].numel, plan.units[2].members[1].offset), (16, 8));
        assert_eq!(plan.units[1].members[1].offset, 16);
        assert!(plan.has_frozen_units());
        assert!(!ShardPlan::new(&p, 2, false).unwrap().has_frozen_units());
    }
}
