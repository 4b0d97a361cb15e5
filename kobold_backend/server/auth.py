"""API key (Authorization: Bearer KEY, KoboldCpp's 401 shape) and CORS for the API routes, preflight included."""

from __future__ import annotations

import hmac
from typing import Any, Optional, Tuple

from flask import Flask, request

from kobold_backend.server.config import ServerConfig
from kobold_backend.server.errors import Unauthorized, error_response

# Routes a client may call without the key: discovery (is the server protected?) and the API description.
PUBLIC_SUFFIXES = ("/api/extra/version", "/info/version", "/info/version/latest", "/info/version/list",
                   "/openapi.json")
ALLOWED_HEADERS = "Content-Type, Authorization, apikey, genkey, X-Requested-With"
ALLOWED_METHODS = "GET, POST, PUT, OPTIONS"


def _needs_key(path: str) -> bool:
    if not (path.startswith("/api/") or path.startswith("/ui/")):
        return False
    return not path.endswith(PUBLIC_SUFFIXES)


def key_ok(expected: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        token = request.headers.get("apikey", "")
    return hmac.compare_digest(token.strip().encode(), expected.encode())


def allowed_origin(origins: Tuple[str, ...], origin: Optional[str]) -> Optional[str]:
    if not origins:
        return None
    if "*" in origins:
        return "*"
    return origin if origin in origins else None


def install_auth_and_cors(app: Flask, config: ServerConfig) -> None:
    """Register the key check (before each request) and the CORS headers (after each API response)."""

    @app.before_request
    def _check_key() -> Any:
        if config.api_key and request.method != "OPTIONS" and _needs_key(request.path):
            if not key_ok(config.api_key):
                e = Unauthorized()
                return error_response(e.status, e.body(), {"WWW-Authenticate": "Bearer"})
        return None

    @app.after_request
    def _cors(resp: Any) -> Any:
        if request.path.startswith("/api/"):
            add_cors_headers(resp, config.cors_origins, ALLOWED_METHODS, ALLOWED_HEADERS)
        return resp


def add_cors_headers(resp: Any, origins: Tuple[str, ...], methods: str, headers: str) -> Any:
    """CORS headers for the request's Origin when `origins` allows it (nothing otherwise)."""
    allowed = allowed_origin(origins, request.headers.get("Origin"))
    if allowed is None:
        return resp
    resp.headers["Access-Control-Allow-Origin"] = allowed
    if allowed != "*":
        resp.headers.add("Vary", "Origin")
    resp.headers["Access-Control-Allow-Methods"] = methods
    resp.headers["Access-Control-Allow-Headers"] = headers
    resp.headers["Access-Control-Max-Age"] = "600"
    return resp
