"""Hugging Face side of scripts/bench-rlhf.sh: the decode users already have, on CPU.

    hf_generate.py make DIR
        Writes two random-weight Qwen2 checkpoints (nothing is downloaded) and the prompts:
        DIR/tiny (hidden 128, 2 layers, 4/2 heads, vocab 1024, ~0.4M parameters),
        DIR/27m (hidden 512, 8 layers, 8/2 heads, vocab 8192, ~27M parameters),
        DIR/110m (hidden 768, 12 layers, 12/4 heads of 64, vocab 32000, ~110M parameters:
        the shape of `tiny::bench_config_110m`, beyond what the engine's kernels were tuned on),
        DIR/prompts-<model>.json (64 prompts of 32 token ids each).
    hf_generate.py generate DIR MODEL BATCHES NEW THREADS REPEATS
        `model.generate` with its KV cache (the default DynamicCache), greedy, float32, on
        THREADS intra-op threads, for each batch size in BATCHES (comma-separated), best of
        REPEATS rounds after one warm-up round. Writes DIR/hf-<model>-b<batch>.json with the
        generated ids and prints one JSON line per batch size.
"""

import json
import sys
import time

import torch

MODELS = {
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
    "27m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=8192),
    "110m": dict(hidden_size=768, intermediate_size=2432, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64, vocab_size=32000),
}
PROMPTS = 64
PROMPT_LEN = 32


def make(directory: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for name, shape in MODELS.items():
        config = Qwen2Config(
            **shape, max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).float()
        model.save_pretrained(f"{directory}/{name}", safe_serialization=True)
        generator = torch.Generator().manual_seed(1)
        # Ids from 3 up: no prompt holds the eos id, so every sequence decodes NEW tokens on
        # both sides (min_new_tokens keeps HF going past an eos it generates; the engine is
        # asked to ignore eos the same way).
        prompts = torch.randint(3, config.vocab_size, (PROMPTS, PROMPT_LEN), generator=generator)
        with open(f"{directory}/prompts-{name}.json", "w") as f:
            json.dump(prompts.tolist(), f)
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"make": name, "params": params}))


def generate(directory, name, batches, new, threads, repeats) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(threads))
    model = AutoModelForCausalLM.from_pretrained(f"{directory}/{name}", dtype=torch.float32).eval()
    with open(f"{directory}/prompts-{name}.json") as f:
        prompts = json.load(f)
    new = int(new)

    def run(batch):
        ids = torch.tensor(prompts[:batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=0,
            )
        return out[:, ids.shape[1]:]

    for batch in [int(b) for b in batches.split(",")]:
        run(batch)  # warm-up: libtorch's lazy initialisation, first-touch of buffers
        best = None
        for _ in range(int(repeats)):
            start = time.perf_counter()
            out = run(batch)
            seconds = time.perf_counter() - start
            best = seconds if best is None else min(best, seconds)
        with open(f"{directory}/hf-{name}-b{batch}.json", "w") as f:
            json.dump(out.tolist(), f)
        tokens = out.numel()
        print(json.dumps({"hf": name, "batch": batch, "seconds": best,
                          "tokens_per_s": tokens / best, "threads": int(threads),
                          "torch": torch.__version__}))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"make": make, "generate": generate}[command](*args)
