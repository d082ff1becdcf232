//! Stop strings: after each sampled token, the detokenised tail of the output is searched for
//! the request's stop strings.
//!
//! Only a window of the newest tokens is decoded (every token of a byte-level vocabulary
//! decodes to at least one byte, so `longest stop string in bytes + 1` tokens cover any match
//! that the newest token completes), and a match counts only if the window without the newest
//! token does not contain it already: a stop string seen before `min_tokens` was reached must
//! not fire later.

use rtrun_rlhf_model::TextTokenizer;

use crate::scheduler::StopStringMatch;

/// Extra tokens decoded beyond the longest stop string, for tokens that decode to nothing
/// (special tokens) or to a fragment of a multi-byte character.
const WINDOW_SLACK_TOKENS: usize = 8;

/// Finds a stop string completed by the newest output token; the sample keeps all its tokens.
pub fn find_stop_string(
    tokenizer: &TextTokenizer,
    stop: &[String],
    output: &[u32],
) -> Option<StopStringMatch> {
    let longest = stop.iter().map(String::len).max()?;
    let window = &output[output.len().saturating_sub(longest + WINDOW_SLACK_TOKENS)..];
    let (_, before) = window.split_last()?;
    // Ids the tokenizer does not know (the model's vocabulary can be larger) decode to an
    // error, which here simply means that no stop string can be matched in this window.
    let text = tokenizer.decode(window, false).ok()?;
    let previous = tokenizer.decode(before, false).ok()?;
    stop.iter()
        .position(|s| text.contains(s.as_str()) && !previous.contains(s.as_str()))
        .map(|stop_index| StopStringMatch { stop_index, keep_tokens: output.len() })
}
