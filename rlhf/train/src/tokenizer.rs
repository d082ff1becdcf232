//! The one tokenizer abstraction of the trainer: prompts become ids for the engines, responses
//! become text for the rewards, generation stops on the tokenizer's EOS ids. The synthetic
//! tasks' [`CharTokenizer`] and a Hugging Face checkpoint's tokenizer ([`HfTokenizer`]) both
//! implement it, so nothing in `trainer/` knows a token id.

use std::path::Path;
use std::sync::Arc;

use rtrun_rlhf_model::PretrainedTokenizer;

use crate::demo::chars::{BOS_ID, CharTokenizer, EOS_ID, PAD_ID};
use crate::error::{Result, TrainError};

/// What the trainer needs of a tokenizer.
pub trait PromptTokenizer: Send + Sync + std::fmt::Debug {
    /// The ids a prompt text is generated from.
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>>;
    /// The ids of a response text (no special tokens added; the caller appends an EOS id where
    /// the response is complete).
    fn encode_response(&self, text: &str) -> Result<Vec<u32>>;
    /// The text of a generated response: up to its first EOS id, special tokens skipped.
    fn decode_response(&self, ids: &[u32]) -> String;
    /// The text of ids, special tokens skipped, not cut at an EOS id (a tool's answer in a
    /// multi-turn response, which the template's turn markers surround).
    fn decode_text(&self, ids: &[u32]) -> String;
    /// Every id that ends a generation (the first is the one appended to complete answers).
    fn eos_token_ids(&self) -> Vec<u32>;
    /// The padding id.
    fn pad_token_id(&self) -> u32;
    /// The ids that follow a model's turn `assistant_turn` (which stopped at a tool call) in a
    /// multi-turn conversation: the turn's close, the tools' `answers` as the chat template
    /// renders `tool` messages, and the header of the model's next turn. Only a tokenizer with a
    /// chat template has them.
    fn tool_turn(
        &self,
        _assistant_turn: &str,
        _answers: &[String],
        _tools: &[serde_json::Value],
    ) -> Result<Vec<u32>> {
        Err(TrainError::config(
            "tools",
            "expected a policy whose tokenizer has a chat template (policy.pretrain), found the \
             synthetic task's character tokenizer",
        ))
    }
}

impl PromptTokenizer for CharTokenizer {
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        CharTokenizer::encode_prompt(self, text)
    }

    fn encode_response(&self, text: &str) -> Result<Vec<u32>> {
        self.encode(text)
    }

    fn decode_response(&self, ids: &[u32]) -> String {
        self.decode(ids)
    }

    fn decode_text(&self, ids: &[u32]) -> String {
        self.decode(ids)
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        vec![EOS_ID]
    }

    fn pad_token_id(&self) -> u32 {
        debug_assert_ne!(PAD_ID, BOS_ID);
        PAD_ID
    }
}

/// A Hugging Face checkpoint's tokenizer. Prompts rendered by a chat template already hold
/// their special tokens (transformers tokenizes them with `add_special_tokens=False`); raw
/// prompts get the tokenizer's own (a BOS where the tokenizer adds one).
#[derive(Debug, Clone)]
pub struct HfTokenizer {
    inner: Arc<PretrainedTokenizer>,
    add_special_tokens: bool,
}

impl HfTokenizer {
    /// Loads the tokenizer files of `dir`; `chat_template_applied` says whether prompts come
    /// rendered by the chat template.
    pub fn from_dir(dir: &Path, chat_template_applied: bool) -> Result<Self> {
        let inner = PretrainedTokenizer::from_dir(dir)?;
        Ok(Self { inner: Arc::new(inner), add_special_tokens: !chat_template_applied })
    }

    /// The loaded files (chat template, special tokens).
    pub fn pretrained(&self) -> &PretrainedTokenizer {
        &self.inner
    }
}

impl PromptTokenizer for HfTokenizer {
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.tokenizer.encode(text, self.add_special_tokens)?)
    }

    fn encode_response(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.tokenizer.encode(text, false)?)
    }

    fn decode_response(&self, ids: &[u32]) -> String {
        let eos = &self.inner.eos_token_ids;
        let end = ids.iter().position(|id| eos.contains(id)).unwrap_or(ids.len());
        // Ids outside the vocabulary cannot come from the engine (it samples within it); should
        // one appear, the response scores as empty rather than failing the step.
        self.inner.tokenizer.decode(&ids[..end], true).unwrap_or_default()
    }

    fn decode_text(&self, ids: &[u32]) -> String {
        self.inner.tokenizer.decode(ids, true).unwrap_or_default()
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.eos_token_ids.clone()
    }

    fn pad_token_id(&self) -> u32 {
        self.inner.pad_token_id
    }

    /// Renders the conversation before the turn (`before`), with the turn (`with_turn`) and with
    /// the answers and the next turn's header (`after`); the turn's close is what `with_turn`
    /// adds after `before` and the turn, the rest is what `after` adds to `with_turn`.
    fn tool_turn(
        &self,
        assistant_turn: &str,
        answers: &[String],
        tools: &[serde_json::Value],
    ) -> Result<Vec<u32>> {
        use rtrun_rlhf_model::ChatMessage;
        let render = |messages: &[ChatMessage], open: bool| {
            self.inner
                .apply_chat_template_with_tools(messages, open, tools)
                .map_err(|e| TrainError::config("tools", format!("rendering a tool answer: {e}")))
        };
        let user = ChatMessage::new("user", "?");
        let turn = ChatMessage::new("assistant", assistant_turn);
        let before = render(std::slice::from_ref(&user), true)?;
        let with_turn = render(&[user.clone(), turn.clone()], false)?;
        let mut messages = vec![user, turn];
        messages.extend(answers.iter().map(|a| ChatMessage::new("tool", a)));
        let after = render(&messages, true)?;
        let unexpected = || {
            TrainError::config(
                "tools",
                "expected a chat template that renders a conversation as its turns one after \
                 another (each rendering starting with the one before), found one that does not",
            )
        };
        let close = with_turn
            .strip_prefix(before.as_str())
            .and_then(|rest| rest.strip_prefix(assistant_turn))
            .ok_or_else(unexpected)?;
        let next = after.strip_prefix(with_turn.as_str()).ok_or_else(unexpected)?;
        Ok(self.inner.tokenizer.encode(&format!("{close}{next}"), false)?)
    }
}

/// The text of a response as rewards read it: the model's turns each up to its EOS, a tool's
/// answers whole (a response without a loss mask is one model turn).
pub fn response_text(
    tokenizer: &dyn PromptTokenizer,
    sequence: &crate::experience::Sequence,
) -> String {
    if sequence.loss_mask.is_empty() {
        return tokenizer.decode_response(&sequence.response_ids);
    }
    let mut text = String::new();
    let mut start = 0;
    let ids = &sequence.response_ids;
    while start < ids.len() {
        let model = sequence.counts(start);
        let end = (start..ids.len()).find(|&i| sequence.counts(i) != model).unwrap_or(ids.len());
        let run = &ids[start..end];
        text.push_str(&if model {
            tokenizer.decode_response(run)
        } else {
            tokenizer.decode_text(run)
        });
        start = end;
    }
    text
}

/// The tokenizer of a run: the character tokenizer for a synthetic task, else the policy
/// checkpoint's.
pub fn run_tokenizer(config: &crate::TrainConfig) -> Result<Arc<dyn PromptTokenizer>> {
    match &config.policy.pretrain {
        None => Ok(Arc::new(CharTokenizer)),
        Some(dir) => Ok(Arc::new(
            HfTokenizer::from_dir(dir, config.data.apply_chat_template)
                .map_err(|e| TrainError::config("policy.pretrain", e.to_string()))?,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_tokenizer_speaks_the_trait() {
        let tok: Arc<dyn PromptTokenizer> = Arc::new(CharTokenizer);
        let ids = tok.encode_prompt("12>").unwrap();
        assert_eq!(ids[0], BOS_ID);
        let mut response = tok.encode_response("21").unwrap();
        response.extend(tok.eos_token_ids());
        response.push(7);
        assert_eq!(tok.decode_response(&response), "21");
        assert_eq!(tok.pad_token_id(), PAD_ID);
    }
}
