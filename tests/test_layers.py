"""Imports run one way: entry points on top, the two services below them, the wire contract
under the services, mechanisms under that, and the ground (errors, settings plumbing, TLS)
at the bottom.  docs/architecture.md ("Packages and the direction of imports") draws the same
layers; this test is what keeps them true.

Rule: a module may import a module of a lower layer, or of its own unit (package or top-level
module).  Two units of one layer may not import each other (the agent and the coordinator talk
only through pitstop.wire), except on the ground, whose small modules may use one another.
Every import counts, including those inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "service" / "pitstop"

# Top to bottom.  A new package or top-level module must be placed here (see the last test).
LAYERS: list[tuple[str, set[str]]] = [
    ("entry", {"cli"}),
    ("tools", {"dev", "doctor", "migration", "replay"}),
    ("services", {"agent", "coordinator", "launcher", "slurm"}),
    ("wire", {"wire"}),
    ("mechanisms", {"gpu", "shimctl", "network", "memory", "container"}),
    ("criu", {"criu"}),
    ("transfer", {"transfer"}),
    ("proc", {"proc"}),
    ("ground", {"errors", "logs", "safepath", "nsinit", "endpoints", "httpapi", "faults", "tls", "nativelib",
                "stopping", "sdnotify", "priority", "undo", "fdlimit", "__init__"}),
]
GROUND = "ground"


def _module_name(path: Path) -> tuple[list[str], bool]:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    return (parts[:-1] if is_pkg else parts), is_pkg


def _exists(mod: str) -> bool:
    p = PKG.parent / mod.replace(".", "/")
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path, source: str | None = None) -> set[str]:
    """The pitstop modules `path` imports (relative imports resolved; `from P import m` counts m
    where m is a module)."""
    parts, is_pkg = _module_name(path)
    found: set[str] = set()
    for n in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = parts if is_pkg else parts[:-1]
                base = base[:len(base) - (n.level - 1)]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            subs = {f"{mod}.{a.name}" for a in n.names if _exists(f"{mod}.{a.name}")}
            found |= subs or {mod}
    return {m for m in found if m == "pitstop" or m.startswith("pitstop.")}


def layer_of(unit: str) -> int:
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    raise KeyError(unit)


def violations(files: dict[Path, str | None]) -> list[str]:
    bad = []
    for path, source in files.items():
        here = _unit(".".join(_module_name(path)[0]))
        for mod in sorted(imports_of(path, source)):
            there = _unit(mod)
            if there == here or mod == "pitstop":
                continue
            a, b = layer_of(here), layer_of(there)
            if a > b or (a == b and LAYERS[a][0] != GROUND):
                bad.append(f"{path.relative_to(PKG.parent)} ({LAYERS[a][0]}) imports {mod} ({LAYERS[b][0]})")
    return bad


def _tree() -> dict[Path, str | None]:
    return {p: None for p in PKG.rglob("*.py")}


def test_imports_run_one_way():
    assert violations(_tree()) == []


def test_an_upward_or_sideways_import_is_caught():
    """The check itself can fail: CRIU's driver reaching up into the agent, and the coordinator
    importing the agent (same layer, not through the wire) are both reported."""
    up = {PKG / "criu" / "criu_ops.py": "from ..agent import state\n"}
    side = {PKG / "coordinator" / "driver.py": "def f():\n    from pitstop.agent import capturing\n"}
    assert violations(up) == ["pitstop/criu/criu_ops.py (criu) imports pitstop.agent.state (services)"]
    assert violations(side) == ["pitstop/coordinator/driver.py (services) imports pitstop.agent.capturing (services)"]


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
             if (p.suffix == ".py") or (p / "__init__.py").exists()}
    placed = set().union(*(u for _, u in LAYERS))
    assert units - placed == set(), "place these in LAYERS (tests/test_layers.py) and docs/architecture.md"
    assert placed - units == set(), "these are in LAYERS but no longer exist"


def circles(files: dict[Path, str | None]) -> list[list[str]]:
    """Modules that import one another, directly or round a loop (every import counts, those for
    type checking too): each circle once, as its modules in import order."""
    graph: dict[str, set[str]] = {}
    for path, source in files.items():
        name = ".".join(_module_name(path)[0])
        graph.setdefault(name, set()).update(m for m in imports_of(path, source) if m != name and m != "pitstop")
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                loop = path[path.index(n):]
                if frozenset(loop) not in seen:
                    seen.add(frozenset(loop))
                    found.append(loop)
            elif n in graph and not state.get(n):
                walk(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            walk(m)
    return found


def test_no_two_modules_import_each_other():
    """Within a unit too: a circle (the agent and its snapshots, the coordinator's service and its
    takeover, each needing the other) means neither can be read, tested or changed alone; the
    lower one names what it needs (a Protocol, or the collaborators themselves) instead."""
    assert circles(_tree()) == []


def test_a_circle_is_caught():
    a = {PKG / "agent" / "agent.py": "from pitstop.agent.snapshots import Snapshots\n",
         PKG / "agent" / "snapshots.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from pitstop.agent.agent import Agent\n"}
    assert circles(a) == [["pitstop.agent.agent", "pitstop.agent.snapshots"]]


HTTP_CALLS = {"Client", "AsyncClient", "get", "post", "put", "patch", "delete", "request", "stream"}


def http_clients_outside_wire(files: dict[Path, str | None]) -> list[str]:
    """Every place outside pitstop.wire (and the dev tools that stand clusters up) that makes an
    HTTP client or call of its own: the services talk to each other only through the wire's
    clients, each call with a named deadline."""
    bad = []
    for path, source in files.items():
        unit = _unit(".".join(_module_name(path)[0]))
        if unit in ("wire", "dev"):
            continue
        for n in ast.walk(ast.parse(source if source is not None else path.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in HTTP_CALLS and isinstance(n.value, ast.Name) \
                    and n.value.id == "httpx":
                bad.append(f"{path.relative_to(PKG.parent)}:{n.lineno} httpx.{n.attr}")
    return bad


def test_no_http_client_outside_the_wire():
    assert http_clients_outside_wire(_tree()) == []
    made = {PKG / "agent" / "heartbeat.py": "import httpx\nc = httpx.AsyncClient(timeout=5.0)\n"}
    assert http_clients_outside_wire(made) == ["pitstop/agent/heartbeat.py:2 httpx.AsyncClient"]
