"""The coordinator's ASGI app, assembled from the routes of routes.py around one `Coordinator`
(service.py), with the agents' beats answered in front of it (wire/beats.py).
"""

from __future__ import annotations

from fastapi import FastAPI

from pitstop import __version__
from pitstop.coordinator import dashboard, routes
from pitstop.coordinator.driver import Driver
from pitstop.coordinator.leadership import Leadership
from pitstop.coordinator.service import Coordinator
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.standby import LeaderGate
from pitstop.coordinator.store import BaseStore
from pitstop.httpapi import install_error_handlers
from pitstop.wire.beats import BeatFastPath


def build(settings: CoordinatorSettings, store: BaseStore | None = None,
          lead: Leadership | None = None) -> tuple[BeatFastPath, Driver]:
    """The coordinator's ASGI app (the FastAPI app, at `.app`, behind the beats' fast path) and driver.
    lead: this coordinator's side of the lease (server.py); while it does not lead, the app answers
    reads only (coordinator/standby.py)."""
    c = Coordinator(settings, store, lead)
    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN, and the dashboard's token
    # sits in this origin's sessionStorage; the API is described at /openapi.json.
    app = FastAPI(title="pitstop coordinator", version=__version__, docs_url=None, redoc_url=None,
                  description="Evacuate GPU hosts without stopping the training jobs on them.")
    install_error_handlers(app)
    app.add_middleware(LeaderGate, view=lambda: None if c.leading() else (lead.view() if lead else None))
    app.state.coordinator = c
    app.include_router(routes.open_routes)
    app.include_router(dashboard.router)
    app.include_router(routes.agents)
    app.include_router(routes.operators)
    app.include_router(routes.handles)
    beats = c.metrics.heartbeats
    return BeatFastPath(app, beat=c.beat_seen, token=settings.cluster_token, count=beats.labels("beat").inc,
                        count_udp=beats.labels("beat_udp").inc), c.driver
