#!/usr/bin/env bash
# Installs libtorch for the `tch` crate and exports the variables a cargo build needs.
#
# Usage (from any directory, in bash):
#     source scripts/setup-libtorch.sh     # installs once, then exports LIBTORCH
#     bash scripts/setup-libtorch.sh       # installs only (prints the export line)
#
# Why this shape:
# - `tch` 0.26 pairs with libtorch 2.13.0. The only libtorch we can download is the one inside the
#   PyPI wheel `torch==2.13.0`; two small nvidia wheels supply `libcudart.so.13` and
#   `libcupti.so.13`, which `libtorch_cpu.so` needs at load time and finds through its own RPATH
#   when they are installed into the same target directory.
# - The install goes to a cache directory OUTSIDE the checkout
#   (`${RTRUN_CACHE:-$HOME/.cache/rtrun}/libtorch-2.13.0`) so every clone reuses it.
# - It is idempotent and safe to run from two clones at once: the wheels are installed into a
#   private temporary directory next to the target and renamed into place (an atomic rename on one
#   file system); a loser of the race discards its copy. A `flock` (when available) avoids the
#   duplicate 526 MB download in the common case.
# - `LIBTORCH_USE_PYTORCH=1` does not work with this wheel, so `LIBTORCH` points at `<dir>/torch`.
#   `LIBTORCH_BYPASS_VERSION_CHECK` is not needed: the version matches.

# Runs in a subshell-safe way whether sourced or executed: all work happens in a function whose
# failures are reported with `return`, never `exit`, so sourcing never kills the caller's shell.
_rtrun_setup_libtorch() {
    # RTRUN_TORCH_VERSION=2.11.0 installs the torch of the lent GPU machine (scripts/build-gpu.sh).
    local torch_version="${RTRUN_TORCH_VERSION:-2.13.0}"
    local cudart_version="13.0.96"
    local cupti_version="13.0.85"
    local cache_root="${RTRUN_CACHE:-$HOME/.cache/rtrun}"
    local target="$cache_root/libtorch-$torch_version"
    local marker="$target/.rtrun-complete"
    local python="${RTRUN_PYTHON:-python3}"

    if [[ ! -f "$marker" ]]; then
        mkdir -p "$cache_root" || return 1
        local lock="$cache_root/libtorch-$torch_version.lock"
        # Hold a lock on fd 213 (a number a sourcing shell is unlikely to use) while installing,
        # when flock exists; the rename below keeps the result correct even without it.
        exec 213>"$lock"
        if command -v flock >/dev/null 2>&1; then
            if ! flock -n 213; then
                echo "setup-libtorch: another clone is installing; waiting for $lock" >&2
                flock 213
            fi
        fi
        if [[ ! -f "$marker" ]]; then
            local staging
            staging="$(mktemp -d "$cache_root/.libtorch-$torch_version.XXXXXX")" || return 1
            echo "setup-libtorch: installing torch==$torch_version (about 526 MB) into $target" >&2
            if ! PIP_ROOT_USER_ACTION=ignore "$python" -m pip install --quiet --no-deps --no-compile --target "$staging" \
                "torch==$torch_version" \
                "nvidia-cuda-runtime==$cudart_version" \
                "nvidia-cuda-cupti==$cupti_version"; then
                rm -rf "$staging"
                exec 213>&-
                echo "setup-libtorch: pip install failed" >&2
                return 1
            fi
            touch "$staging/.rtrun-complete"
            if ! mv -T "$staging" "$target" 2>/dev/null; then
                # Another clone finished first (or a stale partial directory exists without the
                # marker): keep a complete install, replace an incomplete one.
                if [[ -f "$marker" ]]; then
                    rm -rf "$staging"
                else
                    rm -rf "$target" && mv -T "$staging" "$target" || {
                        exec 213>&-
                        return 1
                    }
                fi
            fi
        fi
        exec 213>&-
    fi

    # The CUDA runtime headers need the `crt/` headers of one more small wheel (about 1 MB) to
    # compile: only the `cuda` feature's shims include them (`cargo clippy --features cuda` in
    # CI, scripts/build-gpu.sh). Added after the fact to installs made before it: the headers
    # go to a private directory and are renamed into place.
    local crt_version="13.0.88"
    local crt="$target/nvidia/cu13/include/crt"
    if [[ -d "$target/nvidia/cu13/include" && ! -f "$crt/host_config.h" ]]; then
        local crt_staging
        crt_staging="$(mktemp -d "$cache_root/.cuda-crt.XXXXXX")" || return 1
        if PIP_ROOT_USER_ACTION=ignore "$python" -m pip install --quiet --no-deps --no-compile \
            --target "$crt_staging" "nvidia-cuda-crt==$crt_version" \
            && [[ -f "$crt_staging/nvidia/cu13/include/crt/host_config.h" ]]; then
            mv -T "$crt_staging/nvidia/cu13/include/crt" "$crt" 2>/dev/null || true
        else
            echo "setup-libtorch: installing nvidia-cuda-crt failed (only the cuda feature needs it)" >&2
        fi
        rm -rf "$crt_staging"
    fi

    export LIBTORCH="$target/torch"
    # The include and lib paths follow from LIBTORCH; spelled out for tools that read them.
    export LIBTORCH_INCLUDE="$LIBTORCH"
    export LIBTORCH_LIB="$LIBTORCH"
    # Binaries get an rpath from rtrun-rlhf-model's build script; this only helps programs built
    # by other means (for example a test harness that dlopens libtorch).
    case ":${LD_LIBRARY_PATH:-}:" in
        *":$LIBTORCH/lib:"*) ;;
        *) export LD_LIBRARY_PATH="$LIBTORCH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
    echo "setup-libtorch: LIBTORCH=$LIBTORCH" >&2
    return 0
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    # Executed: install, and print the line a caller can eval.
    set -u
    _rtrun_setup_libtorch || exit 1
    echo "export LIBTORCH=$LIBTORCH"
else
    _rtrun_setup_libtorch
fi
