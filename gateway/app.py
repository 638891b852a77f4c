"""The gateway's FastAPI app factory."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from gateway.admission import AdmissionMiddleware
from gateway.config import GatewayConfig
from gateway.errors import install_error_handlers
from gateway.metrics import RequestTimer
from gateway.routes import admin, dashboard, health, openai_api
from gateway.routes.direct import DirectRoutes
from gateway.services import Services


def create_app(config: GatewayConfig) -> FastAPI:
    """Build an app for ``config``. Workers are polled and clients opened in the lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.build(config)
        app.state.services = services
        try:
            await services.start()  # a start that fails (the shared books away, say) still closes what it opened
            yield
        finally:
            await services.aclose()

    app = FastAPI(title="revisit gateway", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(DirectRoutes)  # the completion endpoints past FastAPI's routing (gateway/routes/direct.py)
    app.add_middleware(AdmissionMiddleware)  # who calls, and how much they have in flight (gateway/admission.py)
    app.add_middleware(RequestTimer)  # revisit_requests_total and the latency histograms (gateway/metrics.py)
    app.include_router(openai_api.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    app.include_router(admin.metrics_router)
    app.include_router(dashboard.router)
    return app
