//! The dock's configuration: its columns, consumers, shape and sampling policy.
//!
//! Names are resolved to dense ids here once, so that the index core works on `usize` ids and
//! bitmaps and only the boundary deals with strings.

use serde::{Deserialize, Serialize};

use crate::column::ColumnKind;
use crate::error::DockError;

/// One column of the dock: a name and the type of value each row holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnSpec {
    /// The column's name, e.g. `responses` or `old_log_prob`.
    pub name: String,
    /// What each row of the column holds.
    pub kind: ColumnKind,
}

/// In which order a consumer receives the ready prompt groups.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SampleOrder {
    /// Lowest group index first: a stable, reproducible order that follows the prompt order
    /// (what MindSpeed-RL does under partial rollout).
    Ascending,
    /// Uniformly random among the usable groups, from the consumer's own seeded generator, so
    /// that DP ranks see a mix of prompts. The chosen groups are returned in ascending order.
    #[default]
    Random,
}

/// How a consumer's requests are served. Every field has a default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplingConfig {
    /// Which usable groups are picked first. Default: [`SampleOrder::Random`].
    pub order: SampleOrder,
    /// Seed of the per-consumer generators; consumer `i` draws from `seed` mixed with `i`, so
    /// consumers are independent but the whole dock is reproducible. Default: 0.
    pub seed: u64,
    /// When fewer groups remain unconsumed than a request asks for and all of them are ready,
    /// hand out those remaining groups instead of waiting forever for a full batch. Off by
    /// default because DP ranks usually need equal batch sizes. Default: false.
    pub allow_short_final_batch: bool,
}

/// The shape of a dock: columns × rows, rows = prompts × samples per prompt, and the consumers
/// that read it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DockConfig {
    /// The columns, in id order.
    pub columns: Vec<ColumnSpec>,
    /// The consumers (pipeline stages), in id order.
    pub consumers: Vec<String>,
    /// Prompts per dock fill (the rollout batch).
    pub prompts: usize,
    /// Samples generated per prompt (`n`); a prompt group is this many consecutive rows.
    pub samples_per_prompt: usize,
    /// How requests are served.
    pub sampling: SamplingConfig,
}

/// A column's dense id in a [`DockConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ColumnId(pub usize);

/// A consumer's dense id in a [`DockConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConsumerId(pub usize);

impl DockConfig {
    /// A dock of `prompts` × `samples_per_prompt` rows with no columns or consumers yet and the
    /// default sampling policy.
    pub fn new(prompts: usize, samples_per_prompt: usize) -> Self {
        Self {
            columns: Vec::new(),
            consumers: Vec::new(),
            prompts,
            samples_per_prompt,
            sampling: SamplingConfig::default(),
        }
    }

    /// Adds a column.
    pub fn with_column(mut self, name: impl Into<String>, kind: ColumnKind) -> Self {
        self.columns.push(ColumnSpec { name: name.into(), kind });
        self
    }

    /// Adds a consumer.
    pub fn with_consumer(mut self, name: impl Into<String>) -> Self {
        self.consumers.push(name.into());
        self
    }

    /// Replaces the sampling policy.
    pub fn with_sampling(mut self, sampling: SamplingConfig) -> Self {
        self.sampling = sampling;
        self
    }

    /// Checks that the config describes a dock: at least one prompt, sample, column and
    /// consumer, unique non-empty names, and a row count that fits in memory indices.
    pub fn validate(&self) -> Result<(), DockError> {
        let invalid = |reason: String| Err(DockError::InvalidConfig { reason });
        if self.prompts == 0 {
            return invalid("expected at least 1 prompt, found 0".into());
        }
        if self.samples_per_prompt == 0 {
            return invalid("expected at least 1 sample per prompt, found 0".into());
        }
        if self.prompts.checked_mul(self.samples_per_prompt).is_none() {
            return invalid(format!(
                "{} prompts × {} samples overflows the row index",
                self.prompts, self.samples_per_prompt
            ));
        }
        if self.columns.is_empty() {
            return invalid("expected at least 1 column, found 0".into());
        }
        if self.consumers.is_empty() {
            return invalid("expected at least 1 consumer, found 0".into());
        }
        if let Some(name) = first_duplicate(self.columns.iter().map(|c| c.name.as_str())) {
            return invalid(format!("column `{name}` is declared twice"));
        }
        if let Some(name) = first_duplicate(self.consumers.iter().map(String::as_str)) {
            return invalid(format!("consumer `{name}` is declared twice"));
        }
        Ok(())
    }

    /// The number of rows, prompts × samples per prompt (saturating; [`Self::validate`] rejects
    /// configs where it would overflow).
    pub fn rows(&self) -> usize {
        self.prompts.saturating_mul(self.samples_per_prompt)
    }

    /// The id of the column called `name`.
    pub fn column_id(&self, name: &str) -> Result<ColumnId, DockError> {
        self.columns.iter().position(|c| c.name == name).map(ColumnId).ok_or_else(|| {
            DockError::UnknownColumn {
                name: name.to_owned(),
                known: join(self.columns.iter().map(|c| c.name.as_str())),
            }
        })
    }

    /// The ids of `names`, rejecting an empty list and repeated names.
    pub fn column_ids<S: AsRef<str>>(&self, names: &[S]) -> Result<Vec<ColumnId>, DockError> {
        if names.is_empty() {
            return Err(DockError::NoColumns);
        }
        if let Some(name) = first_duplicate(names.iter().map(AsRef::as_ref)) {
            return Err(DockError::DuplicateColumn { name: name.into() });
        }
        names.iter().map(|name| self.column_id(name.as_ref())).collect()
    }

    /// The id of the consumer called `name`.
    pub fn consumer_id(&self, name: &str) -> Result<ConsumerId, DockError> {
        self.consumers.iter().position(|c| c == name).map(ConsumerId).ok_or_else(|| {
            DockError::UnknownConsumer {
                name: name.to_owned(),
                known: join(self.consumers.iter().map(String::as_str)),
            }
        })
    }

    /// The seed of consumer `id`'s generator: the dock seed mixed with the id, so that two
    /// consumers never share a stream.
    pub(crate) fn consumer_seed(&self, id: ConsumerId) -> u64 {
        let mut mixer = rtrun_rlhf_rng::SplitMix64::new(self.sampling.seed ^ (id.0 as u64));
        mixer.next_u64()
    }
}

fn first_duplicate<'a>(names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let mut seen = std::collections::HashSet::new();
    names.into_iter().find(|name| !seen.insert(*name))
}

fn join<'a>(names: impl Iterator<Item = &'a str>) -> String {
    names.collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> DockConfig {
        DockConfig::new(4, 2)
            .with_column("prompts", ColumnKind::TokenIds)
            .with_column("rm_scores", ColumnKind::Scalars)
            .with_consumer("rule_reward")
    }

    #[test]
    fn valid_config_resolves_names() {
        let config = config();
        config.validate().unwrap();
        assert_eq!(config.rows(), 8);
        assert_eq!(config.column_id("rm_scores").unwrap(), ColumnId(1));
        assert_eq!(config.consumer_id("rule_reward").unwrap(), ConsumerId(0));
        let error = config.column_id("nope").unwrap_err();
        assert_eq!(
            error.to_string(),
            "unknown column `nope`, expected one of [prompts, rm_scores]"
        );
        assert!(matches!(config.consumer_id("x"), Err(DockError::UnknownConsumer { .. })));
    }

    #[test]
    fn column_ids_rejects_empty_and_duplicates() {
        let config = config();
        assert_eq!(config.column_ids::<&str>(&[]), Err(DockError::NoColumns));
        assert!(matches!(
            config.column_ids(&["prompts", "prompts"]),
            Err(DockError::DuplicateColumn { .. })
        ));
    }

    #[test]
    fn invalid_configs_are_rejected() {
        assert!(
            DockConfig::new(0, 2)
                .with_column("a", ColumnKind::Scalars)
                .with_consumer("c")
                .validate()
                .is_err()
        );
        assert!(
            DockConfig::new(2, 0)
                .with_column("a", ColumnKind::Scalars)
                .with_consumer("c")
                .validate()
                .is_err()
        );
        assert!(DockConfig::new(2, 2).with_consumer("c").validate().is_err());
        assert!(DockConfig::new(2, 2).with_column("a", ColumnKind::Scalars).validate().is_err());
        assert!(config().with_column("prompts", ColumnKind::Floats).validate().is_err());
        assert!(config().with_consumer("rule_reward").validate().is_err());
        assert!(
            DockConfig::new(usize::MAX, 2)
                .with_column("a", ColumnKind::Scalars)
                .with_consumer("c")
                .validate()
                .is_err()
        );
    }

    #[test]
    fn consumer_seeds_differ() {
        let config = config().with_consumer("other");
        assert_ne!(config.consumer_seed(ConsumerId(0)), config.consumer_seed(ConsumerId(1)));
    }
}
