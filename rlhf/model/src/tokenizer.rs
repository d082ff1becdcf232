//! Tokenizers in the Hugging Face `tokenizer.json` format, through the `tokenizers` crate built
//! without its network features, with the special tokens, EOS ids and chat template of the
//! checkpoint directory ([`PretrainedTokenizer`]); plus training of a small byte-level BPE for
//! tiny test models.

use std::collections::BTreeMap;
use std::path::Path;

use tokenizers::SplitDelimiterBehavior;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::{NFC, NormalizerWrapper};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder, TokenizerImpl};

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::{ModelError, Result};

/// File name of a Hugging Face fast tokenizer.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Qwen2's pre-tokenization regex: contractions, letter runs, **single digits**, punctuation runs,
/// newlines and spaces (GPT-2's byte-level regex keeps digit runs together instead).
pub const QWEN2_PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A loaded tokenizer.
#[derive(Debug)]
pub struct TextTokenizer {
    inner: Tokenizer,
}

fn tokenizer_error(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl TextTokenizer {
    /// Loads `<dir>/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join(TOKENIZER_FILE);
        if !path.exists() {
            return Err(ModelError::io(&path, std::io::Error::from(std::io::ErrorKind::NotFound)));
        }
        let inner = Tokenizer::from_file(&path)
            .map_err(|e| ModelError::Tokenizer(format!("cannot load `{}`: {e}", path.display())))?;
        Ok(Self { inner })
    }

    /// Trains a byte-level BPE on `lines`, with the `special_tokens` getting the first ids in
    /// order. The normalizer and pre-tokenizer are Qwen2's (NFC, then [`QWEN2_PRETOKENIZE_REGEX`]
    /// isolating each digit, then byte-level without its own regex), the ones transformers'
    /// `Qwen2Tokenizer` rebuilds in code whatever `tokenizer.json` says: a checkpoint with this
    /// tokenizer tokenizes the same in rtrun and in transformers, whichever class loads it.
    pub fn train_byte_level_bpe<'a>(
        lines: impl Iterator<Item = &'a str> + Send,
        vocab_size: usize,
        special_tokens: &[&str],
    ) -> Result<Self> {
        let mut trainer = BpeTrainerBuilder::new()
            .show_progress(false)
            .vocab_size(vocab_size)
            .min_frequency(2)
            .special_tokens(
                special_tokens.iter().map(|t| AddedToken::from(t.to_string(), true)).collect(),
            )
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        let split = Split::new(
            SplitPattern::Regex(QWEN2_PRETOKENIZE_REGEX.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tokenizer_error)?;
        let byte_level = ByteLevel::new(false, false, false);
        let pre_tokenizer = PreTokenizerWrapper::Sequence(PreTokenizerSequence::new(vec![
            PreTokenizerWrapper::Split(split),
            PreTokenizerWrapper::ByteLevel(byte_level),
        ]));
        let mut tokenizer: TokenizerImpl<
            BPE,
            NormalizerWrapper,
            PreTokenizerWrapper,
            ByteLevel,
            ByteLevel,
        > = TokenizerBuilder::new()
            .with_model(BPE::default())
            .with_normalizer(Some(NormalizerWrapper::NFC(NFC)))
            .with_pre_tokenizer(Some(pre_tokenizer))
            .with_post_processor(Some(byte_level))
            .with_decoder(Some(byte_level))
            .build()
            .map_err(tokenizer_error)?;
        tokenizer.train(&mut trainer, lines).map_err(tokenizer_error)?;
        Ok(Self { inner: Tokenizer::from(tokenizer) })
    }

    /// Writes `<dir>/tokenizer.json`.
    pub fn save_to_dir(&self, dir: &Path) -> Result<()> {
        self.inner.save(dir.join(TOKENIZER_FILE), true).map_err(tokenizer_error)
    }

    /// Token ids of `text` (special tokens added when the tokenizer defines a template).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self.inner.encode(text, add_special_tokens).map_err(tokenizer_error)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tokenizer_error)
    }

    /// The id of a token, if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// File name of the tokenizer settings (special tokens, chat template).
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// File name of the generation defaults (EOS ids among them).
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// File name of a chat template saved on its own (transformers ≥ 4.43 writes it).
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// The tokenizer files of a Hugging Face directory, copied along when a model is exported.
pub const TOKENIZER_FILES: &[&str] = &[
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    CHAT_TEMPLATE_FILE,
    "special_tokens_map.json",
];

/// The special-token keys of `tokenizer_config.json`, passed to chat templates by name.
const SPECIAL_TOKEN_KEYS: &[&str] =
    &["bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"];

/// A tokenizer as a Hugging Face checkpoint directory defines it: `tokenizer.json` plus the
/// special tokens and chat template of `tokenizer_config.json` (or `chat_template.jinja`) and
/// the EOS ids of `generation_config.json`.
#[derive(Debug)]
pub struct PretrainedTokenizer {
    /// The vocabulary and its pre/post-processing.
    pub tokenizer: TextTokenizer,
    /// The chat template, when the directory has one.
    pub chat_template: Option<ChatTemplate>,
    /// `bos_token`, `eos_token`, … as text (those the config sets).
    pub special_tokens: BTreeMap<String, String>,
    /// Every id that ends a generation: `generation_config.json`'s `eos_token_id` (one or a
    /// list) and the tokenizer's `eos_token`, deduplicated, in that order.
    pub eos_token_ids: Vec<u32>,
    /// The padding id (`pad_token`, else the first EOS id).
    pub pad_token_id: u32,
}

impl PretrainedTokenizer {
    /// Loads the tokenizer files of `dir`; `tokenizer.json` is required, the others optional,
    /// but at least one EOS id must be defined somewhere (`generation_config.json`,
    /// `tokenizer_config.json` or `config.json`).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tokenizer = TextTokenizer::from_dir(dir)?;
        let config = read_json_if_present(&dir.join(TOKENIZER_CONFIG_FILE))?;
        let mut special_tokens = BTreeMap::new();
        if let Some(config) = &config {
            for key in SPECIAL_TOKEN_KEYS {
                if let Some(text) = config.get(*key).and_then(token_text) {
                    special_tokens.insert((*key).to_owned(), text);
                }
            }
        }
        let token_id = |key: &str| -> Result<Option<u32>> {
            match special_tokens.get(key) {
                None => Ok(None),
                Some(text) => tokenizer.token_to_id(text).map(Some).ok_or_else(|| {
                    ModelError::Tokenizer(format!(
                        "`{}` sets {key} `{text}`, which `{TOKENIZER_FILE}` does not have",
                        dir.join(TOKENIZER_CONFIG_FILE).display()
                    ))
                }),
            }
        };
        let mut eos_token_ids = Vec::new();
        let generation = read_json_if_present(&dir.join(GENERATION_CONFIG_FILE))?;
        if let Some(ids) = generation.as_ref().and_then(|g| g.get("eos_token_id")) {
            eos_token_ids.extend(id_list(ids, &dir.join(GENERATION_CONFIG_FILE))?);
        }
        if let Some(id) = token_id("eos_token")? {
            eos_token_ids.push(id);
        }
        if eos_token_ids.is_empty() {
            let model_config = read_json_if_present(&dir.join("config.json"))?;
            if let Some(ids) = model_config.as_ref().and_then(|c| c.get("eos_token_id")) {
                eos_token_ids.extend(id_list(ids, &dir.join("config.json"))?);
            }
        }
        let mut seen = std::collections::HashSet::new();
        eos_token_ids.retain(|id| seen.insert(*id));
        let Some(&first_eos) = eos_token_ids.first() else {
            return Err(ModelError::Tokenizer(format!(
                "`{}` defines no end-of-sequence token: expected `eos_token_id` in {GENERATION_CONFIG_FILE} \
                 or config.json, or `eos_token` in {TOKENIZER_CONFIG_FILE}",
                dir.display()
            )));
        };
        let pad_token_id = token_id("pad_token")?.unwrap_or(first_eos);
        let template_path = dir.join(CHAT_TEMPLATE_FILE);
        let source = if template_path.is_file() {
            Some(
                std::fs::read_to_string(&template_path)
                    .map_err(|e| ModelError::io(&template_path, e))?,
            )
        } else {
            config.as_ref().and_then(|c| c.get("chat_template")).and_then(template_source)
        };
        let chat_template = source
            .map(|s| {
                ChatTemplate::new(&s, special_tokens.clone()).map_err(|e| {
                    ModelError::Tokenizer(format!(
                        "{}: {e}",
                        dir.join(TOKENIZER_CONFIG_FILE).display()
                    ))
                })
            })
            .transpose()?;
        Ok(Self { tokenizer, chat_template, special_tokens, eos_token_ids, pad_token_id })
    }

    /// The chat template applied to `messages` (the text a model is prompted with).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with_tools(messages, add_generation_prompt, &[])
    }

    /// [`PretrainedTokenizer::apply_chat_template`] with the conversation's tools (OpenAI
    /// function schemas).
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: &[serde_json::Value],
    ) -> Result<String> {
        let template = self.chat_template.as_ref().ok_or_else(|| {
            ModelError::Tokenizer(
                "the tokenizer has no chat template (`chat_template` in tokenizer_config.json \
                 or chat_template.jinja)"
                    .to_owned(),
            )
        })?;
        template.render_with_tools(messages, add_generation_prompt, tools)
    }
}

/// The text of a special-token entry: a string or an `AddedToken` object's `content`.
fn token_text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(map) => map.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// A chat template entry: a string, or a list of `{name, template}` (the one named `default`).
fn template_source(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(items) => items
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_owned),
        _ => None,
    }
}

/// An id or a list of ids.
fn id_list(value: &serde_json::Value, path: &Path) -> Result<Vec<u32>> {
    let one = |v: &serde_json::Value| {
        v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
            ModelError::Tokenizer(format!(
                "`{}`: expected a token id or a list of ids for eos_token_id, found {value}",
                path.display()
            ))
        })
    };
    match value {
        serde_json::Value::Null => Ok(Vec::new()),
        serde_json::Value::Array(items) => items.iter().map(one).collect(),
        v => Ok(vec![one(v)?]),
    }
}

fn read_json_if_present(path: &Path) -> Result<Option<serde_json::Value>> {
    match std::fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map(Some).map_err(|e| ModelError::json(path, e))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ModelError::io(path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trained_bpe_round_trips_text() {
        let corpus = ["the quick brown fox", "the lazy dog", "the quick dog jumps"];
        let tok =
            TextTokenizer::train_byte_level_bpe(corpus.iter().copied(), 300, &["<|pad|>"]).unwrap();
        assert_eq!(tok.token_to_id("<|pad|>"), Some(0));
        let ids = tok.encode("the quick zebra ü", false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), "the quick zebra ü");
        assert!(TextTokenizer::from_dir(Path::new("/nonexistent")).is_err());
    }
}
