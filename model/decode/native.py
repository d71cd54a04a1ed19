"""A native (C++) decode step for Llama-architecture decoders on the CPU (``TSERVE_NATIVE_DECODE``).

Why: a decode step of SmolLM2-135M at batch 1 reads ~134 MB of int8 weights, ~5 ms at this
machine's bandwidth, yet the eager step took ~22 ms (and an inductor-compiled one, since
removed, ~18 ms): the rest is the interpreter and the dispatcher around ~40 small operators per
layer (norms, RoPE, cache index arithmetic, masks, SiLU, residuals, smoothing scales). llama.cpp pays none of that.

How: ``model/decode/csrc/`` holds the whole step (embedding lookup, 30 layers, final norm, head;
its files split by kind of kernel, ``csrc/common.h`` lists them) in one C++ object built once per
model from its weights. The projections call
the very kernels the eager int8 path calls (fbgemm's dynamic int8 linear through the packed
weights ``DecodeInt8Linear`` holds, or ``at::linear`` for float layers); everything between
them is plain loops over float32 rows. Attention reads each row's blocks in place (its block
table names them), over exactly its positions (no span bucket, no mask, no gather), with a group's query heads
sharing the K/V they read, one (row, K/V head) item per thread; AVX-512 loops where the CPU
has them (chosen at run time), over a float32 or bfloat16 cache.

The maths is the eager step's; only float rounding differs (the attention sums, the norms).
Tests hold it to the eager path in float32 and bfloat16, and in int8 to the same distance from
float32 (``tests/model/decode/test_native_decode.py``, ``tests/model/formats/test_smollm2.py``).

Built with torch's C++ extension machinery on first use (needs a C++ compiler and ninja;
~1 min on 2 quiet cores, then cached under ``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), or loaded prebuilt (``build(library)``; ``main`` builds one).
Where neither works, ``wants_native`` says why in the log and the model keeps the Python step.
Which models it can run is decided with every other fast path in ``model/decode/support.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from model.decode.support import unsupported_reason as config_unsupported_reason
from model.decode.threads import SMALL_DECODE, decode_threads, passive_wait
from model.nn.kv_cache import PagedKVCache
from model.nn.layers import Linear
from model.nn.transformer import DecoderLM, EncoderDecoder
from model.quant import q4
from model.quant.int8 import DecodeInt8Linear, RowwiseInt8, RowwiseInt8Linear
from model.quant.kquant import KQuantLinear, StoredEmbedding

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # every .cpp here is compiled into the one library
_BUILD_LOCK = threading.Lock()
_BUILD: dict[str, object] = {}  # "seconds" it took, or "error": why, once tried in this process
LIBRARY_ENV = "TSERVE_NATIVE_LIBRARY"  # a prebuilt library every caller of build() loads (the container's)
_DEFAULT_LIBRARY: dict[str, str] = {}


def use_library(library: str | Path | None) -> None:
    """Make ``library`` (a prebuilt one) what ``build()`` loads when its caller names none (the
    service's ``TSERVE_NATIVE_LIBRARY``, which may come from a .env file): the GGUF import asks
    for the block kernels before any decode step is chosen, and the first call in a process decides."""
    if library:
        _DEFAULT_LIBRARY["path"] = str(library)
    else:
        _DEFAULT_LIBRARY.pop("path", None)


def default_library() -> str:
    """The prebuilt library ``build()`` loads when none is named: ``use_library``'s, else the
    ``TSERVE_NATIVE_LIBRARY`` environment variable's, else none (compile on this machine)."""
    return _DEFAULT_LIBRARY.get("path") or os.environ.get(LIBRARY_ENV, "")


# -march=native: built for the vector units of the machine it runs on, as inductor's kernels
# are (measured ~5% faster at batch 8-32 than a generic x86-64 build, equal at batch 1). A
# portable build (for an image that may run on another CPU) leaves it out. -ffp-contract=off: the
# compiler fuses no multiply and add the source does not (it would where the build targets FMA,
# and not in a portable build), so the plain loops give the same bits in every build and the
# vector kernels, which fuse exactly where the plain loops call std::fma, give them too.
# -fno-trapping-math: no program of ours reads floating-point exception flags, and without it GCC
# keeps the activation loops (act_row: std::floor inside fast_exp) scalar, a value at a time (4 %
# of a 2,000-token prompt, ~9 % of a 32-row step). It changes no value: no operation is added,
# removed, reordered or fused (that would take -ffast-math's other parts, which stay off).
NATIVE_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-DNDEBUG"]
PORTABLE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-DNDEBUG"]


def build(library: str | Path | None = None) -> float:
    """Load the extension: the prebuilt ``library`` (a path; the container ships one, built by
    ``main``), else this machine's build (compiled on first use, then cached); returns the
    seconds the first (deciding) call in this process took. Raises RuntimeError naming why
    it is not available here."""
    with _BUILD_LOCK:
        if "error" in _BUILD:
            raise RuntimeError(str(_BUILD["error"]))
        if "seconds" in _BUILD:
            return float(_BUILD["seconds"])
        start = time.perf_counter()
        try:
            prebuilt = str(library or default_library())
            if prebuilt:
                torch.ops.load_library(prebuilt)
            else:
                compile_library(library_name(), NATIVE_FLAGS)
        except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: all mean "not here"
            detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
            where = f" from {prebuilt}" if prebuilt else ""
            _BUILD["error"] = f"the native decode step could not be loaded{where}: {type(exc).__name__}: {detail}"
            raise RuntimeError(str(_BUILD["error"])) from exc
        _BUILD["seconds"] = time.perf_counter() - start
        return float(_BUILD["seconds"])


def compile_library(name: str, flags: list[str], build_directory: Path | None = None) -> Path:
    """Compile the extension as ``name`` (into ``build_directory``, default torch's cache) and
    load it; returns the library's path."""
    from torch.utils import cpp_extension

    if build_directory is not None:
        build_directory.mkdir(parents=True, exist_ok=True)
    folder = build_directory or Path(cpp_extension._get_build_directory(name, verbose=False))
    clear_stale_lock(folder)
    cpp_extension.load(name=name, sources=[str(unity_source(folder))], is_python_module=False, extra_cflags=flags,
                       build_directory=str(folder), verbose=False)
    return folder / f"{name}.so"


def unity_source(folder: Path) -> Path:
    """One translation unit that includes every .cpp of ``CSRC`` (a unity build): each file of
    csrc/ re-reads ATen's headers, so compiled one by one they cost ~3.7x the CPU time of one unit
    (measured 203 s against 54 s); included into one they cost what the single file did. The files
    stay apart for reading; a helper private to one file sits in an unnamed namespace with a name
    no other file uses."""
    unit = folder / "unity.cpp"
    text = "".join(f'#include "{source}"\n' for source in sources())
    if not unit.exists() or unit.read_text() != text:
        unit.write_text(text)
    return unit


STALE_LOCK_S = 900.0  # a build takes 1-2 minutes on 2 cores; a lock this old outlived its process


def clear_stale_lock(folder: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``folder/lock`` when it is older than ``max_age_s``: torch's build lock is a bare
    file with no owner in it, so a build killed mid-way (a benchmark interrupted, a pod evicted)
    leaves one behind and every later start waits on it forever. Returns whether one was removed."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age < max_age_s:
        return False
    log.warning("removing a stale native build lock %s (%.0f s old; its build was interrupted)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def sources() -> list[Path]:
    """The .cpp files compiled (each with the headers beside it)."""
    return sorted(CSRC.glob("*.cpp"))


def source_digest() -> bytes:
    """Every source and header in ``CSRC``, named and in order: a changed header is a new build
    (torch's own check of a cached build reads only the .cpp files it was given)."""
    files = sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])
    return b"".join(f.name.encode() + b"\0" + f.read_bytes() + b"\0" for f in files)


def library_name() -> str:
    """The cached build's name: the CPU it was built for, the sources it was built from and the
    torch it was built against (version and install), so a cache moved to another CPU, a newer
    source beside an older build (two versions of the service on one host, an upgrade), or two
    venvs sharing the cache never load (or keep rebuilding over) a library built for something else."""
    against = f"{torch.__version__} {Path(torch.__file__).resolve().parent}"
    source = hashlib.blake2b(source_digest() + " ".join(NATIVE_FLAGS).encode() + against.encode(),
                             digest_size=4).hexdigest()
    return f"tserve_native_llama_{_cpu_tag()}_{source}"


def _cpu_tag() -> str:
    """A short hash of this CPU's model and feature flags (Linux; "any" elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "any"
    lines = sorted({line for line in text.splitlines() if line.startswith(("flags", "model name", "vendor_id"))})
    return hashlib.blake2b("\n".join(lines).encode(), digest_size=6).hexdigest()


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``NativeStep`` cannot run ``model`` (None: it can): its config (``model.decode.support.FIELDS``),
    then where its weights are (float32, on the CPU)."""
    if not isinstance(model, DecoderLM):
        return f"{type(model).__name__} is not a decoder-only model"
    why = config_unsupported_reason(model.cfg, "native")
    if why is not None:
        return why
    if model.device.type != "cpu":
        return f"the model is on {model.device} (CPU only)"
    if model.dtype != torch.float32:
        return f"the model is {model.dtype} (float32 only)"
    return None


class NativeDecodeAttention:
    """The native library's paged decode attention (csrc: ``paged_decode_attention``) as an
    attention layer's decode path (``AttentionContext.decode_kernel``) in the Python step on the
    CPU: each row attends over its own positions read from the block pool where they lie, the
    native step's attention. It replaces, on every layer of every decode step, a gather of
    every row's history into a padded copy (twice: K and V) and SDPA over that copy with a
    length mask: on the CPU an encoder-decoder's step spent ~30% of its time in those copies
    (the translation profile in docs/benchmarks.md). A row's result never depends on the rows
    beside it. Only float rounding differs from SDPA (tested against the reference)."""

    mode = "native"

    def applies(self, q: Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype == torch.float32 and q.size(-1) <= 512

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor,
                 scale: float, window: int = 0) -> Tensor | None:
        # k_cache, v_cache: (blocks, nkv, block_len, hs) views of the layer's (nkv, blocks, ...) pool
        return torch.ops.tserve_native.paged_decode_attention(
            q, k_cache.transpose(0, 1), v_cache.transpose(0, 1), tables, lengths, float(scale), int(window))

    def cross(self, q: Tensor, k_mem: Tensor, v_mem: Tensor, slots: Tensor, lengths: Tensor, scale: float) -> Tensor:
        """An encoder-decoder's cross-attention, one new token per row: q (B, nh, hs) over the
        memory rows ``slots`` (B,) of k_mem, v_mem (slots, nh, S, hs), each over its source's
        ``lengths`` (B,) tokens -> (B, nh, hs). SDPA read a (B, nh, S, hs) slice with a padding mask."""
        return torch.ops.tserve_native.cross_decode_attention(q, k_mem, v_mem, slots, lengths, float(scale))


def native_attention(mode: str, device: torch.device, library: str | Path | None = None
                     ) -> NativeDecodeAttention | None:
    """The native decode attention for a Python step on ``device`` under ``TSERVE_DECODE_ATTENTION``
    ``mode``: ``native`` (an error naming why it cannot run here), ``auto`` (on the CPU where the
    library builds; where it does not, a warning and SDPA), else None."""
    if mode not in ("auto", "native"):
        return None
    if device.type != "cpu":
        if mode == "native":
            raise ValueError(f"decode attention 'native' runs on the CPU, and the model is on {device}")
        return None
    try:
        build(library)
    except RuntimeError as exc:
        if mode == "native":
            raise ValueError(f"decode attention 'native' cannot run here: {exc}") from exc
        log.warning("%s; decode attention through SDPA", exc)
        return None
    return NativeDecodeAttention()


def attach_int8_kernels(model: nn.Module) -> int:
    """Give every row-wise int8 projection of ``model`` (``RowwiseInt8``: an encoder-decoder's, and
    the decode copies a Python step runs) the native library's ``Int8Linear`` over its weights
    (the library loaded): bit for bit the Python path's result, in one call. Returns how many.
    Idempotent."""
    count = 0
    for layer in model.modules():
        if isinstance(layer, RowwiseInt8) and layer.native is None:
            inv = None if layer.inv_scale is None else layer.inv_scale.float()
            layer.native = torch.classes.tserve_native.Int8Linear(layer.quantized._packed_params._packed_params, inv,
                                                                  layer.blocks)
            count += 1
    return count


def wants_native(mode: str, model: nn.Module, library: str | Path | None = None) -> bool:
    """``TSERVE_NATIVE_DECODE``: ``off``; ``on`` (a model it cannot run, or a machine it cannot be
    built on, is an error naming why); ``auto`` (the default): where it can run, decode steps
    are int8 (where it was measured) and it builds. An encoder-decoder's native step is
    ``NativeEncDecStep`` (its own rules: ``encdec_unsupported_reason``), a decoder's ``NativeStep``."""
    if mode == "off":
        return False
    encdec = isinstance(model, EncoderDecoder)
    why = encdec_unsupported_reason(model) if encdec else unsupported_reason(model)
    if mode == "on":
        if why is not None:
            raise ValueError(f"TSERVE_NATIVE_DECODE=on: {why}")
        build(library)  # an error naming why, where it cannot be built
        return True
    if why is not None or not (encdec or any(isinstance(m, (DecodeInt8Linear, KQuantLinear)) for m in model.modules())):
        return False
    try:
        build(library)
    except RuntimeError as exc:
        log.warning("%s; decoding with the Python step", exc)
        return False
    return True


# With a partner thread (csrc: Partner) every step, decode rows or a prompt's, runs on one
# intra-op thread and the partner rather than on OpenMP's sleeping threads. Measured against
# two passive OpenMP threads (SmolLM2, 2 cores, tokens identical): decode steps 1.24x faster at
# batch 1, 1.39x at 8, 1.38x at 32; a 1,000-token prompt 1.42x (the partner takes every other
# attention item, where OpenMP's static halves gave the later, longer rows to one thread).
PARTNER_ROWS = 1 << 30

# A prompt chunk of at least this many rows of one sequence attends as a block (csrc:
# attend_block: over a bfloat16 cache with the CPU's AVX512-BF16 dot products, attend_block_bf16,
# where it has them, else torch's CPU flash attention over its keys gathered once; on a layer with
# a window, one wider than a 256-row block) instead of row by row; 0 = row by row always. 0 by
# default: a block's rounding depends on where the chunk starts and how long it is, so a prompt
# computed whole, in chunks or after a prefix-cache hit got different last bits, and at a near
# tie another greedy token. Row by row, each row's attention is one fixed arithmetic (csrc
# attention.cpp) whatever the call; rows of one sequence share each key tile they read.
PROMPT_ATTENTION_ROWS = 0

# The gate activations the C++ step implements, by its codes (csrc: enum Activation).
ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_new": 1}


# How a LlamaDecoder's int8 projections quantize their input (csrc: use_int8_blocks takes the index).
INT8_ACTIVATIONS = ("rows", "runs-decode", "runs")


class NativeStep:
    """A ``DecodeStep`` over the C++ step. Build it once the weights are final (quantized): it
    holds the projections' kernels and copies of the norms as they are now."""

    name = "native"

    def __init__(self, model: nn.Module, library: str | Path | None = None, kv_dtype: torch.dtype = torch.bfloat16,
                 prefills: bool = True, partner: bool | None = None, weights4: bool = True, lean: bool = False,
                 activations: str = "runs"):
        """``prefills``: the engine writes prompts through ``prefill`` too (else the model's own
        float forward does). ``partner``: steps of a few rows split each int8 projection with a
        second thread; default: under a passive OpenMP wait policy with more than one thread.
        ``activations``: how the int8 projections quantize their input: ``runs`` (the default: 8 bits
        per run of 32 values, decode steps and prompts alike), ``runs-decode`` (per run in decode
        steps, one 7-bit grid per row in prompts: fbgemm's product) or ``rows`` (per row
        throughout, as before; for comparisons, benchmarks.studies.fidelity).
        ``weights4``: an int8 projection whose float weights are 4-bit runs already (a GGUF Q4_0 /
        Q4_1 file; ``model.quant.q4``) gets them too: decode steps read the 4-bit weights, prompts
        the int8 ones. ``lean`` (what ``prepare`` asks where this step writes the prompts): once the
        step is built, the model keeps only what it reads (``drop_float_copies``, then
        ``halve_embeddings``)."""
        why = unsupported_reason(model)
        if why is not None:
            raise ValueError(f"no native decode step for this model: {why}")
        if activations not in INT8_ACTIVATIONS:
            raise ValueError(f"activations={activations!r}; expected one of {list(INT8_ACTIVATIONS)}")
        if kv_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the native decode step needs a float32 or bfloat16 KV cache, not {kv_dtype}")
        self.kv_dtype, self.prefills = kv_dtype, prefills
        self.build_seconds = build(library)
        cfg = model.cfg
        first = model.decoder_layers[0]
        eps = first.self_attn_norm.eps if first.self_attn_norm.eps is not None else torch.finfo().eps
        plan = torch.classes.tserve_native.LlamaDecoder(cfg.n_heads, cfg.kv_heads, cfg.head_dim, float(eps),
                                                       float(first.self_attn.scale))
        # Under a passive wait policy each step runs on one intra-op thread and shares each int8
        # projection and its attention with a second thread of the step's own (csrc: Partner):
        # the other core's memory bandwidth at batch 1, without OpenMP's sleeping threads.
        self.partner = partner if partner is not None else passive_wait() and torch.get_num_threads() > 1
        plan.use_partner(self.partner)
        plan.use_int8_blocks(INT8_ACTIVATIONS.index(activations))
        self.one_thread_rows = PARTNER_ROWS if self.partner else SMALL_DECODE
        with torch.no_grad():
            _set_model(plan, model)
            # What the lineages after Llama add, as data (support.py lists what is implemented).
            plan.set_features(float(model.embed.scale), ACTIVATIONS[cfg.activation],
                              getattr(model.embed, "rope_local", None))
            self.extra_bytes = 0  # what the step holds beyond the model's tensors: the partner's halves, 4-bit runs
            self.weights4 = 0  # projections whose decode steps read 4-bit weights
            for layer in model.decoder_layers:
                attn, ffn = layer.self_attn, layer.ffn
                plan.add_layer(layer.self_attn_norm.weight, layer.ffn_norm.weight)
                norms = [None if n is None else n.weight
                         for n in (attn.q_norm, attn.k_norm, layer.self_attn_post_norm, layer.ffn_post_norm)]
                plan.set_layer_features(*norms, int(cfg.sliding_window or 0) if attn.window else 0,
                                        bool(attn.local_rope))
                for proj in (attn.qkv_proj, attn.out_proj, ffn.gate, ffn.up, ffn.down):
                    self.extra_bytes += self._add(plan, proj, weights4)
            self.extra_bytes += self._add(plan, model.lm_head.proj, weights4)
        # Prompts attend as blocks from PROMPT_ATTENTION_ROWS rows of one sequence on: bit for bit
        # one decode step per token below that, float (or bfloat16 product) rounding above.
        plan.set_prompt_attention(PROMPT_ATTENTION_ROWS)
        self.plan = plan
        if lean:
            drop_float_copies(model)
            if halve_embeddings(model):
                with torch.no_grad():
                    _set_model(plan, model)

    def _add(self, plan, layer: nn.Module, weights4: bool) -> int:
        """Hands ``layer`` to the C++ step (``_add_projection``), with its 4-bit runs too where it is
        an int8 projection whose float weights are 4-bit runs already. Returns the bytes of what
        the step holds beyond the model's tensors."""
        extra = _add_projection(plan, layer, self.partner)
        if weights4 and isinstance(layer, DecodeInt8Linear) and layer.dense is None:
            raise ValueError("the 4-bit weights are read from the float weights, which an earlier prepare "
                             "(prefill='auto' under the native step) dropped; load the model again, or weights='int8'")
        runs = q4.exact(layer.dense.weight) if weights4 and isinstance(layer, DecodeInt8Linear) else None
        if runs is None:
            return extra
        packed = q4.pack_q4(*runs)
        n, k = layer.dense.weight.shape
        plan.attach_q4(packed, n, k, None if layer.dense.bias is None else layer.dense.bias.detach().float())
        self.weights4 += 1
        return extra + packed.numel()

    def __call__(self, cache: PagedKVCache, tokens: Tensor, slots: Sequence[int], positions: Sequence[int]) -> Tensor:
        """tokens (B,) at ``positions`` of rows ``slots`` -> logits (B, V) float32."""
        positions, tables = _tables(cache, slots, positions)
        with decode_threads(len(positions), self.one_thread_rows):
            return self.plan.step(tokens.view(-1), cache.k, cache.v, tables, positions)

    def prefill(self, cache: PagedKVCache, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                starts: Sequence[int] | None = None) -> Tensor:
        """``DecoderLM.prefill`` through the C++ step (the same contract): each prompt (or chunk
        continuing at its start) goes in as rows of its slot at consecutive positions, and the
        logits (B, V) after each prompt's last token come back. The rows are quantized one by one
        (per-row int8), so a prompt's cache and logits do not depend on the prompts beside it."""
        last = list(itertools.accumulate(len(p) for p in prompts))
        return self.prefill_rows(cache, prompts, slots, [n - 1 for n in last], starts)

    def replay(self, cache: PagedKVCache, prompts: Sequence[Sequence[int]], slots: Sequence[int],
               starts: Sequence[int]) -> Tensor:
        """``prefill``, each row computed as a decode step computes it (4-bit weights where a
        projection has them, not the prompts' int8 ones): a preempted sequence's output written
        again with the bits its decode steps wrote."""
        last = list(itertools.accumulate(len(p) for p in prompts))
        return self.prefill_rows(cache, prompts, slots, [n - 1 for n in last], starts, decoded=True)

    def prefill_rows(self, cache: PagedKVCache, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                     logit_rows: Sequence[int], starts: Sequence[int] | None = None, decoded: bool = False) -> Tensor:
        """``prefill``, with the logits of any of the rows (indices into the prompts' tokens laid
        end to end) coming back, (len(logit_rows), V) float32, in that order: what scoring the
        tokens of a text needs (``model.encoder.rescore``). ``decoded``: see ``replay``."""
        starts = list(starts or [0] * len(prompts))
        ids = [t for p in prompts for t in p]
        rows = [s for p, s in zip(prompts, slots) for _ in p]
        positions = [st + i for p, st in zip(prompts, starts) for i in range(len(p))]
        positions, tables = _tables(cache, rows, positions)
        tokens = torch.tensor(ids, dtype=torch.long)
        with decode_threads(len(ids), self.one_thread_rows):
            run = self.plan.replay if decoded else self.plan.prefill
            return run(tokens, cache.k, cache.v, tables, positions, [int(r) for r in logit_rows])

def drop_float_copies(model: nn.Module) -> None:
    """Frees what a decoder-only model under the native step's prefill never reads again: the
    float layer of each int8 projection (``DecodeInt8Linear.dense``: a float copy the int8
    quantization kept for float prompts; Gemma 3's cloned 640 MB output head among them) and the
    prepacked float copies of the other projections (``Linear.packed``). The step holds the int8
    weights, the norms and the embedding, which stay. The model's own forward still runs
    afterwards, each projection in int8 (``DecodeInt8Linear.forward``), and the step's logits
    do not change (tested). Float weights read from a memory-mapped file give their pages back
    (``_forget_pages``)."""
    dropped = []
    for module in model.modules():
        if isinstance(module, DecodeInt8Linear) and module.dense is not None:
            dropped.append(module.dense.weight)
            module.dense = None
        elif isinstance(module, Linear):
            module.packed = None
    live = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    # a tied output head's float layer is the embedding table, which stays
    _forget_pages([t for t in dropped if t.untyped_storage().data_ptr() not in live])


def float_copies_dropped(model: nn.Module) -> bool:
    return any(isinstance(m, DecodeInt8Linear) and m.dense is None for m in model.modules())


def halve_embeddings(model: nn.Module) -> bool:
    """Keeps a float32 model's token embeddings in bfloat16 (``Embeddings.compute_dtype`` float32:
    rows are widened as they are read, by the step and by the model's forward alike). A step
    reads one row per token, so the table is memory, not traffic: Gemma 3 270M's 262,144 x 640
    table is 640 MiB in float32. Only where nothing else holds the table (an output head tied
    to it and still float is not halved). Returns whether it did."""
    tokens = model.embed.tokens
    if not isinstance(tokens, nn.Embedding):  # GGUF blocks read as stored: smaller already
        return False
    holders = [p for _, p in model.named_parameters(remove_duplicate=False) if p is tokens.weight]
    if tokens.weight.dtype != torch.float32 or len(holders) != 1:
        return False
    old = tokens.weight
    tokens.weight = nn.Parameter(old.detach().to(torch.bfloat16), requires_grad=False)
    model.embed.compute_dtype = torch.float32
    _forget_pages([old])
    return True


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges this process maps from files (Linux: /proc/self/maps); [] elsewhere."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            lo, hi = fields[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def _forget_pages(tensors: list[Tensor]) -> None:
    """For tensors being dropped whose bytes are a file's memory-mapped pages (a converted
    checkpoint read from the weights cache, model.formats.import_cache): tells the kernel the
    pages wholly inside them will not be read again (``madvise(MADV_DONTNEED)``). Otherwise
    they stay resident as long as any other tensor of that file lives (measured: Gemma 3 270M's
    process 2,218 MiB -> 1,516 MiB). Only file-backed pages: read again, they would come back from
    the file unchanged; heap pages are left to the allocator, which frees them with the tensor."""
    import ctypes
    import mmap

    mappings = _file_mappings()
    if not mappings:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    for t in tensors:
        start = t.data_ptr()
        first, last = -(-start // page) * page, (start + t.numel() * t.element_size()) // page * page
        if last > first and any(lo <= first and last <= hi for lo, hi in mappings):
            libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)  # MADV_DONTNEED


def _tables(cache: PagedKVCache, slots: Sequence[int], positions: Sequence[int]
            ) -> tuple[list[int], Tensor]:
    """The checked positions and each row's block table (B, blocks), on the host."""
    positions = [int(p) for p in positions]
    if max(positions) >= cache.max_len:
        raise ValueError(f"sequence length {max(positions) + 1} exceeds the KV cache's max_len {cache.max_len}")
    if cache.k.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the native decode step needs a float32 or bfloat16 KV cache, not {cache.k.dtype}")
    rows = [int(s) for s in slots]
    if min(rows) < 0 or max(rows) >= cache.n_slots:
        raise IndexError(f"slots {[s for s in rows if not 0 <= s < cache.n_slots]} out of range "
                         f"[0, {cache.n_slots})")
    furthest: dict[int, int] = {}  # a prompt's rows share a slot: one check per slot
    for slot, p in zip(rows, positions):
        furthest[slot] = max(p, furthest.get(slot, p))
    for slot, p in furthest.items():
        if cache.held(slot) <= p and not cache.ensure(slot, p + 1):  # a bare cache; the engine allocated
            raise RuntimeError(f"the KV cache's pool of {cache.n_blocks} blocks is exhausted")
    cache.zero_fresh()  # blocks just allocated, before the step writes them
    width = -(-(max(positions) + 1) // cache.block_len)
    return positions, cache.tables[rows, :width]  # (B, blocks) on the host, where the step reads it


# The activations the encoder-decoder step implements, by its codes (csrc: EncDecDecoder::activate).
ENCDEC_ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_new": 2, "silu": 3, "swish": 3}


def encdec_unsupported_reason(model: nn.Module) -> str | None:
    """Why the native encoder-decoder step cannot run ``model``; None where it can: its config
    passes support.py's ``native_encdec`` rules, it is float32 on the CPU, and every projection
    of its decoder and head is a row-wise int8 one (``quantize_int8_(rowwise=True)``)."""
    if not isinstance(model, EncoderDecoder):
        return f"{type(model).__name__} is not an encoder-decoder"
    why = config_unsupported_reason(model.cfg, "native_encdec")
    if why is not None:
        return why
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"the model is {model.dtype} on {model.device} (float32 on the CPU only)"
    if not all(isinstance(p, RowwiseInt8Linear) for layer in model.decoder_layers for p in _encdec_projections(layer)) \
            or not isinstance(model.lm_head.proj, RowwiseInt8Linear):
        return "its decoder's projections are not row-wise int8 (TSERVE_QUANTIZE)"
    return None


def _encdec_projections(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's projections in the order ``EncDecDecoder`` takes them."""
    attn, cross, ffn = layer.self_attn, layer.cross_attn, layer.ffn
    qkv = [attn.qkv_proj] if attn.fused else [attn.q_proj, attn.k_proj, attn.v_proj]
    return [*qkv, attn.out_proj, cross.q_proj, cross.out_proj, ffn.up, ffn.down]


class NativeEncDecStep:
    """A ``DecodeStep`` over the C++ encoder-decoder step (csrc: ``EncDecDecoder``): the decoder's
    layers and head in one call per step, the same operations as the Python step with the
    native library's kernels, so the same logits bit for bit (tested). The encoder and the
    cross-attention memory stay the model's own (``EncoderDecoder.prefill``): they run once per
    source. Build it once the weights are final (quantized)."""

    name = "native"

    def __init__(self, model: EncoderDecoder, library: str | Path | None = None):
        why = encdec_unsupported_reason(model)
        if why is not None:
            raise ValueError(f"no native decode step for this model: {why}")
        self.build_seconds = build(library)
        attach_int8_kernels(model)  # the encoder and the memory's projections, run by the model itself
        self.kv_dtype, self.extra_bytes = model.dtype, 0
        cfg, first = model.cfg, model.decoder_layers[0]
        plan = torch.classes.tserve_native.EncDecDecoder(
            cfg.n_heads, cfg.head_dim, float(first.self_attn.scale), float(first.cross_attn.scale),
            first.pre_norm, ENCDEC_ACTIVATIONS[cfg.activation], float(first.self_attn_norm.eps))
        embed = model.embed
        table = embed.positions.weight if cfg.positional == "learned" else embed.sinusoid
        with torch.no_grad():
            plan.set_embedding(embed.tokens.weight, float(embed.scale), table,
                               *((embed.norm.weight, embed.norm.bias) if embed.norm is not None else (None, None)))
            for layer in model.decoder_layers:
                norms = [t for n in (layer.self_attn_norm, layer.cross_attn_norm, layer.ffn_norm)
                         for t in (n.weight, n.bias)]
                plan.add_layer(norms, layer.self_attn.fused)
                for proj in _encdec_projections(layer):
                    plan.add_projection(proj.quantized._packed_params._packed_params, proj.inv_scale)
            head = model.lm_head.proj
            plan.add_projection(head.quantized._packed_params._packed_params, head.inv_scale)
            norm = model.decoder_norm
            plan.set_final_norm(*((norm.weight, norm.bias) if isinstance(norm, nn.LayerNorm) else (None, None)))
        self.plan = plan

    def __call__(self, cache: PagedKVCache, tokens: Tensor, slots: Sequence[int], positions: Sequence[int]) -> Tensor:
        """tokens (B,) at ``positions`` of rows ``slots`` -> logits (B, V) float32."""
        positions, tables = _tables(cache, slots, positions)
        rows = torch.tensor([int(s) for s in slots], dtype=torch.long)
        with decode_threads(len(positions)):
            return self.plan.step(tokens.view(-1), torch.tensor(positions, dtype=torch.long), cache.k, cache.v,
                                  tables, cache.cross_k, cache.cross_v, cache.cross_rows[rows], cache.src_lengths[rows])


def _set_model(plan, model: nn.Module) -> None:
    """The token embeddings (a float table, or GGUF blocks read as stored), final norm and rotary table."""
    tokens = model.embed.tokens
    if isinstance(tokens, StoredEmbedding):
        plan.set_model(torch.empty(0, tokens.embedding_dim), model.decoder_norm.weight, model.embed.rope)
        plan.set_embedding_blocks(tokens.raw, tokens.qtype.code)
    else:
        plan.set_model(tokens.weight, model.decoder_norm.weight, model.embed.rope)


def _add_projection(plan, layer: nn.Module, partner: bool) -> int:
    """Hands ``layer`` to the C++ step; returns the bytes of the copies it makes (with a partner,
    an int8 projection is packed again as two halves: its int8 weights, scales and zero points)."""
    if isinstance(layer, DecodeInt8Linear):
        packed = layer.quantized._packed_params._packed_params
        plan.add_int8(packed, layer.inv_scale)
        out_features, in_features = layer.quantized.out_features, layer.quantized.in_features
        return out_features * (in_features + 16) if partner and out_features >= 128 else 0
    if isinstance(layer, KQuantLinear):  # GGUF blocks as stored, read in place
        plan.add_kquant([p.raw for p in layer.parts], [p.qtype.code for p in layer.parts], [p.n for p in layer.parts],
                        layer.in_features, layer.bias)
        return 0
    if isinstance(layer, nn.Linear):
        plan.add_float(layer.weight.detach(), None if layer.bias is None else layer.bias.detach(), None)
        return 0
    raise TypeError(f"no native kernel for {type(layer).__name__}")


def main(argv: list[str] | None = None) -> None:
    """``python -m model.decode.native --out DIR [--portable]``: build the library into DIR
    (what the container image ships; ``TSERVE_NATIVE_LIBRARY`` names the printed path)."""
    parser = argparse.ArgumentParser(prog="python -m model.decode.native", description=main.__doc__)
    parser.add_argument("--out", type=Path, required=True, help="directory for the built library")
    parser.add_argument("--portable", action="store_true",
                        help="no -march=native: runs on any x86-64 (or aarch64) CPU, not just this one")
    args = parser.parse_args(argv)
    path = compile_library("tserve_native_llama", PORTABLE_FLAGS if args.portable else NATIVE_FLAGS,
                           args.out.resolve())
    print(path)


if __name__ == "__main__":
    main()
