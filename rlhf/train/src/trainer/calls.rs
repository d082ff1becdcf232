//! The trainer's calls to role ranks and engines, and how it waits for their answers.
//!
//! Every call in flight carries the name of the rank it went to (`vllm_engine rank 0
//! (actor-3)`), so a failure says which role and rank it came from: the rank's own error, a
//! worker process that died, or a rank that stopped answering. Waiting is watched: an answer
//! still missing after `cluster.stall_warn_s` is logged (a warning naming the late ranks, then
//! again at the same interval), and after `cluster.call_timeout_s` the call fails the step.
//! Ranks of one call are waited for together, so a rank that dies is reported at once even
//! while the others still work.

use std::ops::Deref;
use std::time::{Duration, Instant};

use rtrun::{ActorId, ActorRef, ObjectRef};
use serde::de::DeserializeOwned;

use crate::config::ClusterConfig;
use crate::error::{Result, TrainError};

/// A call's answer: the rank's value or the rank's error message.
pub type Answer<T> = ObjectRef<std::result::Result<T, String>>;

/// Which rank of which role an answer comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankName {
    /// The role, as the placement spec names it (`actor`, `ref`, `critic`, `reward`,
    /// `vllm_engine`).
    pub role: &'static str,
    /// The rank within the role.
    pub rank: usize,
    /// The runtime's actor; `None` for a task (the reward functions run as tasks).
    pub actor: Option<ActorId>,
    /// A tensor-parallel engine's rank other than 0, called directly (a weight sync gives each
    /// rank its shard): that rank and its node.
    pub shard: Option<(usize, String)>,
}

impl std::fmt::Display for RankName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.actor {
            Some(actor) => write!(f, "{} rank {} ({actor})", self.role, self.rank)?,
            None => write!(f, "{} task {}", self.role, self.rank)?,
        }
        match &self.shard {
            Some((rank, node)) => write!(f, ", tensor-parallel rank {rank} (on node {node})"),
            None => Ok(()),
        }
    }
}

/// One call in flight to one rank.
pub struct RankCall<T> {
    /// Who was called.
    pub rank: RankName,
    /// What will come back.
    pub answer: Answer<T>,
}

/// Calls every member of a role (`members[i]` is rank `i`) the same way.
pub fn each<M, A, T>(
    role: &'static str,
    members: &[M],
    mut call: impl FnMut(&M) -> Answer<T>,
) -> Vec<RankCall<T>>
where
    M: Deref<Target = ActorRef<A>>,
{
    members.iter().enumerate().map(|(rank, m)| actor_call(role, rank, m, call(m))).collect()
}

/// Calls each member with its own argument: `args[i]` goes to rank `i` (extra arguments or
/// members are left out, so `args` must have one entry per member).
pub fn each_with<M, A, X, T>(
    role: &'static str,
    members: &[M],
    args: Vec<X>,
    mut call: impl FnMut(&M, X) -> Answer<T>,
) -> Vec<RankCall<T>>
where
    M: Deref<Target = ActorRef<A>>,
{
    members
        .iter()
        .zip(args)
        .enumerate()
        .map(|(rank, (m, x))| actor_call(role, rank, m, call(m, x)))
        .collect()
}

/// Splits `batch` into one contiguous chunk per member and calls each with its chunk.
pub fn dispatch<M, A, T, R>(
    role: &'static str,
    members: &[M],
    batch: Vec<T>,
    call: impl FnMut(&M, Vec<T>) -> Answer<Vec<R>>,
) -> Vec<RankCall<Vec<R>>>
where
    M: Deref<Target = ActorRef<A>>,
{
    each_with(role, members, rtrun::split_batch(batch, members.len()), call)
}

/// A call to `member`, rank `rank` of `role`.
pub fn actor_call<M, A, T>(
    role: &'static str,
    rank: usize,
    member: &M,
    answer: Answer<T>,
) -> RankCall<T>
where
    M: Deref<Target = ActorRef<A>>,
{
    RankCall { rank: RankName { role, rank, actor: Some(member.id()), shard: None }, answer }
}

impl<T> RankCall<T> {
    /// The call goes to rank `rank` of a tensor-parallel engine, on `node`, not to its rank 0.
    pub fn on_shard(mut self, rank: usize, node: &str) -> Self {
        self.rank.shard = Some((rank, node.to_owned()));
        self
    }
}

/// Deadlines of the trainer's calls (`cluster.call_timeout_s`, `cluster.stall_warn_s`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CallWatch {
    /// How long a call may take before it fails the step.
    pub timeout: Duration,
    /// How long a call may take before the late ranks are logged (and again at this interval).
    pub warn_after: Duration,
}

impl CallWatch {
    /// The watch the config asks for (the config checked both are positive and finite).
    pub fn from_config(cluster: &ClusterConfig) -> Self {
        Self {
            timeout: Duration::from_secs_f64(cluster.call_timeout_s),
            warn_after: Duration::from_secs_f64(cluster.stall_warn_s),
        }
    }

    /// Waits for every rank's answer to `call` and returns them in rank order; fails with the
    /// first rank (in arrival order) that fails, or with the ranks still silent at the deadline.
    pub fn wait<T: DeserializeOwned>(&self, call: &str, calls: Vec<RankCall<T>>) -> Result<Vec<T>> {
        let started = Instant::now();
        let deadline = started + self.timeout;
        let mut next_warning = started + self.warn_after;
        let mut answers: Vec<Option<T>> = calls.iter().map(|_| None).collect();
        let mut pending: Vec<usize> = (0..calls.len()).collect();
        while !pending.is_empty() {
            let refs: Vec<_> = pending.iter().map(|&i| calls[i].answer.clone()).collect();
            let wake = next_warning.min(deadline);
            rtrun::wait(&refs, 1, Some(wake.saturating_duration_since(Instant::now())))
                .map_err(TrainError::Runtime)?;
            let mut still = Vec::with_capacity(pending.len());
            for i in pending {
                if calls[i].answer.is_ready() {
                    answers[i] = Some(take(&calls[i])?);
                } else {
                    still.push(i);
                }
            }
            pending = still;
            if pending.is_empty() {
                break;
            }
            let now = Instant::now();
            let late = || {
                pending.iter().map(|&i| calls[i].rank.to_string()).collect::<Vec<_>>().join(", ")
            };
            if now >= deadline {
                return Err(TrainError::Stalled {
                    ranks: late(),
                    call: call.to_owned(),
                    timeout_s: self.timeout.as_secs_f64(),
                    elapsed_s: now.duration_since(started).as_secs_f64(),
                });
            }
            if now >= next_warning {
                tracing::warn!(
                    "{} has not answered `{call}` after {:.0} s (the step fails at \
                     cluster.call_timeout_s = {} s)",
                    late(),
                    now.duration_since(started).as_secs_f64(),
                    self.timeout.as_secs_f64()
                );
                next_warning = now + self.warn_after;
            }
        }
        Ok(answers.into_iter().flatten().collect())
    }

    /// [`CallWatch::wait`] for per-rank lists, concatenated in rank order.
    pub fn gather<R: DeserializeOwned>(
        &self,
        call: &str,
        calls: Vec<RankCall<Vec<R>>>,
    ) -> Result<Vec<R>> {
        Ok(self.wait(call, calls)?.into_iter().flatten().collect())
    }

    /// [`CallWatch::wait`] for a single call.
    pub fn wait_one<T: DeserializeOwned>(&self, call: &str, rank_call: RankCall<T>) -> Result<T> {
        self.wait(call, vec![rank_call])?
            .pop()
            .ok_or_else(|| TrainError::Data(format!("`{call}`: expected one answer, found none")))
    }
}

/// A ready answer as a value or an error naming the rank.
fn take<T: DeserializeOwned>(call: &RankCall<T>) -> Result<T> {
    let rank = || call.rank.to_string();
    match call.answer.get() {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(message)) => Err(TrainError::RankFailed { rank: rank(), message }),
        Err(rtrun::Error::ActorDied { reason, .. }) => {
            Err(TrainError::RankDied { rank: rank(), reason })
        }
        Err(e) => Err(TrainError::RankFailed { rank: rank(), message: e.to_string() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_names_say_role_rank_and_actor() {
        let engine =
            RankName { role: "vllm_engine", rank: 0, actor: Some(ActorId(3)), shard: None };
        assert_eq!(engine.to_string(), format!("vllm_engine rank 0 ({})", ActorId(3)));
        let shard = RankName { shard: Some((1, "n2 (10.0.0.2)".into())), ..engine };
        assert_eq!(
            shard.to_string(),
            format!(
                "vllm_engine rank 0 ({}), tensor-parallel rank 1 (on node n2 (10.0.0.2))",
                ActorId(3)
            )
        );
        let task = RankName { role: "reward", rank: 2, actor: None, shard: None };
        assert_eq!(task.to_string(), "reward task 2");
    }
}
