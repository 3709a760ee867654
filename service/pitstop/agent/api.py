"""The agent's two HTTP apps, assembled from the routers declared once in their own modules.

Two listeners, two audiences:
- TCP, for peers and the coordinator (peer_routes.py): every request but /healthz and /metrics
  needs the cluster token (PITSTOP_CLUSTER_TOKEN).
- a Unix socket, for `pitstop run` on this host (local_routes.py): registration and output.
  Its file mode (0660, root) is the access check.
Both answer the reads of shared_routes.py.  The routes reach the `Agent` through the app's state.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI

from pitstop import __version__
from pitstop.agent import local_routes, peer_routes, shared_routes, snapshot_routes
from pitstop.agent.agent import Agent
from pitstop.httpapi import install_error_handlers


def peer_app(agent: Agent) -> FastAPI:
    app = FastAPI(title="pitstop agent", version=__version__, docs_url=None, redoc_url=None)  # no CDN scripts
    install_error_handlers(app)
    app.state.agent = agent
    app.include_router(peer_routes.open_router)
    app.include_router(shared_routes.router, prefix="/v1", dependencies=[Depends(peer_routes.from_peers)])
    app.include_router(peer_routes.peers)
    app.include_router(peer_routes.router)
    app.include_router(snapshot_routes.peers)
    app.include_router(snapshot_routes.router)
    return app


def local_app(agent: Agent) -> FastAPI:
    app = FastAPI(title="pitstop agent (local)", version=__version__, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.state.agent = agent
    app.include_router(local_routes.router)
    app.include_router(shared_routes.router, prefix="/v1")
    return app
