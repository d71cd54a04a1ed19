"""The models of one run, built once in a temporary directory and shared by the sections."""

from __future__ import annotations

import shutil
import tempfile
from functools import cached_property
from pathlib import Path

import torch

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.synthetic import save_gpt2, save_marian


def quiet_transformers():
    """Import transformers with its progress bars and advisory warnings off."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
    return transformers


class Workspace:
    def __init__(self, cfg: BenchConfig, root: Path | None = None):
        self.cfg = cfg
        self._tmp = None if root else tempfile.TemporaryDirectory(prefix="tserve-bench-")
        self.root = Path(root or self._tmp.name)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- GPT-2 (sections 1, 3, 6) -------------------------------------------------------
    @cached_property
    def gpt2_dir(self) -> Path:
        c = self.cfg
        return save_gpt2(self.root / "gpt2", c.gpt2_layers, c.gpt2_d_model, c.gpt2_heads, c.gpt2_vocab,
                         c.gpt2_positions, c.seed)

    def gpt2_ours(self, device: str = "cpu", dtype: torch.dtype | None = None):
        from model import load_hf

        model = load_hf(self.gpt2_dir, device=device, dtype=dtype).model
        model.optimize_for_inference()  # as the engine serves it (prepacked CPU weights; no-op elsewhere)
        return model

    def gpt2_peer(self, device: str = "cpu", dtype: torch.dtype = torch.float32):
        transformers = quiet_transformers()
        return transformers.GPT2LMHeadModel.from_pretrained(self.gpt2_dir, dtype=dtype).to(device).eval()

    # --- Marian (sections 2, 6) ---------------------------------------------------------
    @cached_property
    def marian_dir(self) -> Path:
        c = self.cfg
        quiet_transformers()
        return save_marian(self.root / "marian", c.marian_layers, c.marian_d_model, c.marian_heads, c.marian_ffn,
                           c.marian_vocab, c.seed)

    def marian_ours(self, device: str = "cpu", dtype: torch.dtype | None = None):
        from model import load_hf

        imported = load_hf(self.marian_dir, device=device, dtype=dtype)
        imported.model.optimize_for_inference()  # as the engine serves it
        return imported

    def marian_peer(self, device: str = "cpu", dtype: torch.dtype = torch.float32):
        transformers = quiet_transformers()
        return transformers.MarianMTModel.from_pretrained(self.marian_dir, dtype=dtype).to(device).eval()

    @cached_property
    def marian_ct2_dir(self) -> Path:
        """The same Marian weights converted for CTranslate2 (float32; int8 is quantized at load)."""
        from ctranslate2.converters import TransformersConverter

        quiet_transformers()
        out = self.root / "marian-ct2"
        if out.exists():
            shutil.rmtree(out)
        TransformersConverter(str(self.marian_dir)).convert(str(out), quantization=None)
        return out
