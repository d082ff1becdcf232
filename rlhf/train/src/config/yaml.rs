//! Config YAML to config values with errors a user can act on: the file and line of a syntax
//! error or a duplicate key, and for a value of the wrong type the dotted key, what it expects
//! and what it found (`config key `train.actor_lr` (grpo.yaml:31): expected a number, found a
//! sequence`), instead of the parser's own wording.

use serde_json::Value;

use crate::error::{Result, TrainError};

/// The YAML as a tree (`Null` for a file without settings: empty or only comments).
pub(super) fn parse_tree(text: &str, file: &str) -> Result<Value> {
    if text.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_saphyr::from_str::<Value>(text).map_err(|e| {
        let at = match e.location() {
            Some(l) if l.line() > 0 => format!("{file}:{}:{}", l.line(), l.column()),
            _ => file.to_owned(),
        };
        // The parser wraps errors with a source snippet (and alias context); the cause is inside.
        let mut e = e;
        while let serde_saphyr::Error::WithSnippet { error, .. }
        | serde_saphyr::Error::AliasError { error, .. } = e
        {
            e = *error;
        }
        let message = match &e {
            serde_saphyr::Error::DuplicateMappingKey { key: Some(key), .. } => {
                format!("duplicate key `{key}` (a key may appear once in its section)")
            }
            serde_saphyr::Error::DuplicateMappingKey { key: None, .. } => {
                "duplicate key (a key may appear once in its section)".to_owned()
            }
            other => first_line(&other.to_string()),
        };
        TrainError::ConfigFile { file: at, message }
    })
}

/// The parser's message without the source snippet it may append and without its own
/// position (`error: line 3 column 5: `), which the caller puts in front as `file:line:column`.
fn first_line(message: &str) -> String {
    let line = message.lines().next().unwrap_or(message).trim();
    let line = line.strip_prefix("error: ").unwrap_or(line);
    match line.strip_prefix("line ").and_then(|rest| rest.split_once(": ")) {
        Some((position, rest)) if position.contains(" column ") => rest.to_owned(),
        _ => line.to_owned(),
    }
}

/// What a YAML value is, for messages.
pub(super) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a sequence",
        Value::Object(_) => "a mapping",
    }
}

/// The tree as the config; an error names the key (with its line in the file when the file,
/// not an override, set it).
pub(crate) fn typed<T: serde::de::DeserializeOwned>(
    root: Value,
    text: &str,
    file: &str,
    overrides: &[String],
) -> Result<T> {
    serde_path_to_error::deserialize(root).map_err(|e| {
        let path = e.path().to_string();
        let message = e.inner().to_string();
        let (key, message) = match unknown_field(&message) {
            Some((field, expected)) => {
                // The path names the unknown key already, or (at the top level) nothing.
                let key = match path.as_str() {
                    "." => field.to_owned(),
                    p if p == field || p.ends_with(&format!(".{field}")) => path.clone(),
                    p => format!("{p}.{field}"),
                };
                let hint = nearest(field, expected)
                    .map(|near| format!("did you mean `{near}`? "))
                    .unwrap_or_default();
                (key, format!("unknown key; {hint}expected one of {expected}"))
            }
            None => match unknown_variant(&message) {
                Some((value, expected)) => match nearest(value, expected) {
                    Some(near) => (path, format!("{message} (did you mean `{near}`?)")),
                    None => (path, message),
                },
                None => (path, plain_type_error(&message)),
            },
        };
        let overridden = overrides.iter().any(|o| {
            o.split_once('=').is_some_and(|(k, _)| {
                let k = k.trim();
                k == key || key.starts_with(&format!("{k}.")) || k.starts_with(&format!("{key}."))
            })
        });
        let at = if overridden {
            "--set".to_owned()
        } else {
            match key_line(text, &key) {
                Some(line) => format!("{file}:{line}"),
                None => file.to_owned(),
            }
        };
        TrainError::Config { key, message: format!("{message} ({at})") }
    })
}

/// `unknown field `x`, expected one of `a`, `b`` as (`x`, "`a`, `b`").
fn unknown_field(message: &str) -> Option<(&str, &str)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (field, rest) = rest.split_once('`')?;
    let expected = rest.trim_start_matches(',').trim();
    let expected = expected.strip_prefix("expected one of ").unwrap_or(expected);
    let expected = expected.strip_prefix("expected ").unwrap_or(expected);
    Some((field, expected))
}

/// `unknown variant `x`, expected `a` or `b`` as (`x`, "`a` or `b`").
fn unknown_variant(message: &str) -> Option<(&str, &str)> {
    let rest = message.strip_prefix("unknown variant `")?;
    let (value, rest) = rest.split_once('`')?;
    let expected = rest.trim_start_matches(',').trim();
    Some((value, expected.strip_prefix("expected ").unwrap_or(expected)))
}

/// The backticked name in `expected` closest to `word`, if one is close enough to be a slip
/// (Jaro-Winkler similarity of 0.8 or more, as cargo and clap suggest).
fn nearest<'a>(word: &str, expected: &'a str) -> Option<&'a str> {
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|name| (strsim::jaro_winkler(word, name), name))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, name)| name)
}

/// serde's `invalid type: sequence, expected f64` as `expected a number, found a sequence`.
fn plain_type_error(message: &str) -> String {
    let Some(rest) =
        message.strip_prefix("invalid type: ").or_else(|| message.strip_prefix("invalid value: "))
    else {
        return message.to_owned();
    };
    let Some((found, expected)) = rest.rsplit_once(", expected ") else {
        return message.to_owned();
    };
    let expected = match expected {
        "f32" | "f64" => "a number",
        "u8" | "u16" | "u32" | "u64" | "usize" => "a whole number >= 0",
        "i8" | "i16" | "i32" | "i64" | "isize" => "a whole number",
        e if e.starts_with("struct ") => "a mapping of keys",
        e => e,
    };
    let found = match found {
        "sequence" => "a sequence".to_owned(),
        "map" => "a mapping".to_owned(),
        "null" | "unit value" => "nothing".to_owned(),
        f => f.to_owned(),
    };
    format!("expected {expected}, found {found}")
}

/// The line (1-based) of dotted `key` in block-style YAML `text`: a line `name:` whose
/// enclosing keys (by indentation) are the key's sections. A key inside a flow mapping
/// (`train: {actor_lr: 1}`) gives the line of its innermost section found that way.
pub(crate) fn key_line(text: &str, key: &str) -> Option<usize> {
    let path: Vec<&str> = key.split('.').collect();
    let mut stack: Vec<(usize, &str)> = Vec::new();
    let mut best: Option<(usize, usize)> = None;
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let indent = line.len() - trimmed.len();
        let Some((name, _)) = trimmed.split_once(':') else { continue };
        let name = name.trim().trim_matches(|c| c == '"' || c == '\'');
        if name.is_empty() || name.contains(char::is_whitespace) {
            continue;
        }
        while stack.last().is_some_and(|&(i, _)| i >= indent) {
            stack.pop();
        }
        stack.push((indent, name));
        let depth = stack.len();
        if depth <= path.len() && stack.iter().map(|&(_, n)| n).eq(path[..depth].iter().copied()) {
            if depth == path.len() {
                return Some(index + 1);
            }
            if best.is_none_or(|(d, _)| depth > d) {
                best = Some((depth, index + 1));
            }
        }
    }
    best.map(|(_, line)| line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_lines_follow_indentation() {
        let text = "seed: 1\ntrain:\n  # lr\n  actor_lr: [1, 2]\nrollout: {top_p: 2}\n";
        assert_eq!(key_line(text, "train.actor_lr"), Some(4));
        assert_eq!(key_line(text, "seed"), Some(1));
        assert_eq!(key_line(text, "rollout.top_p"), Some(5));
        assert_eq!(key_line(text, "eval.every_steps"), None);
    }

    #[test]
    fn type_errors_read_plainly() {
        assert_eq!(
            plain_type_error("invalid type: sequence, expected f64"),
            "expected a number, found a sequence"
        );
        assert_eq!(
            plain_type_error("invalid type: string \"x\", expected usize"),
            "expected a whole number >= 0, found string \"x\""
        );
        assert_eq!(plain_type_error("something else"), "something else");
    }
}
