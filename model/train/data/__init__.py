"""Data preparation: corpora built reproducibly from package-registry sources.

``python -m model.train.data prepare`` writes ``data/corpora/<name>/{train,valid,test}.jsonl.gz``
and ``data/corpora/manifest.json`` (sources, licences, counts, sha256).
"""

from model.train.data.corpus import SPLITS, load_split, split_of

__all__ = ["SPLITS", "load_split", "split_of"]
