"""Typed dependencies for the routes: the registry, the settings, the API key check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from service.registry import EngineRegistry
from service.settings import Settings


def get_registry(request: Request) -> EngineRegistry:
    return request.app.state.registry


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


RegistryDep = Annotated[EngineRegistry, Depends(get_registry)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def require_api_key(request: Request, settings: SettingsDep) -> None:
    """With TSERVE_API_KEY set, require ``Authorization: Bearer <key>`` (constant-time compare)."""
    if settings.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    expected = settings.api_key.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
        raise HTTPException(401, "missing or invalid API key (Authorization: Bearer <key>)",
                            headers={"WWW-Authenticate": "Bearer"})
