#!/usr/bin/env bash
# Ray's own microbenchmark on this machine: the anchor `rtrun microbenchmark` is compared with.
#
# Usage: scripts/bench/ray-anchor.sh [PATTERN | --venv]
#   PATTERN picks the tests whose names contain it (Ray's TESTS_TO_RUN); none runs them all.
#   --venv installs Ray if needed and prints the venv's directory (for other anchors).
# Prints Ray's result lines unchanged: "<metric> per second <mean> +- <sd>".
# Ray 2.60.0 is installed on first use into a venv under ${RTRUN_ANCHOR_DIR:-~/.cache/rtrun-anchors}
# (the only download; nothing else is fetched).
set -euo pipefail
version=2.60.0
venv="${RTRUN_ANCHOR_DIR:-$HOME/.cache/rtrun-anchors}/ray-$version"
if [[ ! -x $venv/bin/ray ]]; then
    echo "ray-anchor: installing ray $version into $venv" >&2
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet "ray[default]==$version" numpy >&2
fi
if [[ ${1:-} == --venv ]]; then
    echo "$venv"
    exit 0
fi
# Ray pauses before each test so the machine settles: that is part of how it measures.
TESTS_TO_RUN="${1:-}" "$venv/bin/ray" microbenchmark 2>/dev/null | grep ' per second ' || true
