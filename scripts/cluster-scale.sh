#!/usr/bin/env bash
# Issue 44's real-process benchmark: NODES node daemons (default 64, 4 CPUs each) join one head
# on loopback; a driver (tests/src/bin/scale_driver.rs) creates a single-bundle group per node
# and 4 actors in each, and calls every actor — twice: "cold" (each node first fetches the
# driver's binary from the head) and "warm". Prints the join time, the resident memory of the
# head and of an idle node daemon, group and actor creation rates, call latency, how fast
# `rtrun status` answered meanwhile; then Ray 2.60 at the same shape on this machine
# (ray.cluster_utils.Cluster: NODES raylets, halved until Ray sustains it) and the ratios.
#
# Usage: scripts/cluster-scale.sh [NODES]   (RAY_NODES=N starts Ray's attempts at N; 0 skips Ray)
set -euo pipefail
cd "$(dirname "$0")/.."
nodes="${1:-64}"
ray_nodes="${RAY_NODES:-$nodes}"
source scripts/setup.sh >/dev/null
cargo build --release -q -p rtrun --bin rtrun -p rtrun-tests --bin scale_driver
target="${CARGO_TARGET_DIR:-target}/release"
dir="$(mktemp -d /tmp/rtrun-scale.XXXXXX)"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do pkill -9 -P "$pid" 2>/dev/null || true; done
    kill -9 "${pids[@]}" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port="$(free_port)"; metrics="$(free_port)"; dashboard="$(free_port)"
rss_kib() { ps -o rss= -p "$1" | tr -d ' '; }

"$target/rtrun" head --bind 127.0.0.1 --port "$port" --num-cpus 0 --node-name head \
    --object-store-memory 64000000 --credentials-dir "$dir/hc" --data-dir "$dir/hd" \
    --metrics-port "$metrics" --dashboard-port "$dashboard" > "$dir/head.out" 2> "$dir/head.err" &
head_pid=$!
disown
pids+=("$head_pid")
for _ in $(seq 100); do grep -q "join token" "$dir/head.out" 2>/dev/null && break; sleep 0.1; done
token="$(awk '/join token/ {print $3}' "$dir/head.out")"
start=$(date +%s.%N)
node_pids=()
for n in $(seq 1 "$nodes"); do
    "$target/rtrun" join --address "127.0.0.1:$port" --token "$token" --num-cpus 4 \
        --node-name "n$n" --object-store-memory 16000000 --credentials-dir "$dir/c$n" \
        --data-dir "$dir/d$n" > "$dir/n$n.out" 2> "$dir/n$n.err" &
    disown
    pids+=($!)
    node_pids+=($!)
done
for n in $(seq 1 "$nodes"); do
    for _ in $(seq 600); do grep -q "^node " "$dir/n$n.out" 2>/dev/null && break; sleep 0.1; done
    grep -q "^node " "$dir/n$n.out" || { echo "node n$n did not join:"; cat "$dir/n$n.err"; exit 1; }
done
joined=$(python3 -c "print(f'{$(date +%s.%N) - $start:.2f}')")
sleep 2
head_idle=$(rss_kib "$head_pid")
node_rss=$(for pid in "${node_pids[@]}"; do rss_kib "$pid"; done | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
echo "== rtrun (release): $nodes node daemons joined in ${joined} s; idle resident memory: head ${head_idle} KiB, node daemon (median) ${node_rss} KiB"

# `rtrun status` in a loop while the driver runs: how long each answer took.
(
    while true; do
        t0=$(date +%s%N)
        "$target/rtrun" status --address "127.0.0.1:$port" --credentials-dir "$dir/hc" > /dev/null 2>&1 \
            && echo $(( ($(date +%s%N) - t0) / 1000000 )) >> "$dir/status.ms"
        curl -sf "http://127.0.0.1:$metrics/metrics" > /dev/null && echo 1 >> "$dir/metrics.ok"
        curl -sf "http://127.0.0.1:$dashboard/nodes" > /dev/null && echo 1 >> "$dir/dashboard.ok"
        sleep 0.5
    done
) &
poller=$!
disown
pids+=("$poller")
echo "driver binary: $(( $(stat -c %s "$target/scale_driver") / 1000000 )) MB"
for attempt in cold warm; do
    RTRUN_ADDRESS="127.0.0.1:$port" RTRUN_CREDENTIALS_DIR="$dir/hc" \
        "$target/scale_driver" --nodes "$nodes" --actors-per-node 4 > "$dir/$attempt.txt"
    grep -v '^json\|^ok' "$dir/$attempt.txt" | sed "s/^/$attempt: /"
    # The driver's actors and groups end with it: wait until the head has let them go.
    for _ in $(seq 200); do
        "$target/rtrun" status --address "127.0.0.1:$port" --credentials-dir "$dir/hc" 2>/dev/null \
            | grep -q "alive actors: 0" && break
        sleep 0.1
    done
done
kill "$poller" 2>/dev/null || true
head_busy=$(rss_kib "$head_pid")
status_ms=$(sort -n "$dir/status.ms" 2>/dev/null | awk '{a[NR]=$1} END {if (NR) print "p50 " a[int((NR+1)/2)] " ms, max " a[NR] " ms over " NR " calls"; else print "none"}')
echo "status while running: $status_ms; metrics answered $(wc -l < "$dir/metrics.ok" 2>/dev/null || echo 0)×, dashboard $(wc -l < "$dir/dashboard.ok" 2>/dev/null || echo 0)×"
echo "head resident memory with $((nodes * 4)) actors: ${head_busy} KiB"

[[ $ray_nodes == 0 ]] && exit 0
venv="$(scripts/bench/ray-anchor.sh --venv)"
size="$ray_nodes"
while (( size >= 2 )); do
    echo "== Ray 2.60 (anchor): $size raylets, ray.cluster_utils.Cluster"
    if timeout 1200 "$venv/bin/python" scripts/bench/ray_cluster_scale.py "$size" > "$dir/ray.txt" 2> "$dir/ray.err"; then
        grep -v '^json' "$dir/ray.txt"
        break
    fi
    echo "Ray did not sustain $size nodes here ($(tail -1 "$dir/ray.err")); halving"
    "$venv/bin/ray" stop --force > /dev/null 2>&1 || true
    size=$((size / 2))
done
grep -q '^json' "$dir/ray.txt" 2>/dev/null || { echo "no Ray figures"; exit 0; }
python3 - "$dir" "$nodes" "$size" <<'PY'
import json, sys
d, nodes, size = sys.argv[1:]
ray = json.loads(next(l for l in open(f"{d}/ray.txt") if l.startswith("json "))[5:])
same = "same shape" if nodes == size else f"rtrun at {nodes} nodes, Ray at {size}"
for attempt in ("cold", "warm"):
    rt = json.loads(next(l for l in open(f"{d}/{attempt}.txt") if l.startswith("json "))[5:])
    r = ray[attempt]
    print(f"== rtrun / Ray, {attempt} ({same}): groups/s {rt['groups_per_s'] / r['groups_per_s']:.1f}x, "
          f"actors/s {rt['actors_per_s'] / r['actors_per_s']:.1f}x, "
          f"call p50 {r['call_p50_us'] / rt['call_p50_us']:.1f}x faster, "
          f"p99 {r['call_p99_us'] / rt['call_p99_us']:.1f}x faster")
print(f"resident memory: Ray raylet {ray['raylet_rss_kib']} KiB, GCS {ray['gcs_rss_kib']} KiB")
PY
