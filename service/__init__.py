"""HTTP service over ``model``: FastAPI app, engines with continuous batching, metrics.

Its parts, one folder each:
- ``http/``: the app factory, the server, middleware, dependencies, HTTP errors, the OpenAPI document;
- ``routes/`` (+ ``routes/compat/``): the endpoints, thin: parse, call one engine method, shape the reply;
- ``engines/``: the generative and encoder engines (threads, queues, deadlines, metrics), their base,
  their errors, waiting for a request's events;
- ``models/``: the registry (available and loaded models) and its parts (catalogue, loading, memory
  budget, leases and keep-alive, lookup), the models' facts and their memory;
- ``schemas/``: the request and response bodies;
- ``chat/``: structured outputs and tool calls;
- ``translation/``: language pairs and the placeholder-safe driver, ``.po`` catalogues, language id.

``model`` is reached only through ``engines/`` and ``models/``.
"""
