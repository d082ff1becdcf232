//! The demo tasks' character-level tokenizer: one id per character, so an engine needs no
//! `tokenizer.json` (prompts go out as ids and responses come back as ids).

use crate::error::TrainError;

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
}
