//! The synthetic verifiable tasks of the shipped examples, their character-level tokenizer and the
//! JSONL prompt datasets the driver writes into a run directory.
//!
//! A task turns a seeded random source into `{prompt, label}` records whose answer a rule can
//! check exactly, which is what lets a tiny model show a clear reward rise on two CPU cores:
//! - `reverse_digits`: `"4071>"` → `"1704"`;
//! - `sort_digits`: `"4071>"` → `"0147"`;
//! - `add`: `"38+7="` → `"45"`.
//!
//! The tokenizer has one id per character, so an engine needs no `tokenizer.json`: prompts go
//! out as ids and responses come back as ids.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::TrainError;
use crate::rng::SplitMix64;

/// Id of the padding token.
pub const PAD_ID: u32 = 0;
/// Id of the beginning-of-sequence token (first token of every prompt).
pub const BOS_ID: u32 = 1;
/// Id of the end-of-sequence token (ends every answer).
pub const EOS_ID: u32 = 2;

/// The characters after the three special tokens, in id order.
const CHARS: &str = "0123456789>+=";

/// One id per character of `CHARS`, after `<pad>`, `<bos>` and `<eos>`.
#[derive(Debug, Clone, Copy, Default)]
pub struct CharTokenizer;

impl CharTokenizer {
    /// Number of ids (specials included).
    pub const VOCAB_SIZE: usize = 3 + CHARS.len();

    /// `<bos>` followed by one id per character.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TrainError> {
        let mut ids = vec![BOS_ID];
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    /// One id per character; characters outside the vocabulary are an error.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TrainError> {
        text.chars()
            .map(|c| {
                CHARS.find(c).map(|i| 3 + i as u32).ok_or_else(|| {
                    TrainError::Data(format!(
                        "text should use only the characters `{CHARS}`, found `{c}` in `{text}`"
                    ))
                })
            })
            .collect()
    }

    /// The text of `ids`, stopping at `<eos>` and skipping `<pad>`/`<bos>`; ids outside the
    /// vocabulary decode as `?` so a malformed generation still gets a (low) reward.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        for &id in ids {
            match id {
                EOS_ID => break,
                PAD_ID | BOS_ID => {}
                _ => out.push(CHARS.chars().nth((id - 3) as usize).unwrap_or('?')),
            }
        }
        out
    }
}

/// A prompt and the exact answer a rule checks against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptRecord {
    /// The prompt text (without `<bos>`).
    pub prompt: String,
    /// The expected answer text (without `<eos>`).
    pub label: String,
}

/// Which synthetic task the run learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            kind: TaskKind::ReverseDigits,
            min_digits: 3,
            max_digits: 6,
            train_size: 4096,
            eval_size: 128,
        }
    }
}

impl TaskConfig {
    /// Longest answer in tokens, `<eos>` included: the generation budget.
    pub fn max_answer_tokens(&self) -> usize {
        match self.kind {
            TaskKind::ReverseDigits | TaskKind::SortDigits => self.max_digits + 1,
            TaskKind::Add => self.max_digits + 2,
        }
    }

    /// Longest prompt in tokens, `<bos>` included.
    pub fn max_prompt_tokens(&self) -> usize {
        match self.kind {
            TaskKind::ReverseDigits | TaskKind::SortDigits => self.max_digits + 2,
            TaskKind::Add => 2 * self.max_digits + 3,
        }
    }

    /// One record drawn from `rng`.
    pub fn sample(&self, rng: &mut SplitMix64) -> PromptRecord {
        let span = (self.max_digits - self.min_digits + 1) as u64;
        let digits = |rng: &mut SplitMix64| -> String {
            let len = self.min_digits + rng.below(span) as usize;
            (0..len).map(|_| char::from(b'0' + rng.below(10) as u8)).collect()
        };
        match self.kind {
            TaskKind::ReverseDigits => {
                let d = digits(rng);
                PromptRecord { prompt: format!("{d}>"), label: d.chars().rev().collect() }
            }
            TaskKind::SortDigits => {
                let d = digits(rng);
                let mut sorted: Vec<char> = d.chars().collect();
                sorted.sort_unstable();
                PromptRecord { prompt: format!("{d}>"), label: sorted.into_iter().collect() }
            }
            TaskKind::Add => {
                let (a, b) = (digits(rng), digits(rng));
                // Leading zeros are kept in the prompt; the sum is written without them.
                let sum = a.parse::<u128>().unwrap_or(0) + b.parse::<u128>().unwrap_or(0);
                PromptRecord { prompt: format!("{a}+{b}="), label: sum.to_string() }
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

/// Writes records as JSON lines.
pub fn write_jsonl(path: &Path, records: &[PromptRecord]) -> Result<(), TrainError> {
    let io = |e| TrainError::io(path, e);
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for record in records {
        let line = serde_json::to_string(record).map_err(|e| TrainError::Data(e.to_string()))?;
        writeln!(file, "{line}").map_err(io)?;
    }
    file.flush().map_err(io)
}

/// Reads JSON lines of `{prompt, label}`; a bad line is an error naming its line number.
pub fn read_jsonl(path: &Path) -> Result<Vec<PromptRecord>, TrainError> {
    crate::data::read_records(path)?
        .into_iter()
        .map(|record| {
            serde_json::from_value(record.value).map_err(|e| {
                TrainError::Data(format!(
                    "{}: expected a JSON object {{\"prompt\": .., \"label\": ..}}, found {e}",
                    record.location
                ))
            })
        })
        .collect()
}

/// An epoch-wise, seeded shuffle over a dataset, with a position that checkpoints record
/// (OpenRLHF resumes from `consumed_samples`; here the position says the same thing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptLoader {
    /// Dataset size.
    pub len: usize,
    /// Shuffle seed.
    pub seed: u64,
    /// Samples consumed so far, across epochs.
    pub consumed: usize,
}

impl PromptLoader {
    /// A loader at the start of the data.
    pub fn new(len: usize, seed: u64) -> Self {
        Self { len, seed, consumed: 0 }
    }

    /// The order of epoch `epoch`: a Fisher-Yates shuffle seeded by `(seed, epoch)`.
    fn order(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        let mut rng = SplitMix64::new(self.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9));
        for i in (1..order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
        order
    }

    /// The next `count` dataset indices, wrapping into the next epoch when one runs out.
    pub fn next_batch(&mut self, count: usize) -> Vec<usize> {
        if self.len == 0 {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(count);
        let mut epoch = self.consumed / self.len;
        let mut order = self.order(epoch);
        while out.len() < count {
            let e = self.consumed / self.len;
            if e != epoch {
                epoch = e;
                order = self.order(epoch);
            }
            out.push(order[self.consumed % self.len]);
            self.consumed += 1;
        }
        out
    }

    /// The epoch the next sample comes from.
    pub fn epoch(&self) -> usize {
        self.consumed.checked_div(self.len).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_round_trips_and_rejects_foreign_characters() {
        let tok = CharTokenizer;
        let ids = tok.encode_prompt("4071>").unwrap();
        assert_eq!(ids[0], BOS_ID);
        assert_eq!(tok.decode(&ids), "4071>");
        let mut answer = tok.encode("1704").unwrap();
        answer.extend([EOS_ID, 5, 6]);
        assert_eq!(tok.decode(&answer), "1704");
        assert!(tok.encode("12a").unwrap_err().to_string().contains("found `a`"));
        assert_eq!(tok.decode(&[99]), "?");
        assert!(ids.iter().all(|&i| (i as usize) < CharTokenizer::VOCAB_SIZE));
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

    #[test]
    fn jsonl_round_trips_and_names_bad_lines() {
        let dir = std::env::temp_dir().join(format!("rtrun-task-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.jsonl");
        let records =
            TaskConfig { train_size: 5, eval_size: 0, ..Default::default() }.generate(1).unwrap().0;
        write_jsonl(&path, &records).unwrap();
        assert_eq!(read_jsonl(&path).unwrap(), records);
        std::fs::write(&path, "{\"prompt\":\"1>\",\"label\":\"1\"}\nnot json\n").unwrap();
        let err = read_jsonl(&path).unwrap_err().to_string();
        assert!(err.contains(":2:"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn loader_covers_each_epoch_once_and_resumes_identically() {
        let mut loader = PromptLoader::new(10, 5);
        let first: Vec<usize> = loader.next_batch(10);
        let mut sorted = first.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_eq!(loader.epoch(), 1);
        let mut resumed = PromptLoader { consumed: 4, ..PromptLoader::new(10, 5) };
        let mut straight = PromptLoader::new(10, 5);
        straight.next_batch(4);
        assert_eq!(resumed.next_batch(13), straight.next_batch(13));
        assert_ne!(
            PromptLoader::new(10, 5).next_batch(10),
            PromptLoader::new(10, 6).next_batch(10)
        );
    }
}
