"""Quote CRIU back to the operator: its own Error lines are the best diagnosis."""

from __future__ import annotations

from pathlib import Path

# Logged as an Error on every run on this kernel, and harmless (docs/architecture.md).
_NOISE = ("Can't setup RLIMIT_NOFILE for self",)


def error_lines(log: Path, limit: int = 8) -> list[str]:
    """The last `limit` meaningful Error lines of a CRIU log."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    lines = [ln.strip() for ln in text.splitlines()
             if ("Error" in ln or "error" in ln.split(":", 1)[0]) and not any(n in ln for n in _NOISE)]
    return lines[-limit:]
