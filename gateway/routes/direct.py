"""The completion endpoints called straight from the middleware stack, past FastAPI's routing.

Every completion pays the gateway's own handling, so the endpoints it exists for take the shortest way through it:
``DirectRoutes`` sits innermost among the app's middleware (inside ``RequestTimer`` and ``AdmissionMiddleware``,
which still see every request) and calls the endpoint of a POST to one of ``ROUTES`` itself. What it leaves out
is what these endpoints never use: route matching over every route, the exception middleware's wrapping, the
dependency solver and the exit stack (they take the ``Request`` alone and return a ``Response``). Measured with a
worker that answers at once, these layers were about a sixth of the gateway's CPU for a text request.

Errors come out as they would through FastAPI: a ``GatewayError`` raised before the response starts is answered by
the same handler (gateway/errors.py), anything else goes on to the server-error handler outside. FastAPI still
lists these routes (OpenAPI, ``/docs``) and answers their other methods (405).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette._utils import get_route_path
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import GatewayError, gateway_error_response
from gateway.routes.openai_api import chat_completions, completions

Endpoint = Callable[[Request], Awaitable[Response]]

ROUTES: Mapping[str, Endpoint] = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}


class DirectRoutes:
    """ASGI middleware: a POST to one of ``routes`` runs its endpoint here; anything else goes on to the app."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Endpoint] = ROUTES) -> None:
        self.app, self.routes = app, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.routes.get(get_route_path(scope)) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            response = await endpoint(Request(scope, receive, send))
        except GatewayError as exc:
            response = gateway_error_response(exc)
        await response(scope, receive, send)
