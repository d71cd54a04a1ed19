"""The OpenAPI schema is the contract: schemathesis, with every one of its checks, over every
operation (the drop-in APIs included), positive and negative data, a fixed seed and a bounded
number of examples.

Every check runs as schemathesis ships it (server errors, status codes, content types,
response schemas and headers, negative data rejected, methods, ...) except one:
``positive_data_acceptance`` is replaced by a stricter-where-it-can version. Data valid
against the schema must be accepted, or refused with a client error (400; TGI's 422, TEI's 413)
for a reason JSON Schema cannot state: a prompt's tokens past the model's limit,
no mask token, best_of != n, echo with logprobs, top_logprobs without logprobs, a grammar
that does not compile, a tool choice naming no tool, a file that is not a gettext .po
catalogue, a language LibreTranslate detected
(source=auto) that no model translates. Those reasons are listed here and on the fields.
"""

from __future__ import annotations

import re
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, load_all_checks, positive_data_acceptance
from schemathesis.core.errors import InvalidSchema
from schemathesis.core.failures import FailureGroup

from tests.service.conftest import settings_for
from tests.service.server_thread import ServerThread

EXAMPLES = 25  # per operation and mode
# client errors for schema-valid data: limits that depend on tokenization, on two fields together
# or on what a text is (its language)
NOT_IN_SCHEMA = re.compile(r"tokens|mask token|best_of must equal n|echo together with logprobs|"
                           r"queues at most|'top_logprobs' needs 'logprobs'|"
                           r"not a gettext \.po file|file is empty|compiled \.mo catalogue|"
                           # structured outputs: whether a schema, regex or grammar compiles; tool names
                           r"cannot be compiled|TSERVE_GRAMMAR_|TSERVE_MAX_TOOLS|is not valid JSON|"
                           r"must be a JSON Schema|names must be unique|not in tools|cannot follow a grammar|"
                           r"non-empty list|must not be empty|needs a 'json_schema' object|detected|"
                           # the doors: blocks in the other role's message, a tool_result answering no call
                           r"belong in|input: must hold")
# the doors' five, POST /models/load, /models/unload, GET / (the playground), the four GET /v1/<task>/info,
# GET /v1/loads (the load signals a gateway reads)
OPERATIONS = 39


@pytest.fixture(scope="module")
def live(weights_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("contract-weights")  # a translation model named for its pair (en -> de)
    for name, source in (("generate-tiny", "generate-tiny"), ("translate-tiny-en-de", "translate-tiny"),
                         ("fill-mask-tiny", "fill-mask-tiny")):
        (root / name).symlink_to(weights_dir / source, target_is_directory=True)
    with ServerThread(settings_for(root, max_seq_len=64, max_texts=4, max_text_chars=100, max_queue=64)) as s:
        yield s


def _message(response) -> str:
    """The error message in whichever shape the operation's API uses (OpenAI, TGI/TEI and
    LibreTranslate, DeepL)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return error.get("message", "")
    return error if isinstance(error, str) else str(body.get("message", body))[:200]


def positive_data_accepted(ctx, response, case) -> bool | None:
    """Valid data: 2xx, 404 for an id no model has, 429; or a client error for a reason the schema cannot state."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return None
    status = response.status_code
    if 200 <= status < 300 or status in (404, 429):
        return None
    message = _message(response)
    assert status in (400, 413, 422) and NOT_IN_SCHEMA.search(message), (
        f"{case.operation.label}: schema-valid data refused with {status}: {message}\nbody: {case.body!r}")
    return None


def _checks():
    load_all_checks()
    return [c for c in CHECKS.get_all() if c is not positive_data_acceptance] + [positive_data_accepted]


def test_schema_and_server_agree_on_every_operation(live):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) == OPERATIONS, sorted(op.label for op in operations)  # every operation is fuzzed
    checks, failures, started = _checks(), [], time.monotonic()
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @seed(14)
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                      database=None)
            def run(case):
                case.call_and_validate(base_url=live.url, checks=checks, timeout=60)

            try:
                run()
            except Unsatisfiable:  # no negative data exists for an operation without inputs
                assert mode is GenerationMode.NEGATIVE, op.label
            except InvalidSchema as exc:  # schemathesis cannot lay out its own negation of a valid schema
                # (positive data for the same operation is generated and checked above): its
                # generator's limit, not a disagreement between schema and server
                assert mode is GenerationMode.NEGATIVE and "Cannot generate" in str(exc), f"{op.label}: {exc}"
            except (Exception, FailureGroup) as exc:  # collect, so one run reports every disagreement
                failures.append(f"{op.label} [{mode.value}]: {exc}"[:3000])
    assert not failures, "\n\n".join(failures)
    assert time.monotonic() - started < 150


def test_schema_states_the_limits(live):
    import httpx

    from service.schemas.common import NOT_BLANK

    schema = httpx.get(live.url + "/openapi.json").json()
    props = schema["components"]["schemas"]
    text = props["TranslateRequest"]["properties"]["text"]["anyOf"]
    assert text[0] == {"type": "string", "minLength": 1, "maxLength": 100, "pattern": NOT_BLANK}
    assert text[1]["minItems"] == 1 and text[1]["maxItems"] == 4
    assert props["GenerateRequest"]["properties"]["prompt"]["minLength"] == 1
    assert props["CompletionRequest"]["properties"]["model"]["enum"] == ["generate-tiny"]
    assert "400" in props["CompletionRequest"]["properties"]["model"]["description"]
    assert props["CompletionRequest"]["additionalProperties"] is False  # unknown fields: 400
    paths = schema["paths"]
    assert props["ChatCompletionRequest"]["properties"]["model"]["enum"] == ["generate-tiny"]  # has a template
    for path in ("/v1/generate", "/v1/completions", "/v1/translate", "/v1/chat/completions", "/generate_stream", "/"):
        assert "text/event-stream" in paths[path]["post"]["responses"]["200"]["content"], path
    assert "404" in paths["/v1/models/{model_id}"]["get"]["responses"]
    assert "431" in paths["/v1/generate"]["post"]["responses"]
    assert "422" not in paths["/v1/generate"]["post"]["responses"]  # validation errors are 400s
    # the drop-ins: their own error shapes and statuses
    assert paths["/generate"]["post"]["responses"]["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/HFError"}
    assert "413" in paths["/embed"]["post"]["responses"] and "403" in paths["/v2/translate"]["post"]["responses"]
    assert paths["/translate"]["post"]["responses"]["403"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/LibreTranslateError"}
    assert props["EmbedRequest"]["properties"]["dimensions"]["anyOf"][0] == {"enum": [32]}
