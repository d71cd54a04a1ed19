"""The reliability suite serves the service tests' tiny checkpoints, the decoder with a chat
template (so /v1/chat/completions is exercised too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.formats.checkpoint import CHAT_TEMPLATE_FILE
from tests.service.conftest import make_weights

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def weights_dir(tmp_path_factory) -> Path:
    root = make_weights(tmp_path_factory.mktemp("reliability-weights"))
    (root / "generate-tiny" / CHAT_TEMPLATE_FILE).write_text(CHATML)
    return root


