//! Prompt datasets (config section `data`): a synthetic task, or JSONL / Parquet files of
//! records as OpenRLHF reads them — `input_key` holds a prompt string or a list of chat
//! messages, `label_key` the answer a reward checks — rendered through the policy tokenizer's
//! chat template when `apply_chat_template` is set, and filtered by token length.
//!
//! Every bad record is an error naming the file and line (row, for Parquet); a length filter
//! that drops every prompt is an error, not an empty run.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use rtrun_rlhf_model::ChatMessage;

use crate::demo::task::TaskConfig;
use crate::error::{Result, TrainError};
use crate::prompts::PromptRecord;
use crate::rng::SplitMix64;
use crate::tokenizer::{HfTokenizer, PromptTokenizer};

/// One value or a list of them (`prompt_data: a.jsonl` or `prompt_data: [a.jsonl, b.parquet]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "OneOrManyRepr<T>", into = "Vec<T>")]
#[serde(bound(deserialize = "T: Deserialize<'de> + Clone", serialize = "T: Serialize + Clone"))]
pub struct OneOrMany<T: Clone>(pub Vec<T>);

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrManyRepr<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> From<OneOrManyRepr<T>> for OneOrMany<T> {
    fn from(value: OneOrManyRepr<T>) -> Self {
        match value {
            OneOrManyRepr::One(p) => OneOrMany(vec![p]),
            OneOrManyRepr::Many(v) => OneOrMany(v),
        }
    }
}

impl<T: Clone> From<OneOrMany<T>> for Vec<T> {
    fn from(value: OneOrMany<T>) -> Self {
        value.0
    }
}

impl<T: Clone + schemars::JsonSchema> schemars::JsonSchema for OneOrMany<T> {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        format!("OneOrMany_{}", T::schema_name()).into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let one = generator.subschema_for::<T>();
        schemars::json_schema!({"anyOf": [one, {"type": "array", "items": one}]})
    }
}

impl<T: Clone> Default for OneOrMany<T> {
    fn default() -> Self {
        OneOrMany(Vec::new())
    }
}

impl<T: Clone> OneOrMany<T> {
    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Paths given as one or a list.
pub type PathList = OneOrMany<PathBuf>;

/// Where prompts come from (config section `data`; OpenRLHF's flag in each doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// A generated verifiable task (the shipped demo); used when `prompt_data` is empty.
    pub synthetic: Option<TaskConfig>,
    /// JSONL (`.jsonl`, `.json`) or Parquet (`.parquet`) files (`--prompt_data`).
    pub prompt_data: PathList,
    /// The record key holding the prompt: a string or a list of `{role, content}` messages
    /// (`--input_key`); a dotted key reaches into nested records (`extra_info.question`).
    pub input_key: String,
    /// The record key holding the label a reward checks (`--label_key`; absent: no labels); a
    /// dotted key reaches into nested records (verl's `reward_model.ground_truth`).
    pub label_key: Option<String>,
    /// A template a string prompt is put into, `{}` standing for it (`--input_template`,
    /// e.g. `"Question: {}\nAnswer:"`); not with `apply_chat_template`.
    pub input_template: Option<String>,
    /// With several `prompt_data` files, the share of training prompts drawn from each
    /// (`--prompt_data_probs`, summing to 1): the training set keeps its size and is a seeded
    /// mix of the files by these weights (a file runs out and starts over as needed).
    pub prompt_probs: Option<Vec<f64>>,
    /// Render prompts with the policy tokenizer's chat template (`--apply_chat_template`); a
    /// string input becomes one user message.
    pub apply_chat_template: bool,
    /// Prompts longer than this many tokens are dropped and counted (`--prompt_max_len`).
    pub max_prompt_len: usize,
    /// Use at most this many training records, the first ones (`--max_samples`).
    pub max_samples: Option<usize>,
    /// Held-out files (`--eval_dataset`); without them `eval_fraction` of `prompt_data` is held
    /// out.
    pub eval_data: PathList,
    /// Fraction of `prompt_data` held out for evaluation when `eval_data` is empty.
    pub eval_fraction: f64,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            synthetic: None,
            prompt_data: PathList::default(),
            input_key: "input".to_owned(),
            label_key: None,
            input_template: None,
            prompt_probs: None,
            apply_chat_template: false,
            max_prompt_len: 1024,
            max_samples: None,
            eval_data: PathList::default(),
            eval_fraction: 0.05,
        }
    }
}

impl DataConfig {
    /// The synthetic task of the run: the configured one, or the default task when no prompt
    /// files are given either. `None` for a run on prompt files.
    pub fn synthetic_task(&self) -> Option<TaskConfig> {
        if self.prompt_data.is_empty() {
            Some(self.synthetic.clone().unwrap_or_default())
        } else {
            None
        }
    }

    /// Checks the keys of this section.
    pub fn validate(&self) -> Result<()> {
        if self.synthetic.is_some() && !self.prompt_data.is_empty() {
            return Err(TrainError::config(
                "data.synthetic",
                "expected either data.synthetic or data.prompt_data, found both",
            ));
        }
        if self.prompt_data.is_empty() && !self.eval_data.is_empty() {
            return Err(TrainError::config(
                "data.eval_data",
                "expected data.prompt_data beside it (a synthetic task makes its own held-out set)",
            ));
        }
        if let Some(template) = &self.input_template {
            if template.matches("{}").count() != 1 {
                return Err(TrainError::config(
                    "data.input_template",
                    format!("expected one `{{}}` where the prompt goes, found `{template}`"),
                ));
            }
            if self.apply_chat_template {
                return Err(TrainError::config(
                    "data.input_template",
                    "expected it or data.apply_chat_template, found both (the chat template \
                     already frames the prompt)",
                ));
            }
        }
        if let Some(probs) = &self.prompt_probs {
            let files = self.prompt_data.0.len();
            if probs.len() != files {
                return Err(TrainError::config(
                    "data.prompt_probs",
                    format!(
                        "expected one weight per data.prompt_data file ({files}), found {}",
                        probs.len()
                    ),
                ));
            }
            let sum: f64 = probs.iter().sum();
            if probs.iter().any(|p| !(p.is_finite() && *p >= 0.0)) || (sum - 1.0).abs() > 1e-6 {
                return Err(TrainError::config(
                    "data.prompt_probs",
                    format!("expected weights >= 0 that sum to 1, found {probs:?}"),
                ));
            }
        }
        if self.max_prompt_len == 0 {
            return Err(TrainError::config("data.max_prompt_len", "expected at least 1, found 0"));
        }
        if self.max_samples == Some(0) {
            return Err(TrainError::config("data.max_samples", "expected at least 1, found 0"));
        }
        if !(self.eval_fraction > 0.0 && self.eval_fraction < 1.0) {
            return Err(TrainError::config(
                "data.eval_fraction",
                format!("expected a number in (0, 1), found {}", self.eval_fraction),
            ));
        }
        if self.input_key.is_empty() {
            return Err(TrainError::config("data.input_key", "expected a key name, found ``"));
        }
        Ok(())
    }
}

/// An error naming `key` when one of `files` is not an existing file.
pub fn check_files(key: &str, files: &PathList) -> Result<()> {
    match files.0.iter().find(|f| !f.is_file()) {
        Some(missing) => Err(TrainError::config(
            key,
            format!("expected an existing file, found no file at {}", missing.display()),
        )),
        None => Ok(()),
    }
}

/// One record of a dataset file, with where it came from.
#[derive(Debug, Clone)]
pub struct RawRecord {
    /// `file:line` (JSONL) or `file:row N` (Parquet), for messages.
    pub location: String,
    /// The record.
    pub value: serde_json::Value,
}

/// Reads every record of a JSONL or Parquet file.
pub fn read_records(path: &Path) -> Result<Vec<RawRecord>> {
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match extension {
        "jsonl" | "json" => read_jsonl_records(path),
        "parquet" => read_parquet_records(path),
        other => Err(TrainError::Data(format!(
            "{}: expected a .jsonl, .json or .parquet file, found extension `{other}`",
            path.display()
        ))),
    }
}

fn read_jsonl_records(path: &Path) -> Result<Vec<RawRecord>> {
    use std::io::BufRead;
    let file = std::fs::File::open(path).map_err(|e| TrainError::io(path, e))?;
    let mut records = Vec::new();
    for (index, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| TrainError::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let location = format!("{}:{}", path.display(), index + 1);
        let value: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
            TrainError::Data(format!(
                "{location}: expected a JSON object, found invalid JSON ({e})"
            ))
        })?;
        if !value.is_object() {
            return Err(TrainError::Data(format!(
                "{location}: expected a JSON object, found {}",
                json_kind(&value)
            )));
        }
        records.push(RawRecord { location, value });
    }
    Ok(records)
}

fn read_parquet_records(path: &Path) -> Result<Vec<RawRecord>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let file = std::fs::File::open(path).map_err(|e| TrainError::io(path, e))?;
    let reader = SerializedFileReader::new(file).map_err(|e| {
        TrainError::Data(format!("{}: expected a Parquet file, found {e}", path.display()))
    })?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| TrainError::Data(format!("{}: cannot read rows: {e}", path.display())))?;
    let mut records = Vec::new();
    for (index, row) in rows.enumerate() {
        let location = format!("{}: row {}", path.display(), index + 1);
        let row = row.map_err(|e| TrainError::Data(format!("{location}: {e}")))?;
        records.push(RawRecord { location, value: row.to_json_value() });
    }
    Ok(records)
}

pub(crate) fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The prompt text and label of one record.
pub fn to_prompt_record(
    record: &RawRecord,
    config: &DataConfig,
    tokenizer: &HfTokenizer,
    tools: &[serde_json::Value],
) -> Result<PromptRecord> {
    let at = &record.location;
    let keys = || -> String {
        record
            .value
            .as_object()
            .map(|m| m.keys().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", "))
            .unwrap_or_default()
    };
    let input = lookup(&record.value, &config.input_key).ok_or_else(|| {
        TrainError::Data(format!(
            "{at}: expected the key `{}` (data.input_key), found only {}",
            config.input_key,
            keys()
        ))
    })?;
    let prompt = match input {
        serde_json::Value::String(text) if !config.apply_chat_template => {
            match &config.input_template {
                Some(template) => template.replacen("{}", text, 1),
                None => text.clone(),
            }
        }
        serde_json::Value::String(text) => {
            render(at, tokenizer, &[ChatMessage::new("user", text)], tools)?
        }
        serde_json::Value::Array(items) => {
            if !config.apply_chat_template {
                return Err(TrainError::Data(format!(
                    "{at}: `{}` holds chat messages, which need data.apply_chat_template: true",
                    config.input_key
                )));
            }
            render(at, tokenizer, &chat_messages(at, &config.input_key, items)?, tools)?
        }
        other => {
            return Err(TrainError::Data(format!(
                "{at}: expected `{}` to be a string or a list of chat messages, found {}",
                config.input_key,
                json_kind(other)
            )));
        }
    };
    let label = match &config.label_key {
        None => String::new(),
        Some(key) => match lookup(&record.value, key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) => v.to_string(),
            Some(other) => {
                return Err(TrainError::Data(format!(
                    "{at}: expected the label `{key}` to be a string or a number, found {}",
                    json_kind(other)
                )));
            }
            None => {
                return Err(TrainError::Data(format!(
                    "{at}: expected the key `{key}` (data.label_key), found only {}",
                    keys()
                )));
            }
        },
    };
    let data_source = match record.value.get("data_source") {
        Some(serde_json::Value::String(source)) => source.clone(),
        _ => String::new(),
    };
    Ok(PromptRecord { prompt, label, data_source })
}

/// The value under `key` in `record`: the key itself, else a dotted path into nested objects
/// (`reward_model.ground_truth`).
pub fn lookup<'a>(record: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    record.get(key).or_else(|| key.split('.').try_fold(record, |value, part| value.get(part)))
}

/// `len` training records drawn from `files` (each file's records, in order, restarting when
/// used up) with the weights `probs`, seeded.
fn mix(files: Vec<Vec<PromptRecord>>, probs: &[f64], len: usize, seed: u64) -> Vec<PromptRecord> {
    let usable = probs.iter().zip(&files).any(|(p, f)| *p > 0.0 && !f.is_empty());
    if !usable {
        return files.concat();
    }
    let mut next = vec![0usize; files.len()];
    let mut rng = SplitMix64::new(seed ^ 0x5EED_D1C7);
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let draw = rng.below(1 << 53) as f64 / (1u64 << 53) as f64;
        let mut acc = 0.0;
        let mut file = probs.len() - 1;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if draw < acc {
                file = i;
                break;
            }
        }
        let records = &files[file];
        if records.is_empty() {
            continue;
        }
        out.push(records[next[file] % records.len()].clone());
        next[file] += 1;
    }
    out
}

/// The chat messages of the list `items` under `key` of the record at `at`.
pub(crate) fn chat_messages(
    at: &str,
    key: &str,
    items: &[serde_json::Value],
) -> Result<Vec<ChatMessage>> {
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            serde_json::from_value::<ChatMessage>(m.clone()).map_err(|e| {
                TrainError::Data(format!(
                    "{at}: message {i} of `{key}`: expected {{\"role\": .., \"content\": ..}} with strings, found {m} ({e})"
                ))
            })
        })
        .collect()
}

/// A prompt's text: `messages` through the chat template with the run's `tools` (the
/// assistant's turn opened).
fn render(
    at: &str,
    tokenizer: &HfTokenizer,
    messages: &[ChatMessage],
    tools: &[serde_json::Value],
) -> Result<String> {
    tokenizer
        .pretrained()
        .apply_chat_template_with_tools(messages, true, tools)
        .map_err(|e| TrainError::Data(format!("{at}: {e}")))
}

/// `messages` through the tokenizer's chat template (with the assistant's turn opened when
/// `add_generation_prompt`), an error naming the record at `at` on failure.
pub(crate) fn render_chat(
    at: &str,
    tokenizer: &HfTokenizer,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<String> {
    tokenizer
        .pretrained()
        .apply_chat_template(messages, add_generation_prompt)
        .map_err(|e| TrainError::Data(format!("{at}: {e}")))
}

/// The training and held-out records of a dataset: `read` over `train_files` (`key` names them
/// in errors), the held-out ones read from `eval_files` or, without them, a seeded draw of
/// `fraction` of the training ones; then the training ones capped at `max_samples`.
pub(crate) fn split_records<T>(
    key: &str,
    train_files: &PathList,
    eval_files: &PathList,
    fraction: f64,
    max_samples: Option<usize>,
    seed: u64,
    read: impl Fn(&PathList) -> Result<Vec<T>>,
) -> Result<(Vec<T>, Vec<T>)> {
    let mut train = read(train_files)?;
    let needed = if eval_files.is_empty() { 2 } else { 1 };
    if train.len() < needed {
        return Err(TrainError::Data(format!(
            "{key} {:?} holds {} record(s), expected at least {needed}{}",
            train_files.0,
            train.len(),
            if needed == 2 { " (one is held out without held-out files)" } else { "" }
        )));
    }
    let eval = if eval_files.is_empty() {
        let (kept, eval) = hold_out(train, fraction, seed);
        train = kept;
        eval
    } else {
        read(eval_files)?
    };
    if let Some(max) = max_samples {
        train.truncate(max);
    }
    Ok((train, eval))
}

/// A seeded draw of `fraction` of `records` (at least one, and at least one left): (kept,
/// held out), each in the original order.
fn hold_out<T>(records: Vec<T>, fraction: f64, seed: u64) -> (Vec<T>, Vec<T>) {
    let held_out = ((records.len() as f64 * fraction).ceil() as usize)
        .clamp(1, records.len().saturating_sub(1).max(1));
    let mut order: Vec<usize> = (0..records.len()).collect();
    let mut rng = SplitMix64::new(seed ^ 0xE7A1);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut is_eval = vec![false; records.len()];
    for &i in &order[..held_out] {
        is_eval[i] = true;
    }
    let (mut kept, mut eval) = (Vec::new(), Vec::new());
    for (record, held) in records.into_iter().zip(is_eval) {
        if held { eval.push(record) } else { kept.push(record) }
    }
    (kept, eval)
}

/// The prompts of a run from files, and what was left out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadedPrompts {
    /// Training prompts.
    pub train: Vec<PromptRecord>,
    /// Held-out prompts.
    pub eval: Vec<PromptRecord>,
    /// Prompts dropped for being longer than `data.max_prompt_len` (train, eval).
    pub dropped_too_long: (usize, usize),
}

/// Reads, renders and filters the prompt files of `config`; the held-out split (when no
/// `eval_data` is given) is a seeded draw of `eval_fraction` of the records.
pub fn load_prompts(
    config: &DataConfig,
    tokenizer: &HfTokenizer,
    seed: u64,
    tools: &[serde_json::Value],
) -> Result<LoadedPrompts> {
    // Each record with the index of its file (for `prompt_probs`).
    let read_all = |paths: &PathList| -> Result<Vec<(usize, PromptRecord)>> {
        let mut out = Vec::new();
        for (file, path) in paths.0.iter().enumerate() {
            for record in read_records(path)? {
                out.push((file, to_prompt_record(&record, config, tokenizer, tools)?));
            }
        }
        Ok(out)
    };
    let (train, eval) = split_records(
        "data.prompt_data",
        &config.prompt_data,
        &config.eval_data,
        config.eval_fraction,
        config.max_samples,
        seed,
        read_all,
    )?;
    let mut eval: Vec<PromptRecord> = eval.into_iter().map(|(_, r)| r).collect();
    let mut train: Vec<PromptRecord> = match &config.prompt_probs {
        None => train.into_iter().map(|(_, r)| r).collect(),
        Some(probs) => {
            let len = train.len();
            let mut files = vec![Vec::new(); probs.len()];
            for (file, record) in train {
                files[file].push(record);
            }
            mix(files, probs, len, seed)
        }
    };
    let filter = |records: &mut Vec<PromptRecord>, split: &str| -> Result<usize> {
        let before = records.len();
        let mut longest = 0;
        let mut kept = Vec::with_capacity(before);
        for record in records.drain(..) {
            let tokens = tokenizer.encode_prompt(&record.prompt)?.len();
            longest = longest.max(tokens);
            if tokens <= config.max_prompt_len {
                kept.push(record);
            }
        }
        *records = kept;
        if records.is_empty() && before > 0 {
            return Err(TrainError::config(
                "data.max_prompt_len",
                format!(
                    "every one of the {before} {split} prompts is longer than {} tokens (the longest has {longest}); raise data.max_prompt_len",
                    config.max_prompt_len
                ),
            ));
        }
        Ok(before - records.len())
    };
    let dropped_train = filter(&mut train, "training")?;
    let dropped_eval = filter(&mut eval, "held-out")?;
    if dropped_train + dropped_eval > 0 {
        tracing::warn!(
            train = dropped_train,
            eval = dropped_eval,
            max_prompt_len = config.max_prompt_len,
            "dropped prompts longer than data.max_prompt_len"
        );
    }
    Ok(LoadedPrompts { train, eval, dropped_too_long: (dropped_train, dropped_eval) })
}

/// Writes records as JSON lines.
pub fn write_jsonl(path: &Path, records: &[PromptRecord]) -> Result<()> {
    let io = |e| TrainError::io(path, e);
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for record in records {
        let line = serde_json::to_string(record).map_err(|e| TrainError::Data(e.to_string()))?;
        writeln!(file, "{line}").map_err(io)?;
    }
    file.flush().map_err(io)
}

/// Reads JSON lines of `{prompt, label}`; a bad line is an error naming its line number.
pub fn read_jsonl(path: &Path) -> Result<Vec<PromptRecord>> {
    read_records(path)?
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dotted_keys_reach_into_nested_records() {
        let record = serde_json::json!({"reward_model": {"ground_truth": "42"}, "a.b": 1});
        assert_eq!(lookup(&record, "reward_model.ground_truth"), Some(&serde_json::json!("42")));
        assert_eq!(lookup(&record, "a.b"), Some(&serde_json::json!(1)), "a dotted key itself");
        assert_eq!(lookup(&record, "reward_model.style"), None);
    }

    #[test]
    fn files_mix_by_their_weights_seeded_and_restart_when_used_up() {
        let file = |tag: &str, n: usize| -> Vec<PromptRecord> {
            (0..n)
                .map(|i| PromptRecord { prompt: format!("{tag}{i}"), ..Default::default() })
                .collect()
        };
        let mixed = mix(vec![file("a", 3), file("b", 100)], &[0.8, 0.2], 1000, 7);
        let from_a = mixed.iter().filter(|r| r.prompt.starts_with('a')).count();
        assert!((760..=840).contains(&from_a), "{from_a} of 1000 at weight 0.8");
        // `a` has 3 records: they come round in order.
        let a: Vec<&str> = mixed
            .iter()
            .filter(|r| r.prompt.starts_with('a'))
            .take(4)
            .map(|r| r.prompt.as_str())
            .collect();
        assert_eq!(a, ["a0", "a1", "a2", "a0"]);
        assert_eq!(mixed, mix(vec![file("a", 3), file("b", 100)], &[0.8, 0.2], 1000, 7));
        // No weight on a file with records: the files as they are.
        assert_eq!(mix(vec![file("a", 2), Vec::new()], &[0.0, 1.0], 5, 1).len(), 2);
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
}
