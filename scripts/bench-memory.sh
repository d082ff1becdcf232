#!/usr/bin/env bash
# Sharded training (ZeRO stages, activation checkpointing): what a policy rank holds at each
# stage on 1, 2 and 4 ranks beside the ZeRO paper's formula, stage 3's step time against stage 0
# on the same 2 ranks with the collectives' share, and what activation checkpointing saves on a
# ~110M model at 8 × 512 tokens. Real worker processes (the policy role of `train --mode sft`)
# for the first two, this process for the third. Writes the tables to stdout (Markdown).
#
#     scripts/bench-memory.sh                 # everything (about 10 minutes on 2 cores)
#     PARTS=memory MODELS=27m scripts/bench-memory.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
ROOT=$(pwd)
BENCH_DIR=${BENCH_DIR:-$HOME/.cache/rtrun/bench-memory}
PARTS=${PARTS:-memory,time,checkpointing}
MODELS=${MODELS:-27m,110m}
mkdir -p "$BENCH_DIR"
cargo build --release --quiet -p rtrun-rlhf --example zero_bench
echo "bench-memory: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" >&2
"$ROOT/target/release/examples/zero_bench" --dir "$BENCH_DIR/models" --parts "$PARTS" \
    --models "$MODELS"
