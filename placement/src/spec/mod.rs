//! YAML placement specs for colocation: which placement groups exist and which role groups
//! (actor, ref, critic, reward, vLLM engines) use which of their bundles. The format is
//! documented in `placement/SPEC.md`.
//!
//! [`parse_spec`] takes the file's text and its name (the runtime reads the file; this crate
//! does no I/O), checks it completely, and returns a [`PlacementSpec`] or a [`SpecError`] that
//! reads `file:line:column: expected X, found Y`. [`PlacementSpec::plan`] turns a valid spec
//! into placement-group requests and one placement per actor.

mod plan;
mod raw;
mod validate;

use serde::{Deserialize, Serialize};

use crate::cluster::Strategy;
use crate::resources::ResourceSet;

pub use plan::{ActorPlacement, PlacementPlan, ScheduledActor, ScheduledPlan, SpecBundle};

/// Bounds on what one spec may ask for, so a hostile or mistyped file cannot make the parser
/// allocate without limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecLimits {
    /// The most bundles one placement group may have (default 4,096: 512 nodes × 8 GPUs).
    pub max_bundles_per_group: u64,
    /// The most replicas one role may have (default 65,536).
    pub max_replicas: u64,
    /// The most GPUs one bundle may hold (default 64; a node has 8 or 16).
    pub max_gpus_per_bundle: u64,
    /// The largest spec file accepted, in bytes (default 1 MiB).
    pub max_bytes: usize,
}

impl Default for SpecLimits {
    fn default() -> Self {
        SpecLimits {
            max_bundles_per_group: 4096,
            max_replicas: 65_536,
            max_gpus_per_bundle: 64,
            max_bytes: 1 << 20,
        }
    }
}

/// A spec file that is not valid YAML, has the wrong shape, or asks for something impossible.
/// Both kinds display as `file:line:column: message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The YAML does not parse or does not have the spec's shape (unknown key, wrong type).
    #[error("{file}:{line}:{column}: {message}")]
    Syntax {
        /// The file name given to [`parse_spec`].
        file: String,
        /// 1-based line (0 when the parser knew none).
        line: u64,
        /// 1-based column (0 when the parser knew none).
        column: u64,
        /// What was expected and what was found.
        message: String,
    },
    /// The YAML has the right shape but its content is inconsistent (unknown group, bundle
    /// index out of range, over-committed bundle, replicas not matching bundles).
    #[error("{file}:{line}:{column}: {message}")]
    Invalid {
        /// The file name given to [`parse_spec`].
        file: String,
        /// 1-based line.
        line: u64,
        /// 1-based column.
        column: u64,
        /// What was expected and what was found.
        message: String,
    },
}

impl SpecError {
    /// The `(line, column)` the error points at.
    pub fn position(&self) -> (u64, u64) {
        match self {
            SpecError::Syntax { line, column, .. } | SpecError::Invalid { line, column, .. } => {
                (*line, *column)
            }
        }
    }
}

/// A checked spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementSpec {
    /// Placement groups, in file order.
    pub groups: Vec<GroupSpec>,
    /// Role groups, in file order.
    pub roles: Vec<RoleSpec>,
}

/// One placement group of a spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSpec {
    /// The group's name.
    pub name: String,
    /// Its strategy.
    pub strategy: Strategy,
    /// Its bundles with `count` expanded, in order.
    pub bundles: Vec<ResourceSet>,
}

/// One role group of a spec: `replicas` actors of one role.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleSpec {
    /// The role's name (`actor`, `ref`, `critic`, `reward`, `vllm_engine`, …).
    pub name: String,
    /// How many actors (ranks).
    pub replicas: usize,
    /// What each actor needs.
    pub resources: ResourceSet,
    /// Where its actors go; `None` places them anywhere in the cluster.
    pub placement: Option<RolePlacement>,
}

/// The group and bundles a role's actors live in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolePlacement {
    /// The placement group's name.
    pub group: String,
    /// The bundle indices used, in rank order; consecutive ranks share a bundle when there are
    /// more replicas than bundles.
    pub bundles: Vec<usize>,
}

impl RolePlacement {
    /// The bundle that rank `rank` of `replicas` uses.
    pub fn bundle_of_rank(&self, rank: usize, replicas: usize) -> Option<usize> {
        let per_bundle = replicas.checked_div(self.bundles.len())?;
        self.bundles.get(rank.checked_div(per_bundle)?).copied()
    }
}

/// Parses and checks a spec with the default [`SpecLimits`]. `file` is only used in messages.
pub fn parse_spec(text: &str, file: &str) -> Result<PlacementSpec, SpecError> {
    parse_spec_with(text, file, &SpecLimits::default())
}

/// Parses and checks a spec within `limits`.
pub fn parse_spec_with(
    text: &str,
    file: &str,
    limits: &SpecLimits,
) -> Result<PlacementSpec, SpecError> {
    if text.len() > limits.max_bytes {
        return Err(SpecError::Syntax {
            file: file.to_owned(),
            line: 1,
            column: 1,
            message: format!(
                "expected a spec of at most {} bytes, found {} bytes",
                limits.max_bytes,
                text.len()
            ),
        });
    }
    let raw: raw::RawSpec =
        serde_saphyr::from_str(text).map_err(|err| syntax_error(&err, file, text))?;
    validate::validate(raw, file, limits)
}

fn syntax_error(err: &serde_saphyr::Error, file: &str, text: &str) -> SpecError {
    let plain = err.without_snippet();
    let (line, column) = plain.location().map_or((0, 0), |at| (at.line(), at.column()));
    let rendered = plain.to_string();
    let suffix = format!(" at line {line}, column {column}");
    let message = rendered.strip_suffix(&suffix).unwrap_or(&rendered);
    let message = rephrase(message, &token_at(text, line, column));
    SpecError::Syntax { file: file.to_owned(), line, column, message }
}

/// Puts the YAML library's messages into this crate's `expected X, found Y` form.
fn rephrase(message: &str, token: &str) -> String {
    if let Some((found, expected)) = message.split_once(", expected ") {
        return format!("expected {expected}, found {found}");
    }
    if message == "unexpected end of input" {
        return "expected a spec with a `roles` mapping, found the end of the file".to_owned();
    }
    if let Some(kind) = message.strip_prefix("invalid ") {
        let expected = match kind {
            "u8" | "u16" | "u32" | "u64" | "usize" => "a non-negative whole number".to_owned(),
            "floating point" => "a number".to_owned(),
            other => format!("a valid {other}"),
        };
        return format!("expected {expected}, found `{token}`");
    }
    message.to_owned()
}

/// The scalar starting at 1-based `line` and `column` of `text`, for quoting in messages.
fn token_at(text: &str, line: u64, column: u64) -> String {
    let Some(row) = usize::try_from(line).ok().and_then(|l| text.lines().nth(l.checked_sub(1)?))
    else {
        return String::new();
    };
    let skip = usize::try_from(column.saturating_sub(1)).unwrap_or(usize::MAX);
    let token: String =
        row.chars().skip(skip).take_while(|c| !matches!(c, ',' | '}' | ']' | '#')).collect();
    token.trim().to_owned()
}

#[cfg(test)]
mod tests;
