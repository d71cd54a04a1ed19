"""Benchmarks against peers (issue 7): ``python -m benchmarks`` or ``make bench``.

Three sub-packages, imports going one way (tests/test_layering.py checks it):
- ``sections/``: what ``python -m benchmarks`` runs side by side in one process and reports in
  one table (``benchmarks/__main__.py`` lists them: decode, translation, KV cache, attention,
  service, GPU, chat model, embeddings, ...);
- ``studies/``: standalone measurements, ``python -m benchmarks.studies.NAME`` (served against
  llama-server, pod memory, soak, speculative decoding, prefill, ...);
- ``harness/``: what both stand on (sizes, timing, the report, the synthetic models, the load
  generator, a server in a child process). Sections and studies import the harness only.
"""
