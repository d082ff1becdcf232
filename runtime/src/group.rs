//! Actor groups: N actors of one type with rank and world size, called all at once, per rank,
//! or with a batch split across ranks and the results gathered back in order (verl's
//! `DP_COMPUTE_PROTO`). The RLHF role groups (a master plus DP workers) are built on this.

use serde::de::DeserializeOwned;

use crate::actor::{Actor, ActorOptions};
use crate::context::GroupMembership;
use crate::error::{Error, Result};
use crate::object::{ObjectRef, get_all};

/// A group of actors of type `A`, rank-ordered.
pub struct ActorGroup<A: Actor> {
    name: String,
    members: Vec<A::Ref>,
}

impl<A: Actor> std::fmt::Debug for ActorGroup<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActorGroup({} × {} {})", self.name, self.members.len(), A::TYPE_NAME)
    }
}

impl<A: Actor> ActorGroup<A> {
    /// Creates `world_size` actors. `spawn(rank, options)` creates rank `rank` with the given
    /// options (which carry the group membership; add per-rank settings to them as needed).
    pub fn create(
        name: &str,
        world_size: usize,
        options: ActorOptions,
        mut spawn: impl FnMut(usize, ActorOptions) -> Result<A::Ref>,
    ) -> Result<ActorGroup<A>> {
        if world_size == 0 {
            return Err(Error::Invalid(format!("actor group `{name}` needs at least one member")));
        }
        // Rank 0 may land on any node: it listens where it runs, on a port of its choosing,
        // and publishes the address under a key unique to this group.
        let master_addr = String::new();
        let master_port = 0;
        let rendezvous_key =
            Some(format!("rtrun/collective/{name}/{:016x}", crate::runtime::random_u64()));
        let mut members = Vec::with_capacity(world_size);
        for rank in 0..world_size {
            let mut member_options = options.clone();
            member_options.group = Some(GroupMembership {
                group: name.to_owned(),
                rank,
                world_size,
                master_addr: master_addr.clone(),
                master_port,
                rendezvous_key: rendezvous_key.clone(),
            });
            members.push(spawn(rank, member_options)?);
        }
        Ok(ActorGroup { name: name.to_owned(), members })
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The number of members.
    pub fn world_size(&self) -> usize {
        self.members.len()
    }

    /// The members, by rank.
    pub fn members(&self) -> &[A::Ref] {
        &self.members
    }

    /// Calls every member the same way (a broadcast); one reference per rank.
    pub fn call_all<R>(&self, call: impl Fn(&A::Ref) -> ObjectRef<R>) -> Vec<ObjectRef<R>> {
        self.members.iter().map(call).collect()
    }

    /// Calls each member with its own argument: `args[rank]` goes to rank `rank`.
    pub fn call_each<X, R>(
        &self,
        args: Vec<X>,
        call: impl Fn(&A::Ref, X) -> ObjectRef<R>,
    ) -> Result<Vec<ObjectRef<R>>> {
        if args.len() != self.members.len() {
            return Err(Error::Invalid(format!(
                "call_each on group `{}` needs {} arguments (one per rank), found {}",
                self.name,
                self.members.len(),
                args.len()
            )));
        }
        Ok(self.members.iter().zip(args).map(|(m, a)| call(m, a)).collect())
    }

    /// Splits `batch` into contiguous per-rank chunks and calls each rank with its chunk.
    pub fn dispatch<T, R>(
        &self,
        batch: Vec<T>,
        call: impl Fn(&A::Ref, Vec<T>) -> ObjectRef<Vec<R>>,
    ) -> Vec<ObjectRef<Vec<R>>> {
        let chunks = split_batch(batch, self.members.len());
        self.members.iter().zip(chunks).map(|(m, c)| call(m, c)).collect()
    }

    /// [`ActorGroup::dispatch`], then waits and concatenates the per-rank results in rank order.
    pub fn dispatch_gather<T, R: DeserializeOwned>(
        &self,
        batch: Vec<T>,
        call: impl Fn(&A::Ref, Vec<T>) -> ObjectRef<Vec<R>>,
    ) -> Result<Vec<R>> {
        Ok(get_all(&self.dispatch(batch, call))?.into_iter().flatten().collect())
    }

    /// Kills every member.
    pub fn kill(&self) -> Result<()> {
        self.members.iter().try_for_each(|m| m.kill())
    }
}

/// Splits `batch` into `parts` contiguous chunks whose sizes differ by at most one, the larger
/// ones first, so that concatenating them gives back the batch.
pub fn split_batch<T>(batch: Vec<T>, parts: usize) -> Vec<Vec<T>> {
    let parts = parts.max(1);
    let base = batch.len() / parts;
    let extra = batch.len() % parts;
    let mut items = batch.into_iter();
    (0..parts).map(|i| items.by_ref().take(base + usize::from(i < extra)).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn split_then_concat_is_identity(len in 0usize..200, parts in 1usize..17) {
            let batch: Vec<usize> = (0..len).collect();
            let chunks = split_batch(batch.clone(), parts);
            prop_assert_eq!(chunks.len(), parts);
            let sizes: Vec<usize> = chunks.iter().map(Vec::len).collect();
            let (min, max) = (sizes.iter().min().copied().unwrap_or(0), sizes.iter().max().copied().unwrap_or(0));
            prop_assert!(max - min <= 1);
            prop_assert_eq!(chunks.into_iter().flatten().collect::<Vec<_>>(), batch);
        }
    }
}
