"""The sections of ``python -m benchmarks`` (``benchmarks/__main__.py`` lists them): each is a
``run(workspace, config, report)`` that adds rows to the shared report, ours against a peer on
the same weights and inputs. A section imports the harness, never a study or (but ``gpu``,
which re-runs four CPU sections on CUDA) another section."""
