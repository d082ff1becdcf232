//! Chat-template parity with Hugging Face `transformers`: for a ChatML-style and a
//! Llama-3-style template (`parity/chat/`), the text rtrun renders and the ids it tokenizes
//! equal `apply_chat_template`'s, recorded once in `golden.json` by `make_chat_golden.py`. Also
//! the EOS ids and pad id each directory defines.

use std::path::{Path, PathBuf};

use rtrun_rlhf_model::{ChatMessage, PretrainedTokenizer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("parity/chat")
}

/// A checkpoint-like directory: the shared `tokenizer.json` plus one template's configs.
/// A directory of its own per call (`cargo test` runs these tests on threads of one process,
/// and one test removing a directory another is reading made the suite flaky), removed when
/// the guard drops, a failed assertion included.
fn tokenizer_dir(template: &str) -> tempfile::TempDir {
    let dir =
        tempfile::Builder::new().prefix(&format!("rtrun-chat-{template}-")).tempdir().unwrap();
    std::fs::copy(fixtures().join("tokenizer.json"), dir.path().join("tokenizer.json")).unwrap();
    for name in ["tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(fixtures().join(template).join(name), dir.path().join(name)).unwrap();
    }
    dir
}

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
}

#[derive(serde::Deserialize)]
struct Golden {
    template: String,
    case: String,
    text: Option<String>,
    ids: Option<Vec<u32>>,
    #[serde(default)]
    error: bool,
    message: Option<String>,
}

#[test]
fn rendered_text_and_ids_equal_transformers() {
    let cases: Vec<Case> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("conversations.json")).unwrap(),
    )
    .unwrap();
    let golden: Vec<Golden> =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("golden.json")).unwrap())
            .unwrap();
    let mut checked = 0;
    for template in ["chatml", "llama3"] {
        let dir = tokenizer_dir(template);
        let tok = PretrainedTokenizer::from_dir(dir.path()).unwrap();
        for case in &cases {
            let want = golden
                .iter()
                .find(|g| g.template == template && g.case == case.name)
                .unwrap_or_else(|| panic!("no golden entry for {template}/{}", case.name));
            let rendered = tok.apply_chat_template(&case.messages, case.add_generation_prompt);
            if want.error {
                let err = rendered.expect_err(&case.name).to_string();
                let message = want.message.as_deref().unwrap();
                assert!(err.contains(message), "{template}/{}: {err} vs {message}", case.name);
            } else {
                let text = rendered.unwrap_or_else(|e| panic!("{template}/{}: {e}", case.name));
                assert_eq!(Some(&text), want.text.as_ref(), "{template}/{}", case.name);
                let ids = tok.tokenizer.encode(&text, false).unwrap();
                assert_eq!(Some(&ids), want.ids.as_ref(), "{template}/{} ids", case.name);
            }
            checked += 1;
        }
    }
    assert_eq!(checked, golden.len());
}

#[test]
fn eos_and_pad_ids_come_from_the_generation_and_tokenizer_configs() {
    let chatml = PretrainedTokenizer::from_dir(tokenizer_dir("chatml").path()).unwrap();
    // generation_config.json [<|im_end|>, <|endoftext|>], then eos_token <|im_end|> (a repeat).
    assert_eq!(chatml.eos_token_ids, vec![3, 1]);
    assert_eq!(chatml.pad_token_id, 0);
    assert!(!chatml.special_tokens.contains_key("bos_token"));
    let llama3 = PretrainedTokenizer::from_dir(tokenizer_dir("llama3").path()).unwrap();
    assert_eq!(llama3.eos_token_ids, vec![5, 8]);
    assert_eq!(llama3.special_tokens["bos_token"], "<|begin_of_text|>");
}

#[test]
fn broken_tokenizer_directories_name_the_file() {
    let guard = tokenizer_dir("chatml");
    let dir = guard.path();
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let err = PretrainedTokenizer::from_dir(dir).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    let guard = tokenizer_dir("llama3");
    let dir = guard.path();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": "{% if %}"}"#).unwrap();
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": 5}"#).unwrap();
    let err = PretrainedTokenizer::from_dir(dir).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json") && err.contains("chat template"), "{err}");
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "<|nope|>"}"#).unwrap();
    let err = PretrainedTokenizer::from_dir(dir).unwrap_err().to_string();
    assert!(err.contains("<|nope|>"), "{err}");
    std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
    std::fs::remove_file(dir.join("generation_config.json")).unwrap();
    let err = PretrainedTokenizer::from_dir(dir).unwrap_err().to_string();
    assert!(err.contains("end-of-sequence"), "{err}");
}
