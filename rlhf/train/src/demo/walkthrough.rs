//! The no-download walkthrough: writes what a user of rtrun brings from elsewhere — a small
//! Hugging Face Qwen2 checkpoint (byte-level BPE `tokenizer.json`, a ChatML chat template, a
//! generation config) and a GSM8K-format prompt dataset (`question` / `answer` ending in
//! `#### N`) of generated arithmetic word problems — so `deploy/examples/rlhf/grpo-hf.yaml`
//! trains a real checkpoint on real files with nothing fetched. The checkpoint gets a short
//! supervised warm-up on the training problems so that it answers some of them (GRPO needs a
//! non-zero reward to start from), as a user's SFT model would.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use rtrun_rlhf_model::tiny::tiny_config;
use rtrun_rlhf_model::{ChatMessage, ModelFamily, PretrainedTokenizer, TextTokenizer};

use crate::config::WarmupConfig;
use crate::demo::warmup::{WarmupReport, train_supervised};
use crate::error::{Result, TrainError};
use crate::experience::Sequence;
use crate::rng::SplitMix64;

/// The chat template of the walkthrough checkpoint: ChatML as Qwen2.5 writes it (a default
/// system message when the conversation has none), with Qwen2.5's tools: the `tools` listed in
/// the system message, calls as `<tool_call>` JSON in the assistant's turn, and `tool` messages
/// as `<tool_response>` blocks of a user turn.
pub const CHATML_TEMPLATE: &str = "{%- if tools %}\n\
{{- '<|im_start|>system\\n' }}\n\
{%- if messages[0]['role'] == 'system' %}\n\
{{- messages[0]['content'] }}\n\
{%- else %}\n\
{{- 'You are a helpful assistant.' }}\n\
{%- endif %}\n\
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}\n\
{%- for tool in tools %}\n\
{{- '\\n' + (tool | tojson) }}\n\
{%- endfor %}\n\
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}\n\
{%- endif %}\n\
{%- for message in messages %}\n\
{%- if tools and loop.first and message['role'] == 'system' %}\n\
{%- elif message['role'] == 'tool' %}\n\
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}\n\
{{- '<|im_start|>user' }}\n\
{%- endif %}\n\
{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}\n\
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}\n\
{{- '<|im_end|>\\n' }}\n\
{%- endif %}\n\
{%- else %}\n\
{%- if loop.first and message['role'] != 'system' and not tools %}\n\
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n\
{%- endif %}\n\
{%- if message['role'] not in ['system', 'user', 'assistant'] %}\n\
{{- raise_exception('Unknown role: ' + message['role']) }}\n\
{%- endif %}\n\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n\
{%- endif %}\n\
{%- endfor %}\n\
{%- if add_generation_prompt %}\n\
{{- '<|im_start|>assistant\\n' }}\n\
{%- endif %}\n";

/// Special tokens, ids 0.. in this order.
const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// What to write.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WalkthroughConfig {
    /// Training problems.
    pub train_problems: usize,
    /// Held-out problems.
    pub test_problems: usize,
    /// Largest operand of the word problems.
    pub max_operand: u64,
    /// Tokenizer vocabulary size.
    pub vocab_size: usize,
    /// Supervised warm-up of the checkpoint.
    pub warmup: WarmupConfig,
    /// Seed of everything.
    pub seed: u64,
    /// Warm the checkpoint up to call the `calculator` tool (Qwen2.5's tool-call format): the
    /// answer's first turn calls it with the worked sum, the second turn writes the answer
    /// after the tool's response (masked out of the warm-up's loss).
    #[serde(default)]
    pub tool_calls: bool,
}

impl Default for WalkthroughConfig {
    fn default() -> Self {
        Self {
            train_problems: 2000,
            test_problems: 64,
            max_operand: 9,
            vocab_size: 512,
            warmup: WarmupConfig { steps: 150, batch_size: 32, lr: 3e-3 },
            seed: 1,
            tool_calls: false,
        }
    }
}

/// One GSM8K-format record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MathProblem {
    /// The word problem.
    pub question: String,
    /// The worked answer, ending in `#### N`.
    pub answer: String,
}

/// What [`write_walkthrough`] wrote.
#[derive(Debug, Clone)]
pub struct WalkthroughFiles {
    /// The checkpoint directory.
    pub model_dir: PathBuf,
    /// `train.jsonl`.
    pub train_data: PathBuf,
    /// `test.jsonl`.
    pub test_data: PathBuf,
    /// `preference_train.jsonl`: the training problems as `{question, chosen, rejected}` pairs
    /// (the worked answer, and one with a wrong result) for the reward-model and DPO trainers.
    pub preference_train: PathBuf,
    /// `preference_test.jsonl`: the held-out problems as pairs.
    pub preference_test: PathBuf,
    /// The checkpoint's warm-up.
    pub warmup: WarmupReport,
}

const NAMES: [&str; 8] = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana"];
const ITEMS: [&str; 6] = ["apples", "books", "coins", "pens", "shells", "stamps"];

/// A seeded word problem: addition or subtraction of two operands up to `max_operand`.
pub fn problem(rng: &mut SplitMix64, max_operand: u64) -> MathProblem {
    let name = NAMES[rng.below(NAMES.len() as u64) as usize];
    let item = ITEMS[rng.below(ITEMS.len() as u64) as usize];
    let a = 1 + rng.below(max_operand);
    let b = 1 + rng.below(max_operand);
    if rng.below(2) == 0 {
        MathProblem {
            question: format!("{name} has {a} {item} and gets {b} more. How many {item} now?"),
            answer: format!("{a} + {b} = {}\n#### {}", a + b, a + b),
        }
    } else {
        let (big, small) = (a.max(b), a.min(b));
        MathProblem {
            question: format!(
                "{name} has {big} {item} and gives away {small}. How many {item} now?"
            ),
            answer: format!("{big} - {small} = {}\n#### {}", big - small, big - small),
        }
    }
}

/// Writes `out/model/` (the checkpoint) and `out/data/{train,test}.jsonl`.
pub fn write_walkthrough(out: &Path, config: &WalkthroughConfig) -> Result<WalkthroughFiles> {
    let data_dir = out.join("data");
    let model_dir = out.join("model");
    for dir in [&data_dir, &model_dir] {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    }
    let mut problems = walkthrough_problems(config)?;
    let test = problems.split_off(config.train_problems);
    let train_data = data_dir.join("train.jsonl");
    let test_data = data_dir.join("test.jsonl");
    write_problems(&train_data, &problems)?;
    write_problems(&test_data, &test)?;
    let preference_train = data_dir.join("preference_train.jsonl");
    let preference_test = data_dir.join("preference_test.jsonl");
    let mut rng = SplitMix64::new(config.seed ^ 0x9AE5);
    for (path, set) in [(&preference_train, &problems), (&preference_test, &test)] {
        let pairs: Vec<PreferencePair> = set.iter().map(|p| preference_pair(p, &mut rng)).collect();
        write_lines(path, &pairs)?;
    }

    let tools = match config.tool_calls {
        true => vec![crate::tools::Tool::schema(&crate::tools::Calculator)],
        false => Vec::new(),
    };
    let tokenizer = write_tokenizer_files(&model_dir, &problems, config.vocab_size, &tools)?;
    let (end_of_text, im_end) = (0i64, 2i64);
    write_json(
        &model_dir.join("generation_config.json"),
        &serde_json::json!({"eos_token_id": [im_end, end_of_text], "pad_token_id": end_of_text}),
    )?;

    let mut model_config = tiny_config(ModelFamily::Qwen2);
    model_config.vocab_size = tokenizer.vocab_size() as i64;
    model_config.num_key_value_heads = 2;
    model_config.intermediate_size = 128;
    model_config.bos_token_id = None;
    model_config.eos_token_id = Some(im_end);
    model_config.pad_token_id = Some(end_of_text);
    model_config.initializer_range = 0.05;

    let pretrained = PretrainedTokenizer::from_dir(&model_dir)?;
    let chat = crate::tokenizer::HfTokenizer::from_dir(&model_dir, true)?;
    let sequences = problems
        .iter()
        .map(|p| -> Result<Sequence> {
            let user = [ChatMessage::new("user", &p.question)];
            let prompt = pretrained.apply_chat_template_with_tools(&user, true, &tools)?;
            let prompt_ids = pretrained.tokenizer.encode(&prompt, false)?;
            let mut answer_ids = pretrained.tokenizer.encode(&p.answer, false)?;
            answer_ids.push(im_end as u32);
            if !config.tool_calls {
                return Ok(Sequence::new(prompt_ids, answer_ids));
            }
            let (call, result) = tool_call_of(p);
            let mut response = pretrained.tokenizer.encode(&call, false)?;
            let mut mask = vec![true; response.len()];
            let answer =
                crate::tokenizer::PromptTokenizer::tool_turn(&chat, &call, &[result], &tools)?;
            mask.extend(std::iter::repeat_n(false, answer.len()));
            response.extend(answer);
            mask.extend(std::iter::repeat_n(true, answer_ids.len()));
            response.extend(answer_ids);
            let mut sequence = Sequence::new(prompt_ids, response);
            sequence.loss_mask = mask;
            Ok(sequence)
        })
        .collect::<Result<Vec<_>>>()?;
    let longest = sequences.iter().map(|s| s.prompt_ids.len() + s.response_ids.len()).max();
    model_config.max_position_embeddings = (longest.unwrap_or(0) as i64 + 64).max(128);
    // The weights go beside the tokenizer files; written under a temporary name first so a
    // killed warm-up leaves no half checkpoint behind.
    let tmp = out.join("model.tmp");
    let warmup = train_supervised(&tmp, &model_config, &config.warmup, &sequences, config.seed)?;
    for entry in std::fs::read_dir(&tmp).map_err(|e| TrainError::io(&tmp, e))? {
        let entry = entry.map_err(|e| TrainError::io(&tmp, e))?;
        let target = model_dir.join(entry.file_name());
        std::fs::rename(entry.path(), &target).map_err(|e| TrainError::io(&target, e))?;
    }
    std::fs::remove_dir(&tmp).map_err(|e| TrainError::io(&tmp, e))?;
    Ok(WalkthroughFiles {
        model_dir,
        train_data,
        test_data,
        preference_train,
        preference_test,
        warmup,
    })
}

/// The calculator call of a worked answer (`"4 + 3 = 7\n#### 7"` → a call computing `4 + 3`)
/// and what the calculator answers.
pub fn tool_call_of(problem: &MathProblem) -> (String, String) {
    let worked = problem.answer.lines().next().unwrap_or_default();
    let (expression, result) = worked.split_once(" = ").unwrap_or((worked, ""));
    let call = serde_json::json!({"name": "calculator", "arguments": {"expression": expression}});
    (format!("<tool_call>\n{call}\n</tool_call>"), result.to_owned())
}

/// The walkthrough's distinct problems, training ones first then held-out ones.
fn walkthrough_problems(config: &WalkthroughConfig) -> Result<Vec<MathProblem>> {
    let mut rng = SplitMix64::new(config.seed);
    let mut seen = std::collections::HashSet::new();
    let wanted = config.train_problems + config.test_problems;
    let mut problems = Vec::with_capacity(wanted);
    for _ in 0..wanted.saturating_mul(50) {
        if problems.len() == wanted {
            break;
        }
        let p = problem(&mut rng, config.max_operand);
        if seen.insert(p.question.clone()) {
            problems.push(p);
        }
    }
    if problems.len() < wanted {
        return Err(TrainError::Data(format!(
            "walkthrough: only {} distinct problems with operands up to {}, asked for {wanted}",
            problems.len(),
            config.max_operand
        )));
    }
    Ok(problems)
}

/// Trains the walkthrough tokenizer on `problems` and writes `tokenizer.json` and
/// `tokenizer_config.json` (special tokens, the ChatML template) into `model_dir`.
fn write_tokenizer_files(
    model_dir: &Path,
    problems: &[MathProblem],
    vocab_size: usize,
    tools: &[serde_json::Value],
) -> Result<TextTokenizer> {
    // The tokenizer learns the chat markup's words too, so rendered prompts tokenize compactly
    // (and with tools, the tool-call markup and the calls).
    let chat_words = "system user assistant You are a helpful assistant.";
    let mut corpus: Vec<String> = problems
        .iter()
        .flat_map(|p| [p.question.clone(), p.answer.clone()])
        .chain(std::iter::once(chat_words.to_owned()))
        .collect();
    if !tools.is_empty() {
        corpus.extend(problems.iter().map(|p| tool_call_of(p).0));
        let tool_words = "<tool_call> </tool_call> <tool_response> </tool_response> # Tools";
        corpus.push(tool_words.to_owned());
        corpus.extend(tools.iter().map(|t| t.to_string()));
    }
    let tokenizer = TextTokenizer::train_byte_level_bpe(
        corpus.iter().map(String::as_str),
        vocab_size,
        &SPECIAL_TOKENS,
    )?;
    tokenizer.save_to_dir(model_dir)?;
    let tokenizer_config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 512,
        "chat_template": CHATML_TEMPLATE,
    });
    write_json(&model_dir.join("tokenizer_config.json"), &tokenizer_config)?;
    Ok(tokenizer)
}

/// One preference record: a problem, its worked answer and an answer with a wrong result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreferencePair {
    /// The word problem.
    pub question: String,
    /// The worked answer, ending in `#### N`.
    pub chosen: String,
    /// The same working with a final answer off by 1 or 2.
    pub rejected: String,
}

/// `problem` with a rejected answer whose final answer (after `####`) is off by 1 or 2 (never
/// below 0) while the working still shows the right result: a careless answer, which
/// `math_answer` scores 0 and a reward model learns to spot by comparing the two numbers.
pub fn preference_pair(problem: &MathProblem, rng: &mut SplitMix64) -> PreferencePair {
    let (working, result) = problem.answer.rsplit_once("\n#### ").unwrap_or(("", "0"));
    let right: i64 = result.trim().parse().unwrap_or(0);
    let delta = 1 + rng.below(2) as i64;
    let wrong = if right >= delta && rng.below(2) == 0 { right - delta } else { right + delta };
    PreferencePair {
        question: problem.question.clone(),
        chosen: problem.answer.clone(),
        rejected: format!("{working}\n#### {wrong}"),
    }
}

fn write_problems(path: &Path, problems: &[MathProblem]) -> Result<()> {
    write_lines(path, problems)
}

fn write_lines<T: Serialize>(path: &Path, problems: &[T]) -> Result<()> {
    let mut text = String::new();
    for p in problems {
        text.push_str(&serde_json::to_string(p).map_err(|e| TrainError::Data(e.to_string()))?);
        text.push('\n');
    }
    std::fs::write(path, text).map_err(|e| TrainError::io(path, e))
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| TrainError::Data(e.to_string()))?;
    std::fs::write(path, text).map_err(|e| TrainError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The template with tools renders Qwen2.5's layout (written out by hand here), and a tool
    /// answer's turn is the close of the call's turn, the `<tool_response>` block and the next
    /// turn's header.
    #[test]
    fn the_template_lists_tools_and_renders_their_answers_as_qwen_does() {
        let dir = std::env::temp_dir().join(format!("rtrun-wt-tools-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config =
            WalkthroughConfig { train_problems: 50, test_problems: 2, ..Default::default() };
        let problems = walkthrough_problems(&config).unwrap();
        let tools = vec![crate::tools::Tool::schema(&crate::tools::Calculator)];
        write_tokenizer_files(&dir, &problems, 300, &tools).unwrap();
        let pretrained = PretrainedTokenizer::from_dir(&dir).unwrap();
        let messages = [
            ChatMessage::new("user", "Ada has 4 pens and gets 3 more. How many pens now?"),
            ChatMessage::new("assistant", "<tool_call>\n{}\n</tool_call>"),
            ChatMessage::new("tool", "7"),
        ];
        let text = pretrained.apply_chat_template_with_tools(&messages, true, &tools).unwrap();
        let schema = crate::tools::Tool::schema(&crate::tools::Calculator).to_string();
        let expected = format!(
            "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or \
             more functions to assist with the user query.\n\nYou are provided with function \
             signatures within <tools></tools> XML tags:\n<tools>\n{schema}\n</tools>\n\nFor \
             each function call, return a json object with function name and arguments within \
             <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \
             \"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n<|im_start|>user\nAda \
             has 4 pens and gets 3 more. How many pens now?<|im_end|>\n<|im_start|>assistant\n\
             <tool_call>\n{{}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n7\n\
             </tool_response><|im_end|>\n<|im_start|>assistant\n"
        );
        // `tojson` writes Python's separators, serde_json none: compare without them.
        let squeeze = |t: &str| t.replace(": ", ":").replace(", ", ",");
        assert_eq!(squeeze(&text), squeeze(&expected));
        let tokenizer = crate::tokenizer::HfTokenizer::from_dir(&dir, true).unwrap();
        let turn = crate::tokenizer::PromptTokenizer::tool_turn(
            &tokenizer,
            "<tool_call>\n{}\n</tool_call>",
            &["7".to_owned(), "error: x".to_owned()],
            &tools,
        )
        .unwrap();
        assert_eq!(
            pretrained.tokenizer.decode(&turn, false).unwrap(),
            "<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n\
             error: x\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        );
        let (call, result) =
            tool_call_of(&MathProblem { question: "q".into(), answer: "9 - 4 = 5\n#### 5".into() });
        assert_eq!(result, "5");
        assert!(call.starts_with("<tool_call>\n{") && call.contains("\"9 - 4\""), "{call}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rejected_answers_are_wrong_only_in_their_result() {
        let mut rng = SplitMix64::new(5);
        let score = crate::reward::find_reward_function("math_answer").unwrap().score;
        for _ in 0..50 {
            let p = problem(&mut rng, 9);
            let pair = preference_pair(&p, &mut rng);
            let (c, r) = (pair.chosen.split("####").next(), pair.rejected.split("####").next());
            assert_eq!(c, r, "{pair:?}");
            assert_eq!(score("", &pair.chosen, &p.answer), 1.0);
            assert_eq!(score("", &pair.rejected, &p.answer), 0.0, "{pair:?}");
        }
    }

    #[test]
    fn problems_are_gsm8k_shaped_and_answered_by_math_answer() {
        let mut rng = SplitMix64::new(3);
        let score = crate::reward::find_reward_function("math_answer").unwrap().score;
        for _ in 0..50 {
            let p = problem(&mut rng, 9);
            assert!(p.answer.contains("\n#### "), "{p:?}");
            let worked = p.answer.lines().next().unwrap();
            assert_eq!(score(&p.question, &p.answer, &p.answer), 1.0);
            assert_eq!(score(&p.question, worked, &p.answer), 1.0);
        }
    }

    /// The walkthrough checkpoint tokenizes and renders chats as transformers does when a user
    /// loads it with `AutoTokenizer` (which builds `Qwen2Tokenizer` for a qwen2 config): the
    /// golden is `tests/hf/make_walkthrough_tokens.py`'s output on the default walkthrough.
    #[test]
    fn the_default_walkthrough_tokenizer_matches_transformers_auto_tokenizer() {
        let golden: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/hf/walkthrough_tokens.json")).unwrap();
        assert_eq!(golden["transformers_class"], "Qwen2Tokenizer");
        let config = WalkthroughConfig::default();
        let problems = walkthrough_problems(&config).unwrap();
        let dir = std::env::temp_dir().join(format!("rtrun-wt-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_tokenizer_files(&dir, &problems[..config.train_problems], config.vocab_size, &[])
            .unwrap();
        let pretrained = PretrainedTokenizer::from_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let texts = golden["texts"].as_array().unwrap();
        assert!(texts.len() >= 8);
        for case in texts {
            let text = case["text"].as_str().unwrap();
            let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            assert_eq!(pretrained.tokenizer.encode(text, false).unwrap(), want, "{text:?}");
            assert_eq!(pretrained.tokenizer.decode(&want, false).unwrap(), text);
        }
        for chat in golden["chats"].as_array().unwrap() {
            let messages: Vec<ChatMessage> = chat["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap())
                })
                .collect();
            let rendered = pretrained.apply_chat_template(&messages, true).unwrap();
            assert_eq!(rendered, chat["rendered"].as_str().unwrap());
        }
    }
}
