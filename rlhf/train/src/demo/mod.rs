//! The demo that runs with nothing downloaded: synthetic digit tasks, their character tokenizer,
//! the tiny initial policy's supervised warm-up, and the local HF checkpoint plus GSM8K-format
//! data of the walkthrough. The trainer itself knows none of it: it sees prompt records and a
//! [`PromptTokenizer`](crate::tokenizer::PromptTokenizer).
//!
//! - [`task`]: the tasks (`reverse_digits`, `sort_digits`, `add`) and their splits.
//! - [`chars`]: the one-id-per-character tokenizer and its special ids.
//! - [`warmup`]: the initial policy (tiny model + supervised warm-up).
//! - [`walkthrough`]: a local HF checkpoint and GSM8K-format data for the no-download walkthrough.

pub mod chars;
pub mod task;
pub mod walkthrough;
pub mod warmup;
