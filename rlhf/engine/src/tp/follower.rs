//! The ranks of a tensor-parallel engine other than 0: a [`Follower`] runs the commands rank 0
//! sends it, one per engine step; [`Followers`] is rank 0's link to them (threads of one
//! process in [`ThreadFollowers`], actor processes in [`crate::actor`]).

use std::sync::mpsc;
use std::thread::JoinHandle;

use rtrun::collective::{CollectiveConfig, Communicator};
use rtrun_rlhf_model::{CausalLm, TextTokenizer};
use serde::{Deserialize, Serialize};

use crate::api::WeightBucket;
use crate::config::EngineConfig;
use crate::engine::weights::{self, WeightResidency};
use crate::engine::{LlmEngine, WakeTarget};
use crate::error::EngineError;
use crate::runner::ModelRunner;
use crate::runner::batch::StepBatch;
use crate::tp::{TensorParallel, TpLayout, shard_model};

/// What rank 0 of a tensor-parallel engine asks the other ranks to do, once per operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RankCommand {
    /// Run one engine step (the rank's share of every layer; no logits).
    Step(StepBatch),
    /// Sleep at this level (1: offload the weights, 2: release them), freeing the KV cache.
    Sleep(u32),
    /// Wake these parts (empty: both).
    WakeUp(Vec<WakeTarget>),
    /// Copy this rank's shard of a weight update in (in-process ranks; actor ranks get their
    /// buckets straight from the trainer).
    UpdateWeights(WeightBucket),
}

/// Rank 0's link to the other ranks of its engine.
pub trait Followers: Send + std::fmt::Debug {
    /// Ranks behind the link (the engine's size minus one).
    fn len(&self) -> usize;

    /// Whether the link has no ranks.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sends `command` to every rank, without waiting for it to run (rank 0 then runs its own
    /// part, which meets the others in the layers' all-reduces).
    fn start(&mut self, command: &RankCommand) -> Result<(), EngineError>;

    /// Waits until every rank finished the last command; an error names the rank (and its
    /// node, where the link knows it).
    fn finish(&mut self) -> Result<(), EngineError>;

    /// Gives rank `i + 1` its weight bucket `buckets[i]` and waits until every rank applied it.
    fn update_weights(&mut self, buckets: &[WeightBucket]) -> Result<(), EngineError>;
}

/// A tensor-parallel rank other than 0: its shard of the model, its KV cache, and where its
/// weights are.
#[derive(Debug)]
pub struct Follower {
    runner: ModelRunner,
    weights: WeightResidency,
    shapes: Vec<Vec<i64>>,
    num_blocks: usize,
}

impl Follower {
    /// A rank over its shard `model` (on `config`'s device and dtype) in the group `tp`, with
    /// its KV cache allocated (as many blocks as rank 0's).
    pub fn new(
        model: CausalLm,
        tp: TensorParallel,
        config: &EngineConfig,
    ) -> Result<Self, EngineError> {
        let (runner, shapes, num_blocks) = weights::rank_runner(model, Some(tp), config)?;
        Ok(Self { runner, weights: WeightResidency::Resident, shapes, num_blocks })
    }

    /// Runs one command of rank 0.
    pub fn handle(&mut self, command: &RankCommand) -> Result<(), EngineError> {
        match command {
            RankCommand::Step(batch) => {
                self.weights.require_resident("a forward step")?;
                self.runner.execute_shard(batch)
            }
            RankCommand::Sleep(level) => {
                weights::sleep_rank(&mut self.runner, &mut self.weights, *level)
            }
            RankCommand::WakeUp(targets) => weights::wake_rank(
                &mut self.runner,
                &mut self.weights,
                &self.shapes,
                self.num_blocks,
                targets,
            ),
            RankCommand::UpdateWeights(bucket) => self.update_weights(bucket).map(drop),
        }
    }

    /// Copies this rank's shard of a weight update into its model (see
    /// [`LlmEngine::update_weights`]). Returns the tensors updated.
    pub fn update_weights(&mut self, bucket: &WeightBucket) -> Result<usize, EngineError> {
        self.update("update_weights", |model| weights::apply_bucket(model, bucket))
    }

    /// Runs a weight update of any transport on the resident weights.
    pub fn update<T>(
        &mut self,
        operation: &'static str,
        update: impl FnOnce(&CausalLm) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        self.weights.require_resident(operation)?;
        let out = update(self.runner.model());
        self.runner.weights_changed();
        out
    }

    /// The rank's shard of the model.
    pub fn model(&self) -> &CausalLm {
        self.runner.model()
    }

    /// All-reduces issued and bytes contributed.
    pub fn tp_totals(&self) -> (u64, u64) {
        self.runner.tp_totals()
    }
}

/// Followers on threads of this process (tests and benchmarks; a deployed engine's ranks are
/// actor processes).
#[derive(Debug)]
pub struct ThreadFollowers {
    ranks: Vec<ThreadRank>,
}

#[derive(Debug)]
struct ThreadRank {
    commands: mpsc::Sender<RankCommand>,
    results: mpsc::Receiver<Result<(), EngineError>>,
    thread: Option<JoinHandle<()>>,
}

impl ThreadFollowers {
    /// Splits the whole model `full` over `world` ranks on a CPU ring at `127.0.0.1:port` and
    /// returns rank 0's engine, whose other ranks run on threads of this process.
    pub fn engine(
        full: &CausalLm,
        tokenizer: Option<TextTokenizer>,
        config: EngineConfig,
        world: usize,
        port: u16,
    ) -> Result<LlmEngine, EngineError> {
        let layout = TpLayout::new(full.config(), world)?;
        let (device, kind) = (config.torch_device()?, config.torch_kind()?);
        let group = format!("tp-engine-{port}");
        let comm_config =
            |rank| CollectiveConfig::new(group.clone(), rank, world, "127.0.0.1", port);
        let mut ranks = Vec::with_capacity(world - 1);
        for rank in 1..world {
            let model = shard_model(full, &layout, rank, device, kind)?;
            let (comm_config, config) = (comm_config(rank), config.clone());
            let (commands, inbox) = mpsc::channel::<RankCommand>();
            let (outbox, results) = mpsc::channel();
            let thread = std::thread::Builder::new()
                .name(format!("tp-rank-{rank}"))
                .spawn(move || {
                    let follower = Communicator::init(comm_config)
                        .map_err(|e| EngineError::TensorParallel {
                            rank,
                            message: format!("joining the group: {e}"),
                        })
                        .and_then(|comm| Follower::new(model, TensorParallel::new(comm), &config));
                    let mut follower = match follower {
                        Ok(follower) => follower,
                        Err(error) => {
                            let _ = outbox.send(Err(error));
                            return;
                        }
                    };
                    for command in inbox {
                        let result = follower.handle(&command).map_err(|e| match e {
                            e @ EngineError::TensorParallel { .. } => e,
                            e => EngineError::TensorParallel { rank, message: e.to_string() },
                        });
                        if outbox.send(result).is_err() {
                            return;
                        }
                    }
                })
                .map_err(|e| EngineError::InvalidArgument(format!("spawning rank {rank}: {e}")))?;
            ranks.push(ThreadRank { commands, results, thread: Some(thread) });
        }
        let comm = Communicator::init(comm_config(0)).map_err(|e| EngineError::TensorParallel {
            rank: 0,
            message: format!("joining the group: {e}"),
        })?;
        let model = shard_model(full, &layout, 0, device, kind)?;
        let followers = Box::new(ThreadFollowers { ranks });
        LlmEngine::tensor_parallel(model, TensorParallel::new(comm), followers, tokenizer, config)
    }
}

impl Followers for ThreadFollowers {
    fn len(&self) -> usize {
        self.ranks.len()
    }

    fn start(&mut self, command: &RankCommand) -> Result<(), EngineError> {
        for (index, rank) in self.ranks.iter().enumerate() {
            rank.commands.send(command.clone()).map_err(|_| EngineError::TensorParallel {
                rank: index + 1,
                message: "its thread has exited".into(),
            })?;
        }
        Ok(())
    }

    fn update_weights(&mut self, buckets: &[WeightBucket]) -> Result<(), EngineError> {
        check_bucket_count(self.ranks.len(), buckets.len())?;
        for (index, (rank, bucket)) in self.ranks.iter().zip(buckets).enumerate() {
            let command = RankCommand::UpdateWeights(bucket.clone());
            rank.commands.send(command).map_err(|_| EngineError::TensorParallel {
                rank: index + 1,
                message: "its thread has exited".into(),
            })?;
        }
        self.finish()
    }

    fn finish(&mut self) -> Result<(), EngineError> {
        let mut first = Ok(());
        for (index, rank) in self.ranks.iter().enumerate() {
            let result = rank.results.recv().unwrap_or_else(|_| {
                Err(EngineError::TensorParallel {
                    rank: index + 1,
                    message: "its thread has exited".into(),
                })
            });
            if first.is_ok() {
                first = result;
            }
        }
        first
    }
}

impl Drop for ThreadFollowers {
    fn drop(&mut self) {
        for rank in &mut self.ranks {
            // Closing the channel ends the rank's loop.
            let (closed, _) = mpsc::channel();
            rank.commands = closed;
            if let Some(thread) = rank.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

/// Checks that a weight update by rank has one bucket for each of the `ranks` other ranks.
pub(crate) fn check_bucket_count(ranks: usize, buckets: usize) -> Result<(), EngineError> {
    match ranks == buckets {
        true => Ok(()),
        false => Err(EngineError::InvalidArgument(format!(
            "expected a weight bucket for each of the {ranks} other ranks, found {buckets}"
        ))),
    }
}
