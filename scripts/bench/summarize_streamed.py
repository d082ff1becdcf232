"""One JSON line per run of scripts/bench-rlhf.sh's `streamed` part, from its metrics.jsonl:
wall seconds from the end of the baseline evaluation to the end of the last evaluation, the held-out reward at
every evaluation with its wall time, the median seconds of each phase per step and the mean
step time (warm-up steps excluded). Usage: summarize_streamed.py RUN_DIR SEED LABEL"""

import json
import statistics
import sys

run, seed, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
records = [json.loads(line) for line in open(f"{run}/metrics.jsonl") if line.strip()]
start = records[0]["wall_time"]
steps = [r for r in records if r["step"] > 0]
# A record is stamped when its step ends, before that step's evaluation.
evals = [(r["step"], r["wall_time"] - start + r.get("time/eval", 0.0), r["eval/reward"])
         for r in records if "eval/reward" in r and r["step"] > 0]
phases = sorted({k for r in steps for k in r if k.startswith("time/") and k != "time/eval"})
# Step times from wall-clock stamps, without the evaluations inside them and the first steps
# (the async thread's start, the engines' first compilation of shapes).
durations = []
for before, r in zip(records, records[1:]):
    if r["step"] > 3:
        durations.append(r["wall_time"] - before["wall_time"] - before.get("time/eval", 0.0))
print(json.dumps({
    "streamed": label,
    "seed": seed,
    "wall_s": records[-1]["wall_time"] - start + records[-1].get("time/eval", 0.0),
    "evals": evals,
    "step_s_mean": statistics.mean(durations) if durations else None,
    "phase_s_median": {p[5:]: statistics.median(r.get(p, 0.0) for r in steps) for p in phases},
    "response_length_mean": statistics.mean(r["response_length"] for r in steps),
    "response_length_max": max(r["response_length"] for r in steps),
    "max_staleness": max((r.get("rollout/max_staleness", 0.0) for r in steps), default=0.0),
    "stale_dropped": sum(r.get("async/stale_dropped_groups", 0.0) for r in steps),
    "accuracy": [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r],
    "tool_calls_per_sample": statistics.mean(r.get("tools/calls_per_sample", 0.0) for r in steps),
}))
