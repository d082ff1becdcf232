//! The synthetic verifiable tasks of the shipped examples.
//!
//! A task turns a seeded random source into `{prompt, label}` records whose answer a rule can
//! check exactly, which is what lets a tiny model show a clear reward rise on two CPU cores:
//! - `reverse_digits`: `"4071>"` → `"1704"`;
//! - `sort_digits`: `"4071>"` → `"0147"`;
//! - `add`: `"38+7="` → `"45"`.

use serde::{Deserialize, Serialize};

use crate::error::TrainError;
use crate::prompts::PromptRecord;
use crate::rng::SplitMix64;

/// Which synthetic task the run learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// Reverse a string of digits.
    ReverseDigits,
    /// Sort a string of digits ascending.
    SortDigits,
    /// Add two numbers.
    Add,
}

/// The task's settings (config section `task`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TaskConfig {
    /// The task.
    pub kind: TaskKind,
    /// Fewest digits in a prompt (per operand for `add`).
    pub min_digits: usize,
    /// Most digits in a prompt (per operand for `add`).
    pub max_digits: usize,
    /// Number of training prompts.
    pub train_size: usize,
    /// Number of held-out prompts (never trained on).
    pub eval_size: usize,
    /// A share of prompts far longer than the rest (`reverse_digits` and `sort_digits`): a
    /// long-tailed response-length distribution, as real rollouts have. Absent: none.
    pub long_tail: Option<LongTail>,
}

/// `data.synthetic.long_tail`: `share` of the prompts have `min_digits..=max_digits` digits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LongTail {
    /// The share of long prompts, in [0, 1].
    pub share: f64,
    /// Fewest digits of a long prompt.
    pub min_digits: usize,
    /// Most digits of a long prompt (at most 512).
    pub max_digits: usize,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            kind: TaskKind::ReverseDigits,
            min_digits: 3,
            max_digits: 6,
            train_size: 4096,
            eval_size: 128,
            long_tail: None,
        }
    }
}

impl TaskConfig {
    /// Longest answer in tokens, `<eos>` included: the generation budget.
    pub fn max_answer_tokens(&self) -> usize {
        match self.kind {
            TaskKind::ReverseDigits | TaskKind::SortDigits => self.longest() + 1,
            TaskKind::Add => self.max_digits + 2,
        }
    }

    /// Longest prompt in tokens, `<bos>` included.
    pub fn max_prompt_tokens(&self) -> usize {
        match self.kind {
            TaskKind::ReverseDigits | TaskKind::SortDigits => self.longest() + 2,
            TaskKind::Add => 2 * self.max_digits + 3,
        }
    }

    /// The most digits of any prompt (the long tail's included).
    fn longest(&self) -> usize {
        self.long_tail.as_ref().map_or(self.max_digits, |t| t.max_digits.max(self.max_digits))
    }

    /// One record drawn from `rng`.
    pub fn sample(&self, rng: &mut SplitMix64) -> PromptRecord {
        let (min, max) = match &self.long_tail {
            // 2^-53 steps: `share` of the draws land in the tail.
            Some(t) if ((rng.next_u64() >> 11) as f64 / ((1u64 << 53) as f64)) < t.share => {
                (t.min_digits, t.max_digits)
            }
            _ => (self.min_digits, self.max_digits),
        };
        let span = (max - min + 1) as u64;
        let digits = |rng: &mut SplitMix64| -> String {
            let len = min + rng.below(span) as usize;
            (0..len).map(|_| char::from(b'0' + rng.below(10) as u8)).collect()
        };
        match self.kind {
            TaskKind::ReverseDigits => {
                let d = digits(rng);
                PromptRecord {
                    prompt: format!("{d}>"),
                    label: d.chars().rev().collect(),
                    ..Default::default()
                }
            }
            TaskKind::SortDigits => {
                let d = digits(rng);
                let mut sorted: Vec<char> = d.chars().collect();
                sorted.sort_unstable();
                PromptRecord {
                    prompt: format!("{d}>"),
                    label: sorted.into_iter().collect(),
                    ..Default::default()
                }
            }
            TaskKind::Add => {
                let (a, b) = (digits(rng), digits(rng));
                // Leading zeros are kept in the prompt; the sum is written without them.
                let sum = a.parse::<u128>().unwrap_or(0) + b.parse::<u128>().unwrap_or(0);
                PromptRecord {
                    prompt: format!("{a}+{b}="),
                    label: sum.to_string(),
                    ..Default::default()
                }
            }
        }
    }

    /// The train and held-out splits: distinct prompts drawn from `seed`; no held-out prompt
    /// appears in the training split.
    pub fn generate(
        &self,
        seed: u64,
    ) -> Result<(Vec<PromptRecord>, Vec<PromptRecord>), TrainError> {
        let mut rng = SplitMix64::new(seed);
        let mut seen = std::collections::HashSet::new();
        let wanted = self.train_size + self.eval_size;
        let mut records = Vec::with_capacity(wanted);
        // Small digit ranges have few distinct prompts; give up instead of looping forever.
        let max_draws = wanted.saturating_mul(50).max(1000);
        for _ in 0..max_draws {
            if records.len() == wanted {
                break;
            }
            let record = self.sample(&mut rng);
            if seen.insert(record.prompt.clone()) {
                records.push(record);
            }
        }
        if records.len() < wanted {
            return Err(TrainError::Config {
                key: "task.train_size".into(),
                message: format!(
                    "expected at most {} distinct prompts for digits {}..={}, asked for {wanted}",
                    records.len(),
                    self.min_digits,
                    self.max_digits
                ),
            });
        }
        let eval = records.split_off(self.train_size);
        Ok((records, eval))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::chars::CharTokenizer;

    #[test]
    fn a_long_tail_is_its_share_of_long_prompts_and_widens_the_budget() {
        let tail = LongTail { share: 0.1, min_digits: 30, max_digits: 40 };
        let config = TaskConfig {
            train_size: 2000,
            eval_size: 10,
            long_tail: Some(tail),
            ..Default::default()
        };
        let (train, _) = config.generate(3).unwrap();
        let long = train.iter().filter(|r| r.label.len() >= 30).count();
        assert!((150..=250).contains(&long), "{long} of 2000 long prompts for a share of 0.1");
        assert!(
            train.iter().all(|r| r.label.len() <= 40
                && r.label.chars().rev().collect::<String>() + ">" == r.prompt)
        );
        assert_eq!(config.max_answer_tokens(), 41);
        assert_eq!(config.max_prompt_tokens(), 42);
    }

    #[test]
    fn tasks_give_checkable_answers_and_disjoint_splits() {
        for kind in [TaskKind::ReverseDigits, TaskKind::SortDigits, TaskKind::Add] {
            let config = TaskConfig { kind, train_size: 300, eval_size: 50, ..Default::default() };
            let (train, eval) = config.generate(7).unwrap();
            assert_eq!((train.len(), eval.len()), (300, 50));
            let prompts: std::collections::HashSet<_> = train.iter().map(|r| &r.prompt).collect();
            assert!(eval.iter().all(|r| !prompts.contains(&r.prompt)));
            for r in train.iter().chain(&eval) {
                let tok = CharTokenizer;
                assert!(tok.encode_prompt(&r.prompt).unwrap().len() <= config.max_prompt_tokens());
                assert!(tok.encode(&r.label).unwrap().len() < config.max_answer_tokens());
            }
        }
        let r = TaskConfig::default().sample(&mut SplitMix64::new(1));
        let digits = r.prompt.trim_end_matches('>');
        assert_eq!(r.label, digits.chars().rev().collect::<String>());
        // Same seed, same data.
        assert_eq!(
            TaskConfig::default().generate(3).unwrap(),
            TaskConfig::default().generate(3).unwrap()
        );
    }

    #[test]
    fn too_few_distinct_prompts_is_a_config_error() {
        let config = TaskConfig {
            min_digits: 1,
            max_digits: 1,
            train_size: 20,
            eval_size: 5,
            ..Default::default()
        };
        let err = config.generate(1).unwrap_err().to_string();
        assert!(err.contains("task.train_size"), "{err}");
    }
}
