"""Render the chat-template parity cases with Hugging Face transformers and write golden.json.

For each template (chatml, llama3):
  1. writes <template>/tokenizer_config.json (chat_template = the text of <template>.jinja, special
     tokens) and <template>/generation_config.json (eos_token_id list), so they never drift from
     the .jinja sources;
  2. loads AutoTokenizer from a temp dir holding tokenizer.json + that tokenizer_config.json;
  3. renders every case of conversations.json with apply_chat_template(tokenize=False) and
     (tokenize=True), and checks the ids equal tokenizer.encode(text, add_special_tokens=False).

golden.json: one entry per (template, case), in conversations.json order:
  {"template", "case", "text", "ids"}  or, for expect_error cases,  {"template", "case", "error": true, "message"}

    ~/.cache/rtrun/parity-venv/bin/python rlhf/model/parity/chat/make_chat_golden.py
"""

import json
import shutil
import tempfile
from pathlib import Path

import jinja2
import tokenizers
import transformers
from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]

TEMPLATES = {
    "chatml": {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "gen_eos": ["<|im_end|>", "<|endoftext|>"],
    },
    "llama3": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|pad|>",
        "gen_eos": ["<|end_of_text|>", "<|eot_id|>"],
    },
}


def dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def write_configs(name: str, spec: dict, vocab: dict) -> None:
    d = HERE / name
    d.mkdir(exist_ok=True)
    cfg = {
        "bos_token": spec["bos_token"],
        "eos_token": spec["eos_token"],
        "pad_token": spec["pad_token"],
        "unk_token": None,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": (HERE / f"{name}.jinja").read_text(encoding="utf-8"),
    }
    dump(d / "tokenizer_config.json", cfg)
    gen = {"eos_token_id": [vocab[t] for t in spec["gen_eos"]], "pad_token_id": vocab[spec["pad_token"]]}
    if spec["bos_token"] is not None:
        gen = {"bos_token_id": vocab[spec["bos_token"]], **gen}
    dump(d / "generation_config.json", gen)


def plain_ids(out) -> list[int]:
    # transformers 5 returns a BatchEncoding by default (return_dict=True); 4.x returned a list.
    if isinstance(out, (list, tuple)):
        return [int(i) for i in out]
    return [int(i) for i in out["input_ids"]]


def main() -> None:
    print(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, jinja2 {jinja2.__version__}")
    vocab = json.loads((HERE / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = {**vocab["model"]["vocab"], **{t["content"]: t["id"] for t in vocab["added_tokens"]}}
    cases = json.loads((HERE / "conversations.json").read_text(encoding="utf-8"))

    golden = []
    for name, spec in TEMPLATES.items():
        write_configs(name, spec, vocab)
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(HERE / "tokenizer.json", tmp)
            shutil.copy(HERE / name / "tokenizer_config.json", tmp)
            tok = AutoTokenizer.from_pretrained(tmp)
        print(f"\n== {name}: {type(tok).__name__}, special_tokens_map {tok.special_tokens_map}")
        assert tok.chat_template == (HERE / f"{name}.jinja").read_text(encoding="utf-8")

        for i, case in enumerate(cases):
            kw = dict(add_generation_prompt=case["add_generation_prompt"])
            if case.get("expect_error"):
                try:
                    tok.apply_chat_template(case["messages"], tokenize=False, **kw)
                except jinja2.exceptions.TemplateError as e:
                    golden.append({"template": name, "case": case["name"], "error": True, "message": str(e)})
                    print(f"-- {case['name']}: error {type(e).__name__}: {e}")
                    continue
                raise AssertionError(f"{name}/{case['name']}: expected an error")

            text = tok.apply_chat_template(case["messages"], tokenize=False, **kw)
            ids = plain_ids(tok.apply_chat_template(case["messages"], tokenize=True, **kw))
            assert isinstance(text, str)
            enc = tok.encode(text, add_special_tokens=False)
            assert enc == ids, f"{name}/{case['name']}: encode(text) != apply_chat_template ids"
            # The ByteLevel post-processor adds nothing, so add_special_tokens is moot here.
            assert tok.encode(text, add_special_tokens=True) == ids
            assert tok.decode(ids) == text, f"{name}/{case['name']}: decode(ids) != text"
            if i == 0:
                print(f"encode(text of {case['name']!r}, add_special_tokens=False) == apply_chat_template ids: {enc == ids}")
            golden.append({"template": name, "case": case["name"], "text": text, "ids": ids})

    out = HERE / "golden.json"
    out.write_text(
        "[\n" + ",\n".join("  " + json.dumps(g, ensure_ascii=False) for g in golden) + "\n]\n", encoding="utf-8"
    )
    print(f"\nwrote {out.relative_to(REPO)}: {len(golden)} entries")


if __name__ == "__main__":
    main()
