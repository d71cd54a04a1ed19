"""Convert a local Hugging Face model directory into our checkpoint format.

    python -m model.convert downloads/opus-mt-en-de weights/translate-opus-en-de [--dtype bfloat16]

Writes config.json + model.safetensors + tokenizer.json (model.checkpoint.save) and a short
README.md model card, so the service serves it from weights/ like our own models.
Only local files are read: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from model.checkpoint import save
from model.config import DTYPES
from model.hf_import import HFImportError, HFModel, load_hf


def model_card(hf: HFModel, dtype: str) -> str:
    lines = [
        f"# {hf.path.name} (converted)",
        "",
        (f"Converted from the Hugging Face `{hf.architecture}` checkpoint at `{hf.path}` with "
         "`python -m model.convert`."),
        "",
        f"- family: {hf.config.family}",
        f"- parameters: {hf.model.num_parameters():,}",
        f"- storage dtype: {dtype}",
        f"- vocabulary: {hf.config.vocab_size} ({hf.tokenizer.vocab_size} in the tokenizer)",
        "",
        "Licence and intended use are those of the source model; see its own model card.",
    ]
    if hf.notes:
        lines += [""] + [f"Note: {note}" for note in hf.notes]
    return "\n".join(lines) + "\n"


def convert(src: str | Path, dst: str | Path, dtype: str = "float32", overwrite: bool = False) -> HFModel:
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"{dst}: exists and is not empty (pass --overwrite to replace its files)")
    hf = load_hf(src, dtype=DTYPES[dtype])
    save(dst, hf.model, hf.tokenizer)
    (dst / "README.md").write_text(model_card(hf, dtype))
    return hf


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.convert", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="local Hugging Face model directory (config.json + model.safetensors + tokenizer)")
    parser.add_argument("dst", help="output checkpoint directory, e.g. weights/<name>")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="storage dtype of the weights")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty destination")
    args = parser.parse_args(argv)
    try:
        hf = convert(args.src, args.dst, args.dtype, args.overwrite)
    except (HFImportError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{hf.architecture} -> {hf.config.family} ({hf.model.num_parameters():,} parameters, {args.dtype}) "
          f"written to {args.dst}")
    for note in hf.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
