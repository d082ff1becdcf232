//! A contiguous copy of the running decode batch's keys and values, kept across steps (CPU).
//!
//! Paged attention reads a sequence's context through its block table, so every step gathers
//! the whole context of every sequence into a contiguous `[kv_heads, batch, len, head_dim]`
//! tensor first: a copy of the batch's entire KV cache per layer per step, which took a sixth
//! of the 0.4M-parameter model's decode step at batch 64. Between two decode steps of the same
//! sequences, that tensor changes by one row per sequence. The lanes keep it: sequence `b` of
//! the batch owns lane `b` of a `[kv_heads, lanes, head_dim, capacity]` key tensor (keys
//! transposed: the decode attention kernel reads a block of adjacent positions per width) and a
//! `[kv_heads, lanes, capacity, head_dim]` value tensor per layer, a step appends its new keys
//! and values there, and attention reads views of them. The block table is consulted only when
//! the lanes are (re)built.
//!
//! The paged cache stays the source of truth (every step still writes it), and the lanes are a
//! cache of it keyed by slots: a step reuses them only when its decode group lists, for each
//! sequence in lane order, exactly the slots the lane holds followed by the one slot the step
//! writes. A slot's content changes only when a step writes it, so any other step (a prefill,
//! a mixed step) drops the lanes, as do freeing and reallocating the cache. Anything else —
//! a sequence that finished or joined, a reordered batch, a full lane — rebuilds them with one
//! gather, which is what every step cost before.

use tch::{Device, Tensor};

use super::kv_cache::LayerCache;
use crate::error::EngineError;

/// Positions a rebuilt lane holds beyond its sequence's context (so it is rebuilt at most once
/// per this many decode steps).
const LANE_HEADROOM: usize = 64;

/// The lanes of one decode batch.
#[derive(Debug)]
pub struct DecodeLanes {
    /// Per lane, the cache slot of each position it holds, in position order.
    slots: Vec<Vec<i64>>,
    /// Positions each lane has room for.
    capacity: i64,
    /// Per decoder layer, keys `[kv_heads, lanes, head_dim, capacity]` and values `[kv_heads,
    /// lanes, capacity, head_dim]`. Positions past a lane's context hold zeros or the padding
    /// the rebuild gathered (slot 0, finite): attention masks them, and multiplies them by zero
    /// weights.
    layers: Vec<(Tensor, Tensor)>,
}

/// The lanes one decode step works with.
#[derive(Debug)]
pub struct LaneStep {
    /// The lanes (with no layers yet when they are being rebuilt).
    pub lanes: DecodeLanes,
    /// When the lanes hold every sequence's context but the new position: where the step
    /// appends, the lanes `0..lanes` and each one's new position. `None` when the step rebuilds
    /// them from the paged cache ([`DecodeLanes::rebuild_layer`]).
    pub append_at: Option<[Tensor; 2]>,
}

impl DecodeLanes {
    /// The lanes of a decode step of `positions.len()` sequences, one query each, in lane
    /// order: sequence `b` is at `positions[b]`, and `kv_slots[b * kv_len..][..=positions[b]]`
    /// are the slots of its context, the last one written by this step. `previous` is what the
    /// last step left (`None` when it was not a decode step); it is reused when it holds
    /// exactly those contexts but the new position, else rebuilt.
    pub fn step(
        previous: Option<DecodeLanes>,
        positions: &[i64],
        kv_slots: &[i64],
        kv_len: usize,
    ) -> Result<LaneStep, EngineError> {
        let holds_all_but_the_new_position = |lanes: &DecodeLanes| {
            lanes.slots.len() == positions.len()
                && positions.iter().zip(&lanes.slots).enumerate().all(|(b, (&p, held))| {
                    let p = p as usize;
                    p < lanes.capacity as usize
                        && held.len() == p
                        && kv_slots[b * kv_len..][..p] == held[..]
                })
        };
        match previous {
            Some(lanes) if holds_all_but_the_new_position(&lanes) => {
                let lane =
                    Tensor::f_arange(positions.len() as i64, (tch::Kind::Int64, Device::Cpu))?;
                let append_at = Some([lane, Tensor::f_from_slice(positions)?]);
                Ok(LaneStep { lanes, append_at })
            }
            _ => {
                let capacity = (kv_len + LANE_HEADROOM).next_multiple_of(LANE_HEADROOM) as i64;
                let slots = positions
                    .iter()
                    .enumerate()
                    .map(|(b, &p)| kv_slots[b * kv_len..][..=p as usize].to_vec())
                    .collect();
                Ok(LaneStep {
                    lanes: Self { slots, capacity, layers: Vec::new() },
                    append_at: None,
                })
            }
        }
    }

    /// Positions each lane has room for (past its context: zeros, or keys and values a
    /// rebuild gathered as padding, all finite).
    pub fn capacity(&self) -> i64 {
        self.capacity
    }

    /// Records the slots an appending step wrote (`kv_slots` as in [`DecodeLanes::step`]).
    pub fn record_append(&mut self, positions: &[i64], kv_slots: &[i64], kv_len: usize) {
        for (b, (&p, held)) in positions.iter().zip(&mut self.slots).enumerate() {
            held.push(kv_slots[b * kv_len + p as usize]);
        }
    }

    /// Builds the next layer's lanes from its paged cache, reading `rows` (the
    /// [`super::kv_cache::KvCache::head_major`] rows of the group's `kv_len` slots per
    /// sequence); returns views of the keys (transposed) and values of the first `kv_len`
    /// positions, as [`DecodeLanes::append_layer`] does.
    pub fn rebuild_layer(
        &mut self,
        cache: &LayerCache,
        rows: &Tensor,
        kv_len: i64,
    ) -> Result<(Tensor, Tensor), EngineError> {
        let lanes = self.slots.len() as i64;
        let (k, v) = cache.gather(rows, lanes, kv_len)?;
        let size = k.size();
        let (heads, width, options) = (size[0], size[3], (k.f_kind()?, k.device()));
        let keys = Tensor::f_zeros([heads, lanes, width, self.capacity], options)?;
        keys.f_narrow(3, 0, kv_len)?.f_copy_(&k.f_transpose(2, 3)?)?;
        let values = Tensor::f_zeros([heads, lanes, self.capacity, width], options)?;
        values.f_narrow(2, 0, kv_len)?.f_copy_(&v)?;
        let views = (keys.f_narrow(3, 0, kv_len)?, values.f_narrow(2, 0, kv_len)?);
        self.layers.push((keys, values));
        Ok(views)
    }

    /// Layer `layer`'s key lanes `[kv_heads, lanes, head_dim, capacity]` and value lanes
    /// `[kv_heads, lanes, capacity, head_dim]`.
    pub fn layer(&self, layer: usize) -> Result<&(Tensor, Tensor), EngineError> {
        self.layers.get(layer).ok_or_else(|| {
            EngineError::InvalidArgument(format!(
                "decode lanes hold {} layers, a step appended to layer {layer}",
                self.layers.len()
            ))
        })
    }

    /// The keys and values of layer `layer`'s first `kv_len` positions, views of the lanes:
    /// keys transposed `[kv_heads, lanes, head_dim, kv_len]`, values `[kv_heads, lanes,
    /// kv_len, head_dim]`.
    pub fn views(&self, layer: usize, kv_len: i64) -> Result<(Tensor, Tensor), EngineError> {
        let (keys, values) = self.layer(layer)?;
        Ok((keys.f_narrow(3, 0, kv_len)?, values.f_narrow(2, 0, kv_len)?))
    }

    /// Appends `k, v: [kv_heads, lanes, head_dim]` (one new position per lane) to layer
    /// `layer` at `at` ([`LaneStep::append_at`]) and returns the keys and values of the first
    /// `kv_len` positions, views of the lanes: keys transposed `[kv_heads, lanes, head_dim,
    /// kv_len]`, values `[kv_heads, lanes, kv_len, head_dim]`.
    pub fn append_layer(
        &self,
        layer: usize,
        at: &[Tensor; 2],
        k: &Tensor,
        v: &Tensor,
        kv_len: i64,
    ) -> Result<(Tensor, Tensor), EngineError> {
        let (keys, values) = self.layer(layer)?;
        // Both as `[lanes, capacity, kv_heads, head_dim]` views, written at (lane, position).
        let at = [Some(at[0].shallow_clone()), Some(at[1].shallow_clone())];
        let new = |t: &Tensor| t.f_permute([1, 0, 2]);
        let _ = keys.f_permute([1, 3, 0, 2])?.f_index_put_(&at, &new(k)?, false)?;
        let _ = values.f_permute([1, 2, 0, 3])?.f_index_put_(&at, &new(v)?, false)?;
        self.views(layer, kv_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lanes of `positions`, as a step that built them leaves them (no layers needed).
    fn built(positions: &[i64], kv_slots: &[i64], kv_len: usize) -> DecodeLanes {
        let step = DecodeLanes::step(None, positions, kv_slots, kv_len).unwrap();
        assert!(step.append_at.is_none());
        step.lanes
    }

    #[test]
    fn lanes_are_reused_only_for_exactly_the_contexts_they_hold() {
        // Two sequences at positions 2 and 1 (contexts of 3 and 2 slots, padded to 3).
        let lanes = || built(&[2, 1], &[10, 11, 12, 20, 21, 0], 3);
        let capacity = lanes().capacity;
        assert_eq!(capacity, 128);
        // Next step: both one position on, same slots, one new slot each.
        let next = [10, 11, 12, 13, 20, 21, 22, 0];
        let step = DecodeLanes::step(Some(lanes()), &[3, 2], &next, 4).unwrap();
        let [lane, position] = step.append_at.expect("the lanes hold both contexts");
        assert_eq!(Vec::<i64>::try_from(&lane).unwrap(), vec![0, 1]);
        assert_eq!(Vec::<i64>::try_from(&position).unwrap(), vec![3, 2]);
        let mut kept = step.lanes;
        kept.record_append(&[3, 2], &next, 4);
        assert_eq!(kept.slots, vec![vec![10, 11, 12, 13], vec![20, 21, 22]]);

        let rebuilds = |positions: &[i64], kv_slots: &[i64], kv_len: usize| {
            DecodeLanes::step(Some(lanes()), positions, kv_slots, kv_len)
                .unwrap()
                .append_at
                .is_none()
        };
        // A slot of a held position differs (the block was freed and handed out again).
        assert!(rebuilds(&[3, 2], &[10, 11, 99, 13, 20, 21, 22, 0], 4));
        // A sequence finished, or joined, or the order changed.
        assert!(rebuilds(&[3], &[10, 11, 12, 13], 4));
        assert!(rebuilds(&[3, 2, 0], &[10, 11, 12, 13, 20, 21, 22, 0, 30, 0, 0, 0], 4));
        assert!(rebuilds(&[2, 3], &[20, 21, 22, 0, 10, 11, 12, 13], 4));
        // A step that skipped a position, or repeats one.
        assert!(rebuilds(&[4, 2], &[10, 11, 12, 13, 14, 20, 21, 22, 0, 0], 5));
        assert!(rebuilds(&[2, 1], &[10, 11, 12, 20, 21, 0], 3));
    }

    #[test]
    fn a_full_lane_is_rebuilt_with_room_again() {
        let positions: Vec<i64> = vec![127];
        let slots: Vec<i64> = (0..128).collect();
        let mut lanes = built(&[126], &slots[..127], 127);
        assert_eq!(lanes.capacity, 192);
        lanes.capacity = 127;
        let step = DecodeLanes::step(Some(lanes), &positions, &slots, 128).unwrap();
        assert!(step.append_at.is_none());
        assert_eq!(step.lanes.capacity, 192);
    }
}
