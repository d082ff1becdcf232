//! Datasets of the trainers beside RL: JSONL / Parquet records as OpenRLHF's `SFTDataset` and
//! `RewardDataset` read them, tokenized into [`Sample`]s (prompt ids, then response ids ending in
//! EOS; the loss covers the response) grouped in units: one sample per SFT record, a (chosen,
//! rejected) pair per preference record.
//!
//! An SFT record is `{input_key: prompt, output_key: response}` with a string prompt or a list of
//! chat messages, or (without `output_key`) `{input_key: [messages…]}` whose last message is the
//! assistant's response. A preference record is `{input_key: prompt, chosen_key: response,
//! rejected_key: response}`, or `{chosen_key: [messages…], rejected_key: [messages…]}` whose last
//! messages are the two responses. With `apply_chat_template` the prompt is the template's
//! rendering of the prompt messages with the assistant's turn opened, and the response is what
//! the template adds for the assistant's message (its end-of-turn tokens included). Every bad
//! record is an error naming its file and line (row, for Parquet).

use rtrun_rlhf_model::ChatMessage;

use crate::config::Mode;
use crate::data::{
    PathList, RawRecord, chat_messages, json_kind, read_records, render_chat, split_records,
};
use crate::error::{Result, TrainError};
use crate::stage::config::StageDataConfig;
use crate::stage::pack::{Sample, Unit};
use crate::tokenizer::{HfTokenizer, PromptTokenizer};

/// The examples of a run: units of one sample (SFT) or a (chosen, rejected) pair.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadedSamples {
    /// Training units, in file order.
    pub train: Vec<Unit>,
    /// Held-out units.
    pub eval: Vec<Unit>,
    /// Units dropped for a sample longer than `data.max_len` (train, held-out).
    pub dropped_too_long: (usize, usize),
}

/// The prompt and response text of one SFT record.
pub fn prompt_and_response(
    record: &RawRecord,
    config: &StageDataConfig,
    tokenizer: &HfTokenizer,
) -> Result<(String, String)> {
    let output = config.output_key.as_deref().map(|k| (k, "data.output_key"));
    render_example(record, config.apply_chat_template, tokenizer, &config.input_key, output)
}

/// The (chosen, rejected) prompt and response texts of one preference record.
pub fn preference_pair(
    record: &RawRecord,
    config: &StageDataConfig,
    tokenizer: &HfTokenizer,
) -> Result<[(String, String); 2]> {
    let side = |key: &str, setting: &str| {
        let template = config.apply_chat_template;
        match record.value.get(key) {
            // A whole conversation ending in the response.
            Some(serde_json::Value::Array(_)) => {
                render_example(record, template, tokenizer, key, None)
            }
            _ => {
                render_example(record, template, tokenizer, &config.input_key, Some((key, setting)))
            }
        }
    };
    let chosen = side(&config.chosen_key, "data.chosen_key")?;
    let rejected = side(&config.rejected_key, "data.rejected_key")?;
    if chosen.0 != rejected.0 {
        return Err(TrainError::Data(format!(
            "{}: `{}` and `{}` must answer the same prompt, found two different conversations",
            record.location, config.chosen_key, config.rejected_key
        )));
    }
    Ok([chosen, rejected])
}

/// The prompt and response of a record: the prompt under `input_key`, the response under
/// `response` (`(key, config setting)`) or, without one, the last message of `input_key`'s
/// conversation.
fn render_example(
    record: &RawRecord,
    template: bool,
    tokenizer: &HfTokenizer,
    input_key: &str,
    response: Option<(&str, &str)>,
) -> Result<(String, String)> {
    let at = &record.location;
    let keys = || -> String {
        record
            .value
            .as_object()
            .map(|m| m.keys().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", "))
            .unwrap_or_default()
    };
    let get = |key: &str, setting: &str| {
        record.value.get(key).ok_or_else(|| {
            TrainError::Data(format!(
                "{at}: expected the key `{key}` ({setting}), found only {}",
                keys()
            ))
        })
    };
    let input = get(input_key, "data.input_key")?;
    let needs_template = || {
        TrainError::Data(format!(
            "{at}: `{input_key}` holds chat messages, which need data.apply_chat_template: true"
        ))
    };
    let mut messages = match input {
        serde_json::Value::String(text) => vec![ChatMessage::new("user", text)],
        serde_json::Value::Array(items) if template => chat_messages(at, input_key, items)?,
        serde_json::Value::Array(_) => return Err(needs_template()),
        other => {
            return Err(TrainError::Data(format!(
                "{at}: expected `{input_key}` to be a string or a list of chat messages, found {}",
                json_kind(other)
            )));
        }
    };
    let response = match response {
        Some((key, setting)) => match get(key, setting)? {
            serde_json::Value::String(text) => text.clone(),
            other => {
                return Err(TrainError::Data(format!(
                    "{at}: expected the response `{key}` to be a string, found {}",
                    json_kind(other)
                )));
            }
        },
        None => {
            let last = match input {
                serde_json::Value::Array(_) => messages.pop(),
                _ => None,
            };
            match last {
                Some(m) if m.role == "assistant" && !messages.is_empty() => m.content,
                _ => {
                    return Err(TrainError::Data(format!(
                        "{at}: without a response key, `{input_key}` must be a conversation whose \
                         last message is the assistant's response (after at least one other)"
                    )));
                }
            }
        }
    };
    if !template {
        let serde_json::Value::String(prompt) = input else {
            return Err(needs_template());
        };
        return Ok((prompt.clone(), response));
    }
    let prompt = render_chat(at, tokenizer, &messages, true)?;
    messages.push(ChatMessage::new("assistant", &response));
    let whole = render_chat(at, tokenizer, &messages, false)?;
    match whole.strip_prefix(&prompt) {
        Some(rest) => Ok((prompt, rest.to_owned())),
        None => Err(TrainError::Data(format!(
            "{at}: the chat template renders the conversation with a different beginning than the \
             prompt alone, so the response cannot be told apart"
        ))),
    }
}

/// The tokenized sample of a prompt and response: the response ends in the first EOS id (added
/// when the text does not end with one).
pub fn tokenize(at: &str, tokenizer: &HfTokenizer, prompt: &str, response: &str) -> Result<Sample> {
    let mut ids = tokenizer.encode_prompt(prompt)?;
    let prompt_len = ids.len();
    let mut response_ids = tokenizer.encode_response(response)?;
    let eos = tokenizer.eos_token_ids();
    if !response_ids.last().is_some_and(|id| eos.contains(id))
        && let Some(&first) = eos.first()
    {
        response_ids.push(first);
    }
    if prompt_len == 0 {
        return Err(TrainError::Data(format!("{at}: the prompt tokenizes to no tokens")));
    }
    ids.extend(response_ids);
    Ok(Sample { ids, prompt_len })
}

/// Reads, tokenizes and filters the dataset of `config` for `mode` (SFT samples, or preference
/// pairs); without `eval_data` a seeded `eval_fraction` of `train_data` is held out.
pub fn load_samples(
    config: &StageDataConfig,
    tokenizer: &HfTokenizer,
    seed: u64,
    mode: Mode,
) -> Result<LoadedSamples> {
    let read_all = |paths: &PathList| -> Result<Vec<Unit>> {
        let mut out = Vec::new();
        for path in &paths.0 {
            for record in read_records(path)? {
                let at = &record.location;
                let unit = if mode == Mode::Sft {
                    let (prompt, response) = prompt_and_response(&record, config, tokenizer)?;
                    vec![tokenize(at, tokenizer, &prompt, &response)?]
                } else {
                    preference_pair(&record, config, tokenizer)?
                        .iter()
                        .map(|(prompt, response)| tokenize(at, tokenizer, prompt, response))
                        .collect::<Result<Vec<_>>>()?
                };
                out.push(unit);
            }
        }
        Ok(out)
    };
    let (mut train, mut eval) = split_records(
        "data.train_data",
        &config.train_data,
        &config.eval_data,
        config.eval_fraction,
        config.max_samples,
        seed,
        read_all,
    )?;
    let filter = |units: &mut Vec<Unit>, split: &str| -> Result<usize> {
        let before = units.len();
        let longest = units.iter().flatten().map(|s| s.ids.len()).max().unwrap_or(0);
        units.retain(|u| u.iter().all(|s| s.ids.len() <= config.max_len));
        if units.is_empty() && before > 0 {
            return Err(TrainError::config(
                "data.max_len",
                format!(
                    "every one of the {before} {split} records has a sample longer than {} \
                     tokens (the longest has {longest}); raise data.max_len",
                    config.max_len
                ),
            ));
        }
        Ok(before - units.len())
    };
    let dropped = (filter(&mut train, "training")?, filter(&mut eval, "held-out")?);
    Ok(LoadedSamples { train, eval, dropped_too_long: dropped })
}
