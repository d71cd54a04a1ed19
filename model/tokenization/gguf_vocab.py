"""The tokenizer a GGUF file describes, rebuilt as a ``tokenizers`` tokenizer.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the merges, a type per
token and the special ids as metadata (``tokenizer.ggml.*``). Two vocabularies are rebuilt
(``gguf_tokenizer`` chooses by ``tokenizer.ggml.model``), each as transformers rebuilds it from
the same file (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), so both give the same ids:

- "gpt2": byte-level BPE from the tokens and merges (``byte_level_tokenizer``);
- "llama": a SentencePiece BPE vocabulary (Llama 2, Mistral, Phi-3, Gemma) from the tokens and
  their scores (``sentencepiece_tokenizer``): merges recovered from the scores (Gemma: from the
  token order), byte fallback to the ``<0xNN>`` pieces, ``▁`` for spaces, the prefix space where
  ``tokenizer.ggml.add_space_prefix`` asks for it (Gemma: never), BOS added unless the file says not.

The split regex comes from ``tokenizer.ggml.pre``, as transformers chooses it when it
loads the same file (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), so both give
the same ids: a few names have their own pattern, every other name the GPT-2 one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from model.tokenization.tokenizer import Tokenizer

# llama.cpp's token types (llama_token_type): what the vocabulary says each entry is.
CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex applied before the byte-level mapping. Names not listed
# use the GPT-2 pattern built into the ByteLevel pre-tokenizer (SmolLM2's "smollm" among them).
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "pixtral": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}


class GGUFTokenizerError(ValueError):
    """Tokenizer metadata that cannot be rebuilt; the message names the key."""


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table: bytes that are printable
    Latin-1 stand for themselves, the other 68 are moved to U+0100 upwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    moved = (b for b in range(256) if b not in table)
    for offset, b in enumerate(moved):
        table[b] = chr(256 + offset)
    return dict(sorted(table.items()))


TOKENIZER_MODELS = ("gpt2", "llama")


def gguf_tokenizer(get: Callable[[str], Any]) -> Tokenizer:
    """The tokenizer of the file whose metadata ``get(key) -> value or None`` reads."""
    kind = get("tokenizer.ggml.model")
    if kind == "gpt2":
        return byte_level_tokenizer(get)
    if kind == "llama":
        return sentencepiece_tokenizer(get)
    raise GGUFTokenizerError(f"metadata 'tokenizer.ggml.model' is {kind!r}; supported: 'gpt2' (byte-level BPE), "
                             "'llama' (SentencePiece)")


def byte_level_tokenizer(get: Callable[[str], Any]) -> Tokenizer:
    """Build from the metadata reader ``get(key) -> value or None``."""
    kind = get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(f"metadata 'tokenizer.ggml.model' is {kind!r}; only 'gpt2' (byte-level BPE) "
                                 "vocabularies are supported")
    tokens = get("tokenizer.ggml.tokens")
    merges = get("tokenizer.ggml.merges")
    for key, value in (("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.merges", merges)):
        if not isinstance(value, list) or not value:
            raise GGUFTokenizerError(f"metadata '{key}' is missing or empty")
    types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"metadata 'tokenizer.ggml.token_type' has {len(types)} entries for "
                                 f"{len(tokens)} tokens")

    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # Every BPE entry must be spelled in the byte alphabet; a few files store a token as its
    # plain text (e.g. with a real space), which is respelled byte by byte.
    vocab = {tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8")): i
             for i, tok in enumerate(tokens)}
    pairs = []
    for n, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFTokenizerError(f"metadata 'tokenizer.ggml.merges' entry {n} is {merge!r}; expected 'a b'")
        pairs.append((parts[0], parts[1]))
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))

    split = PRE_TOKENIZER_SPLITS.get(get("tokenizer.ggml.pre"))
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tk.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) are matched whole and are special; user-defined ones
    # are matched whole but decode like text. A "control" entry outside the byte alphabet is a
    # mislabelled placeholder that no text can produce, and is left to the BPE vocabulary.
    control = [AddedToken(tok, special=True, normalized=False)
               for tok, kind in zip(tokens, types) if kind == CONTROL and set(tok) <= spelled]
    user = [AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, types) if kind == USER_DEFINED and tok in vocab]
    tk.add_special_tokens(control)
    tk.add_tokens(user)

    _add_bos_eos(tk, get, tokens)
    return Tokenizer(tk)


def _add_bos_eos(tk: HFTokenizer, get: Callable[[str], Any], tokens: list[str]) -> None:
    """The BOS / EOS that encode() adds around every text, where the file asks for them."""
    ends = {}  # "head"/"tail" -> (token, id) that encode() adds around every text
    for end, flag, key in (("head", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"),
                           ("tail", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.eos_token_id")):
        token_id = get(key)
        if get(flag) and token_id is not None:
            if not 0 <= token_id < len(tokens):
                raise GGUFTokenizerError(f"metadata '{key}' is {token_id}; the vocabulary has {len(tokens)} tokens")
            ends[end] = (tokens[token_id], token_id)
    if ends:
        head = [ends["head"][0]] if "head" in ends else []
        tail = [ends["tail"][0]] if "tail" in ends else []
        tk.post_processor = processors.TemplateProcessing(
            single=" ".join([*head, "$A", *tail]), pair=" ".join([*head, "$A", *tail, "$B:1", *tail]),
            special_tokens=list(set(ends.values())))


# --- SentencePiece ("llama") vocabularies ---------------------------------------------------

SPACE = "\u2581"  # ▁, SentencePiece's escaped space
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def recover_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary and each token's score: every split of a token into two
    tokens of the vocabulary is a merge, ranked by the token's score (best first), then by the
    lengths of its parts; as transformers' ``generate_merges`` ranks them, so both agree."""
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def sentencepiece_tokenizer(get: Callable[[str], Any]) -> Tokenizer:
    """A SentencePiece BPE vocabulary (``tokenizer.ggml.model = "llama"``) as transformers rebuilds
    it: LlamaTokenizer's shape (Metaspace prefix space on the first piece of text), Phi-3's (the
    prefix space from a normalizer) or GemmaTokenizer's (no prefix space; Gemma's merges follow the
    token order, not the scores, and its all-space tokens are stored as real spaces)."""
    arch = get("general.architecture")
    tokens = get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFTokenizerError("metadata 'tokenizer.ggml.tokens' is missing or empty")
    types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"metadata 'tokenizer.ggml.token_type' has {len(types)} entries for "
                                 f"{len(tokens)} tokens")
    gemma = arch in GEMMA_ARCHITECTURES
    if gemma:
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranking = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise GGUFTokenizerError("metadata 'tokenizer.ggml.scores' is missing or does not match the tokens")
        ranking = dict(zip(tokens, scores))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = get("tokenizer.ggml.merges")
    pairs = [tuple(m.split(" ")) for m in merges] if merges else recover_merges(vocab, ranking)

    if gemma:
        tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, unk_token="<unk>", byte_fallback=True))
        tk.normalizer = normalizers.Replace(" ", SPACE)
        tk.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tk.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        prefix = get("tokenizer.ggml.add_space_prefix")
        prefix = True if prefix is None else bool(prefix)
        tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
        if arch == "phi3":
            tk.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        else:
            scheme = "first" if prefix else "never"
            tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
        steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        tk.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))

    control = [AddedToken(tok, special=True, normalized=False) for tok, kind in zip(tokens, types) if kind == CONTROL]
    user = [AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, types) if kind == USER_DEFINED and tok in vocab]
    tk.add_special_tokens(control)
    tk.add_tokens(user)
    # transformers defaults add_bos_token to True for SentencePiece files that do not say (llama.cpp does too)
    _add_bos_eos(tk, lambda key: True if key == "tokenizer.ggml.add_bos_token" and get(key) is None else get(key),
                 tokens)
    return Tokenizer(tk)
