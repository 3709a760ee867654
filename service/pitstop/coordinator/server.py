"""Run the coordinator."""

from __future__ import annotations

import structlog
import uvicorn

from ..errors import FailedPrecondition
from .api import build
from .settings import CoordinatorSettings

log = structlog.get_logger("pitstop.coordinator")


def serve(s: CoordinatorSettings) -> None:
    if not s.insecure and not (s.operator_token and s.cluster_token):
        missing = [n for n, v in (("PITSTOP_TOKEN", s.operator_token), ("PITSTOP_CLUSTER_TOKEN", s.cluster_token))
                   if not v]
        raise FailedPrecondition(f"refusing to start without {' and '.join(missing)}", code="no_token",
                                 action="set them (operators use PITSTOP_TOKEN, agents PITSTOP_CLUSTER_TOKEN), "
                                        "or pass --insecure for local development")
    app, driver = build(s)
    touched = driver.reconcile()
    host, port = s.host_port()
    log.info("coordinator up", listen=s.listen, db=str(s.db), reconciled=touched)
    uvicorn.run(app, host=host, port=port, log_level="warning", lifespan="off")
