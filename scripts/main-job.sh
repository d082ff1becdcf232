#!/usr/bin/env bash
# The README's main-job command: sets up what is missing, builds the release driver and runs it on
# the embedded single-node runtime. Until the RLHF trainer lands this is the runtime demo driver.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo run --release -p rtrun --example demo -- "$@"
