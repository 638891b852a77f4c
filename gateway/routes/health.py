"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when at least one worker is healthy, else 503; lists every worker's state, and how many requests went to
    a silent worker for want of a healthy one (gateway/workers.py, the last resort)."""
    pool = request.app.state.services.pool
    ready = pool.ready
    body = {
        "status": "ok" if ready else "unavailable",
        "workers": [w.snapshot() for w in pool.workers],
        "last_resort_sent": pool.last_resort_sent,
    }
    return JSONResponse(body, status_code=200 if ready else 503)
