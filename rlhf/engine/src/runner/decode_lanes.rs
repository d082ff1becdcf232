//! A contiguous copy of the running decode batch's keys and values, kept across steps (CPU).
//!
//! Paged attention reads a sequence's context through its block table, so every step gathers
//! the whole context of every sequence into a contiguous `[kv_heads, batch, len, head_dim]`
//! tensor first: a copy of the batch's entire KV cache per layer per step, which took a sixth
//! of the 0.4M-parameter model's decode step at batch 64. Between two decode steps of the same
//! sequences, that tensor changes by one row per sequence. The lanes keep it: sequence `b` of
//! the batch owns lane `b` of `[kv_heads, lanes, capacity, head_dim]` tensors (one key and one
//! value per layer), a step appends its new keys and values there, and attention reads a view
//! of them. The block table is consulted only when the lanes are (re)built.
//!
//! The paged cache stays the source of truth (every step still writes it), and the lanes are a
//! cache of it keyed by slots: a step reuses them only when its decode group lists, for each
//! sequence in lane order, exactly the slots the lane holds followed by the one slot the step
//! writes. A slot's content changes only when a step writes it, so any other step (a prefill,
//! a mixed step) drops the lanes, as do freeing and reallocating the cache. Anything else —
//! a sequence that finished or joined, a reordered batch, a full lane — rebuilds them with one
//! gather, which is what every step cost before.

use tch::Tensor;

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
    /// Per decoder layer, keys and values `[kv_heads, lanes, capacity, head_dim]`. Positions
    /// past a lane's context hold zeros or the padding the rebuild gathered (slot 0, finite):
    /// attention masks them, and multiplies them by zero weights.
    layers: Vec<(Tensor, Tensor)>,
}

/// The lanes one decode step works with.
#[derive(Debug)]
pub struct LaneStep {
    /// The lanes (with no layers yet when they are being rebuilt).
    pub lanes: DecodeLanes,
    /// When the lanes hold every sequence's context but the new position: where the step
    /// appends, each lane's new position as a row of `[lanes * capacity]`. `None` when the
    /// step rebuilds them from the paged cache ([`DecodeLanes::rebuild_layer`]).
    pub append_rows: Option<Tensor>,
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
                let rows: Vec<i64> = positions
                    .iter()
                    .enumerate()
                    .map(|(b, &p)| b as i64 * lanes.capacity + p)
                    .collect();
                let append_rows = Some(Tensor::f_from_slice(&rows)?);
                Ok(LaneStep { lanes, append_rows })
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
                    append_rows: None,
                })
            }
        }
    }

    /// Records the slots an appending step wrote (`kv_slots` as in [`DecodeLanes::step`]).
    pub fn record_append(&mut self, positions: &[i64], kv_slots: &[i64], kv_len: usize) {
        for (b, (&p, held)) in positions.iter().zip(&mut self.slots).enumerate() {
            held.push(kv_slots[b * kv_len + p as usize]);
        }
    }

    /// Builds the next layer's lanes from its paged cache, reading `rows` (the
    /// [`super::kv_cache::KvCache::head_major`] rows of the group's `kv_len` slots per
    /// sequence); returns the keys and values of the first `kv_len` positions.
    pub fn rebuild_layer(
        &mut self,
        cache: &LayerCache,
        rows: &Tensor,
        kv_len: i64,
    ) -> Result<(Tensor, Tensor), EngineError> {
        let lanes = self.slots.len() as i64;
        let (k, v) = cache.gather(rows, lanes, kv_len)?;
        let room = |t: &Tensor| -> Result<Tensor, EngineError> {
            let size = t.size();
            let full = Tensor::f_zeros(
                [size[0], lanes, self.capacity, size[3]],
                (t.f_kind()?, t.device()),
            )?;
            full.f_narrow(2, 0, kv_len)?.f_copy_(t)?;
            Ok(full)
        };
        self.layers.push((room(&k)?, room(&v)?));
        Ok((k, v))
    }

    /// Appends `k, v: [kv_heads, lanes, head_dim]` (one new position per lane) to layer
    /// `layer` at `rows` ([`LaneStep::append_rows`]) and returns the keys and values of the
    /// first `kv_len` positions, views `[kv_heads, lanes, kv_len, head_dim]` of the lanes.
    pub fn append_layer(
        &self,
        layer: usize,
        rows: &Tensor,
        k: &Tensor,
        v: &Tensor,
        kv_len: i64,
    ) -> Result<(Tensor, Tensor), EngineError> {
        let (keys, values) = self.layers.get(layer).ok_or_else(|| {
            EngineError::InvalidArgument(format!(
                "decode lanes hold {} layers, a step appended to layer {layer}",
                self.layers.len()
            ))
        })?;
        let append = |lanes: &Tensor, new: &Tensor| -> Result<Tensor, EngineError> {
            let size = lanes.size();
            let (heads, width) = (size[0], size[3]);
            let mut flat = lanes.f_view([heads, size[1] * self.capacity, width])?;
            let _ = flat.f_index_copy_(1, rows, new)?;
            Ok(lanes.f_narrow(2, 0, kv_len)?)
        };
        Ok((append(keys, k)?, append(values, v)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lanes of `positions`, as a step that built them leaves them (no layers needed).
    fn built(positions: &[i64], kv_slots: &[i64], kv_len: usize) -> DecodeLanes {
        let step = DecodeLanes::step(None, positions, kv_slots, kv_len).unwrap();
        assert!(step.append_rows.is_none());
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
        let rows = step.append_rows.expect("the lanes hold both contexts");
        assert_eq!(Vec::<i64>::try_from(&rows).unwrap(), vec![3, capacity + 2]);
        let mut kept = step.lanes;
        kept.record_append(&[3, 2], &next, 4);
        assert_eq!(kept.slots, vec![vec![10, 11, 12, 13], vec![20, 21, 22]]);

        let rebuilds = |positions: &[i64], kv_slots: &[i64], kv_len: usize| {
            DecodeLanes::step(Some(lanes()), positions, kv_slots, kv_len)
                .unwrap()
                .append_rows
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
        assert!(step.append_rows.is_none());
        assert_eq!(step.lanes.capacity, 192);
    }
}
