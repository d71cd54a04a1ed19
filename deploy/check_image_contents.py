"""Runs INSIDE the serving image (piped to `python -`): what serving needs is there, nothing else.

    docker run --rm -i --network none transformer-serve \
        python - [--require-service] [--require-native] [checkpoint names] < deploy/check_image_contents.py

Checks: the serving dependencies import; the process is not root; the train/test/bench
extras are absent; /app/weights is read-only for the service user and holds the named
checkpoints (each with a readable config.json, model.safetensors and tokenizer.json); the
native decode library that TSERVE_NATIVE_LIBRARY names loads (--require-native: it must be
there; without, an image built without a compiler only says it decodes through the Python step).
"""

import importlib
import importlib.util
import os
import shutil
import sys

SERVING = ["torch", "fastapi", "uvicorn", "tokenizers", "safetensors", "numpy",
           "prometheus_client", "pydantic", "pydantic_settings", "llguidance", "model"]
# One module from each extra that must not be installed in a serving image.
NOT_SERVING = ["pytest", "matplotlib", "sacrebleu", "transformers", "ctranslate2", "openai", "httpx"]
CHECKPOINT_FILES = ["config.json", "model.safetensors", "tokenizer.json"]

problems = []
for name in SERVING:
    try:
        mod = importlib.import_module(name)
        print(f"image: {name} {getattr(mod, '__version__', '')}".rstrip())
    except (ImportError, OSError) as err:  # a missing module or a broken shared library
        problems.append(f"cannot import {name}: {err!r}")
# Before the service is merged the image holds model/ only; the smoke test asks for the
# service (--require-service) as soon as the tree has one.
if importlib.util.find_spec("service") is None:
    if "--require-service" in sys.argv:
        problems.append("the service package is not installed")
    else:
        print("image: no service package in this tree yet")
elif importlib.util.find_spec("service.__main__") is None:
    problems.append("service has no __main__ (python -m service)")
else:
    print("image: service package installed")
    from importlib.resources import files

    page = files("service") / "playground"
    missing = [n for n in ("index.html", "main.js", "api.js", "tabs.js", "playground.css") if not (page / n).is_file()]
    if missing:
        problems.append(f"the playground page lacks {missing} (package data in pyproject.toml)")
if shutil.which("transformer-serve") is None:
    problems.append("no transformer-serve console script on PATH")

# torch's kernels work (the build trims torch's test binaries and headers).
if "torch" in sys.modules:
    torch = sys.modules["torch"]
    q = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(0))  # (B, nh, T, hs)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    if out.shape != q.shape or not torch.isfinite(out).all() or not torch.allclose(out[:, :, 0], q[:, :, 0]):
        problems.append("torch attention gives wrong results")  # row 0 attends only to itself

# The prebuilt native decode step: it loads here, without the headers and compiler it was built with.
native_library = os.environ.get("TSERVE_NATIVE_LIBRARY", "")
if not native_library:
    problems.append("TSERVE_NATIVE_LIBRARY is not set (the image ships the native decode step)")
elif not os.path.isfile(native_library):
    if "--require-native" in sys.argv:
        problems.append(f"no native decode library at {native_library} (the native stage had no compiler?)")
    else:
        print(f"image: no native decode library at {native_library}: Llama-architecture models use the Python step")
elif "torch" in sys.modules:
    try:
        sys.modules["torch"].ops.load_library(native_library)
        print(f"image: native decode library {native_library} loads ({os.path.getsize(native_library) // 1024} KiB)")
    except (OSError, RuntimeError) as err:
        problems.append(f"the native decode library {native_library} does not load: {err}")
compilers = [c for c in ("g++", "c++", "gcc", "cc") if shutil.which(c)]
print(f"image: C++ compiler: {', '.join(compilers) if compilers else 'none'}")

for name in NOT_SERVING:
    if importlib.util.find_spec(name) is not None:
        problems.append(f"{name} is installed but serving does not need it")

if os.getuid() == 0:
    problems.append("runs as root")
weights = os.environ.get("TSERVE_WEIGHTS_DIR", "weights")
if os.access(weights, os.W_OK):
    problems.append(f"{weights} is writable by the service user")
for name in [a for a in sys.argv[1:] if not a.startswith("--")]:
    for fname in CHECKPOINT_FILES:
        path = os.path.join(weights, name, fname)
        if not os.path.isfile(path):
            problems.append(f"checkpoint {name}: {fname} missing under {weights}")
        elif not os.access(path, os.R_OK):
            problems.append(f"checkpoint {name}: {fname} not readable by uid {os.getuid()}")
print(f"image: uid {os.getuid()}, weights {sorted(os.listdir(weights))}, python {sys.version.split()[0]}")

# Weights shipped in chunks are in the image once: joined in the weights cache, their chunk
# packages uninstalled (the Dockerfile's venv stage).
if "--require-service" in sys.argv:
    import importlib.metadata
    import json

    cache = os.environ.get("TSERVE_WEIGHTS_CACHE", "")
    for name in sorted(os.listdir(weights)):
        manifest_file = os.path.join(weights, name, "manifest.json")
        if not os.path.isfile(manifest_file):
            continue
        with open(manifest_file, encoding="utf-8") as fh:
            manifest = json.load(fh)
        joined = os.path.join(cache, manifest["sha256"][:16], manifest["file"])
        if not manifest.get("parts") or not os.path.isfile(joined):
            continue
        for part in manifest["parts"]:
            try:
                importlib.metadata.distribution(part["package"])
            except importlib.metadata.PackageNotFoundError:
                continue
            problems.append(f"{name}: chunk package {part['package']} is installed beside the joined {joined}")
        print(f"image: {name} joined once ({os.path.getsize(joined) // 2**20} MiB), no chunk packages")

for problem in problems:
    print(f"image: PROBLEM: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
