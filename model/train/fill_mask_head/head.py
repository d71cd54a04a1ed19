"""The masked-LM head on the MiniLM encoder: building it, the encoder's pieces the trainers run
(its layers from a given one, the [MASK] row from a trainable vector), and the head file
(read back into a run, written with its manifest)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from model.formats.sentence_transformers import MASK_EMBEDDING

ENCODER = Path("weights/all-minilm-l6-v2")
HEAD_FILE = "mlm_head.safetensors"


def encoder_parts(model, ids: torch.Tensor, real: torch.Tensor, upto: int):
    """States entering encoder layer ``upto`` (B, T, d), and the attention context."""
    from model.nn.layers import AttentionContext

    positions = torch.arange(ids.size(1))
    x = model.embed(ids, positions, None)
    ctx = AttentionContext(mask=real[:, None, None, :], rope=model.embed.rotary(positions, x.dtype))
    for layer in model.encoder_layers[:upto]:
        x = layer(x, ctx)
    return x, ctx


def run_top(model, x: torch.Tensor, ctx, start: int) -> torch.Tensor:
    for layer in model.encoder_layers[start:]:
        x = layer(x, ctx)
    return model.encoder_norm(x)


def head_config(cfg):
    import dataclasses

    return dataclasses.replace(cfg, mlm_head=True, mlm_transform=True, lm_head_bias=True, tie_word_embeddings=True)


def new_head(ckpt):
    from model.nn.transformer import LMHead

    head = LMHead(head_config(ckpt.config))
    with torch.no_grad():
        head.dense.weight.copy_(torch.eye(head.dense.weight.size(0)) + 0.02 * torch.randn_like(head.dense.weight))
        head.dense.bias.zero_()
    head.proj.weight = ckpt.model.embed.tokens.weight  # tied, frozen
    head.proj.weight.requires_grad_(False)
    return head


def head_state(head, layers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    out = {f"lm_head.{k}": v.detach().clone().contiguous() for k, v in head.state_dict().items()
           if k != "proj.weight"}
    for k, v in (layers or {}).items():
        out[k] = v.detach().clone().contiguous()
    return out


def write_manifest(dest: Path) -> None:
    """``dest/manifest.json``: the encoder's manifest (its pinned package) plus the head file and its sha256."""
    from model.formats.manifest import MANIFEST_FILE, sha256_of

    manifest = json.loads((ENCODER / MANIFEST_FILE).read_text())
    manifest["mlm_head"] = {"file": HEAD_FILE, "sha256": sha256_of(dest / HEAD_FILE)}
    (dest / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def embedding_params(model) -> dict[str, torch.nn.Parameter]:
    """The embedding tensors ``finetune`` trains: all but the word embeddings (tied to the decoder)."""
    return {f"embed.{k}": p for k, p in model.embed.named_parameters() if k != "tokens.weight"}


def init_from_head_file(model, head, mask_vec: torch.Tensor, path: Path) -> None:
    """Load an exported head file (``path``: a model directory, its manifest naming the file, or the
    file) into ``finetune``'s model, head and ``[MASK]`` vector, cast to their dtype. Every tensor
    of the file must name one of theirs, and every tensor ``finetune`` trains must be in the file."""
    from safetensors.torch import load_file

    from model.formats.manifest import read_manifest, sha256_of

    file = path
    if path.is_dir():
        manifest = read_manifest(path)
        file = path / manifest.mlm_head
        if manifest.mlm_head_sha256 and sha256_of(file) != manifest.mlm_head_sha256:
            sys.exit(f"{file}: sha256 differs from {path}'s manifest")
    tensors = load_file(file)
    targets = {f"lm_head.{k}": v for k, v in head.state_dict().items() if k != "proj.weight"}
    targets.update({f"encoder_layers.{k}": v for k, v in model.encoder_layers.state_dict().items()})
    targets.update({k: p.data for k, p in embedding_params(model).items()})
    targets[MASK_EMBEDDING] = mask_vec.data
    unknown, missing = sorted(set(tensors) - set(targets)), sorted(set(targets) - set(tensors))
    if unknown or missing:
        sys.exit(f"{file} does not match the model finetune trains: unknown {unknown[:5]}, missing {missing[:5]}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tensor.shape != targets[name].shape:
                sys.exit(f"{file}: {name} has shape {tuple(tensor.shape)}, the model's {tuple(targets[name].shape)}")
            targets[name].copy_(tensor.to(targets[name].dtype))


def embed_ids(model, ids: torch.Tensor, mask_vec: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``model.embed(ids)`` with the [MASK] rows taken from ``mask_vec`` (trainable) instead of the
    frozen word-embedding matrix."""
    emb = model.embed
    x = emb.tokens(ids)
    x = torch.where((ids == mask_id)[..., None], mask_vec.to(x.dtype), x)
    x = x + emb.positions(torch.arange(ids.size(1)))
    if emb.token_types is not None:
        x = x + emb.token_types.weight[0]
    return emb.norm(x) if emb.norm is not None else x


def encode_states(model, ids: torch.Tensor, real: torch.Tensor, mask_vec: torch.Tensor, mask_id: int) -> torch.Tensor:
    from model.nn.layers import AttentionContext

    x = embed_ids(model, ids, mask_vec, mask_id)
    ctx = AttentionContext(mask=real[:, None, None, :], rope=None)
    for layer in model.encoder_layers:
        x = layer(x, ctx)
    return model.encoder_norm(x)


def export_finetuned(model, head, mask_vec: torch.Tensor, dest: Path, dtype: str = "float16",
                     history: dict | None = None, record: dict | None = None) -> None:
    """The head file of a fine-tuned encoder: the head, every encoder layer, the embeddings but the
    word matrix, and the [MASK] input row (``MASK_EMBEDDING``), stored in ``dtype``. With
    ``history``, also the loss curve and ``train_history.json`` (``record`` plus the history)."""
    from safetensors.torch import save_file

    from model.train.export import plot_loss_curve

    cast = getattr(torch, dtype)
    layers = {f"encoder_layers.{k}": v for k, v in model.encoder_layers.state_dict().items()}
    layers.update({k: p.detach() for k, p in embedding_params(model).items()})
    layers[MASK_EMBEDDING] = mask_vec.detach()
    tensors = {k: v.to(cast) for k, v in head_state(head, layers).items()}
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dest / HEAD_FILE, metadata={"format": "pt"})
    write_manifest(dest)
    if history is not None:
        plot_loss_curve({"train": history["train"], "valid": history["valid"]}, dest / "loss_curve.png",
                        "fill-mask-en: MiniLM-L6 fine-tuned as a masked LM")
        (dest / "train_history.json").write_text(json.dumps({**(record or {}), "history": history}) + "\n")
