"""One JSON line for a finished `train --mode sft|rm|dpo` run: its median wall seconds per
optimizer step and its training tokens per second (every real token of the steps after the first,
which warms up, over their wall time), read from RUN_DIR/metrics.jsonl. Usage: summarize_sft.py
RUN_DIR SEED LAYOUT"""

import json
import statistics
import sys

run_dir, seed, layout = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl") if line.strip()]
steps = [r for r in rows if "loss" in r]
walls = [b["wall_time"] - a["wall_time"] for a, b in zip(steps, steps[1:])]
tokens = sum(r["tokens"] for r in steps[1:])
print(json.dumps({
    "rtrun_sft_seed": seed,
    "layout": layout,
    "seconds_per_step_median": statistics.median(walls),
    "tokens_per_s": tokens / sum(walls),
    "mean_tokens_per_unit": statistics.mean(r["tokens"] for r in steps) / 32,
    "steps_timed": len(walls),
    "loss_first": steps[0]["loss"],
    "loss_last": steps[-1]["loss"],
    "losses": [r["loss"] for r in steps],
}))
