//! GPUs as individual instances (index and UUID) and the pool that hands out whole GPUs and
//! fractional shares of one GPU.
//!
//! A node's GPUs and a placement-group bundle's reserved GPUs are both a [`GpuPool`]: a list of
//! slots, each one GPU instance with a capacity (1 for a node's GPU, the reserved share for a
//! bundle) and a free share. The same assignment rule applies to both, so an actor placed into a
//! bundle is given GPUs exactly as an actor placed onto a bare node.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::resources::Quantity;

/// One physical (or fake) GPU on a node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GpuInstance {
    /// The device index as CUDA numbers it on the node (what `CUDA_VISIBLE_DEVICES` lists).
    pub index: u32,
    /// The device UUID in NVIDIA's `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` shape.
    pub uuid: String,
}

impl GpuInstance {
    /// A GPU with a known index and UUID (as detected from the machine).
    pub fn new(index: u32, uuid: impl Into<String>) -> GpuInstance {
        GpuInstance { index, uuid: uuid.into() }
    }

    /// A fake GPU for machines without one (`--num-gpus N` on a CPU machine). The UUID is
    /// derived deterministically from the node id and the index, so a test can predict it and
    /// two nodes never share one.
    pub fn synthetic(node: &str, index: u32) -> GpuInstance {
        GpuInstance { index, uuid: synthetic_uuid(node, index) }
    }

    /// `count` fake GPUs numbered `0..count`.
    pub fn synthetic_set(node: &str, count: u32) -> Vec<GpuInstance> {
        (0..count).map(|index| GpuInstance::synthetic(node, index)).collect()
    }
}

impl fmt::Display for GpuInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.index, self.uuid)
    }
}

/// The synthetic UUID of fake GPU `index` on `node`: two 64-bit FNV-1a hashes of the node id
/// and index (with different seeds) formatted as `GPU-8-4-4-4-12` hex digits, with the version
/// nibble set to 8 so it can never collide with a real (version 4) NVIDIA UUID.
pub fn synthetic_uuid(node: &str, index: u32) -> String {
    let high = fnv1a(0xcbf2_9ce4_8422_2325, node.as_bytes(), index);
    let low = fnv1a(0x8422_2325_cbf2_9ce4, node.as_bytes(), index ^ 0x5bd1_e995);
    let high = (high & !0xf000) | 0x8000;
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0xffff,
        low >> 48,
        low & 0xffff_ffff_ffff
    )
}

fn fnv1a(seed: u64, bytes: &[u8], index: u32) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = seed;
    for byte in bytes.iter().copied().chain([0xff]).chain(index.to_le_bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(PRIME);
    }
    hash
}

/// A share of one GPU given to a bundle or an actor: the whole GPU (`1`) or a fraction.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuShare {
    /// Which GPU.
    pub gpu: GpuInstance,
    /// How much of it (at most 1).
    pub share: Quantity,
}

/// The device indices of `shares`, comma-separated, as `CUDA_VISIBLE_DEVICES` wants them
/// (empty when there are none).
pub fn cuda_visible_devices(shares: &[GpuShare]) -> String {
    let indices: Vec<String> = shares.iter().map(|share| share.gpu.index.to_string()).collect();
    indices.join(",")
}

/// One GPU in a pool: its capacity in this pool and what is still free.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSlot {
    /// The GPU.
    pub gpu: GpuInstance,
    /// How much of the GPU this pool owns (1 on a node; the reserved share in a bundle).
    pub capacity: Quantity,
    /// How much of `capacity` is not handed out.
    pub free: Quantity,
}

/// A GPU demand that no pool could ever satisfy by its shape alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuDemandError {
    /// More than one GPU must be a whole number (a fraction must fit on one device).
    #[error("a GPU amount above 1 must be whole, found {0}")]
    FractionAboveOne(Quantity),
}

/// The GPUs of a node or of a bundle, handing out whole GPUs and fractional shares.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPool {
    slots: Vec<GpuSlot>,
}

impl GpuPool {
    /// A pool owning every GPU in `gpus` whole.
    pub fn whole(gpus: impl IntoIterator<Item = GpuInstance>) -> GpuPool {
        let one = Quantity::whole(1);
        GpuPool {
            slots: gpus.into_iter().map(|gpu| GpuSlot { gpu, capacity: one, free: one }).collect(),
        }
    }

    /// A pool owning the given shares (a bundle's reservation).
    pub fn from_shares(shares: &[GpuShare]) -> GpuPool {
        GpuPool {
            slots: shares
                .iter()
                .map(|s| GpuSlot { gpu: s.gpu.clone(), capacity: s.share, free: s.share })
                .collect(),
        }
    }

    /// The slots, in the order they were given.
    pub fn slots(&self) -> &[GpuSlot] {
        &self.slots
    }

    /// The total free share over all slots.
    pub fn free_total(&self) -> Quantity {
        Quantity::from_raw(self.slots.iter().map(|slot| slot.free.raw()).sum())
    }

    /// Checks that `amount` has a shape a GPU pool can serve: zero, a fraction below one, or a
    /// whole number.
    pub fn check_demand(amount: Quantity) -> Result<(), GpuDemandError> {
        if amount > Quantity::whole(1) && !amount.is_whole() {
            return Err(GpuDemandError::FractionAboveOne(amount));
        }
        Ok(())
    }

    /// Which slots would serve `amount`, without changing anything; `None` when the pool cannot
    /// serve it now.
    ///
    /// A whole amount `n` takes `n` slots that are entirely free and own a whole GPU, lowest
    /// index first. A fraction takes one slot: the fullest one that still has room (so fractions
    /// pack onto one GPU before another is started), ties going to the lowest index.
    pub fn plan(&self, amount: Quantity) -> Option<Vec<(usize, Quantity)>> {
        let one = Quantity::whole(1);
        if amount == Quantity::ZERO {
            return Some(Vec::new());
        }
        if amount.is_whole() {
            let wanted = usize::try_from(amount.raw() / Quantity::SCALE).ok()?;
            let mut free: Vec<usize> = (0..self.slots.len())
                .filter(|&i| self.slots[i].capacity == one && self.slots[i].free == one)
                .collect();
            free.sort_by_key(|&i| self.slots[i].gpu.index);
            if free.len() < wanted {
                return None;
            }
            return Some(free[..wanted].iter().map(|&i| (i, one)).collect());
        }
        if amount > one {
            return None;
        }
        (0..self.slots.len())
            .filter(|&i| self.slots[i].free >= amount)
            .min_by_key(|&i| (self.slots[i].free, self.slots[i].gpu.index))
            .map(|i| vec![(i, amount)])
    }

    /// Takes `amount` as [`GpuPool::plan`] chooses, returning the shares handed out.
    pub fn take(&mut self, amount: Quantity) -> Option<Vec<GpuShare>> {
        let plan = self.plan(amount)?;
        let mut shares = Vec::with_capacity(plan.len());
        for (slot, share) in plan {
            let entry = &mut self.slots[slot];
            entry.free = entry.free.checked_sub(share)?;
            shares.push(GpuShare { gpu: entry.gpu.clone(), share });
        }
        Some(shares)
    }

    /// Takes exactly `shares` (a restored allocation's). Fails, changing nothing, when a share
    /// names a GPU this pool does not own or more of it than is free.
    pub fn take_exact(&mut self, shares: &[GpuShare]) -> Result<(), GpuShare> {
        self.adjust(shares, |slot, share| slot.free.checked_sub(share))
    }

    /// Returns shares handed out by [`GpuPool::take`]. Fails, changing nothing, when a share
    /// names a GPU this pool does not own or would overfill its slot.
    pub fn give_back(&mut self, shares: &[GpuShare]) -> Result<(), GpuShare> {
        self.adjust(shares, |slot, share| {
            slot.free.checked_add(share).filter(|free| *free <= slot.capacity)
        })
    }

    /// Sets each share's slot free amount to what `free_after` says (`None`: refused), on a
    /// copy committed only when every share names a GPU of this pool and is accepted; else the
    /// first share refused.
    fn adjust(
        &mut self,
        shares: &[GpuShare],
        free_after: impl Fn(&GpuSlot, Quantity) -> Option<Quantity>,
    ) -> Result<(), GpuShare> {
        let mut updated = self.slots.clone();
        for share in shares {
            let slot = updated
                .iter_mut()
                .find(|slot| slot.gpu == share.gpu)
                .ok_or_else(|| share.clone())?;
            slot.free = free_after(slot, share.share).ok_or_else(|| share.clone())?;
        }
        self.slots = updated;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(amount: f64) -> Quantity {
        Quantity::from_f64(amount).unwrap()
    }

    #[test]
    fn synthetic_uuids_are_deterministic_distinct_and_shaped() {
        let a = synthetic_uuid("node-a", 0);
        assert_eq!(a, synthetic_uuid("node-a", 0));
        assert_ne!(a, synthetic_uuid("node-a", 1));
        assert_ne!(a, synthetic_uuid("node-b", 0));
        let parts: Vec<&str> = a.strip_prefix("GPU-").unwrap().split('-').collect();
        let lengths: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        assert_eq!(lengths, [8, 4, 4, 4, 12]);
        assert!(parts.iter().all(|p| p.chars().all(|c| c.is_ascii_hexdigit())));
        assert!(parts[2].starts_with('8'));
    }

    #[test]
    fn fractions_pack_onto_one_gpu_before_starting_another() {
        let mut pool = GpuPool::whole(GpuInstance::synthetic_set("n", 2));
        let mut indices = Vec::new();
        for _ in 0..6 {
            let shares = pool.take(q(0.2)).unwrap();
            indices.push(shares[0].gpu.index);
        }
        assert_eq!(indices, [0, 0, 0, 0, 0, 1]);
        assert!(pool.take(Quantity::whole(2)).is_none());
        assert_eq!(pool.free_total(), q(0.8));
    }

    #[test]
    fn whole_gpus_are_distinct_and_lowest_first() {
        let mut pool = GpuPool::whole(GpuInstance::synthetic_set("n", 4));
        pool.take(q(0.5)).unwrap();
        let shares = pool.take(Quantity::whole(2)).unwrap();
        let indices: Vec<u32> = shares.iter().map(|s| s.gpu.index).collect();
        assert_eq!(indices, [1, 2]);
        assert_eq!(cuda_visible_devices(&shares), "1,2");
    }

    #[test]
    fn give_back_restores_and_rejects_foreign_shares() {
        let mut pool = GpuPool::whole(GpuInstance::synthetic_set("n", 1));
        let before = pool.clone();
        let shares = pool.take(q(0.3)).unwrap();
        pool.give_back(&shares).unwrap();
        assert_eq!(pool, before);
        let foreign = GpuShare { gpu: GpuInstance::synthetic("m", 0), share: q(0.3) };
        assert!(pool.give_back(&[foreign]).is_err());
        assert!(pool.give_back(&shares).is_err(), "overfilling a slot must fail");
        assert_eq!(pool, before);
    }

    #[test]
    fn bundle_pool_of_a_fraction_serves_only_fractions() {
        let share = GpuShare { gpu: GpuInstance::synthetic("n", 3), share: q(0.5) };
        let pool = GpuPool::from_shares(&[share]);
        assert!(pool.plan(Quantity::whole(1)).is_none());
        assert!(pool.plan(q(0.5)).is_some());
        assert!(GpuPool::check_demand(q(1.5)).is_err());
        assert!(GpuPool::check_demand(q(2.0)).is_ok());
    }
}
