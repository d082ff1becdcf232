#!/usr/bin/env bash
# rtrun's microbenchmark beside Ray's, metric by metric, in one run on this machine.
#
# Usage: scripts/bench/compare-with-ray.sh RTRUN_BINARY [METRIC ...]
#   RTRUN_BINARY microbenchmark PATTERN must print Ray's line format
#   ("<metric> per second <mean> +- <sd>", Ray's metric names). Without METRICs the ten rows of
#   the README are measured.
# One row per metric: metric, rtrun's rate, Ray's rate and their ratio. The two sides of a row
# run back to back, so a drift of the machine touches both.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
binary="$1"
shift
if (($# == 0)); then
    set -- "single client tasks sync" "single client tasks async" "1:1 actor calls sync" \
        "1:1 actor calls async" "1:1 actor calls concurrent" "n:n actor calls async" \
        "single client get calls (Plasma Store)" "single client put calls (Plasma Store)" \
        "single client put gigabytes" "placement group create/removal"
fi
# The mean of the first "<metric> per second <mean>" line on stdin.
rate() {
    grep -F "$1 per second" | head -1 | awk '{ for (i = 1; i < NF; i++) if ($i == "second") { print $(i + 1); exit } }'
}
printf '%-42s %14s %14s %10s\n' metric rtrun ray ratio
for metric in "$@"; do
    ours=$("$binary" microbenchmark "$metric" 2>/dev/null | rate "$metric" || true)
    theirs=$("$here/ray-anchor.sh" "$metric" | rate "$metric" || true)
    ratio=n/a
    if [[ -n $ours && -n $theirs ]]; then
        ratio=$(awk -v a="$ours" -v b="$theirs" 'BEGIN { printf "%.2f", a / b }')
    fi
    printf '%-42s %14s %14s %10s\n' "$metric" "${ours:-missing}" "${theirs:-missing}" "$ratio"
done
