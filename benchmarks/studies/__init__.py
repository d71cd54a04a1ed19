"""Standalone measurements, each run on its own (``python -m benchmarks.studies.NAME``, its
docstring says with what): served comparisons, memory, soak, quality, one feature against
its absence. Their figures are in docs/benchmarks.md and the pages it links. A study imports
the harness only: never a section or another study."""
