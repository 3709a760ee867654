"""The qualification matrix's bookkeeping: each fault test records (fault, outcome, detail);
at the end the matrix is printed, and with PITSTOP_QUALIFY_DOC=path written there as markdown."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import pytest

ROWS: list[dict] = []


@pytest.fixture
def record(request):
    def add(fault: str, outcome: str, detail: str = "") -> None:
        ROWS.append({"test": request.node.name, "fault": fault, "outcome": outcome, "detail": detail[:300]})
    return add


def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201
    if call.when == "call" and call.excinfo is not None:
        ROWS.append({"test": item.name, "fault": item.name, "outcome": "FAILED",
                     "detail": str(call.excinfo.value).splitlines()[0][:300]})


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001, ANN201
    if not ROWS:
        return
    lines = ["| fault | outcome | what the operator is told / detail |", "|---|---|---|"]
    for r in ROWS:
        lines.append(f"| {r['fault']} | {r['outcome']} | {r['detail'].replace('|', '/')} |")
    table = "\n".join(lines)
    print("\n\nqualification matrix\n" + table)
    doc = os.environ.get("PITSTOP_QUALIFY_DOC")
    if doc:
        head = Path(doc).read_text().split("<!-- matrix -->")[0] if Path(doc).exists() else ""
        stamp = (f"Latest run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()} "
                 f"({os.cpu_count()} cores), `make qualify`, exit status {exitstatus}.\n\n")
        Path(doc).write_text(head + "<!-- matrix -->\n" + stamp + table + "\n")
