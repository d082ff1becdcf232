//! Tools a policy calls in multi-turn rollouts, and the agent loop that decides each turn.
//!
//! A turn of the model that contains tool calls in the Hermes / Qwen format
//! (`<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 7"}}</tool_call>`, the
//! format of Qwen2.5's and Hermes' chat templates and of vLLM's `hermes` tool parser) gets the
//! tools' answers as the next message (role `tool`), and generation goes on after it. What a tool
//! answers is an observation: an unknown tool, malformed arguments, an error, a timeout or an
//! answer over the size limit all become text the model reads (and the metrics count), never a
//! failed step.
//!
//! - [`AgentLoop`]: the conversation so far → the next [`Action`] (generate, call tools,
//!   finish). [`ToolAgent`] is the built-in loop (verl's `tool_agent`): finish when the model's
//!   turn has no tool call or a limit is reached (`rollout.max_turns`,
//!   `rollout.max_tool_calls`).
//! - [`Tool`]: one tool; [`ToolBox`] the run's tools by name: the built-in `calculator` and the
//!   tools an HTTP endpoint serves ([`HttpTools`], `tools.url`).

pub mod calculator;
pub mod http;

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use http::HttpTools;

/// The built-in tools' names (`tools.enabled`).
pub const BUILT_IN: [&str; 1] = ["calculator"];

/// The run's tools: the built-ins `config` enables and an endpoint's (a clear error naming
/// `tools.url` when it cannot be listed).
pub fn from_config(config: &crate::config::ToolsConfig) -> crate::Result<ToolBox> {
    let mut tools = ToolBox::new(config.max_output_bytes);
    for name in &config.enabled {
        match name.as_str() {
            "calculator" => tools.add(Arc::new(Calculator)),
            other => {
                return Err(crate::TrainError::config(
                    "tools.enabled",
                    format!("expected built-in tools of {BUILT_IN:?}, found `{other}`"),
                ));
            }
        }
    }
    if let Some(url) = &config.url {
        let timeout = std::time::Duration::from_secs_f64(config.timeout_s);
        // The body may be larger than what the model reads (it is cut then); beyond 16× it is
        // refused as an error observation.
        let limit = (config.max_output_bytes as u64).saturating_mul(16).max(1 << 16);
        for tool in HttpTools::connect(url, timeout, limit)
            .map_err(|e| crate::TrainError::config("tools.url", e))?
        {
            tools.add(tool);
        }
    }
    Ok(tools)
}

/// One call the model asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments (an object).
    #[serde(default)]
    pub arguments: Value,
}

/// What the model's turn asked for, as parsed.
#[derive(Debug, Clone, PartialEq)]
pub enum ParsedCall {
    /// A well-formed call.
    Call(ToolCall),
    /// A `<tool_call>` block that is not a call, and why (answered as an error observation).
    Malformed(String),
}

/// The opening and closing tags of a call in the Hermes / Qwen format.
pub const CALL_OPEN: &str = "<tool_call>";
/// See [`CALL_OPEN`].
pub const CALL_CLOSE: &str = "</tool_call>";

/// Every `<tool_call>…</tool_call>` block of `text`, in order. An unclosed block at the end
/// counts as malformed (the turn ended inside it).
pub fn parse_calls(text: &str) -> Vec<ParsedCall> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(CALL_OPEN) {
        let body_start = start + CALL_OPEN.len();
        let Some(length) = rest[body_start..].find(CALL_CLOSE) else {
            calls.push(ParsedCall::Malformed(format!(
                "expected `{CALL_CLOSE}` after `{CALL_OPEN}`"
            )));
            break;
        };
        let body = rest[body_start..body_start + length].trim();
        calls.push(match serde_json::from_str::<ToolCall>(body) {
            Ok(call) if call.arguments.is_object() || call.arguments.is_null() => {
                ParsedCall::Call(call)
            }
            Ok(call) => ParsedCall::Malformed(format!(
                "expected `arguments` to be a JSON object for tool `{}`, found {}",
                call.name, call.arguments
            )),
            Err(e) => ParsedCall::Malformed(format!(
                "expected a JSON object {{\"name\": …, \"arguments\": {{…}}}}: {e}"
            )),
        });
        rest = &rest[body_start + length + CALL_CLOSE.len()..];
    }
    calls
}

/// One tool.
pub trait Tool: Send + Sync {
    /// Its name, as calls name it.
    fn name(&self) -> &str;
    /// Its OpenAI function schema (`{"type": "function", "function": {name, description,
    /// parameters}}`), what the chat template's `tools` receives.
    fn schema(&self) -> Value;
    /// Runs a call; `Err` is an error the model reads.
    fn call(&self, arguments: &Value) -> Result<String, String>;
}

/// The built-in calculator (see [`calculator`]).
#[derive(Debug, Default)]
pub struct Calculator;

impl Tool for Calculator {
    fn name(&self) -> &str {
        "calculator"
    }

    fn schema(&self) -> Value {
        serde_json::json!({
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluates an arithmetic expression: numbers, + - * / % ^ and parentheses.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2"}},
                    "required": ["expression"],
                },
            },
        })
    }

    fn call(&self, arguments: &Value) -> Result<String, String> {
        let expression = arguments
            .get("expression")
            .and_then(Value::as_str)
            .ok_or("expected a string argument `expression`")?;
        calculator::evaluate(expression).map(calculator::format_number)
    }
}

/// What a call gave the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    /// The text the model reads.
    pub content: String,
    /// Whether it reports an error (unknown tool, bad arguments, a failure, a timeout).
    pub error: bool,
    /// Whether the answer was cut at the size limit.
    pub truncated: bool,
}

/// The run's tools, by name.
#[derive(Clone, Default)]
pub struct ToolBox {
    tools: BTreeMap<String, Arc<dyn Tool>>,
    /// Longest observation in bytes; longer answers are cut (and say so).
    max_output_bytes: usize,
}

impl std::fmt::Debug for ToolBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolBox")
            .field("tools", &self.tools.keys().collect::<Vec<_>>())
            .field("max_output_bytes", &self.max_output_bytes)
            .finish()
    }
}

impl ToolBox {
    /// No tools yet; observations cut at `max_output_bytes`.
    pub fn new(max_output_bytes: usize) -> Self {
        Self { tools: BTreeMap::new(), max_output_bytes }
    }

    /// Adds a tool (a later one of the same name replaces it).
    pub fn add(&mut self, tool: Arc<dyn Tool>) {
        self.tools.insert(tool.name().to_owned(), tool);
    }

    /// The tools' names.
    pub fn names(&self) -> Vec<&str> {
        self.tools.keys().map(String::as_str).collect()
    }

    /// Every tool's schema, for the chat template's `tools`.
    pub fn schemas(&self) -> Vec<Value> {
        self.tools.values().map(|t| t.schema()).collect()
    }

    /// Runs one parsed call; whatever happens becomes an observation.
    pub fn run(&self, call: &ParsedCall) -> Observation {
        let (content, error) = match call {
            ParsedCall::Malformed(why) => (format!("error: {why}"), true),
            ParsedCall::Call(call) => match self.tools.get(&call.name) {
                None => (
                    format!(
                        "error: expected one of the tools {}, found `{}`",
                        self.names().join(", "),
                        call.name
                    ),
                    true,
                ),
                Some(tool) => match tool.call(&call.arguments) {
                    Ok(answer) => (answer, false),
                    Err(e) => (format!("error: {e}"), true),
                },
            },
        };
        let (content, truncated) = cut(content, self.max_output_bytes);
        Observation { content, error, truncated }
    }
}

/// `text` cut to at most `limit` bytes at a character boundary, with a note when cut.
fn cut(text: String, limit: usize) -> (String, bool) {
    if text.len() <= limit {
        return (text, false);
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (format!("{}… [cut at {limit} bytes]", &text[..end]), true)
}

/// A message of a multi-turn conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// `assistant` (the model) or `tool` (observations).
    pub role: TurnRole,
    /// The text.
    pub content: String,
}

/// Who wrote a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnRole {
    /// The model.
    Assistant,
    /// A tool's answer.
    Tool,
}

/// What the rollout does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Let the model write its next turn.
    Generate,
    /// Run these calls, append their answers, then generate.
    CallTools(Vec<ParsedCall>),
    /// The conversation is over.
    Finish,
}

/// Decides each step of a multi-turn rollout from the conversation after the prompt.
pub trait AgentLoop: Send + Sync {
    /// The next action; `turns` ends with the model's latest turn (empty before the first).
    fn next(&self, turns: &[Turn], tool_calls_so_far: usize) -> Action;
}

/// verl's `tool_agent` loop: call the tools the model's latest turn asks for, finish when it
/// asks for none, after `max_turns` model turns, or once `max_tool_calls` calls were made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolAgent {
    /// Model turns at most.
    pub max_turns: usize,
    /// Tool calls at most, over the conversation.
    pub max_tool_calls: usize,
}

impl AgentLoop for ToolAgent {
    fn next(&self, turns: &[Turn], tool_calls_so_far: usize) -> Action {
        let Some(last) = turns.last() else { return Action::Generate };
        if last.role == TurnRole::Tool {
            return Action::Generate;
        }
        let model_turns = turns.iter().filter(|t| t.role == TurnRole::Assistant).count();
        if model_turns >= self.max_turns {
            return Action::Finish;
        }
        let calls = parse_calls(&last.content);
        let room = self.max_tool_calls.saturating_sub(tool_calls_so_far);
        if calls.is_empty() || room == 0 {
            return Action::Finish;
        }
        Action::CallTools(calls.into_iter().take(room).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toolbox() -> ToolBox {
        let mut tools = ToolBox::new(64);
        tools.add(Arc::new(Calculator));
        tools
    }

    #[test]
    fn calls_are_parsed_in_the_hermes_format_and_bad_ones_say_why() {
        let text = "I will compute.<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"3*7\"}}\n</tool_call> and <tool_call>{\"name\": \"calculator\"}</tool_call>";
        let calls = parse_calls(text);
        assert_eq!(calls.len(), 2);
        let ParsedCall::Call(first) = &calls[0] else { panic!("{calls:?}") };
        assert_eq!(first.name, "calculator");
        assert_eq!(first.arguments["expression"], "3*7");
        assert!(matches!(&calls[1], ParsedCall::Call(c) if c.arguments.is_null()));
        assert!(parse_calls("no calls here").is_empty());
        let bad = parse_calls(
            "<tool_call>{not json}</tool_call><tool_call>{\"name\": \"calculator\", \"arguments\": [1]}</tool_call><tool_call>{\"name\"",
        );
        assert_eq!(bad.len(), 3);
        assert!(matches!(&bad[0], ParsedCall::Malformed(m) if m.contains("JSON object")));
        assert!(
            matches!(&bad[1], ParsedCall::Malformed(m) if m.contains("`arguments` to be a JSON object"))
        );
        assert!(matches!(&bad[2], ParsedCall::Malformed(m) if m.contains("</tool_call>")));
    }

    #[test]
    fn every_outcome_is_an_observation_of_bounded_size() {
        let tools = toolbox();
        let call = |name: &str, args: Value| {
            ParsedCall::Call(ToolCall { name: name.into(), arguments: args })
        };
        let ok = tools.run(&call("calculator", serde_json::json!({"expression": "48 / 2 - 6"})));
        assert_eq!(ok, Observation { content: "18".into(), error: false, truncated: false });
        let unknown = tools.run(&call("search", Value::Null));
        assert!(
            unknown.error
                && unknown.content.contains("calculator")
                && unknown.content.contains("`search`")
        );
        let missing = tools.run(&call("calculator", serde_json::json!({"expr": "1"})));
        assert!(missing.error && missing.content.contains("`expression`"), "{missing:?}");
        let failed = tools.run(&call("calculator", serde_json::json!({"expression": "1/0"})));
        assert!(failed.error && failed.content.contains("division by zero"));
        let malformed = tools.run(&ParsedCall::Malformed("expected JSON".into()));
        assert!(malformed.error && malformed.content == "error: expected JSON");
        let long =
            tools.run(&call("calculator", serde_json::json!({"expression": "1+".repeat(200)})));
        assert!(long.error && long.content.contains("at most 256 bytes"), "{long:?}");
        // An answer of megabytes reaches the model cut to the limit, saying so.
        struct Verbose;
        impl Tool for Verbose {
            fn name(&self) -> &str {
                "verbose"
            }
            fn schema(&self) -> Value {
                Value::Null
            }
            fn call(&self, _: &Value) -> Result<String, String> {
                Ok("y".repeat(4 << 20))
            }
        }
        let mut tools = tools.clone();
        tools.add(Arc::new(Verbose));
        let cut_answer = tools.run(&call("verbose", Value::Null));
        assert!(!cut_answer.error && cut_answer.truncated, "{}", cut_answer.content.len());
        assert!(
            cut_answer.content.len() < 100 && cut_answer.content.ends_with("[cut at 64 bytes]")
        );
        let (text, cut_it) = cut("ééé".into(), 3);
        assert!(cut_it && text.starts_with('é') && !text.starts_with("éé"));
        assert_eq!(tools.names(), vec!["calculator", "verbose"]);
        assert_eq!(tools.schemas()[0]["function"]["name"], "calculator");
    }

    #[test]
    fn the_tool_agent_loop_stops_at_its_limits() {
        let agent = ToolAgent { max_turns: 3, max_tool_calls: 2 };
        let turn = |role, content: &str| Turn { role, content: content.into() };
        let call = "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1+1\"}}</tool_call>";
        assert_eq!(agent.next(&[], 0), Action::Generate);
        let mut turns = vec![turn(TurnRole::Assistant, &format!("{call}{call}{call}"))];
        // Three calls asked for, two allowed.
        assert!(matches!(agent.next(&turns, 0), Action::CallTools(c) if c.len() == 2));
        turns.push(turn(TurnRole::Tool, "2"));
        assert_eq!(agent.next(&turns, 2), Action::Generate);
        turns.push(turn(TurnRole::Assistant, call));
        assert_eq!(agent.next(&turns, 2), Action::Finish, "no calls left");
        assert!(matches!(agent.next(&turns, 1), Action::CallTools(c) if c.len() == 1));
        turns.push(turn(TurnRole::Tool, "2"));
        turns.push(turn(TurnRole::Assistant, call));
        assert_eq!(agent.next(&turns, 0), Action::Finish, "three model turns");
        let done = [turn(TurnRole::Assistant, "The answer is 2.")];
        assert_eq!(agent.next(&done, 0), Action::Finish);
    }
}
