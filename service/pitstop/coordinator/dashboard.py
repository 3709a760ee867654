"""The coordinator's dashboard: one page and its script, served by the coordinator itself (no
server of its own to run, nothing fetched from elsewhere at run time).

The page holds no data: its script reads hosts, jobs and operations from the REST API with the
read or operator token, which the operator gives in the address's fragment (`/dashboard#token=...`,
never sent to a server) or in the page's form.  Without one the API refuses, and the page says so.
Plain HTML and a small script rather than a framework or a built bundle: nothing to build, nothing
to keep up to date, and it works where the cluster has no way out to the internet.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Response

router = APIRouter(include_in_schema=False)

CSP = ("default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache",
           "Referrer-Policy": "no-referrer"}


def _file(name: str) -> bytes:
    return resources.files("pitstop.coordinator").joinpath(name).read_bytes()


@router.get("/dashboard")
def page() -> Response:
    return Response(_file("dashboard.html"), media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/dashboard/app.js")
def script() -> Response:
    return Response(_file("dashboard.js"), media_type="text/javascript; charset=utf-8", headers=HEADERS)
