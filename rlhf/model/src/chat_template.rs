//! Chat templates as Hugging Face `transformers` renders them (`apply_chat_template`): the Jinja
//! source from `tokenizer_config.json` (or `chat_template.jinja`) rendered by `minijinja` with
//! the environment transformers sets up — `trim_blocks`, `lstrip_blocks`, loop controls,
//! Python string and dict methods, `raise_exception`, `strftime_now` and a `tojson` that writes
//! what Python's `json.dumps` writes.
//!
//! Variables passed to the template: `messages`, `add_generation_prompt`, `tools` when a
//! conversation has tools, and every special token of the tokenizer config (`bos_token`, `eos_token`, `pad_token`, `unk_token`, …), as
//! transformers does.

use std::collections::BTreeMap;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// One message of a conversation (`{"role": "user", "content": "..."}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, … (the template decides which it accepts).
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.to_owned(), content: content.to_owned() }
    }
}

/// A compiled chat template plus the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    special_tokens: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

/// Name of the template inside the environment (used in error messages).
const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; `special_tokens` maps `bos_token`, `eos_token`, … to their text.
    pub fn new(source: &str, special_tokens: BTreeMap<String, String>) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ModelError::Tokenizer(format!("chat template syntax: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", python_tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| template_error("compiling", source, &e))?;
        Ok(Self { env, source: source.to_owned(), special_tokens })
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`, ending with the assistant's turn header when
    /// `add_generation_prompt` is set (the prompt of a generation).
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, add_generation_prompt, &[])
    }

    /// [`ChatTemplate::render`] with `tools`, OpenAI function schemas (`{"type": "function",
    /// "function": {…}}`), as transformers' `apply_chat_template(tools=…)` passes them; none
    /// leaves `tools` undefined, as transformers' `tools=None` does.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: &[serde_json::Value],
    ) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error("loading", &self.source, &e))?;
        let mut context: BTreeMap<String, Value> = self
            .special_tokens
            .iter()
            .map(|(name, text)| (name.clone(), Value::from(text.as_str())))
            .collect();
        context.insert("messages".to_owned(), Value::from(minijinja::value::Serde(messages)));
        context.insert("add_generation_prompt".to_owned(), Value::from(add_generation_prompt));
        if !tools.is_empty() {
            context.insert("tools".to_owned(), Value::from(minijinja::value::Serde(tools)));
        }
        template.render(context).map_err(|e| template_error("rendering", &self.source, &e))
    }
}

/// A template error with the template's source excerpt and minijinja's message (which carries
/// the line and, for `raise_exception`, the template's own message).
fn template_error(action: &str, source: &str, error: &Error) -> ModelError {
    let mut message = format!("{action} the chat template: {error}");
    if let Some(line) = error.line()
        && let Some(text) = source.lines().nth(line.saturating_sub(1))
    {
        message.push_str(&format!(" (template line {line}: `{}`)", text.trim()));
    }
    let mut cause = std::error::Error::source(error);
    while let Some(inner) = cause {
        message.push_str(&format!(": {inner}"));
        cause = inner.source();
    }
    ModelError::Tokenizer(message)
}

/// `raise_exception(message)`: the template refuses its input.
fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("template raised: {message}")))
}

/// `strftime_now(format)`: the current UTC time (templates print dates in system prompts).
/// Supports the directives chat templates use: `%Y %m %d %B %b %H %M %S %%`.
fn strftime_now(format: String) -> std::result::Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(name),
            Some('b') => out.push_str(&name[..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive `%{other}`"),
                ));
            }
            None => out.push('%'),
        }
    }
    Ok(Value::from(out))
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `x | tojson(indent=None, separators=None, sort_keys=False)` as transformers defines it:
/// `json.dumps(x, ensure_ascii=False, ...)` — `", "` and `": "` separators when not indented,
/// non-ASCII characters kept, nothing HTML-escaped (minijinja's own `tojson` escapes `<`, `>`,
/// `&` and `'`, which a template's output must not contain).
fn python_tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    // Keys keep the template data's order (minijinja's `preserve_order`), as Python dicts do;
    // `sort_keys` goes through a sorted map.
    let text = if sort_keys.unwrap_or(false) {
        to_json_text(&sorted(&value)?, indent)
    } else {
        to_json_text(&value, indent)
    }
    .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(text))
}

/// `value` as `json.dumps` writes it: Python's separators, or `indent` spaces per level.
fn to_json_text<T: serde::Serialize>(
    value: &T,
    indent: Option<usize>,
) -> std::result::Result<String, serde_json::Error> {
    let mut out = Vec::new();
    match indent {
        None => value
            .serialize(&mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter))?,
        Some(n) => {
            let spaces = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&spaces);
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, formatter))?
        }
    }
    // serde_json writes only valid UTF-8.
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// `value` as JSON with every object's keys sorted (serde_json's map is ordered by key).
fn sorted(value: &Value) -> std::result::Result<serde_json::Value, Error> {
    serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))
}

/// Python's `json.dumps` default separators: `", "` between items, `": "` after keys.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specials() -> BTreeMap<String, String> {
        [("bos_token", "<s>"), ("eos_token", "</s>")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    #[test]
    fn renders_with_trimmed_blocks_python_methods_and_special_tokens() {
        let source = "{{ bos_token }}{% for m in messages %}\n\
                      {% if m['role'].startswith('sys') %}[S]{{ m['content'].strip() }}\n\
                      {% else %}[{{ m.role | upper }}]{{ m.content }}{{ eos_token }}\n\
                      {% endif %}\n\
                      {% endfor %}\n\
                      {% if add_generation_prompt %}[ASSISTANT]{% endif %}";
        let t = ChatTemplate::new(source, specials()).unwrap();
        let messages =
            [ChatMessage::new("system", "  be brief \n"), ChatMessage::new("user", "hi")];
        assert_eq!(t.render(&messages, true).unwrap(), "<s>[S]be brief\n[USER]hi</s>\n[ASSISTANT]");
        assert_eq!(t.render(&messages, false).unwrap(), "<s>[S]be brief\n[USER]hi</s>\n");
    }

    #[test]
    fn raise_exception_and_syntax_errors_say_what_and_where() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role not in ['user'] %}\
             {{ raise_exception('only user roles, found ' + m.role) }}{% endif %}{% endfor %}",
            specials(),
        )
        .unwrap();
        let err = t.render(&[ChatMessage::new("tool", "x")], false).unwrap_err().to_string();
        assert!(err.contains("only user roles, found tool"), "{err}");
        let err = ChatTemplate::new("{% for m in messages %}", specials()).unwrap_err().to_string();
        assert!(err.contains("compiling the chat template"), "{err}");
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = ChatTemplate::new("{{ messages | tojson }}", BTreeMap::new()).unwrap();
        let out = t.render(&[ChatMessage::new("user", "<é & '中'>")], false).unwrap();
        assert_eq!(out, r#"[{"role": "user", "content": "<é & '中'>"}]"#);
    }

    #[test]
    fn strftime_now_formats_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
        let t = ChatTemplate::new("{{ strftime_now('%d %B %Y') }}", BTreeMap::new()).unwrap();
        let out = t.render(&[], false).unwrap();
        assert_eq!(out.split(' ').count(), 3, "{out}");
    }
}
