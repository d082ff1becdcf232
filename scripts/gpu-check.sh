#!/usr/bin/env bash
# Every GPU check of rtrun in one run, on a machine with a CUDA GPU, PyTorch and transformers
# (the lent H100: PyTorch 2.11.0+cu130 in /opt/torch/.venv, no Rust toolchain).
#
# Usage, from the repository root:
#     scripts/build-gpu.sh                      # on the build machine → gpu-build/
#     scripts/gpu-check.sh                      # on the GPU machine, gpu-build/ carried along
#
# Writes under $OUT (default /tmp/rtrun-gpu-check): report.jsonl (one JSON line per check),
# report.md (the summary), each step's stderr, nvidia-smi output, and the GRPO run's log,
# metrics and memory trace. Checks, with Hugging Face on the same GPU as the anchor:
#   forward   model forward, CUDA fp32 vs CPU fp32 (max |Δlogits| ≤ 1e-4), bf16 vs fp32
#   engine    rtrun's engine vs HF `generate` (KV cache), greedy, 64 new tokens, on a random
#             Qwen2-0.5B-shaped checkpoint: bf16 at batch 1/64/256 (the speed targets), fp32 at
#             256 (token identity on 256 sequences); per batch also the mean engine step, a
#             temperature-1 run, the static decode step's CUDA graphs (captured, replayed,
#             memory, failures) and the same engine with enforce_eager at the middle batch
#   sampling  sampling on the device against the host sampler (256 rows x 152k vocabulary,
#             every mode), 20,000 draws against the softmax, seeded requests batch-independent
#   sleep     engine sleep/wake frees what it claims (driver-level used memory)
#   ipc       weight sync by CUDA IPC into another process: weights equal, GB/s
#   nccl      two NCCL ranks on one GPU are refused with a clear error, not a hang
#   zero      NCCL device reduce-scatter / all-gather (one rank: one GPU cannot host two) and
#             stage 3 + activation checkpointing training steps on CUDA against stage 0
#   tp        a tensor-parallel engine (2 ranks on the one GPU, all-reduces over the CPU ring)
#             against the whole model: greedy tokens equal, log-probs within 1e-4
#   gpu-metrics  the GRPO run's metrics endpoint serves NVML's per-GPU gauges
#   grpo      the GRPO main job with every role on the GPU in bf16, hybrid (engine sleeps
#             while training, training state offloaded while generating); asked for `nccl`,
#             the one-GPU hybrid spec syncs weights by CUDA IPC (the log says so)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/rtrun-gpu-check}"
mkdir -p "$out"
py="${RTRUN_GPU_PYTHON:-/opt/torch/.venv/bin/python}"
bin="${RTRUN_GPU_BUILD:-gpu-build}"
for b in "$bin/train" "$bin/gpu_check"; do
    [[ -x "$b" ]] || { echo "gpu-check: $b missing (run scripts/build-gpu.sh first)" >&2; exit 1; }
done

# The binaries link libtorch at run time: use this machine's torch and its CUDA libraries.
site="$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
libs="$site/torch/lib"
for d in "$site"/nvidia/*/lib "$site"/nvidia/*/*/lib; do [[ -d "$d" ]] && libs="$libs:$d"; done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

report="$out/report.jsonl"
: > "$report"
work="${RTRUN_GPU_WORK:-/tmp/rtrun-gpu-work}"
mkdir -p "$work"
failed=0
step() {
    local name=$1
    shift
    echo "== $name: $*" >&2
    local start=$SECONDS
    if ! "$@" 2> >(tee "$out/$name.stderr" >&2) | tee -a "$report"; then
        echo "   $name FAILED" >&2
        failed=1
    fi
    echo "   $name took $((SECONDS - start)) s" >&2
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1
ckpt="$work/qwen2-0.5b"
prompts="$work/prompts.json"
[[ -f "$ckpt/config.json" ]] || step make "$py" scripts/gpu/hf_anchor.py make "$ckpt" "$prompts"
step forward "$bin/gpu_check" forward "$ckpt"
# fp32 only at 256 (the identity check): the window is 8 minutes, GPU start included.
for spec in f32:256 bf16:1,64,256; do
    dtype=${spec%%:*} batches=${spec#*:}
    step "engine-$dtype" timeout 150 "$bin/gpu_check" engine "$ckpt" "$prompts" \
        "$work/ours-$dtype.json" "$dtype" "$batches" 64
    step "hf-$dtype" timeout 120 "$py" scripts/gpu/hf_anchor.py generate "$ckpt" "$prompts" \
        "$work/hf-$dtype.json" "$dtype" "$batches" 64
done
step sampling timeout 90 "$bin/gpu_check" sampling "$ckpt" "$prompts"
step greedy-f32 "$py" scripts/gpu/hf_anchor.py compare "$work/ours-f32.json" "$work/hf-f32.json"
step greedy-bf16 "$py" scripts/gpu/hf_anchor.py compare "$work/ours-bf16.json" "$work/hf-bf16.json" \
    report
step sleep timeout 60 "$bin/gpu_check" sleep "$ckpt"
step ipc timeout 60 "$bin/gpu_check" ipc "$ckpt" $((64 << 20))
step nccl timeout 120 "$bin/gpu_check" nccl-same-gpu
step zero timeout 180 "$bin/gpu_check" zero "$ckpt"
step tp timeout 120 "$bin/gpu_check" tp "$ckpt"

# The GRPO main job on the GPU, with a trace of the device's used memory.
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 200 \
    > "$out/grpo-nvidia-smi.csv" 2>/dev/null &
smi=$!
echo "== grpo" >&2
start=$SECONDS
timeout 180 "$bin/train" --config deploy/examples/rlhf/grpo.yaml --overwrite \
    --set run_dir="$work/grpo" \
    --set cluster.num_gpus=1 \
    --set cluster.placement_spec=deploy/examples/rlhf/placement/hybrid.yaml \
    --set policy.device=cuda --set policy.dtype=bf16 \
    --set reference.device=cuda --set reference.dtype=bf16 \
    --set engine.device=cuda --set engine.dtype=bf16 \
    --set rollout.weight_sync_backend=nccl \
    --metrics-port 18081 \
    "$@" > "$out/grpo.log" 2>&1 &
grpo=$!
# NVML's per-GPU gauges on the run's metrics endpoint, scraped once the run is under way.
"$py" - "$out" >> "$report" <<'EOF' &
import json, sys, time, urllib.request
out, found, text = sys.argv[1], [], ""
for _ in range(90):
    time.sleep(2)
    try:
        text = urllib.request.urlopen("http://127.0.0.1:18081/metrics", timeout=5).read().decode()
    except OSError:
        continue
    found = [l for l in text.splitlines() if l.startswith("rtrun_gpu_")]
    if found:
        break
open(f"{out}/grpo-metrics-scrape.txt", "w").write(text)
print(json.dumps({"check": "gpu-metrics", "ok": any("memory_used_bytes" in l for l in found),
                  "lines": found[:8]}))
EOF
scrape=$!
wait "$grpo"
grpo_rc=$?
wait "$scrape"
kill "$smi" 2>/dev/null
echo "   grpo exit $grpo_rc, took $((SECONDS - start)) s" >&2
cp "$work/grpo/metrics.jsonl" "$out/grpo-metrics.jsonl" 2>/dev/null
cp "$work/grpo/summary.md" "$out/grpo-summary.md" 2>/dev/null
"$py" - "$out" "$grpo_rc" >> "$report" <<'EOF'
import json, sys
out, rc = sys.argv[1], int(sys.argv[2])
rows = [json.loads(l) for l in open(f"{out}/grpo-metrics.jsonl")] if rc == 0 else []
def mean(key, part):
    vals = [r[key] for r in part if key in r]
    return sum(vals) / len(vals) if vals else None
first, last = rows[:16], rows[-16:]
gpu = sorted({k for r in rows for k in r if k.startswith("gpu/")})
smi = [float(l.split(",")[1]) for l in open(f"{out}/grpo-nvidia-smi.csv") if "," in l]
result = {
    "check": "grpo", "exit": rc, "steps": len(rows),
    "reward_first16": mean("reward", first), "reward_last16": mean("reward", last),
    "eval_reward": [r["eval/reward"] for r in rows if "eval/reward" in r],
    "engine_logprob_gap_mean": mean("engine_logprob_gap", rows),
    "gpu_mib_max": {k: max(r.get(k, 0) for r in rows) for k in gpu},
    "device_used_mib_peak": max(smi) if smi else None,
    "device_used_mib_min": min(smi) if smi else None,
}
result["ok"] = rc == 0 and result["reward_last16"] is not None and result["reward_last16"] > result["reward_first16"]
print(json.dumps(result))
EOF
"$py" scripts/gpu/hf_anchor.py report "$report" > "$out/report.md"
cat "$out/report.md"
grep -h "CUDA IPC\|held-out\|baseline\|reward " "$out/grpo.log" | tail -8
echo "gpu-check: $SECONDS s in all" >&2
exit $failed
