"""One network call per item, all at once: the coordinator's rounds over agents and ranks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


def in_parallel(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """fn over items at once (each a network call with its own timeout); results in order,
    the first exception raised once all have ended."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(len(items), 32)) as ex:
        futures = [ex.submit(fn, x) for x in items]
        return [f.result() for f in futures]
