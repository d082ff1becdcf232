#!/usr/bin/env bash
# Tensor parallelism of the generation engine (issue 40, item 7): greedy tokens/s of one engine
# of N actor processes at each TP size (each rank with max(1, cores / N) libtorch threads) on
# the ~25M and a ~110M-parameter model, checked token-identical to TP 1, and the resharding per
# weight sync (`reshard::engine_buckets`) with the bytes each rank receives. Writes one Markdown
# table to stdout. On a CPU-only machine the ranks share the same cores, so TP is overhead there:
# the table is the cost of the split, not a speed-up.
#
#     scripts/bench-tp.sh                       # TP 1, 2, 4 on 25m and 110m (about 3 minutes on 2 cores)
#     TP=1,2 MODELS=25m scripts/bench-tp.sh
#     scripts/bench-tp.sh --tp-batch 8          # extra arguments go to engine_bench
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
TP=${TP:-1,2,4}
MODELS=${MODELS:-25m,110m}
cargo build --release --quiet -p rtrun-rlhf-engine --example engine_bench
echo "bench-tp: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" >&2
target/release/examples/engine_bench --tp "$TP" --tp-models "$MODELS" "$@"
