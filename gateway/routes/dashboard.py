"""GET /dashboard: the operator page (dashboards/operator.html). The page holds no figures: it reads them from the
admin API with the admin token, so it may be served to anyone; without the token it shows the API's refusal."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from dashboards import operator_page

router = APIRouter()
_PAGE = operator_page()


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    # The page asks for no third-party resources; it may only talk to this origin.
    return HTMLResponse(_PAGE, headers={"Cache-Control": "no-cache", "Content-Security-Policy":
                                        "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                        "connect-src 'self'; frame-ancestors 'none'"})
