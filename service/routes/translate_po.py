"""POST /v1/translate/po: fill the untranslated entries of a gettext .po file (see
``service.translation.po`` for what is changed and what is kept).

The file comes as multipart/form-data (field ``file``; options as form fields or query
parameters) or as the raw body (``Content-Type: text/x-gettext-translation``, ``text/x-po``,
``application/x-po`` or ``application/octet-stream``; options as query parameters). The
answer is the file (UTF-8), with what was done in ``X-Entries-*`` headers.
"""

from __future__ import annotations

import email.parser
import email.policy
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import ValidationError

from service.engines.errors import InvalidRequestError
from service.engines.generative import GenerativeEngine, SamplingParams
from service.http.dependencies import RegistryDep, SettingsDep
from service.http.errors import ERROR_RESPONSES
from service.routes.streaming import client_gone, mark
from service.schemas.common import TranslatePoOptions
from service.translation import po as po_catalogue

router = APIRouter(tags=["translation"])

PO_MEDIA_TYPE = "text/x-gettext-translation"
RAW_MEDIA_TYPES = (PO_MEDIA_TYPE, "text/x-po", "application/x-po", "application/octet-stream")
# What "parses as a .po file" means cannot be said in JSON Schema; the pattern states a plain form
# of one (comments, msgctxt, msgid and msgstr lines of quoted UTF-8 text), so a schema-driven
# client or fuzzer sends catalogues. The server reads any catalogue gettext reads (a header,
# plurals, another charset): the pattern is the form it promises to accept, not the only one.
_PO_STRING = r'"([^"\\\x00-\x1f\x7f]|\\[\\"nt]){1,80}"'
PO_PATTERN = (r"^((#[ .] [^\x00-\x1f\x7f]{0,40}\n){0,2}(msgctxt " + _PO_STRING + r"\n)?msgid " + _PO_STRING
              + r'\nmsgstr ("[^"\\\x00-\x1f\x7f]{0,80}")\n\n?){1,8}$')
FILE_SCHEMA = {"type": "string", "contentMediaType": PO_MEDIA_TYPE, "pattern": PO_PATTERN, "description": (
    "a gettext .po file (UTF-8 or the charset its header declares); at most TSERVE_MAX_BODY_BYTES and "
    "TSERVE_MAX_PO_ENTRIES entries. The pattern is a plain form of the format (the form a schema can state); any "
    "catalogue gettext reads is accepted, and a file that is not one is refused with 400 naming `file`")}


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A form field has no null: leaving it out gives the default."""
    branches = [b for b in schema.pop("anyOf", []) if b.get("type") != "null"]
    return {**schema, **branches[0]} if len(branches) == 1 else {**schema, **({"anyOf": branches} if branches else {})}


def _options_schema() -> dict[str, Any]:
    props = {name: _not_null({k: v for k, v in schema.items() if k != "title"})
             for name, schema in TranslatePoOptions.model_json_schema()["properties"].items()}
    return {"type": "object", "required": ["file"], "properties": {"file": FILE_SCHEMA, **props}}


OPENAPI_EXTRA = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": _options_schema()},
    **{media: {"schema": FILE_SCHEMA} for media in RAW_MEDIA_TYPES}}}}
RESPONSES: dict[int | str, dict[str, Any]] = {**ERROR_RESPONSES, 200: {
    "description": "the .po file with untranslated entries filled and flagged fuzzy",
    "content": {f"{PO_MEDIA_TYPE}": {"schema": {"type": "string"}}},
    "headers": {name: {"description": doc, "schema": {"type": "integer", "minimum": 0}}
                for name, doc in po_catalogue.HEADERS_DOC.items()}}}


@router.post("/v1/translate/po", response_class=Response, responses=RESPONSES, openapi_extra=OPENAPI_EXTRA,
             summary="Machine-translate the untranslated entries of a gettext .po file (flagged fuzzy)")
async def translate_po(request: Request, registry: RegistryDep, settings: SettingsDep,
                       query: Annotated[TranslatePoOptions, Query()]):
    data, fields = await _upload(request)
    body = _options(query, fields)
    if query.model is not None and query.model != body.model:  # overridden by the form: still a name to check
        registry.check_named(query.model, "encoder-decoder", "/v1/translate/po")
    engine: GenerativeEngine = await registry.acquire(body.model, "encoder-decoder", "/v1/translate/po")
    for options in (query, body):  # the query's values too, where the form's override them
        _check_bounds(options, engine, settings)
    mark(request, engine.name)
    po = po_catalogue.parse(data, settings)
    texts = po_catalogue.plan(po, body.include_fuzzy, body.max_entries)
    capacity = settings.max_queue + settings.max_batch
    if len(texts) > capacity:
        entries = len({t.entry for t in texts})
        raise InvalidRequestError(
            f"file has {entries} entries to translate ({len(texts)} texts, plural forms included); one request "
            f"translates at most {capacity} texts (TSERVE_MAX_QUEUE + TSERVE_MAX_BATCH): send max_entries "
            f"(e.g. {max(1, capacity // 2)}) and send the returned file again for the rest", "max_entries",
            code="body_too_large")
    max_tokens = body.max_tokens if "max_tokens" in body.model_fields_set else min(body.max_tokens, engine.max_len - 1)
    params = SamplingParams(max_new_tokens=max_tokens, beam_size=body.beam_size, temperature=0.0)
    summary = await po_catalogue.translate_catalogue(client_gone(request), engine, po, texts, params,
                                                     settings.max_text_chars)
    mark(request, usage=summary.usage)
    return Response(po_catalogue.render(po), media_type=f"{PO_MEDIA_TYPE}; charset=utf-8",
                    headers=summary.headers())


def _check_bounds(options: TranslatePoOptions, engine: GenerativeEngine, settings) -> None:
    """The bounds the schema states for the model (max_tokens within its context, beam_size within
    TSERVE_MAX_BATCH), for options the engine will not see because the form overrode them."""
    if "max_tokens" in options.model_fields_set and options.max_tokens > engine.max_len - 1:
        raise InvalidRequestError(f"max_tokens: {options.max_tokens} is more than {engine.name}'s context allows "
                                  f"({engine.max_len - 1})", "max_tokens")
    if "beam_size" in options.model_fields_set and options.beam_size > settings.max_batch:
        raise InvalidRequestError(f"beam_size: {options.beam_size} is more than TSERVE_MAX_BATCH "
                                  f"({settings.max_batch})", "beam_size")


async def _upload(request: Request) -> tuple[bytes, dict[str, str]]:
    """(the file's bytes, the form's other fields)."""
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    body = await request.body()
    if media in RAW_MEDIA_TYPES:
        return body, {}
    if media != "multipart/form-data":
        sent = f"Content-Type: {content_type}" if content_type else "no Content-Type"
        raise InvalidRequestError(f"send the .po file as multipart/form-data (field `file`) or as the body with "
                                  f"Content-Type: {' or '.join(RAW_MEDIA_TYPES)} (this request sent {sent})",
                                  "Content-Type")
    header = b"Content-Type: " + content_type.encode("latin-1", "replace") + b"\r\n\r\n"
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(header + body)
    parts = list(message.iter_parts()) if message.is_multipart() else []
    data, fields = None, {}
    for part in parts:
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if not isinstance(name, str) or not isinstance(payload, bytes):
            continue
        if name == "file":
            data = payload
        else:
            fields[name] = payload.decode("utf-8", "replace")
    if data is None:
        raise InvalidRequestError("multipart/form-data body has no `file` part; send the .po file in the form field "
                                  "`file`", "file")
    return data, fields


def _options(query: TranslatePoOptions, fields: dict[str, str]) -> TranslatePoOptions:
    """The query's options, overridden by the form's fields (checked the same way)."""
    given = {k: v for k, v in fields.items() if k in TranslatePoOptions.model_fields}
    if not given:
        return query
    for name, value in given.items():  # a form's boolean as the schema states it (pydantic would read "0", "no")
        if TranslatePoOptions.model_fields[name].annotation in (bool, "bool") and value not in ("true", "false"):
            raise InvalidRequestError(f"{name}: {value!r} is not a boolean; send true or false", name)
    try:
        return TranslatePoOptions.model_validate({**query.model_dump(exclude_unset=True), **given})
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err.get("loc") else None
        raise InvalidRequestError(f"{name}: {err['msg']}", name) from None
