#!/usr/bin/env bash
# The README's test command: sets up what is missing, then runs every test of the workspace
# (unit, property, integration and multi-process tests with real worker processes) and doctests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo nextest run --workspace --profile ci
bash scripts/check-deploy.sh
cargo test --workspace --doc
