//! Tokenizers in the Hugging Face `tokenizer.json` format, through the `tokenizers` crate built
//! without its network features; plus training of a small byte-level BPE for tiny test models.

use std::path::Path;

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder, TokenizerImpl};

use crate::error::{ModelError, Result};

/// File name of a Hugging Face fast tokenizer.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

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

    /// Trains a byte-level BPE (GPT-2 / Qwen style, no prefix space) on `lines`, with the
    /// `special_tokens` getting the first ids in order.
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
        let byte_level = ByteLevel::new(false, true, true);
        let mut tokenizer: TokenizerImpl<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel> =
            TokenizerBuilder::new()
                .with_model(BPE::default())
                .with_normalizer(None)
                .with_pre_tokenizer(Some(byte_level))
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
