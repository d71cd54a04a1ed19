"""The loaded models: discovery in the weights directory, loading, warm-up, lookup.

``start()`` runs in the background of the app's lifespan, so /health answers at once and
/ready turns true only when every engine has loaded and warmed up.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from model import CheckpointError, is_model_dir, load_model
from model.config import DTYPES
from model.decode import prepare, prepare_weights
from model.formats.manifest import ManifestError, is_manifest_dir, locate, read_manifest
from service.encoder_engine import EncoderEngine
from service.engine import BaseEngine, GenerativeEngine
from service.engine_base import TASKS
from service.engine_errors import EngineStoppedError, InvalidRequestError, ModelNotFoundError
from service.metrics import Metrics
from service.schemas import printable
from service.settings import Settings

log = logging.getLogger("tserve.registry")

# the setting that names each task's default model (``EngineRegistry.default``)
DEFAULT_SETTINGS = {"text-generation": "default_generation_model", "feature-extraction": "default_embedding_model",
                    "fill-mask": "default_fill_mask_model", "translation": "default_translation_model"}
# what drop-in clients send when they have no model to name: TGI's and TEI's own names, test
# placeholders, an empty string, or the server's URL (huggingface_hub with a base_url)
PLACEHOLDER_MODELS = {"", "tgi", "tei", "dummy", "default", "unused", "none"}


def is_placeholder(name: str | None) -> bool:
    return name is None or name.strip().lower() in PLACEHOLDER_MODELS or name.startswith(("http://", "https://"))


FAMILY_NAMES = {"encoder-decoder": "translation (encoder-decoder)", "decoder": "text generation (decoder)",
                "encoder": "fill-mask/embedding (encoder)"}


class EngineRegistry:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings, self.metrics = settings, metrics
        self.engines: dict[str, BaseEngine] = {}
        self.error: str | None = None
        self.started = False

    def discover(self) -> list[tuple[str, Path]]:
        """(name, path) of each model to load. ``TSERVE_MODELS`` entries are names in the weights
        directory or paths (a model directory or a ``.gguf`` file); without it, every model
        directory there, skipping (with a warning) manifests whose weight package is missing."""
        root = self.settings.weights_dir
        found = {p.name: p for p in sorted(root.iterdir()) if is_model_dir(p)} if root.is_dir() else {}
        wanted = self.settings.model_names()
        if not wanted:
            found = {name: p for name, p in found.items() if self._installed(p)}
            if not found:
                raise CheckpointError(f"no model directories (config.json + model.safetensors, or manifest.json) "
                                      f"in {root.resolve()}")
            return list(found.items())
        chosen, missing = [], []
        for entry in wanted:
            path = Path(entry)
            if entry in found:
                chosen.append((entry, found[entry]))
            elif ("/" in entry or entry.endswith(".gguf")) and path.exists():
                chosen.append((path.name.removesuffix(".gguf"), path))
            else:
                missing.append(entry)
        if missing:
            raise CheckpointError(f"TSERVE_MODELS names {missing}: neither a model in {root} (found: {sorted(found)}) "
                                  "nor an existing path")
        return chosen

    @staticmethod
    def _installed(path: Path) -> bool:
        if not is_manifest_dir(path):
            return True
        try:
            locate(read_manifest(path))
        except ManifestError as exc:
            log.warning("skipping %s: %s", path.name, exc)
            return False
        return True

    async def start(self) -> None:
        try:
            for name, path in self.discover():
                ckpt = await asyncio.to_thread(load_model, path, self.settings.device, DTYPES[self.settings.dtype])
                options = self.settings.decode_options()
                step = None
                if ckpt.config.has_decoder:
                    # One place chooses the decode step (model.decode.prepare); the engine holds it.
                    step = await asyncio.to_thread(prepare, ckpt.model, options, ckpt.tokenizer)
                    self.metrics.decode_step.labels(name, step.name).set(1)
                    build = getattr(step, "build_seconds", None)
                    log.info("decode step", extra={"model": name, "step": step.name, "kv_dtype": str(step.kv_dtype),
                                                   **({} if build is None else {"build_seconds": round(build, 1)})})
                    engine: BaseEngine = GenerativeEngine(name, ckpt, self.settings, self.metrics, step)
                else:
                    await asyncio.to_thread(prepare_weights, ckpt.model, options, ckpt.tokenizer)
                    engine = EncoderEngine(name, ckpt, self.settings, self.metrics)
                self.engines[name] = engine
                await engine.start()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("model loading failed: %s", self.error)
        finally:
            self.started = True

    async def stop(self, grace_s: float) -> None:
        await asyncio.gather(*(e.stop(grace_s) for e in self.engines.values()))

    @property
    def ready(self) -> bool:
        return self.started and self.error is None and bool(self.engines) and all(
            e.ready for e in self.engines.values())

    def status(self) -> dict:
        return {"ready": self.ready, "error": self.error,
                "models": {name: ("ready" if e.ready else "starting") for name, e in self.engines.items()}}

    def default(self, task: str) -> BaseEngine | None:
        """The model a drop-in request of ``task`` (``TASKS``' values, or ``feature-extraction``)
        without a model goes to: ``TSERVE_DEFAULT_<TASK>_MODEL`` when set, else for text generation
        the first model with a chat template (then any), else the first of the task."""
        candidates = [e for e in self.engines.values() if e.task == task]
        return self._default(candidates, task) if candidates else None

    def _default(self, candidates: list[BaseEngine], task: str) -> BaseEngine:
        setting = DEFAULT_SETTINGS.get(task)
        wanted = getattr(self.settings, setting) if setting else ""
        if wanted:
            found = next((e for e in candidates if e.name == wanted), None)
            if found is None:
                raise InvalidRequestError(f"TSERVE_{setting.upper()} names '{wanted}', which is not a loaded {task} "
                                          f"model (loaded: {sorted(e.name for e in candidates)})", "model")
            return found
        if task == "text-generation":
            return next((e for e in candidates if getattr(e, "chat", None) is not None), candidates[0])
        return candidates[0]

    def get(self, name: str | None, family: str, endpoint: str, task: str | None = None,
            only_one: bool = False) -> BaseEngine:
        """The engine for ``name``; without a name, the first loaded model of ``family`` (of ``task``
        where models of other tasks could answer too). With ``only_one`` (the drop-in APIs, whose
        clients send no model or a placeholder such as ``"tgi"``) the task's default model
        answers (``default``), and a placeholder counts as no name."""
        if only_one and is_placeholder(name):
            name = None
        if name is None:
            candidates = [e for e in self.engines.values() if e.family == family]
            if task is not None and any(e.task == task for e in candidates):
                candidates = [e for e in candidates if e.task == task]
            if not candidates:
                if not self.started:
                    raise EngineStoppedError("models are still loading")
                raise ModelNotFoundError(f"no {FAMILY_NAMES[family]} model is loaded", "model")
            engine = self._default(candidates, task or TASKS[family]) if only_one else candidates[0]
        else:
            engine = self.engines.get(name)
            if engine is None:
                if not self.started:
                    raise EngineStoppedError("models are still loading")
                raise ModelNotFoundError(f"model '{printable(name)}' not found; loaded: {sorted(self.engines)}",
                                         "model")
            if engine.family != family:
                raise InvalidRequestError(f"model '{name}' is a {FAMILY_NAMES[engine.family]} model; {endpoint} "
                                          f"needs a {FAMILY_NAMES[family]} model", "model")
        if not engine.ready:
            raise EngineStoppedError(f"model '{engine.name}' is not ready")
        return engine
