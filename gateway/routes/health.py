"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when at least one worker is healthy, else 503; lists every worker's state."""
    pool = request.app.state.services.pool
    ready = pool.ready
    body = {
        "status": "ok" if ready else "unavailable",
        "workers": [w.snapshot() for w in pool.workers],
    }
    return JSONResponse(body, status_code=200 if ready else 503)
