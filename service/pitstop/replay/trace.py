"""A failure and maintenance trace: what happened to which host, when, and in which failure domain.

Read from CSV (a header with time_h, host, kind, domain) or JSON (a list of such objects, or
{"events": [...]}).  `time_h` is hours from the trace's start; `kind` is planned (maintenance,
a drain: the host can still be read) or unplanned (it died).  A bad row is refused with its
line and what is wrong, before anything is computed.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from pitstop.errors import InvalidRequest

Kind = Literal["planned", "unplanned"]
KINDS = ("planned", "unplanned")
FIELDS = ("time_h", "host", "kind", "domain")


@dataclass(frozen=True)
class Event:
    time_h: float
    host: str
    kind: Kind
    domain: str


def _event(row: dict, where: str) -> Event:
    missing = [f for f in FIELDS if row.get(f) in (None, "")]
    if missing:
        raise InvalidRequest(f"{where}: missing {', '.join(missing)}", code="bad_trace",
                             action=f"every event needs {', '.join(FIELDS)}")
    try:
        t = float(row["time_h"])
    except (TypeError, ValueError):
        raise InvalidRequest(f"{where}: time_h {row['time_h']!r} is not a number of hours", code="bad_trace",
                             action="give hours from the trace's start, e.g. 12.5") from None
    if not math.isfinite(t):
        raise InvalidRequest(f"{where}: time_h {row['time_h']!r} is not a finite number of hours", code="bad_trace",
                             action="give hours from the trace's start, e.g. 12.5")
    if t < 0:
        raise InvalidRequest(f"{where}: time_h {t} is before the trace's start", code="bad_trace",
                             action="give hours from the trace's start (0 or more)")
    kind = str(row["kind"]).strip().lower()
    if kind not in KINDS:
        raise InvalidRequest(f"{where}: kind {row['kind']!r} is neither planned nor unplanned", code="bad_trace",
                             action="planned: maintenance or a drain; unplanned: the host died")
    return Event(t, str(row["host"]), kind, str(row["domain"]))  # type: ignore[arg-type]


def read(path: Path) -> list[Event]:
    """The trace's events in time order."""
    try:
        text = path.read_text()
    except OSError as e:
        raise InvalidRequest(f"cannot read trace {path}: {e.strerror}", code="bad_trace",
                             action="give the path of a CSV or JSON trace") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise InvalidRequest(f"{path} is not JSON: {e}", code="bad_trace",
                                 action="give a list of events or {\"events\": [...]}") from None
        rows = data.get("events") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise InvalidRequest(f"{path}: no list of events in it", code="bad_trace",
                                 action="give a list of events or {\"events\": [...]}")
        events = [_event(r if isinstance(r, dict) else {}, f"{path} event {i}") for i, r in enumerate(rows)]
    else:
        reader = csv.DictReader(text.splitlines())
        if not reader.fieldnames or not set(FIELDS) <= set(reader.fieldnames):
            raise InvalidRequest(f"{path}: the CSV header must name {', '.join(FIELDS)}", code="bad_trace",
                                 action="write a header line: time_h,host,kind,domain")
        events = [_event(r, f"{path} line {i + 2}") for i, r in enumerate(reader)]
    if not events:
        raise InvalidRequest(f"{path} has no events", code="bad_trace", action="give at least one event")
    return sorted(events, key=lambda e: e.time_h)


def write(events: list[Event], path: Path) -> None:
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps({"events": [asdict(e) for e in events]}, indent=1) + "\n")
        return
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for e in events:
            w.writerow(asdict(e))


# Rates for a synthetic trace, from a public report (override any of them):
# Meta's Llama 3 paper (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4): in a
# 54-day snapshot of pre-training on 16,384 H100 GPUs (2,048 hosts of 8), 466 job interruptions,
# 47 of them planned (automated maintenance, firmware upgrades, operators' changes) and 419
# unexpected (78 % of those attributed to hardware).  Per host and day:
LLAMA3_HOSTS = 2048
LLAMA3_DAYS = 54
UNPLANNED_PER_HOST_DAY = 419 / (LLAMA3_HOSTS * LLAMA3_DAYS)   # about 0.0038
PLANNED_PER_HOST_DAY = 47 / (LLAMA3_HOSTS * LLAMA3_DAYS)      # about 0.00042
# Not in that report, assumed: hosts per rack, and the share of unplanned events that take a
# whole rack (a power or top-of-rack switch fault) rather than one host.
HOSTS_PER_RACK = 16
RACK_EVENT_SHARE = 0.02


def synthesize(hosts: int, days: float, seed: int = 0, unplanned_per_host_day: float = UNPLANNED_PER_HOST_DAY,
               planned_per_host_day: float = PLANNED_PER_HOST_DAY, hosts_per_rack: int = HOSTS_PER_RACK,
               rack_event_share: float = RACK_EVENT_SHARE) -> list[Event]:
    """Independent per-host events (Poisson arrivals) at the given rates, a small share of the
    unplanned ones taking a whole rack at once; the failure domain of a host is its rack."""
    if hosts < 1 or days <= 0 or hosts_per_rack < 1:
        raise InvalidRequest("a synthetic trace needs hosts >= 1, days > 0 and hosts per rack >= 1",
                             code="bad_trace", action="check --hosts, --days and --hosts-per-rack")
    rng = random.Random(seed)
    span_h = days * 24
    racks = (hosts + hosts_per_rack - 1) // hosts_per_rack

    def rack(h: int) -> str:
        return f"rack-{h // hosts_per_rack:03d}"

    def arrivals(rate_per_h: float) -> list[float]:
        out: list[float] = []
        t = 0.0
        if rate_per_h <= 0:
            return out
        while True:
            t += rng.expovariate(rate_per_h)
            if t >= span_h:
                return out
            out.append(t)

    events: list[Event] = []
    fleet_unplanned = unplanned_per_host_day * hosts / 24
    for t in arrivals(fleet_unplanned * (1 - rack_event_share)):
        h = rng.randrange(hosts)
        events.append(Event(round(t, 3), f"host-{h:05d}", "unplanned", rack(h)))
    # a rack event's rate: its share of the unplanned host-events, each taking hosts_per_rack hosts
    for t in arrivals(fleet_unplanned * rack_event_share / hosts_per_rack):
        r = rng.randrange(racks)
        for h in range(r * hosts_per_rack, min(hosts, (r + 1) * hosts_per_rack)):
            events.append(Event(round(t, 3), f"host-{h:05d}", "unplanned", rack(h)))
    for t in arrivals(planned_per_host_day * hosts / 24):
        h = rng.randrange(hosts)
        events.append(Event(round(t, 3), f"host-{h:05d}", "planned", rack(h)))
    return sorted(events, key=lambda e: (e.time_h, e.host))
