//! TransferDock: a streaming columnar experience store between rollout and training, after
//! MindSpeed-RL's TransferDock (seed `002`), re-designed for rtrun.
//!
//! # Model
//!
//! The dock is a table of **columns × rows**. Rows are `prompts × samples_per_prompt`; the `n`
//! samples of prompt `p` are the consecutive rows `p·n .. (p+1)·n`, a *prompt group*. Each
//! column has a declared [`ColumnKind`] (token-id rows, float rows or one scalar per row) and
//! each row of it holds a value of its own length.
//!
//! Two kinds of state drive the pipeline:
//! - **readiness per (column, row)**: set when a producer puts the row's value for that column;
//! - **consumption per (consumer, row)**: set when a consumer (a pipeline stage such as
//!   `rule_reward`, `ref_log_prob`, `actor_train`) is handed the row.
//!
//! A consumer asks for `count` rows over some columns and receives only rows that are ready in
//! *every* requested column and that *it* has not received, always in whole prompt groups (GRPO,
//! RLOO and other group baselines need all `n` samples of a prompt together), or nothing if not
//! enough whole groups are ready; it then asks again later. Stages therefore overlap: the reward
//! stage starts on the first finished groups while rollout still generates the rest. Rows can
//! also be requested explicitly (a DP rank's fixed range when the order must be guaranteed).
//!
//! # Layers
//!
//! - [`DockIndex`] (module [`index`]) is the pure core: readiness and consumption as
//!   [`bitmap::RowBitmap`]s and the selection rule, a state machine without I/O, threads or
//!   clocks. Selection ANDs the requested columns' readiness words, removes the consumer's
//!   consumed words, and keeps the groups whose `n` bits are all set; it then picks groups by
//!   the [`SampleOrder`] (ascending, or uniformly at random from a per-consumer SplitMix64
//!   stream, `rtrun_rlhf_rng`, seeded from the config, so runs are reproducible) and marks them
//!   consumed in the same step. This is what the property tests exercise.
//! - [`TransferDock`] adds the data (one slot per (column, row), values moved in without copies)
//!   and makes everything `&self`: a **mutex per consumer** serialises the DP ranks of one
//!   consumer so they never receive the same row, while different consumers sample in parallel
//!   under a shared read lock of the data; puts take the data lock for writing. Its `_packed`
//!   methods take and return [`PackedBatch`]es, copied straight between the wire form and the
//!   row slots.
//! - [`DockActor`] (module [`actor`]) hosts a `TransferDock` as an rtrun actor whose methods
//!   all take `&self`, so the runtime runs them on its pool (`max_concurrency`, set by
//!   [`RemoteDock::create`]) and the dock's own locks decide what overlaps. [`RemoteDock`] is
//!   its blocking, serializable client: hand it to stage actors in other processes.
//! - [`pipeline`] runs stages on the dock: [`run_stage`] is the loop of one stage rank (get its
//!   input columns, work, put its output columns, until its consumer has every row), over any
//!   [`ExperienceStore`] (the local dock or the actor); it records a [`StageTimeline`], and
//!   [`PipelineSummary`] measures how the stages of a run overlapped.
//! - [`pad`] holds the transfer helpers: [`pack`] variable-length rows into one flat buffer plus
//!   lengths (the wire form, no padding bytes), [`unpack`] them back with a length check, and
//!   [`pad_batch`] / [`pad_packed`] into a dense `batch × width` buffer with a mask, `width`
//!   rounded up to a multiple (the TP × CP size) as a model needs.
//!
//! # Example
//!
//! ```
//! use rtrun_rlhf_dock::{ColumnKind, ColumnValues, DockConfig, RowRequest, TransferDock, pad_batch};
//!
//! // 2 prompts × 2 samples; the reward stage reads responses and writes scores.
//! let dock = TransferDock::new(
//!     DockConfig::new(2, 2)
//!         .with_column("responses", ColumnKind::TokenIds)
//!         .with_column("rm_scores", ColumnKind::Scalars)
//!         .with_consumer("rule_reward"),
//! )?;
//! // Rollout finished prompt 1 (rows 2 and 3) first.
//! dock.put_experience(&[2, 3], vec![("responses", ColumnValues::TokenIds(vec![vec![5, 6], vec![7]]))])?;
//! // Asking for two whole groups is not possible yet; one group is.
//! assert!(dock.get_experience("rule_reward", &["responses"], RowRequest::Count(4))?.is_none());
//! let batch = dock.get_experience("rule_reward", &["responses"], RowRequest::Count(2))?.unwrap();
//! assert_eq!(batch.rows, vec![2, 3]);
//! let Some(ColumnValues::TokenIds(responses)) = batch.column("responses") else {
//!     return Err("expected token ids".into());
//! };
//! let padded = pad_batch(responses, 0, 4)?; // width 4: a multiple of TP × CP = 4
//! assert_eq!(padded.values, vec![5, 6, 0, 0, 7, 0, 0, 0]);
//! dock.put_experience(&batch.rows, vec![("rm_scores", ColumnValues::Scalars(vec![1.0, 0.0]))])?;
//! assert!(!dock.all_consumed("rule_reward")?);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Differences from MindSpeed-RL, on purpose
//!
//! - Columns are typed and checked on put; a put of several columns is all-or-nothing.
//! - Explicit-row requests must be whole groups, unconsumed (an error otherwise, instead of
//!   silently handing a row twice) and ready (otherwise `None`, instead of blocking the dock).
//! - An impossible request (count not a multiple of `n`, larger than the dock, unknown names)
//!   is an error rather than an endless stream of empty answers.
//! - A short final batch (fewer groups left than a request asks for) can be enabled with
//!   [`SamplingConfig::allow_short_final_batch`] so a stage can drain a dock whose size is not a
//!   multiple of its dispatch size.
#![forbid(unsafe_code)]

pub mod actor;
pub mod bitmap;
pub mod column;
pub mod config;
pub mod dock;
pub mod error;
pub mod index;
pub mod pad;
pub mod pipeline;

pub use actor::{DockActor, DockActorRef, DockCallError, DockProgress, RemoteDock};
pub use column::{ColumnKind, ColumnValues, PackedColumn};
pub use config::{ColumnId, ColumnSpec, ConsumerId, DockConfig, SampleOrder, SamplingConfig};
pub use dock::{ExperienceBatch, NamedColumn, PackedBatch, PackedNamedColumn, TransferDock};
pub use error::DockError;
pub use index::{ClearScope, DockIndex, RowRequest};
pub use pad::{PackError, PackedRows, PaddedBatch, pack, pad_batch, pad_packed, unpack};
pub use pipeline::{
    ExperienceStore, PipelineSummary, PollConfig, StageError, StageSpec, StageTimeline,
    StageWorkError, run_stage,
};
pub use rtrun_rlhf_rng::SplitMix64;
