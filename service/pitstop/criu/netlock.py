"""CRIU's nftables network lock, lifted when pitstop is done with a dump.

A dump with --tcp-established adds a table `inet CRIU-<run id prefix>` that
drops the dumped connections' packets, and leaves it in place (by design: the
connections must stay silent until they are restored).  Nothing removes it
afterwards, so pitstop does: on rollback (otherwise the resumed source could
never talk again) and on commit (otherwise a later connection that reuses the
same four-tuple would be silently dropped).
"""

from __future__ import annotations

import subprocess

from pitstop.criu import runtime

NFT_TIMEOUT_S = 30  # one `nft` command: milliseconds unless the kernel is stuck


def tables(rt: runtime.CriuRuntime | None = None) -> list[tuple[str, str]]:
    """Every CRIU lock table on this host's ruleset, as (family, name)."""
    rt = rt or runtime.locate()
    if not rt.nft:
        return []
    p = subprocess.run([rt.nft, "list", "tables"], capture_output=True, text=True, timeout=NFT_TIMEOUT_S)
    out = []
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "table" and parts[2].startswith("CRIU-"):
            out.append((parts[1], parts[2]))
    return out


def release(run_id: str, rt: runtime.CriuRuntime | None = None) -> list[str]:
    """Delete the lock tables that belong to dump `run_id`; return their names."""
    if not run_id:
        return []
    rt = rt or runtime.locate()
    removed: list[str] = []
    if rt.nft is None:
        return removed
    for family, name in tables(rt):
        suffix = name[len("CRIU-"):]
        if suffix and run_id.startswith(suffix):
            subprocess.run([rt.nft, "delete", "table", family, name], capture_output=True, timeout=NFT_TIMEOUT_S)
            removed.append(name)
    return removed
