"""Greedy continuations from Hugging Face `generate` (its KV cache, float32, CPU) on the parity
checkpoints in rlhf/model/parity, the golden that rlhf/engine/tests/engine.rs holds the engine to.

    ~/.cache/rtrun/parity-venv/bin/python rlhf/engine/tests/hf/make_hf_greedy.py

Each prompt is generated on its own (no padding), 24 new tokens with `min_new_tokens` = 24, so
eos never ends a sequence early; the engine is asked for the same with `min_tokens`.
"""

import json
import pathlib

import torch
from transformers import AutoModelForCausalLM

HERE = pathlib.Path(__file__).resolve().parent
PARITY = HERE.parents[2] / "model" / "parity"
NEW = 24


def main() -> None:
    generator = torch.Generator().manual_seed(7)
    out = {"transformers_new_tokens": NEW, "models": {}}
    for name in ["qwen2", "llama", "qwen3", "qwen2-sw", "mistral-sw"]:
        model = AutoModelForCausalLM.from_pretrained(PARITY / name, dtype=torch.float32).eval()
        vocab = model.config.vocab_size
        cases = []
        for length in [1, 3, 8, 17, 33, 5]:
            prompt = torch.randint(3, vocab, (1, length), generator=generator)
            with torch.no_grad():
                ids = model.generate(
                    input_ids=prompt, attention_mask=torch.ones_like(prompt),
                    max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                )
            cases.append({"prompt": prompt[0].tolist(), "tokens": ids[0, length:].tolist()})
        out["models"][name] = cases
    (HERE / "hf_greedy.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
