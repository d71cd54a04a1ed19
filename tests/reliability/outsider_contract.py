"""The contract as an outsider checks it: ``schemathesis run`` (stock checks, all of them, every
phase) against ``python -m service`` serving the contract test's tiny models and limits.

    python -m tests.reliability.outsider_contract [--examples 50] [--seeds 1,2,3] [schemathesis args...]

Exit status: schemathesis's (0 = no failure on any seed). ``make contract`` runs it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from model.formats.checkpoint import CHAT_TEMPLATE_FILE
from tests.reliability.conftest import CHATML
from tests.reliability.live import LiveServer
from tests.service.conftest import make_weights

# the contract test's models and limits (tests/reliability/test_contract.py): a text of max_text_chars
# characters fits the context whatever they are (byte-level BPE: 4 tokens for a 4-byte character, + BOS)
CONFIG = Path(__file__).with_name("schemathesis.toml")  # the rules JSON Schema cannot state, per operation
MODELS = (("generate-tiny", "generate-tiny"), ("translate-tiny-en-de", "translate-tiny"),
          ("fill-mask-tiny", "fill-mask-tiny"))
LIMITS = dict(max_seq_len=64, max_texts=4, max_text_chars=15, max_queue=64, max_batch=8, log_level="warning")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=50)
    parser.add_argument("--seeds", default="1,2,3")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="tserve-contract-") as tmp:
        source = make_weights(Path(tmp) / "source")
        (source / "generate-tiny" / CHAT_TEMPLATE_FILE).write_text(CHATML)
        weights = Path(tmp) / "weights"
        weights.mkdir()
        for name, model in MODELS:
            (weights / name).symlink_to(source / model, target_is_directory=True)
        with LiveServer(Path(tmp) / "server.log", weights_dir=str(weights), **LIMITS) as server:
            status = 0
            for seed in args.seeds.split(","):
                command = [str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(CONFIG), "run",
                           server.url + "/openapi.json",
                           "--checks", "all", "--max-examples", str(args.examples), "--seed", seed,
                           "--phases", "examples,coverage,fuzzing,stateful", *extra]
                print("$", " ".join(command), flush=True)
                status = subprocess.run(command, env=os.environ).returncode or status
            return status


if __name__ == "__main__":
    sys.exit(main())
