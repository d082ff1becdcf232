"""Anchor for examples/bench.rs: the same configs, batch shapes and loss in transformers (eager
PyTorch, float32, CPU). Run it right after the Rust bench on the same machine and compare:

    cargo run --release -p rtrun-rlhf-model --example bench -- --iters 5
    ~/.cache/rtrun/parity-venv/bin/python rlhf/model/parity/bench_transformers.py --iters 5
"""

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

CASES = [
    ("tiny (Llama, 2x64)", LlamaForCausalLM, LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False), 8, 128),
    ("25M (Qwen2, 6x512)", Qwen2ForCausalLM, Qwen2Config(
        vocab_size=16384, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
        rope_theta=1e6), 4, 256),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    for name, cls, config, batch, seq in CASES:
        config._attn_implementation = "sdpa"
        model = cls(config).float()
        ids = torch.randint(config.vocab_size, (batch, seq))
        for backward in (False, True):
            def step():
                if backward:
                    model(input_ids=ids, labels=ids).loss.backward()
                    model.zero_grad(set_to_none=True)
                else:
                    with torch.no_grad():
                        model(input_ids=ids)
            step()
            start = time.perf_counter()
            for _ in range(args.iters):
                step()
            secs = time.perf_counter() - start
            params = sum(p.numel() for p in model.parameters())
            kind = "forward+backward" if backward else "forward"
            print(f"{name:<20} params {params:>10}  batch {batch}x{seq}  {kind:<16} {batch * seq * args.iters / secs:>10.0f} tokens/s")


if __name__ == "__main__":
    main()
