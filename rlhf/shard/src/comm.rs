//! The data-parallel communicator of a rank, created on first use and shared by everything
//! of the rank that talks to the group: the sharded models (a DPO rank's policy and frozen
//! reference alike) and stage 0's gradient all-reduce. Collectives of one group must be
//! issued in the same order by every rank; sharing one communicator keeps them in one
//! sequence.

use std::sync::{Arc, Mutex};

use rtrun::collective::{CollectiveConfig, CollectiveError, Communicator};

use crate::error::{Result, ShardError};

/// A rank's place in its data-parallel group and, once used, the group's communicator.
#[derive(Clone)]
pub struct GroupComm {
    rank: usize,
    world_size: usize,
    slot: Arc<Mutex<Slot>>,
    /// A second ring of the same ranks for stage 3's prefetching gathers, which run on a
    /// thread of their own while the first ring serves the layer being computed. The first
    /// sharded model of the rank to ask takes it (a ring's collectives must come from one
    /// thread in one order), the others gather without prefetching.
    prefetch: Arc<Mutex<Option<CollectiveConfig>>>,
}

impl std::fmt::Debug for GroupComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

enum Slot {
    /// Not joined yet: the configuration to join with.
    Pending(Box<CollectiveConfig>),
    Ready(Communicator),
    /// Joining failed; every later use reports it.
    Failed(String),
}

impl GroupComm {
    /// The calling actor's group (rank and world size from its membership); the collective
    /// is joined on first use, by every rank alike.
    pub fn from_group_context() -> Result<Self> {
        let context = rtrun::context().map_err(|e| ShardError::Config(e.to_string()))?;
        match context.group {
            Some(membership) => {
                let config = CollectiveConfig::from_membership(&membership);
                // An actor group's rank 0 picks its port and publishes it under the group's
                // key: the prefetch ring does the same under a key of its own.
                let prefetch = config.rendezvous_key.as_ref().map(|key| CollectiveConfig {
                    group_name: format!("{}-prefetch", config.group_name),
                    rendezvous_key: Some(format!("{key}-prefetch")),
                    ..config.clone()
                });
                let comm = Self::joining(config);
                Ok(match prefetch {
                    Some(prefetch) => comm.with_prefetch(prefetch),
                    None => comm,
                })
            }
            None => Ok(Self::solo()),
        }
    }

    /// A group that joins with `config` on first use.
    pub fn joining(config: CollectiveConfig) -> Self {
        Self {
            rank: config.rank,
            world_size: config.world_size,
            slot: Arc::new(Mutex::new(Slot::Pending(Box::new(config)))),
            prefetch: Arc::new(Mutex::new(None)),
        }
    }

    /// Adds the ring stage 3's prefetching gathers use (same ranks, another group name and
    /// rendezvous); without one, every gather runs when its layer needs it.
    pub fn with_prefetch(self, config: CollectiveConfig) -> Self {
        *self.prefetch.lock().unwrap_or_else(|p| p.into_inner()) = Some(config);
        self
    }

    /// Takes the prefetch ring's group (joined on first use, by the thread that runs it); the
    /// first caller of the rank gets it.
    pub(crate) fn take_prefetch_group(&self) -> Option<GroupComm> {
        let taken = self.prefetch.lock().unwrap_or_else(|p| p.into_inner()).take();
        taken.map(Self::joining)
    }

    /// A group of one (no collective is ever needed).
    pub fn solo() -> Self {
        Self::joining(CollectiveConfig::new("solo", 0, 1, "127.0.0.1", 0))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Runs `f` on the communicator (joining the group first if needed); `what` names the
    /// operation in errors.
    pub fn run<R>(
        &self,
        what: impl FnOnce() -> String,
        f: impl FnOnce(&mut Communicator) -> Result<R, CollectiveError>,
    ) -> Result<R> {
        self.with(|comm| f(comm).map_err(|source| ShardError::Collective { what: what(), source }))
    }

    /// Runs `f` on the communicator, joining first if needed.
    pub fn with<R>(&self, f: impl FnOnce(&mut Communicator) -> Result<R>) -> Result<R> {
        // A panic while holding the lock cannot leave a half-joined communicator: the slot is
        // replaced only after `init` returns.
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Slot::Pending(config) = &*slot {
            let group = config.group_name.clone();
            *slot = match Communicator::init((**config).clone()) {
                Ok(comm) => Slot::Ready(comm),
                Err(e) => Slot::Failed(format!("joining the collective of group `{group}`: {e}")),
            };
        }
        match &mut *slot {
            Slot::Ready(comm) => f(comm),
            Slot::Failed(message) => Err(ShardError::Config(message.clone())),
            Slot::Pending(_) => Err(ShardError::Config("the collective was not joined".into())),
        }
    }
}
