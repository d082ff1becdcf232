#!/usr/bin/env bash
# The README's test command: sets up what is missing, then runs every test of the workspace
# (unit, property, integration and multi-process tests with real worker processes) and doctests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
# The dashboard test drives a real headless browser: Debian's `chromium`, installed once.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test: installing chromium for the dashboard test (once)" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >&2
    else
        echo "test: the dashboard test needs chromium (apt-get install chromium)" >&2
        exit 1
    fi
fi
cargo nextest run --workspace --profile ci
bash scripts/check-deploy.sh
cargo test --workspace --doc
