//! Resharding: the training layout (whole Hugging Face tensors, as the policy holds them once
//! gathered) to one tensor-parallel rank's engine layout, and back. Pure functions on tensors:
//! no I/O, no communication.
//!
//! The name map (Hugging Face name → engine name, vLLM's stacked parameters):
//!
//! | training (HF) name                         | split       | engine name              |
//! |--------------------------------------------|-------------|--------------------------|
//! | `…self_attn.q_proj.{weight,bias}`          | column      | `…self_attn.qkv_proj.*`  |
//! | `…self_attn.{k,v}_proj.{weight,bias}`      | column, kv  | `…self_attn.qkv_proj.*`  |
//! | `…self_attn.o_proj.weight`                 | row         | same                     |
//! | `…mlp.{gate,up}_proj.{weight,bias}`        | column      | `…mlp.gate_up_proj.*`    |
//! | `…mlp.down_proj.weight`                    | row         | same                     |
//! | `…{o,down}_proj.bias`                      | rank 0 only | same (zeros elsewhere)   |
//! | norms, `embed_tokens`, `lm_head`           | replicated  | same                     |
//!
//! Column-parallel tensors keep the rank's rows (its heads, or its slice of the MLP), row-
//! parallel ones its columns; a row-parallel bias is added once, by rank 0, before the
//! all-reduce sums the ranks' partial outputs. The packed `qkv_proj` is the rank's q, k and v
//! rows stacked in that order, `gate_up_proj` its gate then up rows.

use std::collections::HashMap;

use tch::Tensor;

use crate::api::WeightBucket;
use crate::error::EngineError;
use crate::tp::layout::TpLayout;

/// How a parameter splits over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Query projection rows (weight and bias): the rank's heads.
    Query,
    /// Key or value projection rows: the rank's key/value heads (some replicated).
    KeyValue,
    /// Gate or up projection rows: the rank's slice of the intermediate width.
    Intermediate,
    /// `o_proj.weight` columns: the rank's heads' inputs.
    AttentionOut,
    /// `down_proj.weight` columns: the rank's slice of the intermediate width.
    MlpOut,
    /// `o_proj.bias` / `down_proj.bias`: whole on rank 0, zeros on the others.
    RowBias,
    /// The same tensor on every rank.
    Replicated,
}

/// Which member of a packed engine parameter a training parameter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packed {
    /// `q_proj` (first rows of `qkv_proj`).
    Q,
    /// `k_proj`.
    K,
    /// `v_proj` (last rows of `qkv_proj`).
    V,
    /// `gate_proj` (first rows of `gate_up_proj`).
    Gate,
    /// `up_proj`.
    Up,
}

impl Packed {
    /// The three or two members of the packed parameter this one belongs to, in row order.
    pub fn members(self) -> &'static [Packed] {
        match self {
            Packed::Q | Packed::K | Packed::V => &[Packed::Q, Packed::K, Packed::V],
            Packed::Gate | Packed::Up => &[Packed::Gate, Packed::Up],
        }
    }

    /// The training (HF) projection name of the member.
    pub fn projection(self) -> &'static str {
        match self {
            Packed::Q => "q_proj",
            Packed::K => "k_proj",
            Packed::V => "v_proj",
            Packed::Gate => "gate_proj",
            Packed::Up => "up_proj",
        }
    }
}

/// A training parameter's place in the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineParam {
    /// The engine-side name (a packed name for q/k/v and gate/up).
    pub name: String,
    /// How the parameter splits.
    pub split: Split,
    /// Its member of the packed parameter, if packed.
    pub packed: Option<Packed>,
}

/// The engine name and split of the training (Hugging Face) parameter `name`.
pub fn engine_param(name: &str) -> EngineParam {
    let (stem, leaf) = name.rsplit_once('.').unwrap_or((name, ""));
    let (prefix, projection) = stem.rsplit_once('.').unwrap_or(("", stem));
    let packed = |member: Packed, packed_name: &str, split: Split| EngineParam {
        name: format!("{prefix}.{packed_name}.{leaf}"),
        split,
        packed: Some(member),
    };
    let plain = |split: Split| EngineParam { name: name.to_owned(), split, packed: None };
    match (projection, leaf) {
        ("q_proj", _) => packed(Packed::Q, "qkv_proj", Split::Query),
        ("k_proj", _) => packed(Packed::K, "qkv_proj", Split::KeyValue),
        ("v_proj", _) => packed(Packed::V, "qkv_proj", Split::KeyValue),
        ("gate_proj", _) => packed(Packed::Gate, "gate_up_proj", Split::Intermediate),
        ("up_proj", _) => packed(Packed::Up, "gate_up_proj", Split::Intermediate),
        ("o_proj", "weight") => plain(Split::AttentionOut),
        ("down_proj", "weight") => plain(Split::MlpOut),
        ("o_proj" | "down_proj", "bias") => plain(Split::RowBias),
        _ => plain(Split::Replicated),
    }
}

/// The training names a packed engine name stands for, in row order, or `None` for a name
/// that is not packed.
pub fn unpacked_names(engine_name: &str) -> Option<Vec<(Packed, String)>> {
    let (stem, leaf) = engine_name.rsplit_once('.')?;
    let (prefix, projection) = stem.rsplit_once('.')?;
    let members: &[Packed] = match projection {
        "qkv_proj" => &[Packed::Q, Packed::K, Packed::V],
        "gate_up_proj" => &[Packed::Gate, Packed::Up],
        _ => return None,
    };
    Some(members.iter().map(|&m| (m, format!("{prefix}.{}.{leaf}", m.projection()))).collect())
}

/// Rank `rank`'s shard of the whole training tensor `full` named `name`.
pub fn shard(
    layout: &TpLayout,
    rank: usize,
    name: &str,
    full: &Tensor,
) -> Result<Tensor, EngineError> {
    let (r, d) = (rank as i64, layout.head_dim);
    let check = |dim: usize, expected: i64| -> Result<(), EngineError> {
        let size = full.size();
        match size.get(dim) {
            Some(&found) if found == expected => Ok(()),
            _ => Err(EngineError::InvalidWeight {
                name: name.to_owned(),
                message: format!(
                    "expected {expected} along dimension {dim} to split over {} ranks, found shape {size:?}",
                    layout.world
                ),
            }),
        }
    };
    let out = match engine_param(name).split {
        Split::Query => {
            check(0, layout.heads * d)?;
            let rows = layout.local_heads() * d;
            full.f_narrow(0, r * rows, rows)?
        }
        Split::KeyValue => {
            check(0, layout.kv_heads * d)?;
            let heads =
                Tensor::f_from_slice(&layout.kv_heads_of(rank))?.f_to_device(full.device())?;
            let mut by_head = full.size();
            by_head[0] = layout.local_kv_heads() * d;
            let grouped = full.f_reshape([layout.kv_heads, d, -1])?;
            grouped.f_index_select(0, &heads)?.f_reshape(by_head.as_slice())?
        }
        Split::Intermediate => {
            check(0, layout.intermediate)?;
            let rows = layout.local_intermediate();
            full.f_narrow(0, r * rows, rows)?
        }
        Split::AttentionOut => {
            check(1, layout.heads * d)?;
            let cols = layout.local_heads() * d;
            full.f_narrow(1, r * cols, cols)?
        }
        Split::MlpOut => {
            check(1, layout.intermediate)?;
            let cols = layout.local_intermediate();
            full.f_narrow(1, r * cols, cols)?
        }
        Split::RowBias if rank > 0 => full.f_zeros_like()?,
        Split::RowBias | Split::Replicated => full.shallow_clone(),
    };
    Ok(out.f_contiguous()?)
}

/// The whole tensor named `name` from every rank's shard (`shards[r]` is rank `r`'s): the
/// inverse of [`shard`]. A replicated key/value head is taken from the first rank holding it.
pub fn gather(layout: &TpLayout, name: &str, shards: &[Tensor]) -> Result<Tensor, EngineError> {
    if shards.len() != layout.world {
        return Err(EngineError::InvalidArgument(format!(
            "gathering `{name}` needs {} shards, found {}",
            layout.world,
            shards.len()
        )));
    }
    let d = layout.head_dim;
    let out = match engine_param(name).split {
        Split::Query | Split::Intermediate => Tensor::f_cat(shards, 0)?,
        Split::AttentionOut | Split::MlpOut => Tensor::f_cat(shards, 1)?,
        Split::KeyValue => {
            let mut rows: Vec<Option<Tensor>> = (0..layout.kv_heads).map(|_| None).collect();
            for (rank, part) in shards.iter().enumerate() {
                for (j, head) in layout.kv_heads_of(rank).into_iter().enumerate() {
                    let slot = &mut rows[head as usize];
                    if slot.is_none() {
                        *slot = Some(part.f_narrow(0, j as i64 * d, d)?);
                    }
                }
            }
            let rows = rows
                .into_iter()
                .enumerate()
                .map(|(head, row)| {
                    row.ok_or_else(|| {
                        EngineError::InvalidArgument(format!(
                            "`{name}`: no rank holds kv head {head}"
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            Tensor::f_cat(&rows, 0)?
        }
        Split::RowBias | Split::Replicated => shards[0].shallow_clone(),
    };
    Ok(out)
}

/// The packed engine tensor of a rank: its shards of the members (`q`, `k`, `v` or `gate`,
/// `up`), stacked by rows.
pub fn pack(members: &[Tensor]) -> Result<Tensor, EngineError> {
    Ok(Tensor::f_cat(members, 0)?)
}

/// The members of a packed engine tensor (the inverse of [`pack`]), as views, given each
/// member's row count.
pub fn unpack(packed: &Tensor, rows: &[i64]) -> Result<Vec<Tensor>, EngineError> {
    let total: i64 = rows.iter().sum();
    if packed.size().first() != Some(&total) {
        return Err(EngineError::InvalidArgument(format!(
            "a packed tensor of shape {:?} cannot split into rows {rows:?}",
            packed.size()
        )));
    }
    let mut start = 0;
    rows.iter()
        .map(|&n| {
            let part = packed.f_narrow(0, start, n)?;
            start += n;
            Ok(part)
        })
        .collect()
}

/// The rows of a packed member on one rank.
pub fn member_rows(layout: &TpLayout, member: Packed) -> i64 {
    match member {
        Packed::Q => layout.local_heads() * layout.head_dim,
        Packed::K | Packed::V => layout.local_kv_heads() * layout.head_dim,
        Packed::Gate | Packed::Up => layout.local_intermediate(),
    }
}

/// Rank `rank`'s engine tensors of the whole training tensors `params` (in their order; a
/// packed tensor comes when its last member does): its shards under their engine names, with
/// q/k/v and gate/up packed.
pub fn engine_tensors<'a>(
    layout: &TpLayout,
    rank: usize,
    params: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
) -> Result<Vec<(String, Tensor)>, EngineError> {
    let mut out = Vec::new();
    let mut pending: HashMap<String, Vec<(Packed, Tensor)>> = HashMap::new();
    for (name, full) in params {
        let target = engine_param(name);
        let part = shard(layout, rank, name, full)?;
        let Some(member) = target.packed else {
            out.push((target.name, part));
            continue;
        };
        let members = pending.entry(target.name.clone()).or_default();
        members.push((member, part));
        if members.len() == member.members().len() {
            let mut members = pending.remove(&target.name).unwrap_or_default();
            members.sort_by_key(|(m, _)| member.members().iter().position(|x| x == m));
            let parts: Vec<Tensor> = members.into_iter().map(|(_, t)| t).collect();
            out.push((target.name, pack(&parts)?));
        }
    }
    if let Some(name) = pending.keys().next() {
        return Err(EngineError::InvalidWeight {
            name: name.clone(),
            message: "some of its packed members (q/k/v or gate/up) are missing".into(),
        });
    }
    Ok(out)
}

/// Every rank's weight buckets for the whole training tensors `params`: `result[r]` is rank
/// `r`'s shard in the engine layout (see [`engine_tensors`]), split into buckets of at most
/// `max_bucket_bytes`. Each rank receives only its own.
pub fn engine_buckets(
    layout: &TpLayout,
    params: &[(&str, &Tensor)],
    max_bucket_bytes: usize,
) -> Result<Vec<Vec<WeightBucket>>, EngineError> {
    (0..layout.world)
        .map(|rank| {
            let tensors = engine_tensors(layout, rank, params.iter().copied())?;
            WeightBucket::split(tensors.into_iter().map(Ok), max_bucket_bytes, None)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rtrun_rlhf_model::tiny::{tiny_config, tiny_model};
    use rtrun_rlhf_model::{ModelConfig, ModelFamily};
    use tch::Kind;

    use super::*;

    fn config(heads: i64, kv_heads: i64, bias: bool) -> ModelConfig {
        ModelConfig {
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            hidden_size: 24,
            head_dim: 4,
            intermediate_size: 48,
            num_hidden_layers: 1,
            qkv_bias: bias,
            o_bias: bias,
            mlp_bias: bias,
            ..tiny_config(ModelFamily::Llama)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// For every head count, grouping and rank count that divides the heads (and the
        /// MLP), resharding then gathering gives back every tensor bit for bit, and packing
        /// then unpacking a rank's q/k/v and gate/up gives back its shards.
        #[test]
        fn reshard_then_gather_is_the_source(
            (heads, kv_heads) in prop::sample::select(vec![
                (1i64, 1i64), (2, 1), (4, 1), (4, 2), (4, 4), (6, 3), (6, 2), (8, 2), (12, 3),
                (12, 4), (16, 8),
            ]),
            bias in any::<bool>(),
            seed in 0u64..1000,
        ) {
            let config = config(heads, kv_heads, bias);
            let model = tiny_model(&config, seed).unwrap();
            for world in (1..=heads as usize).filter(|w| (heads as usize).is_multiple_of(*w) && 48usize.is_multiple_of(*w)) {
                let layout = TpLayout::new(&config, world).unwrap();
                for (name, full) in model.named_parameters() {
                    let shards: Vec<Tensor> =
                        (0..world).map(|r| shard(&layout, r, name, full).unwrap()).collect();
                    let back = gather(&layout, name, &shards).unwrap();
                    prop_assert!(back.equal(full), "{name} at world {world}");
                    if let Some(member) = engine_param(name).packed {
                        let rows = member_rows(&layout, member);
                        prop_assert_eq!(shards[0].size()[0], rows);
                    }
                }
                for rank in 0..world {
                    let q = shard(&layout, rank, "model.layers.0.self_attn.q_proj.weight",
                        model.params.get("model.layers.0.self_attn.q_proj.weight").unwrap()).unwrap();
                    let k = shard(&layout, rank, "model.layers.0.self_attn.k_proj.weight",
                        model.params.get("model.layers.0.self_attn.k_proj.weight").unwrap()).unwrap();
                    let v = shard(&layout, rank, "model.layers.0.self_attn.v_proj.weight",
                        model.params.get("model.layers.0.self_attn.v_proj.weight").unwrap()).unwrap();
                    let packed = pack(&[q.shallow_clone(), k.shallow_clone(), v.shallow_clone()]).unwrap();
                    let rows: Vec<i64> = [Packed::Q, Packed::K, Packed::V]
                        .iter().map(|&m| member_rows(&layout, m)).collect();
                    let parts = unpack(&packed, &rows).unwrap();
                    prop_assert!(parts[0].equal(&q) && parts[1].equal(&k) && parts[2].equal(&v));
                }
            }
        }
    }

    #[test]
    fn the_name_map_packs_qkv_and_gate_up_and_maps_back() {
        let p = engine_param("model.layers.3.self_attn.k_proj.bias");
        assert_eq!(p.name, "model.layers.3.self_attn.qkv_proj.bias");
        assert_eq!((p.split, p.packed), (Split::KeyValue, Some(Packed::K)));
        let p = engine_param("model.layers.0.mlp.up_proj.weight");
        assert_eq!(p.name, "model.layers.0.mlp.gate_up_proj.weight");
        assert_eq!(engine_param("model.layers.0.mlp.down_proj.bias").split, Split::RowBias);
        assert_eq!(engine_param("lm_head.weight").split, Split::Replicated);
        assert_eq!(engine_param("model.norm.weight").split, Split::Replicated);
        let names = unpacked_names("model.layers.3.self_attn.qkv_proj.weight").unwrap();
        let names: Vec<&str> = names.iter().map(|(_, n)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.3.self_attn.q_proj.weight",
                "model.layers.3.self_attn.k_proj.weight",
                "model.layers.3.self_attn.v_proj.weight"
            ]
        );
        assert!(unpacked_names("model.layers.3.self_attn.o_proj.weight").is_none());
    }

    #[test]
    fn a_row_parallel_bias_is_whole_on_rank_zero_and_zero_elsewhere() {
        let layout = TpLayout::new(&config(4, 2, true), 2).unwrap();
        let bias = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let name = "model.layers.0.self_attn.o_proj.bias";
        assert!(shard(&layout, 0, name, &bias).unwrap().equal(&bias));
        assert_eq!(
            shard(&layout, 1, name, &bias).unwrap().abs().sum(Kind::Float).double_value(&[]),
            0.0
        );
    }

    #[test]
    fn a_tensor_of_the_wrong_shape_is_named() {
        let layout = TpLayout::new(&config(4, 2, false), 2).unwrap();
        let wrong = Tensor::zeros([5, 24], (Kind::Float, tch::Device::Cpu));
        let err = shard(&layout, 0, "model.layers.0.self_attn.q_proj.weight", &wrong).unwrap_err();
        assert!(err.to_string().contains("q_proj") && err.to_string().contains("[5, 24]"), "{err}");
    }
}
