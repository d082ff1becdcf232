#!/usr/bin/env bash
# Builds the binaries carried to the lent GPU machine (see scripts/gpu-check.sh).
#
# Usage: scripts/build-gpu.sh        → gpu-build/{train,gpu_check} (stripped, no debug info)
#
# The GPU machine has PyTorch 2.11.0+cu130 and no Rust toolchain; rtrun pins tch 0.26, made for
# libtorch 2.13. So the binaries are built here against the torch==2.11.0 wheel's headers and
# libraries (installed like the 2.13 one, by scripts/setup-libtorch.sh) with the `cuda` feature,
# and at run time load the GPU machine's own libtorch through LD_LIBRARY_PATH. tch's C wrapper
# has a function for every ATen op of 2.13; the 15 or so that 2.11 lacks are replaced by
# functions returning an error (scripts/gpu/patch_torch_sys.py) in a patched copy of torch-sys.
# The build runs in a copy of the checkout under target-gpu/ so that the patch never touches
# this checkout's Cargo.lock. Why not tch's matching release: every tch release regenerates
# the op wrappers, so an older tch would change the Rust API rtrun is written against.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export RTRUN_TORCH_VERSION=2.11.0
source scripts/setup-libtorch.sh
export LIBTORCH_BYPASS_VERSION_CHECK=1

cache="${RTRUN_CACHE:-$HOME/.cache/rtrun}"
sys_src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/torch-sys-0.26.0 | head -1)"
patched="$cache/torch-sys-0.26.0-libtorch-2.11.0"
if [[ ! -f "$patched/.rtrun-patched" ]]; then
    rm -rf "$patched.tmp" && cp -r "$sys_src" "$patched.tmp"
    python3 scripts/gpu/patch_torch_sys.py "$patched.tmp" "$LIBTORCH"
    touch "$patched.tmp/.rtrun-patched"
    rm -rf "$patched" && mv "$patched.tmp" "$patched"
fi

src="$root/target-gpu/src"
mkdir -p "$src"
# Tracked and untracked-but-not-ignored files, so uncommitted work builds too.
# (tar keeps modification times, so cargo rebuilds only what changed.)
git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf - | tar -xf - -C "$src"
cd "$src"
CARGO_TARGET_DIR="$root/target-gpu/target" cargo build --profile gpu --features cuda \
    --config "patch.crates-io.torch-sys.path=\"$patched\"" \
    -p rtrun-rlhf --bin train --example gpu_check
mkdir -p "$root/gpu-build"
for bin in train examples/gpu_check; do
    cp "$root/target-gpu/target/gpu/$bin" "$root/gpu-build/"
done
ls -la "$root/gpu-build"
