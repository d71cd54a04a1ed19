"""Optional int8 dynamic quantization of every projection (CPU).

Weights are stored as int8 per output channel; activations are quantized per batch at
run time (fbgemm kernels). Measured 2-10x faster than prepacked fp32 for decoding-sized
products at ~2% relative error per layer. Opt-in (``TSERVE_QUANTIZE=int8``): quality must
be checked per model (the embeddings and LayerNorms stay fp32).

The input of a gated (SwiGLU) feed-forward's output projection, ``act(gate x) * up x``,
has a few channels with outliers hundreds of times larger than the rest, which one
per-batch activation scale cannot represent (SmolLM2-135M-Instruct, perplexity on 512
tokens of docs/ARCHITECTURE.md: float32 64.9; everything int8 162.3). ``smooth_gated_ffn_``
moves that range from the activations into the weights before quantizing (SmoothQuant,
Xiao et al. 2022): channel j of the product is divided by s_j, folded exactly into row j
of ``up``, and column j of ``down`` is multiplied by s_j, with
s_j = max|x_j| ** alpha / max|W_down[:, j]| ** (1 - alpha) from a calibration text
(``CALIBRATION``, not the text perplexity is measured on). The float model computes the
same function before and after; only the int8 rounding changes.

Uses ``torch.ao.quantization``, which PyTorch has deprecated in favour of torchao but
still ships in the pinned 2.13; the deprecation warning is silenced here on purpose.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

from model.nn.layers import FeedForward, Linear

log = logging.getLogger("tserve.weights")
CALIBRATION = Path(__file__).with_name("calibration.txt")  # mixed prose, chat and code, written for this
SMOOTH_ALPHA = 0.5


@torch.no_grad()
def smooth_gated_ffn_(model: nn.Module, calibration_ids: Tensor, alpha: float = SMOOTH_ALPHA) -> int:
    """Rescale every gated feed-forward of ``model`` in place so the input of its ``down``
    projection has no outlier channels (see the module docstring); returns how many were
    rescaled. ``calibration_ids`` (1, T): token ids run through the model once."""
    ffns = [m for m in model.modules() if isinstance(m, FeedForward) and m.gate is not None]
    if not ffns:
        return 0
    maxima = input_maxima(model, calibration_ids, [f.down for f in ffns])
    for f in ffns:
        scale = smoothing_scale(maxima[f.down], f.down.weight, alpha)  # (d_ff,)
        f.up.weight.div_(scale[:, None].to(f.up.weight.dtype))
        if f.up.bias is not None:
            f.up.bias.div_(scale.to(f.up.bias.dtype))
        f.down.weight.mul_(scale[None, :].to(f.down.weight.dtype))
        f.up.packed = f.down.packed = None  # prepacked copies are stale
    return len(ffns)


def calibration_ids(tokenizer, limit: int = 512) -> Tensor:
    """The calibration text as (1, <= limit) token ids."""
    return torch.tensor([tokenizer.encode(CALIBRATION.read_text(encoding="utf-8"))[:limit]])


_STEP = threading.local()


@contextmanager
def decode_step_context():
    """Marks a decode step (one new token per sequence) on this thread: inside it,
    ``DecodeInt8Linear`` layers take their int8 path. The Python decode step
    (``model.decode.step.PythonStep``) enters it; prompt chunks, full forward passes and
    training never do."""
    previous = getattr(_STEP, "decoding", False)
    _STEP.decoding = True
    try:
        yield
    finally:
        _STEP.decoding = previous


class RowwiseInt8(nn.Module):
    """What the int8 projections share: ``quantized`` (a dynamic int8 ``Linear`` of fbgemm's
    packed weights) run with each row's activations quantized over the row's own range
    (``rowwise_int8_linear``), so a row's result never depends on the rows beside it; and an
    optional ``inv_scale`` (in_features,), SmoothQuant's scale applied explicitly to the input.

    ``native``: the native library's ``Int8Linear`` for these weights, attached where the
    library is loaded (``model.decode.native.attach_int8_kernels``): the same arithmetic bit for
    bit in one call, where the Python path is some fifteen tensor operations around fbgemm's
    product (at 32 rows of 512 features 125 us against 48 us; the product alone is 43 us)."""

    native = None
    blocks = False  # activations quantized per run of 32 (blockwise_int8_linear) rather than per row

    def __init__(self, quantized: nn.Module, inv_scale: Tensor | None = None):
        super().__init__()
        self.quantized = quantized
        self.register_buffer("inv_scale", inv_scale, persistent=False)

    def float_weights(self) -> tuple[int, int, bool]:
        """(out, in, has bias) of the float projection these int8 weights stand for
        (``TransformerModel.num_parameters`` counts them: they are no ``nn.Parameter``)."""
        return self.quantized.out_features, self.quantized.in_features, self.quantized.bias() is not None

    def int8(self, x: Tensor) -> Tensor:
        """The int8 projection of ``x`` (..., in), the smoothing scale included."""
        flat = x.reshape(-1, x.size(-1)).float()
        if self.native is not None:
            out = self.native.forward(flat)
        else:
            if getattr(self, "_row_sum", None) is None:
                w = self.quantized.weight()
                self._row_sum = w.dequantize().float().sum(1)
                self._bias = self.quantized.bias()
                symmetric = w.qscheme() == torch.per_channel_affine and not w.q_per_channel_zero_points().any()
                self._ints = w.int_repr().float() if self.blocks and symmetric and w.shape[1] % 32 == 0 else None
                self._scales = w.q_per_channel_scales().float() if self._ints is not None else None
            if self.inv_scale is not None:
                flat = flat * self.inv_scale
            if self._ints is not None:
                out = blockwise_int8_linear(flat, self._ints, self._scales, self._bias)
            else:
                out = rowwise_int8_linear(flat, self.quantized._packed_params._packed_params, self._row_sum, self._bias)
        return out.reshape(*x.shape[:-1], out.size(-1))


class RowwiseInt8Linear(RowwiseInt8):
    """A projection in int8 always (prompts, encoders and decode steps alike), each row quantized
    on its own: an encoder-decoder's projections under int8 (``quantize_int8_(rowwise=True)``).
    Its encoder reads a whole source at once, so the per-chunk argument for float prompts
    (``DecodeInt8Linear``) does not apply, and a row's result depends on nothing but the row:
    batched equals alone, and a full recomputation equals cached decoding. fbgemm's int8 product
    runs at ~3x the float one's rate on a source of a few thousand rows here."""

    def forward(self, x: Tensor) -> Tensor:
        return self.int8(x)


class DecodeInt8Linear(RowwiseInt8):
    """A projection kept twice: dynamic int8 for decode steps (``decode_step_context``), the float
    layer for everything else (prompt chunks, whatever their length, and full
    recomputation), so a prompt's tokens give the same K/V and logits however they are
    chunked or cached. Decoding reads every weight once per token and is bound by memory
    traffic, where int8 wins (measured 2x for SmolLM2's 576x1536 projections, ~25x for its
    576x49152 head at batch 1); a prefill chunk is bound by arithmetic, where the prepacked
    float kernel is as fast, and one per-chunk activation scale would be ruined by the
    outlier tokens a prompt starts with. The prompt's K/V are therefore exact.

    ``inv_scale`` (in_features,): the int8 path computes ``quantized(x * inv_scale)`` with
    weights whose column j was multiplied by s_j = 1 / inv_scale_j (SmoothQuant with the
    division explicit, one elementwise product per call), since the float path shares this
    layer's input and its norms cannot absorb the scale.

    Its activations are quantized per run of 32 values (``blockwise_int8_linear``), not per row:
    one 7-bit grid over a whole row left most channels a handful of levels beside the few large
    ones a norm's output has, and cost SmolLM2 most of its greedy answers (docs/benchmarks.md,
    fidelity).

    ``dense`` is None once the native step writes every prompt (``model.decode.native.
    drop_float_copies``): then every call takes the int8 path."""

    blocks = True

    def __init__(self, dense: nn.Module, quantized: nn.Module, inv_scale: Tensor | None = None):
        super().__init__(quantized, inv_scale)
        self.dense = dense

    def forward(self, x: Tensor) -> Tensor:
        if self.dense is None or getattr(_STEP, "decoding", False):  # None: dropped (drop_float_copies)
            return self.int8(x)
        return self.dense(x)


INT8_LEVELS = 127.0  # 7-bit activations, as fbgemm's dynamic linear uses on x86 (reduce_range)


def rowwise_int8_linear(x: Tensor, packed, row_sum: Tensor, bias: Tensor | None) -> Tensor:
    """``W x + b`` for x (B, in) with int8 weights (``packed``, fbgemm) and each row of ``x``
    quantized to 7 bits over its own range [min(x_i, 0), max(x_i, 0)], as fbgemm's dynamic
    linear quantizes a whole batch over one range. One range per batch made a row's result
    depend on the other rows (greedy outputs changed with the batch, and with speculative
    decoding's draft rows); one per row keeps every row as it would be alone.

    fbgemm takes one activation scale per call, so each row is mapped onto the shared grid
    first: u_i = x_i / s_i + z_i lies in [0, 127] and quantizes (scale 1, zero point 0) to the
    row's own levels; the product is then corrected back, W x_i = s_i (W u_i - z_i W 1), with
    ``row_sum`` = W 1 (the int8 weights, dequantized, summed over inputs). The same kernel, one
    pass over the weights; the native decode step does the same in C++."""
    lo = x.amin(-1, keepdim=True).clamp(max=0.0)
    hi = x.amax(-1, keepdim=True).clamp(min=0.0)
    scale = (hi - lo) / INT8_LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (-lo / scale).round()
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x / scale + zero, 1.0, 0, packed)
    if bias is not None:
        y = y - bias
    y = scale * (y - zero * row_sum)
    return y + bias if bias is not None else y


def blockwise_int8_linear(x: Tensor, ints: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """``W x + b`` for x (B, K) with symmetric per-output int8 weights (``ints`` (N, K) as floats,
    ``scales`` (N,)) and each run of 32 values of a row quantized to [-127, 127] on its own scale
    (``model.quant.q4.quantize_activations``, as GGUF's Q8_0 does): the maths of the native
    kernel (csrc/int8_blocks.cpp), y_j = ws_j sum_u s_u (w_j . r)_u. The per-run dot products are
    integers below 2^24, exact in float32; the sum over runs rounds differently from the kernel's
    one fused multiply-add per run, so the two agree to float rounding, not bit for bit."""
    from model.quant.q4 import RUN, quantize_activations

    b, k = x.shape
    r, s = quantize_activations(x)
    dots = torch.einsum("bur,nur->bnu", r.reshape(b, k // RUN, RUN), ints.reshape(-1, k // RUN, RUN))
    y = (dots * s.unsqueeze(1)).sum(-1) * scales
    return y + bias if bias is not None else y


@torch.no_grad()
def input_maxima(model: nn.Module, calibration_ids: Tensor,
                 layers: list[nn.Module] | None = None) -> dict[nn.Module, Tensor]:
    """max |x_j| over the calibration tokens of the input of each of ``layers`` (default:
    every ``Linear`` of ``model``), from one forward pass."""
    amax: dict[nn.Module, Tensor] = {}

    def record(layer: nn.Module):
        def hook(_module, args):
            x = args[0].detach().abs().reshape(-1, args[0].size(-1)).amax(0).float()
            amax[layer] = torch.maximum(amax[layer], x) if layer in amax else x
        return hook

    if layers is None:
        layers = [m for m in model.modules() if isinstance(m, Linear)]
    handles = [m.register_forward_pre_hook(record(m)) for m in layers]
    try:
        model.eval()
        model(calibration_ids.to(model.device))
    finally:
        for h in handles:
            h.remove()
    return amax


def smoothing_scale(x_max: Tensor, weight: Tensor, alpha: float = SMOOTH_ALPHA) -> Tensor:
    """SmoothQuant's per-input-channel s_j = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha)."""
    w_max = weight.detach().abs().amax(0).float().clamp(min=1e-5)
    return (x_max.clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)).clamp(min=1e-3)


def quantize_int8_(model: nn.Module, calibration: Tensor | None = None, decode_only: bool = False,
                   alpha: float = SMOOTH_ALPHA, rowwise: bool = False) -> int:
    """Swap every projection of ``model`` for a dynamic int8 one, in place.

    The trailing underscore says so, as in torch (``add_``, ``zero_``): ``model`` itself is
    changed (put in eval mode, its ``Linear`` layers replaced) and nothing new is built. The
    return value is only a count of the replaced projections, for logs and tests; there is
    no quantized copy to use. CPU only; the embeddings, norms and the output projection of
    gated feed-forwards stay in floating point unless ``calibration`` token ids (1, T) are
    given: those projections are then smoothed with them (``smooth_gated_ffn_``) and
    quantized too, so every projection and the output head run in int8. ``decode_only``
    keeps the float layers as well and uses int8 only for decode steps (``DecodeInt8Linear``:
    more memory, exact prompts); with ``calibration`` every projection (the head included) is
    then smoothed on its own input, the scale applied explicitly on the int8 path. ``rowwise``
    (without ``decode_only``): every projection int8 always, each row quantized on its own
    (``RowwiseInt8Linear``: an encoder-decoder's), in place of one range per call.
    """
    import torch.ao.nn.quantized.dynamic as nnqd
    from torch.ao.quantization import per_channel_dynamic_qconfig

    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("int8 dynamic quantization runs on the CPU only")
    model.eval()
    if not any(isinstance(m, Linear) for m in model.modules()):
        return 0  # no float projection (a GGUF read as stored): nothing to calibrate or quantize
    if decode_only and calibration is not None:  # every projection smoothed on its own input
        maxima = input_maxima(model, calibration)
        smoothed = True
    else:
        maxima = {}
        smoothed = calibration is not None and smooth_gated_ffn_(model, calibration, alpha) > 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, Linear)
               and (smoothed or not (isinstance(parent, FeedForward) and parent.gate is not None and name == "down"))]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecated.*")
        for parent, name, child in targets:
            plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
            plain.weight, plain.bias = child.weight, child.bias  # shares storage: no copy
            scale = smoothing_scale(maxima[child], child.weight, alpha) if child in maxima else None
            if scale is not None:
                plain.weight = nn.Parameter(child.weight.detach() * scale.to(child.weight.dtype)[None, :])
            plain.qconfig = per_channel_dynamic_qconfig
            quantized = nnqd.Linear.from_float(plain)
            inv = None if scale is None else (1.0 / scale).to(child.weight.dtype)
            if decode_only:
                layer = DecodeInt8Linear(child, quantized, inv)
            else:
                layer = RowwiseInt8Linear(quantized, inv) if rowwise else quantized
            setattr(parent, name, layer)
    return len(targets)


# --- the int8 copies of a model kept beside its converted weights (model.formats.import_cache) ----

def _decode_copies(model: nn.Module) -> dict[str, DecodeInt8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, DecodeInt8Linear)}


def save_decode_copies(model: nn.Module, file: Path) -> None:
    """Write the int8 decode copies of ``model`` (per-channel int8 weights, their scales and
    zero points, the smoothing ``inv_scale``) to ``file``, atomically (a temporary file renamed)."""
    from safetensors.torch import save_file

    tensors = {}
    for name, layer in _decode_copies(model).items():
        qweight, _ = layer.quantized._weight_bias()
        tensors[f"{name}.int8"] = qweight.int_repr().contiguous()
        tensors[f"{name}.scales"] = qweight.q_per_channel_scales().contiguous()
        tensors[f"{name}.zero_points"] = qweight.q_per_channel_zero_points().contiguous()
        if layer.inv_scale is not None:
            tensors[f"{name}.inv_scale"] = layer.inv_scale.contiguous()
    tmp = file.with_name(f".{file.name}.{os.getpid()}")
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def load_decode_copies_(model: nn.Module, file: Path) -> int:
    """Give every projection of ``model`` its int8 decode copy from ``file`` (written by
    ``save_decode_copies`` for the same weights): what ``quantize_int8_(decode_only=True)``
    computes, without the calibration pass and the quantization. Raises ValueError when the
    file does not fit the model (the caller quantizes instead)."""
    import torch.ao.nn.quantized.dynamic as nnqd
    from safetensors import safe_open

    targets = [(parent, name, child, f"{prefix}.{name}" if prefix else name) for prefix, parent in model.named_modules()
               for name, child in parent.named_children() if isinstance(child, Linear)]
    with safe_open(str(file), framework="pt") as f:
        stored = set(f.keys())
        expected = {f"{q}.{k}" for *_, q in targets for k in ("int8", "scales", "zero_points")}
        if not expected <= stored or len(stored - expected) > len(targets):
            raise ValueError(f"{file}: holds other layers than this model's {len(targets)} projections")
        built = []
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deprecated.*")
            for parent, name, child, q in targets:
                int8 = f.get_tensor(f"{q}.int8")
                if tuple(int8.shape) != (child.out_features, child.in_features):
                    raise ValueError(f"{file}: {q} has shape {list(int8.shape)}")
                qweight = torch._make_per_channel_quantized_tensor(
                    int8, f.get_tensor(f"{q}.scales"), f.get_tensor(f"{q}.zero_points"), 0)
                # Built 1x1, then given the real weights: the constructor would otherwise prepack a zero
                # matrix of the full size twice before set_weight_bias packs the real one (2/3 of the time).
                quantized = nnqd.Linear(1, 1, dtype=torch.qint8)
                quantized.in_features, quantized.out_features = child.in_features, child.out_features
                quantized.set_weight_bias(qweight, child.bias)  # as from_float does
                inv = f.get_tensor(f"{q}.inv_scale") if f"{q}.inv_scale" in stored else None
                built.append((parent, name, DecodeInt8Linear(child, quantized, inv)))
    model.eval()
    for parent, name, layer in built:  # only once every layer read: a bad file leaves the model as it was
        setattr(parent, name, layer)
    return len(built)


def wants_int8(mode: str, config, device: str) -> bool:
    """The service's ``TSERVE_QUANTIZE``: ``int8`` for every model, ``none`` for none, ``auto``
    (the default) on the CPU for the Llama architecture (decoder-only, gated feed-forward), where
    decoding is bound by reading weights and int8 halves what a step reads, and for
    encoder-decoders (row-wise int8 everywhere: translate-en-de scored the same as float32 on its
    three held-out sets, within 0.1 chrF, at 2.4-2.6x the speed; docs/benchmarks.md)."""
    if mode == "auto":
        if device != "cpu":
            return False
        return config.family == "encoder-decoder" or (config.family == "decoder" and config.mlp == "gated")
    return mode == "int8"


def quantize_checkpoint_(model: nn.Module, tokenizer) -> int:
    """``quantize_int8_`` as the service applies it: decoder-only models keep float prompts and
    decode in int8 (``decode_only``), gated feed-forwards smoothed on the calibration text;
    encoder-decoders run every projection in int8, each row on its own range (``rowwise``:
    the encoder reads whole sources, not chunks of a cached prompt); encoder-only models (no
    decode steps) run every projection in int8.

    A generative model read from a converted-weights cache entry (``weights_cache_dir``, set by
    model.formats.import_cache) keeps its int8 copies there, keyed by this file, the calibration
    text, torch's version and the weights' dtype: a later start loads them instead of
    calibrating and quantizing again (Gemma 3 270M: ~12 s of a start on 2 cores)."""
    cfg = model.cfg
    encdec = cfg.family == "encoder-decoder"
    cached = _decode_copies_file(model) if cfg.has_decoder and not encdec else None  # decode copies only
    if cached is not None and cached.is_file():
        try:
            return load_decode_copies_(model, cached)
        except Exception as exc:  # noqa: BLE001 - a bad file is quantized again, never used
            log.warning("int8 copies in %s cannot be used (%s: %s); quantizing again", cached, type(exc).__name__, exc)
    gated = cfg.mlp == "gated" and tokenizer is not None and not encdec  # calibration runs a decoder-only model
    calibration = calibration_ids(tokenizer, limit=min(512, cfg.max_positions)) if gated else None
    count = quantize_int8_(model, calibration, decode_only=cfg.has_decoder and not encdec, rowwise=encdec)
    if cached is not None:
        try:
            save_decode_copies(model, cached)
            for old in cached.parent.glob("int8-*.safetensors"):
                if old != cached:
                    old.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot keep the int8 copies in %s (%s)", cached, exc)
    return count


def _decode_copies_file(model: nn.Module) -> Path | None:
    directory = getattr(model, "weights_cache_dir", None)
    if directory is None:
        return None
    digest = hashlib.sha256()
    for part in (Path(__file__).read_bytes(), CALIBRATION.read_bytes(), torch.__version__.encode(),
                 str(next(model.parameters()).dtype).encode(), str(SMOOTH_ALPHA).encode()):
        digest.update(part + b"\0")
    return Path(directory) / f"int8-{digest.hexdigest()[:16]}.safetensors"
