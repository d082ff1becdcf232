#!/usr/bin/env python3
"""The anchor of `cargo run --release -p rtrun-rlhf-model --example lora_bench`: the same
~110.7M Qwen2-shaped model in transformers (random weights, fp32, CPU), one training step
(forward, next-token loss, backward, torch AdamW) on 4 x 256 random tokens, fully fine-tuned
and with a peft LoRA of rank 16 (alpha 32) on every projection. Prints the median step time
of each and their trainable parameters, as JSON on the last line.

    ~/.cache/rtrun/parity-venv/bin/python scripts/bench/peft_lora_anchor.py --iters 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import peft
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=32000, hidden_size=768, intermediate_size=2432, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=4096, rope_theta=1e6,
    )
    return Qwen2ForCausalLM(config).train()


def measure(m, ids: torch.Tensor, iters: int) -> dict:
    params = [p for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    times, loss = [], None
    for i in range(iters + 1):
        started = time.perf_counter()
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = out.loss.item()
        if i > 0:
            times.append(time.perf_counter() - started)
    return {
        "trainable": sum(p.numel() for p in params),
        "step_seconds_median": statistics.median(times),
        "loss_last": loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ids = torch.randint(0, 32000, (4, 256))
    full = measure(model(), ids, args.iters)
    lora_config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS)
    lora = measure(peft.get_peft_model(model(), lora_config), ids, args.iters)
    print(json.dumps({"peft_version": peft.__version__, "torch": torch.__version__, "full": full, "lora": lora}))


if __name__ == "__main__":
    main()
