"""API key (Authorization: Bearer KEY, KoboldCpp's 401 shape) and CORS for the API routes, preflight included;
the Host check of loopback binds (DNS rebinding) and the refusal of cross-site simple requests to the routes that
load or unload models."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any, Optional, Tuple

from flask import Flask, request

from kobold_backend.server.config import ServerConfig
from kobold_backend.server.errors import Unauthorized, error_response
from kobold_backend.server.openai_schemas import OpenAIError

# Routes a client may call without the key: discovery (is the server protected?) and the API description.
PUBLIC_SUFFIXES = ("/api/extra/version", "/info/version", "/info/version/latest", "/info/version/list",
                   "/openapi.json")
ALLOWED_HEADERS = "Content-Type, Authorization, apikey, genkey, X-Requested-With"
ALLOWED_METHODS = "GET, POST, PUT, OPTIONS"
# With CORS open to every origin ("*"), pages may not PUT: PUT /api/v1/model loads and unloads models.
WILDCARD_METHODS = "GET, POST, OPTIONS"
# Routes that change which model is loaded: they take JSON only (or a custom header), which a cross-site page can
# send only after a CORS preflight, never as a "simple" form or text/plain request.
MODEL_ROUTES = ("/api/v1/model", "/api/latest/model", "/ui/load")
STATE_METHODS = ("POST", "PUT")
CUSTOM_HEADER = "X-Requested-With"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name part of a Host header: `127.0.0.1:5001` -> 127.0.0.1, `[::1]:5001` -> ::1."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(config_host: str, header: str) -> bool:
    """On a loopback bind only loopback names reach the server: a page whose own name was re-pointed at 127.0.0.1
    (DNS rebinding) sends its own name as Host and is refused. Other binds accept any Host."""
    if not is_loopback(config_host):
        return True
    name = host_name(header)
    return name in LOOPBACK_NAMES or name == config_host.strip("[]").lower() or is_loopback(name) \
        or name.endswith(".localhost")


def cross_site_simple(method: str, path: str, content_type: str, headers: Any) -> bool:
    """A request to a model route that a cross-site page could send without a preflight."""
    if method not in STATE_METHODS or path.rstrip("/") not in MODEL_ROUTES:
        return False
    return content_type.split(";", 1)[0].strip().lower() != "application/json" and CUSTOM_HEADER not in headers


def is_openai_path(path: str) -> bool:
    """/v1 and every path under it (answered in OpenAI's shapes, whether a route matches it or not)."""
    return path == "/v1" or path.startswith("/v1/")


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
    def _check_host_and_origin() -> Any:
        if not host_allowed(config.host, request.headers.get("Host", "")):
            msg = "This server answers only to localhost names on a loopback bind (Host header refused)."
            if is_openai_path(request.path):
                return error_response(403, {"error": {"message": msg, "type": "invalid_request_error",
                                                      "param": None, "code": "forbidden"}})
            return error_response(403, {"detail": {"msg": msg, "type": "forbidden"}})
        if cross_site_simple(request.method, request.path, request.headers.get("Content-Type", ""), request.headers):
            return error_response(415, {"detail": {"msg": "Send this request with Content-Type: application/json "
                                                          f"(or an {CUSTOM_HEADER} header).",
                                                   "type": "unsupported_media_type"}})
        return None

    @app.before_request
    def _check_key() -> Any:
        if config.api_key and request.method != "OPTIONS" and is_openai_path(request.path):
            if not key_ok(config.api_key):  # every /v1 path, routed or not, in OpenAI's shape
                body = OpenAIError("Incorrect API key provided.", 401, None, "invalid_api_key").body()
                return error_response(401, body, {"WWW-Authenticate": "Bearer"})
        elif config.api_key and request.method != "OPTIONS" and _needs_key(request.path):
            if not key_ok(config.api_key):
                e = Unauthorized()
                return error_response(e.status, e.body(), {"WWW-Authenticate": "Bearer"})
        return None

    @app.after_request
    def _cors(resp: Any) -> Any:
        if request.path.startswith("/api/"):
            methods = WILDCARD_METHODS if "*" in config.cors_origins else ALLOWED_METHODS
            add_cors_headers(resp, config.cors_origins, methods, ALLOWED_HEADERS)
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
