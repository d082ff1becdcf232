"""A Qwen3-shaped checkpoint made by Hugging Face transformers itself (`Qwen3ForCausalLM`, random
weights, float32, tied embeddings, heads wider than hidden / heads), for the GRPO run of
rlhf/train/tests/hf.rs: rtrun must load and train what transformers writes, not only what it
writes itself. Its vocabulary (400) and special ids match the walkthrough's tokenizer, whose
files the test copies in beside it.

    ~/.cache/rtrun/parity-venv/bin/python rlhf/model/parity/make_qwen3_hf.py
"""

import pathlib

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = pathlib.Path(__file__).resolve().parent


def main() -> None:
    torch.manual_seed(3)
    config = Qwen3Config(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.05,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        # Norm scales away from one, so that the per-head q/k norms matter.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    out = HERE / "qwen3-hf"
    model.save_pretrained(out)
    print(f"wrote {out} with transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
