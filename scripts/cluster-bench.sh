#!/usr/bin/env bash
# The multi-node benchmark (issue 5's targets): a head and one node on loopback, release build.
# Measures cross-node 1:1 actor calls (sync, one in flight) and 256 MiB object pulls between
# nodes and into a driver, then Ray's same-node "1:1 actor calls sync" as the anchor, in the
# same run. Usage: scripts/cluster-bench.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-5}"
source scripts/setup.sh >/dev/null
cargo build --release -q -p rtrun --bin rtrun -p rtrun-tests --bin cluster_driver
target="${CARGO_TARGET_DIR:-target}/release"
dir="$(mktemp -d)"
pids=()
cleanup() { kill -9 "${pids[@]}" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
port=$((20000 + RANDOM % 20000))
"$target/rtrun" head --bind 127.0.0.1 --port "$port" --num-cpus 1 --node-name head \
  --object-store-memory 1200000000 --credentials-dir "$dir/hc" --data-dir "$dir/hd" > "$dir/head.out" &
pids+=($!)
for _ in $(seq 100); do grep -q "join token" "$dir/head.out" 2>/dev/null && break; sleep 0.1; done
token="$(awk '/join token/ {print $3}' "$dir/head.out")"
"$target/rtrun" join --address "127.0.0.1:$port" --token "$token" --num-cpus 1 --node-name n1 \
  --object-store-memory 1200000000 --credentials-dir "$dir/nc" --data-dir "$dir/nd" > "$dir/node.out" &
pids+=($!)
for _ in $(seq 100); do grep -q "joined" "$dir/node.out" 2>/dev/null && break; sleep 0.1; done
echo "== rtrun (release), head + 1 node on loopback QUIC"
CLUSTER_NODES=2 CLUSTER_BENCH_SECONDS="$seconds" RTRUN_ADDRESS="127.0.0.1:$port" \
  RTRUN_CREDENTIALS_DIR="$dir/hc" "$target/cluster_driver" | grep -E "object pulls|per second|checksum"
echo "== Ray (anchor, same-node)"
scripts/bench/ray-anchor.sh "1:1 actor calls sync" | grep -F "per second" || echo "Ray anchor unavailable"
