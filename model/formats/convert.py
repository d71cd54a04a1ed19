"""Convert a local Hugging Face model directory or a GGUF file into our checkpoint format.

    python -m model.formats.convert downloads/opus-mt-en-de weights/translate-opus-en-de [--dtype bfloat16]
    python -m model.formats.convert SmolLM2-135M-Instruct.Q4_1.gguf weights/smollm2-local

Writes config.json + model.safetensors + tokenizer.json (model.formats.checkpoint.save), the chat
template and extra stop ids when the source has them, and a short README.md model card, so
the service serves it from weights/ like our own models. A manifest directory (weights/*/
manifest.json) is read through its pinned package. Only local files are read: nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from model.config import DTYPES
from model.formats.checkpoint import CheckpointError, save
from model.formats.gguf_import import GGUFModel, load_gguf
from model.formats.hf.importer import HFModel, load_hf
from model.formats.manifest import is_manifest_dir, locate, read_manifest


def model_card(hf: HFModel | GGUFModel, dtype: str) -> str:
    if isinstance(hf, GGUFModel):
        origin = f"the GGUF file `{hf.path}` (architecture `{hf.architecture}`, \"{hf.metadata.get('name', '')}\")"
    else:
        origin = f"the Hugging Face `{hf.architecture}` checkpoint at `{hf.path}`"
    lines = [
        f"# {hf.path.stem if hf.path.is_file() else hf.path.name} (converted)",
        "",
        f"Converted from {origin} with `python -m model.formats.convert`.",
        "",
        f"- family: {hf.config.family}",
        f"- parameters: {hf.model.num_parameters():,}",
        f"- storage dtype: {dtype}",
        f"- vocabulary: {hf.config.vocab_size} ({hf.tokenizer.vocab_size} in the tokenizer)",
        f"- chat template: {'yes (chat_template.jinja)' if hf.chat_template else 'none'}",
        "",
        "Licence and intended use are those of the source model; see its own model card.",
    ]
    licence = hf.metadata.get("license") if isinstance(hf, GGUFModel) else None
    if licence:
        lines.append(f"The source file states the licence `{licence}`.")
    if hf.notes:
        lines += [""] + [f"Note: {note}" for note in hf.notes]
    return "\n".join(lines) + "\n"


def read_source(src: str | Path, dtype: torch.dtype | None = None) -> HFModel | GGUFModel:
    """A HF directory, a GGUF file, or a manifest directory's verified GGUF file."""
    src = Path(src)
    if src.is_file():
        return load_gguf(src, dtype=dtype)
    if is_manifest_dir(src):
        return load_gguf(locate(read_manifest(src)), dtype=dtype)
    return load_hf(src, dtype=dtype)


def convert(src: str | Path, dst: str | Path, dtype: str = "float32", overwrite: bool = False) -> HFModel | GGUFModel:
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"{dst}: exists and is not empty (pass --overwrite to replace its files)")
    hf = read_source(src, dtype=DTYPES[dtype])
    save(dst, hf.model, hf.tokenizer, chat_template=hf.chat_template, stop_token_ids=hf.stop_token_ids)
    (dst / "README.md").write_text(model_card(hf, dtype))
    return hf


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.formats.convert", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="local Hugging Face model directory (config.json + model.safetensors + tokenizer), "
                                    "a .gguf file, or a manifest directory")
    parser.add_argument("dst", help="output checkpoint directory, e.g. weights/<name>")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="storage dtype of the weights")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty destination")
    args = parser.parse_args(argv)
    try:
        hf = convert(args.src, args.dst, args.dtype, args.overwrite)
    except (CheckpointError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{hf.architecture} -> {hf.config.family} ({hf.model.num_parameters():,} parameters, {args.dtype}) "
          f"written to {args.dst}")
    for note in hf.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
