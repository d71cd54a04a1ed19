"""Typed dependencies for the routes: the registry, the settings, the API key check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from service.models.registry import EngineRegistry
from service.settings import Settings


def get_registry(request: Request) -> EngineRegistry:
    return request.app.state.registry


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


RegistryDep = Annotated[EngineRegistry, Depends(get_registry)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


API_KEY_MESSAGE = "missing or invalid API key (Authorization: Bearer <key>)"


def api_key_ok(authorization: str, settings: Settings) -> bool:
    """``Authorization: Bearer <key>`` matches TSERVE_API_KEY (constant-time compare), or no key is set."""
    if settings.api_key is None:
        return True
    scheme, _, token = authorization.partition(" ")
    expected = settings.api_key.get_secret_value().encode()
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), expected)


def require_api_key(request: Request, settings: SettingsDep) -> None:
    """With TSERVE_API_KEY set, require ``Authorization: Bearer <key>``. The routes that depend on
    this are also checked before their body is read (``service.http.middleware.ApiKeyFirstMiddleware``)."""
    if not api_key_ok(request.headers.get("authorization", ""), settings):
        raise HTTPException(401, API_KEY_MESSAGE, headers={"WWW-Authenticate": "Bearer"})


ANTHROPIC_KEY_MESSAGE = "missing or invalid API key (x-api-key: <key>, or Authorization: Bearer <key>)"


def require_api_key_or_x_api_key(request: Request, settings: SettingsDep) -> None:
    """Anthropic's clients send the key as ``x-api-key``; ``Authorization: Bearer`` works too."""
    given = request.headers.get("x-api-key")
    if api_key_ok(request.headers.get("authorization", ""), settings) or (
            given is not None and api_key_ok(f"Bearer {given}", settings)):
        return
    raise HTTPException(401, ANTHROPIC_KEY_MESSAGE)
