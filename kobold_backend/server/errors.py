"""HTTP error shapes of KoboldAI United and KoboldCpp, and the handlers that turn every exception into one
(no traceback ever reaches a client)."""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from kobold_backend.errors import OutOfContextError, RequestError

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as {"detail": {"msg", "type"}} with `status`."""

    status = 500
    type = "generic.error_500"
    msg = "Internal server error."

    def __init__(self, msg: Optional[str] = None, status: Optional[int] = None, type: Optional[str] = None) -> None:
        super().__init__(msg or self.msg)
        self.msg = msg or self.msg
        self.status = status or self.status
        self.type = type or self.type

    def body(self) -> Dict[str, Any]:
        return {"detail": {"msg": self.msg, "type": self.type}}


class NoModelLoaded(ApiError):
    status = 501
    type = "not_implemented"
    msg = "No model is loaded."


class Unauthorized(ApiError):
    status = 401
    type = "unauthorized"
    msg = "Authentication key is missing or invalid."

    def body(self) -> Dict[str, Any]:
        return {"detail": {"error": "Unauthorized", "msg": self.msg, "type": self.type}}


class BadJson(ApiError):
    status = 400
    type = "bad_input"
    msg = "The request body is not valid JSON."


BUSY_MESSAGE = "Server is busy; please try again later."


def error_response(status: int, body: Dict[str, Any], headers: Optional[Dict[str, str]] = None) -> Response:
    resp = jsonify(body)
    resp.status_code = status
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


def register_error_handlers(app: Flask) -> None:
    """Map every exception to KoboldAI's JSON shapes."""
    from kobold_backend.server.queue import ServiceBusy
    from kobold_backend.server.schemas import ValidationFailed

    @app.errorhandler(ApiError)
    def _api_error(e: ApiError) -> Any:
        return error_response(e.status, e.body())

    @app.errorhandler(ValidationFailed)
    def _validation(e: ValidationFailed) -> Any:
        return error_response(422, {"detail": e.errors})

    @app.errorhandler(RequestError)
    def _request_error(e: RequestError) -> Any:
        return error_response(422, {"detail": {e.field or "_schema": [str(e)]}})

    @app.errorhandler(OutOfContextError)
    def _overflow(e: OutOfContextError) -> Any:
        return error_response(500, {"detail": {"msg": str(e), "type": "token_overflow"}})

    @app.errorhandler(ServiceBusy)
    def _busy(e: ServiceBusy) -> Any:
        return error_response(503, {"detail": {"msg": BUSY_MESSAGE, "type": "service_unavailable"}})

    @app.errorhandler(HTTPException)
    def _http(e: HTTPException) -> Any:
        code = e.code or 500
        headers = {k: v for k, v in e.get_headers() if k.lower() != "content-type"}
        if request.path == "/v1" or request.path.startswith("/v1/"):  # a /v1 path no route matched
            from kobold_backend.server.openai_schemas import OpenAIError

            return error_response(code, OpenAIError(e.description or e.name, code).body(), headers)
        body = {"detail": {"msg": e.description or e.name, "type": f"generic.error_{code}"}}
        return error_response(code, body, headers)

    @app.errorhandler(Exception)
    def _unexpected(e: Exception) -> Any:
        import torch

        if isinstance(e, torch.cuda.OutOfMemoryError):
            log.error("out of GPU memory: %s", e)
            return error_response(507, {"detail": {"msg": "Out of GPU memory.",
                                                   "type": "out_of_memory.gpu.cuda"}})
        log.exception("unhandled error")
        return error_response(500, ApiError().body())
