//! The config's own description, generated from the config structs and their doc comments by
//! `schemars`: its JSON Schema (`train --print-config-schema`, for editors that check YAML
//! against a schema), the default config as commented YAML (`train --print-default-config`)
//! and the key reference `docs/config-reference.md` (a test keeps it current).

use serde_json::Value;

use super::{Mode, TrainConfig};
use crate::stage::config::StageConfig;

/// The JSON Schema (draft 2020-12) of `mode`'s config.
pub fn schema(mode: Mode) -> Value {
    match mode {
        Mode::Rl => schemars::schema_for!(TrainConfig),
        Mode::Sft | Mode::Rm | Mode::Dpo => schemars::schema_for!(StageConfig),
    }
    .to_value()
}

/// One key of a config, in the order of the reference (sections alphabetically, keys
/// alphabetically within them).
#[derive(Debug, Clone, PartialEq)]
pub struct Key {
    /// The dotted path (`algo.gamma`).
    pub path: String,
    /// Whether the key is a section of further keys (`policy.lora`).
    pub section: bool,
    /// What it takes (`number`, `` `gae` | `rloo` ``, `text or null`).
    pub kind: String,
    /// Its default (`null` where it is absent by default or required).
    pub default: Value,
    /// Its doc comment, rustdoc links made plain; each accepted value's doc follows.
    pub doc: String,
}

/// Every key of `schema`, depth first.
pub fn keys(schema: &Value) -> Vec<Key> {
    let mut out = Vec::new();
    walk(schema, schema, "", &mut out);
    out
}

fn walk(root: &Value, node: &Value, prefix: &str, out: &mut Vec<Key>) {
    let Some(properties) = object_schema(root, node).and_then(|o| o["properties"].as_object())
    else {
        return;
    };
    for (name, property) in properties {
        let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        let mut doc = plain(property["description"].as_str().unwrap_or_default());
        if doc.is_empty() {
            doc = plain(resolve(root, property)["description"].as_str().unwrap_or_default());
        }
        let values = value_docs(root, property);
        if !values.is_empty() {
            doc = format!("{doc} Values: {}.", values.join("; "));
        }
        let default = property.get("default").cloned().unwrap_or(Value::Null);
        if let Some(inner) = object_schema(root, property) {
            let optional = nullable(root, property);
            let kind = if optional { "section, or null (off)" } else { "section" };
            out.push(Key { path: path.clone(), section: true, kind: kind.into(), default, doc });
            walk(root, inner, &path, out);
        } else {
            out.push(Key { path, section: false, kind: kind(root, property), default, doc });
        }
    }
}

/// `node` with a `$ref` followed (once; the schema's definitions do not chain).
fn resolve<'a>(root: &'a Value, node: &'a Value) -> &'a Value {
    match node["$ref"].as_str().and_then(|r| r.strip_prefix("#/$defs/")) {
        Some(name) => &root["$defs"][name],
        None => node,
    }
}

/// The object schema `node` stands for (directly, by reference, or as the non-null branch of
/// an optional), when it has properties.
fn object_schema<'a>(root: &'a Value, node: &'a Value) -> Option<&'a Value> {
    let node = resolve(root, node);
    if node["properties"].is_object() {
        return Some(node);
    }
    node["anyOf"].as_array()?.iter().find_map(|branch| {
        let branch = resolve(root, branch);
        branch["properties"].is_object().then_some(branch)
    })
}

/// Whether `node` also accepts null.
fn nullable(root: &Value, node: &Value) -> bool {
    let node = resolve(root, node);
    let null = |t: &Value| t == "null";
    null(&node["type"])
        || node["type"].as_array().is_some_and(|types| types.iter().any(null))
        || ["anyOf", "oneOf"]
            .iter()
            .any(|k| node[k].as_array().is_some_and(|b| b.iter().any(|b| nullable(root, b))))
}

/// What `node` accepts, in words.
fn kind(root: &Value, node: &Value) -> String {
    let node = resolve(root, node);
    if let Some(value) = node.get("const") {
        return format!("`{}`", yaml(value));
    }
    if let Some(values) = node["enum"].as_array() {
        return values.iter().map(|v| format!("`{}`", yaml(v))).collect::<Vec<_>>().join(" | ");
    }
    for key in ["oneOf", "anyOf"] {
        if let Some(branches) = node[key].as_array() {
            let mut kinds: Vec<String> = Vec::new();
            for branch in branches {
                let k = kind(root, branch);
                if !kinds.contains(&k) {
                    kinds.push(k);
                }
            }
            let consts = kinds.iter().all(|k| k.starts_with('`'));
            return kinds.join(if consts { " | " } else { ", or " });
        }
    }
    let one = |t: &str| match t {
        "string" => "text".to_owned(),
        "integer" | "number" | "null" => t.to_owned(),
        "boolean" => "true or false".to_owned(),
        "array" => format!("list of {}", kind(root, &node["items"])),
        other => other.to_owned(),
    };
    match &node["type"] {
        Value::String(t) => one(t),
        Value::Array(types) => {
            types.iter().filter_map(Value::as_str).map(one).collect::<Vec<_>>().join(" or ")
        }
        _ => "any".to_owned(),
    }
}

/// `` `value`: its doc `` for each documented value `node` accepts.
fn value_docs(root: &Value, node: &Value) -> Vec<String> {
    let node = resolve(root, node);
    node["oneOf"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|branch| {
            let doc = plain(branch["description"].as_str()?);
            Some(format!("`{}`: {}", yaml(branch.get("const")?), doc.trim_end_matches('.')))
        })
        .collect()
}

/// A doc comment as one paragraph of plain Markdown: rustdoc's intra-doc links (`` [`X`] ``)
/// become code spans, lines join.
fn plain(doc: &str) -> String {
    let mut text = doc.split_whitespace().collect::<Vec<_>>().join(" ");
    while let Some(start) = text.find("[`") {
        let Some(len) = text[start..].find("`]") else { break };
        let end = start + len;
        let linked = text[end + 2..].starts_with('(');
        if linked {
            break;
        }
        text = format!("{}`{}`{}", &text[..start], &text[start + 2..end], &text[end + 2..]);
    }
    text
}

/// `value` as YAML in flow style (what a config file would hold).
pub fn yaml(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => {
            let plain = !s.is_empty()
                && s.chars().all(|c| c.is_alphanumeric() || "_-./".contains(c))
                && !s.starts_with(['-', '.'])
                && s.parse::<f64>().is_err()
                && !["true", "false", "null", "yes", "no", "on", "off", "~"]
                    .contains(&s.to_lowercase().as_str());
            if plain { s.clone() } else { Value::String(s.clone()).to_string() }
        }
        Value::Array(items) => {
            format!("[{}]", items.iter().map(yaml).collect::<Vec<_>>().join(", "))
        }
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter().map(|(k, v)| format!("{k}: {}", yaml(v))).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// `text` as `# ` comment lines of at most ~96 characters, indented by `indent`.
fn comment(text: &str, indent: &str) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && indent.len() + 2 + line.len() + 1 + word.len() > 96 {
            out += &format!("{indent}# {line}\n");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line += word;
    }
    if !line.is_empty() {
        out += &format!("{indent}# {line}\n");
    }
    out
}

/// `mode`'s config with every key at its default, each under its doc as a comment: a file
/// `train --config` reads back as the defaults.
pub fn default_yaml(mode: Mode) -> String {
    let defaults = match mode {
        Mode::Rl => serde_json::to_value(TrainConfig::default()),
        _ => serde_json::to_value(StageConfig { mode, ..StageConfig::default() }),
    }
    .expect("a config serializes to JSON");
    let header = format!(
        "The `train --mode {}` config with every key at its default (generated from the \
         config's structs by `train --print-default-config`; every key's type is in \
         docs/config-reference.md).",
        mode.name()
    );
    commented_yaml(mode, &defaults, &header)
}

/// `values` (a config of `mode` as JSON) as YAML, every key under its doc as a comment, after
/// `header`: what `train --config` reads back as the same config.
pub fn commented_yaml(mode: Mode, values: &Value, header: &str) -> String {
    let schema = schema(mode);
    let mut out = comment(
        &format!("{header} {}", plain(schema["description"].as_str().unwrap_or_default())),
        "",
    );
    out += &format!("mode: {}\n", mode.name());
    for key in keys(&schema) {
        let depth = key.path.matches('.').count();
        let indent = "  ".repeat(depth);
        let value = key.path.split('.').try_fold(values, |v, part| v.get(part));
        let under_null_section = value.is_none();
        if under_null_section {
            // A key of a section that is off by default (`policy.lora`): shown, commented out.
            let default = match key.default {
                Value::Null => "(required)".to_owned(),
                ref d => yaml(d),
            };
            let name = key.path.rsplit('.').next().unwrap_or_default();
            out += &comment(&format!("{name}: {default} — {}", key.doc), &indent);
            continue;
        }
        if !out.ends_with(":\n") {
            out += "\n";
        }
        out += &comment(&key.doc, &indent);
        let name = key.path.rsplit('.').next().unwrap_or_default();
        match value {
            Some(v) if key.section && v.is_object() => out += &format!("{indent}{name}:\n"),
            Some(v) => out += &format!("{indent}{name}: {}\n", yaml(v)),
            None => {}
        }
    }
    out
}

/// `docs/config-reference.md`: every key of every mode with its type, default and doc.
pub fn reference_markdown() -> String {
    let mut out = String::from(
        "# Config reference\n\n\
         Generated from the config structs and their doc comments (`rlhf/train/src/config/`, \
         `rlhf/train/src/stage/config.rs`); `cargo test -p rtrun-rlhf --lib \
         config::reference` fails when this file is stale, and `RTRUN_BLESS=1` with that \
         command rewrites it. `train --print-default-config [--mode M]` prints a mode's \
         config with every key at its default, `train --print-config-schema [--mode M]` its \
         JSON Schema (for editors that check YAML against one). Every key may also be set \
         with `--set key=value`.\n",
    );
    for (mode, title) in [
        (Mode::Rl, "`--mode rl` (the default): PPO, GRPO, REINFORCE++, RLOO"),
        (Mode::Sft, "`--mode sft`, `--mode rm`, `--mode dpo`: the supervised trainers"),
    ] {
        let schema = schema(mode);
        out += &format!(
            "\n## {title}\n\n{}\n",
            plain(schema["description"].as_str().unwrap_or_default())
        );
        let mut table_open = false;
        for key in keys(&schema) {
            let top_section = key.section && !key.path.contains('.');
            if top_section {
                out += &format!("\n### `{}`\n\n{}\n", key.path, key.doc);
                table_open = false;
                continue;
            }
            if !table_open {
                out += "\n| key | takes | default | meaning |\n|---|---|---|---|\n";
                table_open = true;
            }
            let default = match (&key.default, key.section) {
                (Value::Null, true) => "off".to_owned(),
                (d, true) if d.is_object() => "(below)".to_owned(),
                (d, _) => format!("`{}`", yaml(d)),
            };
            let cell = |s: &str| s.replace('|', "\\|");
            out += &format!(
                "| `{}` | {} | {} | {} |\n",
                key.path,
                cell(&key.kind),
                cell(&default),
                cell(&key.doc)
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo_file(rel: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel)
    }

    /// The committed reference is what the structs say today.
    #[test]
    fn the_committed_reference_is_current() {
        let path = repo_file("docs/config-reference.md");
        let generated = reference_markdown();
        if std::env::var_os("RTRUN_BLESS").is_some() {
            std::fs::write(&path, &generated).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == generated,
            "docs/config-reference.md is stale: rerun this test with RTRUN_BLESS=1 and commit it"
        );
    }

    /// Every key is documented, and the reference names every key of the defaults.
    #[test]
    fn every_key_is_documented_and_listed() {
        for mode in [Mode::Rl, Mode::Sft] {
            let keys = keys(&schema(mode));
            assert!(keys.len() > 40, "{}", keys.len());
            let undocumented: Vec<&str> =
                keys.iter().filter(|k| k.doc.is_empty()).map(|k| k.path.as_str()).collect();
            assert!(undocumented.is_empty(), "{undocumented:?}");
        }
        let rl = keys(&schema(Mode::Rl));
        let find = |path: &str| rl.iter().find(|k| k.path == path).unwrap();
        assert_eq!(find("algo.advantage_estimator").default, "gae");
        assert!(find("algo.advantage_estimator").kind.contains("`group_norm`"));
        assert!(find("algo.advantage_estimator").doc.contains("`rloo`: REINFORCE leave-one-out"));
        assert_eq!(find("policy.lora").kind, "section, or null (off)");
        assert!(find("policy.lora.rank").kind.contains("integer"));
        assert!(find("train.zero_stage").kind.contains("`3`"));
        assert_eq!(find("cluster.threads_per_worker").kind, "`auto`, or integer");
        assert!(find("data.prompt_data").kind.contains("list of text"));
    }

    /// The printed defaults read back as the defaults, in every mode.
    #[test]
    fn the_default_config_reads_back_as_the_defaults() {
        let text = default_yaml(Mode::Rl);
        assert!(text.contains("\nalgo:\n") && text.contains("  advantage_estimator: gae\n"));
        assert!(text.contains("# rank: (required) — The rank"), "{text}");
        let read = TrainConfig::from_yaml(&text, "defaults.yaml", &[]).unwrap();
        assert_eq!(read, TrainConfig::default());
        for mode in [Mode::Sft, Mode::Rm, Mode::Dpo] {
            let text = default_yaml(mode);
            let tree = super::super::ConfigTree::parse(&text, "defaults.yaml", &[]).unwrap();
            assert_eq!(tree.mode, mode);
            let mut read: StageConfig = tree.typed().unwrap();
            read.mode = mode;
            assert_eq!(read, StageConfig { mode, ..StageConfig::default() });
        }
    }

    #[test]
    fn values_print_as_yaml_reads_them() {
        let cases = [
            (serde_json::json!("gae"), "gae"),
            (serde_json::json!("token-mean"), "token-mean"),
            (serde_json::json!("true"), "\"true\""),
            (serde_json::json!("3"), "\"3\""),
            (serde_json::json!(""), "\"\""),
            (serde_json::json!("a b"), "\"a b\""),
            (serde_json::json!(["x", 1]), "[x, 1]"),
            (serde_json::json!(0.2), "0.2"),
            (serde_json::json!(null), "null"),
        ];
        for (value, text) in cases {
            assert_eq!(yaml(&value), text);
        }
        assert_eq!(plain("see [`X`] and\n[`Y`]."), "see `X` and `Y`.");
    }
}
