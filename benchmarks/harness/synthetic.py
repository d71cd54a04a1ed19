"""Randomly initialised models and tokenizers of realistic shape, built offline.

Speed does not depend on what the weights say, so the benchmark builds its models from
configs: GPT-2 and Marian with ``transformers`` (saved with ``save_pretrained`` and read
back by ``model.load_hf``, so ours and the peers run the very same tensors), and, for the
service when no shipped checkpoint is present, a stand-in in our own checkpoint format.
The text is pseudo-English from a seeded generator (Zipf-distributed made-up words), so
tokenizers of the usual sizes can be trained in seconds without any data download.
"""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from model import ModelConfig, build_model, save
from model.tokenization.tokenizer import train_bpe

CONSONANTS = "bcdfghjklmnprstvwz"
VOWELS = "aeiouy"
# Marian generation must run to the length limit on every system so tokens/s compare the same
# work; the output bias makes these tokens impossible for all of them alike (no logits processor).
BANNED_LOGIT = -1.0e4


def made_up_words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < n:
        syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        words.add("".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) + rng.choice(("", "", "n", "r", "s"))
                          for _ in range(syllables)))
    return sorted(words)


def sentences(n: int, seed: int, vocabulary: int = 6000, min_words: int = 6, max_words: int = 24) -> list[str]:
    """``n`` pseudo-English sentences; word frequencies follow Zipf's law like real text."""
    words = made_up_words(vocabulary, seed)
    rng = random.Random(seed + 1)
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    out = []
    for _ in range(n):
        ws = rng.choices(words, weights, k=rng.randint(min_words, max_words))
        text = " ".join(ws)
        if rng.random() < 0.3:
            cut = rng.randrange(1, len(ws))
            text = " ".join(ws[:cut]) + ", " + " ".join(ws[cut:])
        out.append(text[0].upper() + text[1:] + rng.choice((".", ".", ".", "?", "!")))
    return out


# --- GPT-2 ---------------------------------------------------------------------------------

def save_gpt2(directory: Path, layers: int, d_model: int, heads: int, vocab: int, positions: int,
              seed: int, init_std: float = 0.1) -> Path:
    """A random GPT2LMHeadModel + a byte-level BPE tokenizer.json, in the HF layout.

    ``init_std`` is above GPT-2's 0.02: with 0.02 a random model repeats one token forever,
    which would make the token-for-token comparison with transformers a weak check.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    transformers.logging.set_verbosity_error()
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    # The tokenizer only has to exist (load_hf reads it); token ids in the benchmark are drawn
    # over the model's full vocabulary, so its size need not match vocab.
    tk.train_from_iterator(sentences(2000, seed), trainers.BpeTrainer(
        vocab_size=min(vocab, 2000), special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    eos = tk.token_to_id("<|endoftext|>")
    tokenizer = transformers.GPT2TokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>",
                                               eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=d_model, n_layer=layers,
                                     n_head=heads, bos_token_id=eos, eos_token_id=eos,
                                     initializer_range=init_std)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# --- Marian --------------------------------------------------------------------------------

def _train_sentencepiece(lines: list[str], vocab_size: int) -> bytes:
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, vocab_size=vocab_size, model_type="unigram",
        hard_vocab_limit=False, character_coverage=1.0, minloglevel=2, num_threads=os.cpu_count() or 1,
        unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, unk_piece="<unk>", eos_piece="</s>",
    )
    return out.getvalue()


def save_marian(directory: Path, layers: int, d_model: int, heads: int, ffn: int, vocab: int,
                seed: int) -> Path:
    """A random MarianMTModel with a SentencePiece vocabulary of about ``vocab`` pieces.

    Marian's file layout: source.spm / target.spm (the same model here: the weights are
    random, so a separate German model would change nothing), one vocab.json with
    </s> = 0, <unk> = 1 and <pad> last. The output bias bans </s> and <pad>
    (``BANNED_LOGIT``) so every system decodes exactly to its length limit.
    """
    import sentencepiece
    import transformers

    transformers.logging.set_verbosity_error()
    directory.mkdir(parents=True, exist_ok=True)
    proto = _train_sentencepiece(sentences(max(4 * vocab, 4000), seed), vocab)
    for name in ("source.spm", "target.spm"):
        (directory / name).write_bytes(proto)
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
    pieces = {"</s>": 0, "<unk>": 1}
    for i in range(sp.get_piece_size()):
        pieces.setdefault(sp.id_to_piece(i), len(pieces))
    pieces["<pad>"] = pad = len(pieces)
    (directory / "vocab.json").write_text(json.dumps(pieces, ensure_ascii=False), encoding="utf-8")
    tokenizer = transformers.MarianTokenizer(source_spm=str(directory / "source.spm"),
                                             target_spm=str(directory / "target.spm"),
                                             vocab=str(directory / "vocab.json"))
    config = transformers.MarianConfig(
        vocab_size=len(pieces), d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        max_position_embeddings=512, activation_function="swish", scale_embedding=True, pad_token_id=pad,
        eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias[0, [0, pad]] = BANNED_LOGIT
    model.generation_config.bad_words_ids = None  # the bias does it, for every system alike
    model.generation_config.forced_eos_token_id = None
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# --- a stand-in for the shipped generate-en checkpoint ---------------------------------------

# The shape model/train/configs/generate-en.json trains (d=192, 4 layers, BPE 5000, 512 positions).
GENERATE_EN_SHAPE = {
    "family": "decoder", "d_model": 192, "n_heads": 4, "n_decoder_layers": 4, "d_ff": 768,
    "activation": "gelu_new", "dropout": 0.0, "max_positions": 512, "positional": "sinusoidal",
    "norm_placement": "pre", "final_norm": True, "tie_word_embeddings": True,
}


def save_synthetic_generator(directory: Path, seed: int, vocab: int = 5000) -> Path:
    """Our checkpoint format (config.json + model.safetensors + tokenizer.json), random weights."""
    tokenizer = train_bpe(sentences(4000, seed), vocab_size=vocab, min_frequency=2, template="<s> $A")
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      **GENERATE_EN_SHAPE)
    model = build_model(cfg).init_weights(seed).eval()
    save(directory, model, tokenizer, metrics={"note": "synthetic benchmark stand-in: random weights"})
    (directory / "README.md").write_text("Random weights in the shape of generate-en, built by the benchmark "
                                         "because no shipped checkpoint was found. Not a trained model.\n")
    return directory
