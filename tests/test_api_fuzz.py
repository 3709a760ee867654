"""The REST APIs fuzzed from their own OpenAPI schemas (schemathesis): whatever a client
sends, no 5xx, and a rejected request changes nothing.  In-process ASGI apps: the
coordinator with an empty fleet, and an agent with no workers."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from pitstop.agent.agent import Agent
from pitstop.agent.api import peer_app
from pitstop.agent.settings import AgentSettings
from pitstop.coordinator.api import build
from pitstop.coordinator.settings import CoordinatorSettings

pytestmark = pytest.mark.timeout(600)
OPERATOR, CLUSTER = "op-token", "cluster-token"


def _coordinator(tmp):
    app, driver = build(CoordinatorSettings(db=tmp / "c.db", operator_token=OPERATOR, cluster_token=CLUSTER))
    return app, driver


def _agent(tmp):
    s = AgentSettings(name="fuzz", state_dir=tmp / "agent", image_dir=tmp / "images", cluster_token=CLUSTER,
                      image_mount=False)  # an in-process agent: nothing would unmount it
    return peer_app(Agent(s))


FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                database=None)
# Schemas are read at import (schemathesis parametrizes at collection); the apps' state lives
# in a temporary directory that the module fixture removes.
_TMP = Path(tempfile.mkdtemp(prefix="pitstop-fuzz-"))
atexit.register(shutil.rmtree, _TMP, True)  # also when no test of this module runs (a -k elsewhere)
COORD_APP, DRIVER = _coordinator(_TMP)
AGENT_APP = _agent(_TMP)
coordinator_schema = schemathesis.openapi.from_asgi("/openapi.json", COORD_APP)
agent_schema = schemathesis.openapi.from_asgi("/openapi.json", AGENT_APP)


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    shutil.rmtree(_TMP, ignore_errors=True)


@coordinator_schema.parametrize()
@FUZZ
def test_coordinator_never_5xx_and_rejections_change_nothing(case):
    store = DRIVER.store
    token = CLUSTER if "heartbeat" in case.path else OPERATOR
    before = (len(store.ops()), len(store.hosts()))
    r = case.call(headers={"Authorization": f"Bearer {token}"})
    assert r.status_code < 500, (case.method, case.path, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert (len(store.ops()), len(store.hosts())) == before
        body = r.json()
        assert body["error"]["message"] and "action" in body["error"], body


@agent_schema.parametrize()
@FUZZ
def test_agent_never_5xx_and_rejections_change_nothing(case):
    r = case.call(headers={"Authorization": f"Bearer {CLUSTER}"})
    assert r.status_code < 500, (case.method, case.path, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text[:300]
