"""The gateway's one exception tree and its mapping to OpenAI error bodies.

Client mistakes raise a subclass of :class:`ClientError` (a 4xx); trouble with the
workers raises :class:`UpstreamError` or :class:`NoHealthyWorker`. One handler turns any
of them into ``{"error": {"message", "type", "param", "code"}}``, the body OpenAI's
clients parse. Unexpected exceptions become a 500 with the same shape and are logged.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class GatewayError(Exception):
    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.error_type, param=self.param, code=self.code)


class ClientError(GatewayError):
    """The request is wrong; retrying it unchanged will fail again."""

    status_code = 400
    error_type = "invalid_request_error"


class InvalidRequest(ClientError):
    pass


class UnprocessableImage(ClientError):
    """The bytes arrived intact but are not an image the gateway can read."""

    status_code = 422


class UnprocessableVideo(ClientError):
    """The bytes arrived intact but are not a video the gateway can read."""

    status_code = 422


class PayloadTooLarge(ClientError):
    status_code = 413


class ModelNotFound(ClientError):
    status_code = 404

    def __init__(self, model: str):
        super().__init__(
            f"The model '{model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


class Unauthorized(ClientError):
    status_code = 401
    error_type = "authentication_error"


class NoHealthyWorker(GatewayError):
    status_code = 503
    error_type = "service_unavailable"


class StoreUnavailable(GatewayError):
    """The store or the shared books did not answer (a Mooncake cluster or a Redis server away)."""

    status_code = 503
    error_type = "service_unavailable"


class UpstreamError(GatewayError):
    """A worker failed, or answered with something the gateway cannot relay."""

    status_code = 502
    error_type = "upstream_error"


class UpstreamClientError(ClientError):
    """A worker rejected the request as the client's mistake (its 4xx, relayed)."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message, param=param, code=code)
        self.status_code = status_code


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    return f"{param + ': ' if param else ''}{first.get('msg', 'invalid value')}", param


def gateway_error_response(exc: GatewayError) -> JSONResponse:
    """The answer to a GatewayError (a server error logged)."""
    if exc.status_code >= 500:
        log.warning("%s: %s", type(exc).__name__, exc.message)
    return JSONResponse(exc.body(), status_code=exc.status_code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return gateway_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(str(exc.detail), error_type, code=code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(error_body("internal error", "server_error"), status_code=500)
