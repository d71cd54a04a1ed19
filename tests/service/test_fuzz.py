"""Property-based fuzzing of the whole API from its OpenAPI schema (schemathesis):
whatever a client sends, valid or not, the answer is never a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.service.conftest import settings_for
from tests.service.server_thread import ServerThread


@pytest.fixture(scope="module")
def live(weights_dir):
    # small limits keep fuzzed generations short; every limit is still enforced
    with ServerThread(settings_for(weights_dir, max_seq_len=64, max_texts=4, max_text_chars=200,
                                   max_queue=64)) as s:
        yield s


OPERATIONS = ["POST /v1/generate", "POST /v1/completions", "POST /v1/translate", "POST /v1/fill-mask",
              "POST /v1/embeddings", "GET /v1/models/{model_id}", "GET /v1/models", "GET /ready"]


@pytest.mark.parametrize("operation", OPERATIONS)
def test_no_input_causes_a_server_error(live, operation):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    method, path = operation.split(" ")
    op = schema[path][method]

    @given(case=op.as_strategy())
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case):
        case.call_and_validate(base_url=live.url, checks=[not_a_server_error], timeout=60)

    check()
