"""Drop-in APIs of other servers over the same engines: LibreTranslate, DeepL v2, TGI, TEI and the
``POST /`` + ``GET /info`` pair Hugging Face's InferenceClient uses. Each answers in its own API's
shapes (errors included) and counts under its own ``endpoint`` label (its path)."""

from service.routes.compat import deepl, hf_inference, libretranslate, tei, tgi

# with their own auth (api_key field, DeepL-Auth-Key header) / behind the service's Bearer key
OWN_AUTH = (libretranslate.router, deepl.router)
BEARER_AUTH = (tgi.router, tei.router, hf_inference.router)
