"""Drop-in APIs of other servers over the same engines: LibreTranslate, DeepL v2, TGI, TEI, Anthropic's
Messages API and the ``POST /`` + ``GET /info`` pair Hugging Face's InferenceClient uses. Each answers in its own API's
shapes (errors included) and counts under its own ``endpoint`` label (its path)."""

from service.routes.compat import (
    anthropic,
    deepl,
    hf_inference,
    hf_task_doors,
    libretranslate,
    responses,
    tei,
    tgi,
    tokenize,
)

# with their own auth (api_key field, DeepL-Auth-Key header; Anthropic's x-api-key or Bearer) / behind
# the service's Bearer key
OWN_AUTH = (libretranslate.router, deepl.router, anthropic.router)
BEARER_AUTH = (tgi.router, tei.router, hf_inference.router, hf_task_doors.info_router)
# OpenAI's own shapes (errors included): behind the Bearer key like the /v1 routes, checked before the body
OPENAI_SHAPED = (responses.router, tokenize.router)
