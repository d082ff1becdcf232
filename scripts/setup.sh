#!/usr/bin/env bash
# Prepares a machine for building rtrun; meant to be sourced by the other scripts.
# Installs, once, what the build needs (cargo-nextest; libtorch for the model crate, into a cache
# directory outside the checkout that every clone reuses) and exports the build environment.
_rtrun_setup() {
    if ! command -v cargo >/dev/null 2>&1; then
        echo "setup: cargo is required (install Rust stable with rustup)" >&2
        return 1
    fi
    if ! cargo nextest --version >/dev/null 2>&1; then
        echo "setup: installing cargo-nextest from crates.io (once)" >&2
        cargo install --locked cargo-nextest >&2 || return 1
    fi
    local here
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    # shellcheck source=scripts/setup-libtorch.sh
    source "$here/setup-libtorch.sh" || return 1
}
_rtrun_setup
