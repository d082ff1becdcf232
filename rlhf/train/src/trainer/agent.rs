//! Multi-turn rollouts with tools (`tools.*`, [`crate::tools`]).
//!
//! Each sample is a conversation after its prompt. The first turn is generated as a
//! single-turn rollout is (one request per prompt, `n` samples), stopping at a tool call's
//! `</tool_call>` or at EOS; then, while the [`ToolAgent`] loop asks for calls, every
//! conversation that made one gets the tools' answers (rendered as the chat template renders
//! `tool` messages, with the close of the model's turn before them and the header of its next
//! turn after) and its next turn is generated from the whole context, all conversations of the
//! step in one batch per round. Prefix caching makes a later turn's prompt nearly free.
//!
//! The response is every turn and answer in order, with a loss mask that is `false` on the
//! answers' tokens (their log-probs are 0 and no loss, KL or advantage reads them) and the
//! engine's log-probs on the model's. The whole response stays within `rollout.max_new_tokens`:
//! a conversation whose next answer would not fit ends there.

use rtrun_rlhf_engine::{GenerationRequest, SamplingParams};

use crate::error::{Result, TrainError};
use crate::prompts::PromptRecord;
use crate::rng::mix_seed;
use crate::tools::{
    Action, AgentLoop, CALL_CLOSE, Observation, ToolAgent, ToolBox, Turn, TurnRole,
};
use crate::trainer::Trainer;
use crate::trainer::rollout::Group;

/// The run's tools and their schemas (what the chat template lists).
#[derive(Debug, Clone)]
pub struct RunTools {
    /// The tools.
    pub toolbox: ToolBox,
    /// Their OpenAI function schemas.
    pub schemas: Vec<serde_json::Value>,
}

/// One sample's conversation after the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// The prompt's ids.
    pub prompt_ids: Vec<u32>,
    /// Every turn's and answer's ids, in order.
    pub response_ids: Vec<u32>,
    /// `true` on the model's tokens, `false` on the answers'.
    pub loss_mask: Vec<bool>,
    /// The engine's log-prob of each model token, 0 on the answers'.
    pub log_probs: Vec<f32>,
    /// The turns' texts, for the agent loop.
    pub turns: Vec<Turn>,
    /// Calls made so far.
    pub tool_calls: usize,
    /// Whether it is over.
    pub done: bool,
}

impl Conversation {
    /// A conversation after `prompt_ids`, nothing said yet.
    pub fn new(prompt_ids: Vec<u32>) -> Self {
        Self {
            prompt_ids,
            response_ids: Vec::new(),
            loss_mask: Vec::new(),
            log_probs: Vec::new(),
            turns: Vec::new(),
            tool_calls: 0,
            done: false,
        }
    }

    /// The model's next turn: its ids, the engine's log-probs of them, and its text.
    pub fn add_model_turn(&mut self, ids: Vec<u32>, log_probs: Vec<f32>, text: String) {
        let mut log_probs = log_probs;
        // A request without log-probs still keeps the columns aligned.
        log_probs.resize(ids.len(), 0.0);
        self.loss_mask.extend(std::iter::repeat_n(true, ids.len()));
        self.response_ids.extend(ids);
        self.log_probs.extend(log_probs);
        self.turns.push(Turn { role: TurnRole::Assistant, content: text });
    }

    /// The tools' answers to the last turn (`ids`: the close of that turn, the answers and the
    /// next turn's header; `text`: what they said).
    pub fn add_answers(&mut self, ids: Vec<u32>, text: String) {
        self.loss_mask.extend(std::iter::repeat_n(false, ids.len()));
        self.log_probs.extend(std::iter::repeat_n(0.0, ids.len()));
        self.response_ids.extend(ids);
        self.turns.push(Turn { role: TurnRole::Tool, content: text });
    }

    /// The prompt and everything said so far: the next turn's prompt.
    pub fn context(&self) -> Vec<u32> {
        let mut ids = self.prompt_ids.clone();
        ids.extend(&self.response_ids);
        ids
    }
}

/// What the tools did in a rollout (the step's `tools/…` metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ToolStats {
    /// Calls run.
    pub calls: usize,
    /// Calls answered with an error (unknown tool, bad arguments, failure, timeout).
    pub errors: usize,
    /// Answers cut at `tools.max_output_bytes`.
    pub truncated: usize,
    /// Conversations.
    pub conversations: usize,
    /// Model turns over every conversation.
    pub model_turns: usize,
    /// Conversations that ended because the next answer would not fit the token budget.
    pub out_of_budget: usize,
}

impl ToolStats {
    /// The `tools/…` metrics.
    pub fn metrics(&self) -> Vec<(String, f64)> {
        let per = |n: usize| n as f64 / self.conversations.max(1) as f64;
        vec![
            ("tools/calls_per_sample".to_owned(), per(self.calls)),
            ("tools/errors".to_owned(), self.errors as f64),
            ("tools/truncated".to_owned(), self.truncated as f64),
            ("tools/turns_per_sample".to_owned(), per(self.model_turns)),
            ("tools/out_of_budget".to_owned(), self.out_of_budget as f64),
        ]
    }
}

/// Runs `calls` for `conversation` and appends the answers (or ends it when they would not fit
/// `budget`); returns the next turn's request, if any.
fn answer_turn(
    trainer: &Trainer,
    tools: &RunTools,
    conversation: &mut Conversation,
    calls: &[crate::tools::ParsedCall],
    stats: &mut ToolStats,
) -> Result<Option<usize>> {
    let answers: Vec<Observation> = calls.iter().map(|c| tools.toolbox.run(c)).collect();
    stats.calls += answers.len();
    stats.errors += answers.iter().filter(|a| a.error).count();
    stats.truncated += answers.iter().filter(|a| a.truncated).count();
    conversation.tool_calls += answers.len();
    let texts: Vec<String> = answers.into_iter().map(|a| a.content).collect();
    let last = conversation.turns.last().map(|t| t.content.clone()).unwrap_or_default();
    let ids = trainer.tokenizer.tool_turn(&last, &texts, &tools.schemas)?;
    let budget = trainer.config.max_new_tokens();
    let used = conversation.response_ids.len() + ids.len();
    if used >= budget {
        stats.out_of_budget += 1;
        conversation.done = true;
        return Ok(None);
    }
    conversation.add_answers(ids, texts.join("\n"));
    Ok(Some(budget - used))
}

impl Trainer {
    /// `params.n` multi-turn conversations per prompt (see the module doc), as groups, and
    /// what the tools did.
    pub(super) fn agent_groups(
        &self,
        records: &[PromptRecord],
        prompt_ids: &[Vec<u32>],
        params: &SamplingParams,
        seed_base: u64,
    ) -> Result<(Vec<Group>, ToolStats)> {
        let tools = self.tools.as_ref().ok_or_else(|| {
            TrainError::config("tools", "expected tools for a multi-turn rollout")
        })?;
        let agent = ToolAgent {
            max_turns: self.config.rollout.max_turns,
            max_tool_calls: self.config.rollout.max_tool_calls,
        };
        let mut stop = params.stop.clone();
        stop.push(CALL_CLOSE.to_owned());
        let first = SamplingParams { stop: stop.clone(), ..params.clone() };
        let outputs = self.generate(prompt_ids, &first, seed_base)?;
        let mut conversations: Vec<Vec<Conversation>> = Vec::with_capacity(outputs.len());
        for (output, ids) in outputs.into_iter().zip(prompt_ids) {
            let group = output
                .samples
                .into_iter()
                .map(|sample| {
                    let mut c = Conversation::new(ids.clone());
                    let text = self.tokenizer.decode_response(&sample.token_ids);
                    c.add_model_turn(sample.token_ids, sample.log_probs, text);
                    c
                })
                .collect();
            conversations.push(group);
        }
        let mut stats = ToolStats::default();
        for round in 1u64.. {
            let mut requests = Vec::new();
            let mut owners = Vec::new();
            for (g, group) in conversations.iter_mut().enumerate() {
                for (j, conversation) in group.iter_mut().enumerate() {
                    if conversation.done {
                        continue;
                    }
                    let calls = match agent.next(&conversation.turns, conversation.tool_calls) {
                        Action::CallTools(calls) => calls,
                        Action::Finish | Action::Generate => {
                            conversation.done = true;
                            continue;
                        }
                    };
                    let Some(room) = answer_turn(self, tools, conversation, &calls, &mut stats)?
                    else {
                        continue;
                    };
                    // Each conversation's turn `round` has its own seed, so its samples do not
                    // depend on which others are still going.
                    let seed = mix_seed(seed_base, (round << 40) | ((g as u64) << 20) | j as u64);
                    let turn = SamplingParams {
                        n: 1,
                        max_tokens: room as u32,
                        seed: Some(seed),
                        stop: stop.clone(),
                        ..params.clone()
                    };
                    requests.push(GenerationRequest::new(conversation.context(), turn));
                    owners.push((g, j));
                }
            }
            if requests.is_empty() {
                break;
            }
            let outputs = self.generate_requests(requests, 1)?;
            for ((g, j), output) in owners.into_iter().zip(outputs) {
                let conversation = &mut conversations[g][j];
                for sample in output.samples {
                    let text = self.tokenizer.decode_response(&sample.token_ids);
                    conversation.add_model_turn(sample.token_ids, sample.log_probs, text);
                }
            }
        }
        stats.conversations = conversations.iter().map(Vec::len).sum();
        stats.model_turns = conversations
            .iter()
            .flatten()
            .map(|c| c.turns.iter().filter(|t| t.role == TurnRole::Assistant).count())
            .sum();
        let groups = conversations
            .into_iter()
            .zip(records)
            .zip(prompt_ids)
            .map(|((group, record), ids)| {
                let mut out = Group::new(record.clone(), ids.clone());
                for c in group {
                    out.responses.push(c.response_ids);
                    out.engine_log_probs.push(c.log_probs);
                    out.loss_masks.push(c.loss_mask);
                }
                out
            })
            .collect();
        Ok((groups, stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conversation_keeps_ids_masks_and_log_probs_aligned() {
        let mut c = Conversation::new(vec![1, 2]);
        c.add_model_turn(vec![10, 11, 12], vec![-0.1, -0.2, -0.3], "call".into());
        c.add_answers(vec![20, 21], "7".into());
        c.add_model_turn(vec![13, 14], vec![-0.4], "done".into());
        assert_eq!(c.response_ids, vec![10, 11, 12, 20, 21, 13, 14]);
        assert_eq!(c.loss_mask, vec![true, true, true, false, false, true, true]);
        assert_eq!(c.log_probs, vec![-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, 0.0]);
        assert_eq!(c.context(), vec![1, 2, 10, 11, 12, 20, 21, 13, 14]);
        let roles: Vec<TurnRole> = c.turns.iter().map(|t| t.role).collect();
        assert_eq!(roles, vec![TurnRole::Assistant, TurnRole::Tool, TurnRole::Assistant]);
        let stats = ToolStats { calls: 3, conversations: 2, model_turns: 5, ..Default::default() };
        let metrics = stats.metrics();
        assert!(metrics.contains(&("tools/calls_per_sample".to_owned(), 1.5)));
        assert!(metrics.contains(&("tools/turns_per_sample".to_owned(), 2.5)));
    }
}
