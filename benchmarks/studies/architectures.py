"""The lineages after Llama against transformers, in-process: greedy decoding speed and tokens
of small random Qwen2, Qwen3, Mistral, Phi-3 and Gemma 3 models that transformers writes.

    python -m benchmarks.studies.architectures [--hidden 256] [--layers 6] [--tokens 64] [--reps 3]

Each model (random weights, a byte-level BPE vocabulary of 2,000 tokens trained here) is saved
by transformers, loaded by ``model.load_model`` like any HF directory, and decoded greedily:
- ours as served: ``model.decode.prepare`` with the service's default options (int8 decode
  projections, the native C++ step where it runs, a bfloat16 cache), through ``generate``;
- ours float32: the reference step (its tokens must equal transformers');
- transformers: ``generate`` (float32, its KV cache, SDPA), the same prompt.
Batch 1 and batch 8 (eight prompts together), ``tokens`` new tokens each, EOS ignored; decode
tokens/s = new tokens over the time after the first token, median of ``reps``. Component
figures: no HTTP (``benchmarks.studies.served_vs_llama_server`` has the served ones).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

TEXT = ["The quick brown fox jumps over the lazy dog while the farmer watches from the gate.",
        "A lighthouse keeper found a message in a bottle washed up on the rocks one winter morning.",
        "Rivers carry water from the mountains through forests and towns down to the sea.",
        "Bread is made from flour, water, salt and yeast, kneaded and left to rise before baking."] * 50

LINEAGES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=64, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=64, query_pre_attn_scalar=64, sliding_window=128, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True)),
}


def _tokenizer(directory: Path):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<pad>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>")
    tok.save_pretrained(directory)
    return tok


def _save(name: str, directory: Path, hidden: int, layers: int, vocab: int):
    import transformers

    config_cls, model_cls, extra = LINEAGES[name]
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                  num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)
    if name == "gemma3":
        kwargs["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _rate(fn, tokens: int, reps: int) -> float:
    """Decode tokens/s: ``fn(n)`` generates n tokens; the time of 1 token is the prefill's."""
    fn(1)
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(1)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        fn(tokens)
        rates.append((tokens - 1) / max(time.perf_counter() - t0 - first, 1e-9))
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.architectures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lineages", nargs="+", default=list(LINEAGES), choices=list(LINEAGES))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)

    from model import load_model
    from model.decode import DecodeOptions, prepare

    print(f"threads {torch.get_num_threads()}; hidden {args.hidden}, {args.layers} layers, {args.tokens} new tokens")
    print("| lineage | batch | ours served (step) tok/s | ours float32 tok/s | transformers tok/s | served / "
          "transformers | float32 tokens = transformers |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tok = _tokenizer(Path(tmp) / "tok")
        g = torch.Generator().manual_seed(0)  # 24 random tokens each: equal lengths, no padding on either side
        prompts = torch.randint(3, len(tok), (8, 24), generator=g).tolist()
        for name in args.lineages:
            directory = Path(tmp) / name
            tok.save_pretrained(directory)
            reference = _save(name, directory, args.hidden, args.layers, len(tok))
            ours = load_model(directory)
            served = prepare(ours.model.eval(), DecodeOptions(), ours.tokenizer)
            plain = load_model(directory)
            for b in (1, 8):
                batch = prompts[:b]
                same = _ours(plain.model, batch, args.tokens) == _hf(reference, batch, args.tokens)
                r_served = _rate(partial(_ours, ours.model, batch, step=served), args.tokens, args.reps) * b
                r_plain = _rate(partial(_ours, plain.model, batch), args.tokens, args.reps) * b
                r_hf = _rate(partial(_hf, reference, batch), args.tokens, args.reps) * b
                print(f"| {name} | {b} | {r_served:.0f} ({served.name}) | {r_plain:.0f} | {r_hf:.0f} | "
                      f"{r_served / r_hf:.2f}x | {'yes' if same else 'NO'} |", flush=True)


def _ours(model, batch: list[list[int]], n: int, step=None) -> list[list[int]]:
    from model import SamplingParams, generate

    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in generate(model, batch, params, step=step)]


def _hf(reference, batch: list[list[int]], n: int) -> list[list[int]]:
    ids = torch.tensor(batch)  # equal lengths
    with torch.inference_mode():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
    return out[:, ids.size(1):].tolist()


if __name__ == "__main__":
    main()
