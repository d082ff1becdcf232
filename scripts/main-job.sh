#!/usr/bin/env bash
# The README's main-job command: sets up what is missing, builds the release `train` driver and
# runs the shipped GRPO example on the embedded single-node runtime (a tiny policy learns to
# reverse digit strings; the held-out reward before and after is printed at the end).
# Extra arguments go to the driver, e.g. `scripts/main-job.sh --set train.max_steps=20`.
# `--overwrite`: the main job is the README's from-scratch reference run, so running it again
# redoes it in runs/grpo (replacing the previous run) instead of resuming the finished run from
# its last checkpoint or refusing the directory. To resume an interrupted run instead, run the
# `cargo run` line below without `--overwrite`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo run --release -p rtrun-rlhf --bin train -- --config deploy/examples/rlhf/grpo.yaml \
    --overwrite "$@"
