"""How transformers tokenizes with the walkthrough checkpoint's tokenizer: the golden that
`rtrun_rlhf::walkthrough`'s unit test holds rtrun's tokenizer and chat template to.

    cargo run --release -p rtrun-rlhf --example make_walkthrough -- /tmp/wt --warmup-steps 1
    ~/.cache/rtrun/parity-venv/bin/python rlhf/train/tests/hf/make_walkthrough_tokens.py /tmp/wt/model

`AutoTokenizer` is what a user calls on an exported policy; for a `qwen2` config transformers 5
builds `Qwen2Tokenizer`, which rebuilds the normalizer and pre-tokenizer in code and takes only
the vocabulary, merges and added tokens from `tokenizer.json`.
"""

import json
import pathlib
import sys

from transformers import AutoTokenizer

HERE = pathlib.Path(__file__).resolve().parent

TEXTS = [
    "Ada has 7 apples and finds 5 more. How many apples now?",
    "7 + 5 = 12\n#### 12",
    "Gus has 18 stamps and gives away 9. How many stamps now?",
    "1234567890 and 3.14159, then 1,000,000.",
    "It's what they'll say: we'd've   spaced\t\tout\n\n\nlines  ",
    "café naïve Ünïcödé — 中文 😀",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    " leading space and trailing space ",
]
CHATS = [
    [{"role": "user", "content": "Ben has 3 books and finds 4 more. How many books now?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 9 - 2?"},
        {"role": "assistant", "content": "9 - 2 = 7\n#### 7"},
    ],
]


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    out = {
        "transformers_class": type(tokenizer).__name__,
        "texts": [{"text": t, "ids": tokenizer.encode(t, add_special_tokens=False)} for t in TEXTS],
        "chats": [
            {
                "messages": m,
                "rendered": tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
            }
            for m in CHATS
        ],
    }
    (HERE / "walkthrough_tokens.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
