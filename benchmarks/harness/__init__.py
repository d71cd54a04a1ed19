"""What every benchmark stands on: the run's sizes (``config``), timing and its statistics,
the report and its table, the machine's description, the synthetic models and their
workspace, the load generator, the llama.cpp peer, and ``server_process`` (a server in a
child process, waited for and stopped). Nothing here imports a section or a study."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: weights/, build/, benchmarks/results/
