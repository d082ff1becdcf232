"""Hugging Face side of scripts/gpu-check.sh, run with the GPU machine's own PyTorch.

    hf_anchor.py make DIR PROMPTS            random Qwen2-0.5B-shaped checkpoint + prompt ids
    hf_anchor.py generate DIR PROMPTS OUT DTYPE BATCHES NEW
                                             `generate` with its KV cache, greedy, on cuda:0
    hf_anchor.py compare OURS THEIRS [MODE]  greedy outputs of the engine vs HF `generate`
    hf_anchor.py report REPORT_JSONL         the summary table of the report

Each command but `make` and `report` prints one JSON line, as gpu_check does.
"""

import json
import sys
import time

import torch


def make(directory: str, prompts_path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 KV heads, vocab 151,936, tied
    # embeddings), random weights: nothing is downloaded.
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151643,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    model.save_pretrained(directory, safe_serialization=True)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (256, 32), generator=generator).tolist()
    with open(prompts_path, "w") as f:
        json.dump(prompts, f)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"check": "make", "params": params, "prompts": len(prompts)}))


def generate(directory, prompts_path, out, dtype, batches, new) -> None:
    from transformers import AutoModelForCausalLM

    kind = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=kind).to("cuda:0").eval()
    with open(prompts_path) as f:
        prompts = json.load(f)
    batches = [int(b) for b in batches.split(",")]
    new = int(new)

    def run(b):
        ids = torch.tensor(prompts[:b], device="cuda:0")
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=0,
            )
        torch.cuda.synchronize()
        return out[:, ids.shape[1]:]

    rows, last = [], None
    for b in batches:
        run(b)  # warm-up at this batch size, as gpu_check does; the second run is timed
        start = time.perf_counter()
        tokens = run(b)
        seconds = time.perf_counter() - start
        rows.append({"batch": b, "seconds": seconds, "tokens_per_s": tokens.numel() / seconds})
        if b == max(batches):
            last = tokens.tolist()
    with open(out, "w") as f:
        json.dump(last, f)
    print(json.dumps({"check": "hf_generate", "dtype": dtype, "torch": torch.__version__,
                      "rows": rows, "ok": True}))


def compare(ours_path, theirs_path, mode="require") -> None:
    """`require`: every sequence must be identical (fp32); `report`: the figures only (bf16,
    where the engine's and transformers' kernels round differently)."""
    with open(ours_path) as f:
        ours = json.load(f)
    with open(theirs_path) as f:
        theirs = json.load(f)
    identical = sum(a == b for a, b in zip(ours, theirs))
    firsts = []
    for a, b in zip(ours, theirs):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        firsts.append(first)
    tokens_equal = sum(x == y for a, b in zip(ours, theirs) for x, y in zip(a, b))
    total = sum(len(a) for a in ours)
    print(json.dumps({
        "check": "greedy_vs_hf", "sequences": len(ours), "identical": identical,
        "mean_first_divergence": sum(firsts) / max(len(firsts), 1),
        "tokens_equal_fraction": tokens_equal / max(total, 1),
        "mode": mode,
        "ok": mode == "report" or (identical == len(ours) and len(ours) == len(theirs)),
    }))


def report(path) -> None:
    lines = [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    engine = {l["dtype"]: l for l in lines if l.get("check") == "engine"}
    hf = {l["dtype"]: l for l in lines if l.get("check") == "hf_generate"}
    print("| dtype | batch | rtrun tok/s (greedy) | HF generate tok/s | ratio | engine step ms "
          "| temperature 1 tok/s (vs greedy) |")
    print("|---|---|---|---|---|---|---|")
    for dtype in engine:
        if dtype not in hf:
            continue
        for ours, theirs in zip(engine[dtype]["rows"], hf[dtype]["rows"]):
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
            sampled = ours.get("sampled_tokens_per_s")
            sampled = f"{sampled:.0f} ({ours['sampled_vs_greedy']:.2f})" if sampled else "-"
            print(f"| {dtype} | {ours['batch']} | {ours['tokens_per_s']:.0f} | "
                  f"{theirs['tokens_per_s']:.0f} | {ratio:.2f}x | {ours.get('step_ms', 0):.2f} "
                  f"| {sampled} |")
    for dtype, l in engine.items():
        eager = l.get("eager", {})
        print(f"- {dtype}: weight-read floor per step {l.get('weight_read_floor_ms', 0):.2f} ms; "
              f"graphs {json.dumps(l.get('graphs'))}; enforce_eager at batch {eager.get('batch')}: "
              f"{eager.get('tokens_per_s', 0):.0f} tok/s, step {eager.get('step_ms', 0):.2f} ms")
    for l in lines:
        if l.get("check") not in ("engine", "hf_generate"):
            print(f"- {l.get('check')}: ok={l.get('ok')} {json.dumps(l)}")


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"make": make, "generate": generate, "compare": compare, "report": report}[command](*args)
