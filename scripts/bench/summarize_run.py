"""One JSON line for a finished `train` run: its median wall seconds per rollout step (the
first step, which warms up, excluded) and the held-out greedy reward before and after, read
from RUN_DIR/metrics.jsonl. Usage: summarize_run.py RUN_DIR SEED"""

import json
import statistics
import sys

run_dir, seed = sys.argv[1], int(sys.argv[2])
rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl") if line.strip()]
steps = [r for r in rows if "reward" in r]
evals = [r for r in rows if "eval/reward" in r]
walls = [b["wall_time"] - a["wall_time"] for a, b in zip(steps, steps[1:])]
keys = [k for k in steps[1] if k.startswith("time/")]
phases = {k[5:]: statistics.median(r.get(k, 0.0) for r in steps[1:]) for k in keys}
print(json.dumps({
    "rtrun_seed": seed,
    "seconds_per_rollout_median": statistics.median(walls),
    "rollouts_timed": len(walls),
    "heldout_reward_start": evals[0]["eval/reward"],
    "heldout_reward_end": evals[-1]["eval/reward"],
    "phase_seconds_median": phases,
}))
