"""grafana/pitstop.json asks only for what the services export: every metric its queries name is
in the /metrics of a real coordinator and a real agent (in process), with a suffix its type has."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pitstop.agent.agent import Agent
from pitstop.agent.api import peer_app
from pitstop.agent.settings import AgentSettings
from pitstop.coordinator.api import build
from pitstop.coordinator.settings import CoordinatorSettings

DASHBOARD = Path(__file__).resolve().parent.parent / "grafana" / "pitstop.json"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "info": ("_info",)}


def _series(text: str) -> set[str]:
    out = set()
    for fam in text_string_to_metric_families(text):
        out |= {fam.name + s for s in SUFFIXES.get(fam.type, ("",))}
    return out


def _exported(tmp_path: Path) -> set[str]:
    app, _ = build(CoordinatorSettings(db=tmp_path / "c.db", operator_token="o", cluster_token="c"))
    with TestClient(app) as c:
        coordinator = c.get("/metrics").text
    agent = Agent(AgentSettings(name="g", state_dir=tmp_path / "agent", image_dir=tmp_path / "images",
                                cluster_token="c", image_mount=False))
    with TestClient(peer_app(agent)) as c:
        agent_text = c.get("/metrics").text
    return _series(coordinator) | _series(agent_text)


def _queries() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def test_every_query_names_a_metric_that_exists(tmp_path):
    exported = _exported(tmp_path)
    queries = _queries()
    assert len(queries) >= 12
    named = {m for q in queries for m in re.findall(r"\bpitstop_[a-z0-9_]+", q)}
    assert named, "the dashboard's queries name no pitstop metric"
    missing = sorted(named - exported)
    assert not missing, f"the dashboard asks for metrics nobody exports: {missing}"
    # what the dashboard is for: moves, the pause, bytes, health
    for needed in ("pitstop_coordinator_evacuation_downtime_seconds_bucket", "pitstop_coordinator_operations_total",
                   "pitstop_coordinator_transferred_bytes_total", "pitstop_coordinator_hosts_degraded"):
        assert needed in named


def test_the_check_catches_a_metric_that_does_not_exist(tmp_path):
    exported = _exported(tmp_path)
    assert "pitstop_coordinator_evacuations_total" not in exported  # a plausible name nobody exports
    assert "pitstop_coordinator_evacuation_downtime_seconds_bucket" in exported
