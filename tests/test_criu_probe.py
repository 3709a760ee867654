"""Which CRIU runs: the one pitstop carries first (criu/patches/), unless PITSTOP_CRIU_STOCK; among
stock ones, a host CRIU older than pitstop's floor is used when a real dump and restore on this
kernel passes (criu/criuprobe.py), and passed over, with the reason, when it fails.  The "older"
host CRIU is the real one behind a wrapper that reports 4.1, so the probe is real."""

from __future__ import annotations

import pytest

from pitstop.criu import criuprobe, runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
def fake_host_criu(tmp_path, monkeypatch):
    real = runtime.locate().binary
    bindir = tmp_path / "bin"
    bindir.mkdir()

    def make(dump_fails: bool) -> str:
        crippled = 'if [ "$1" = dump ]; then echo "Error (criu/sk-inet.c): Can\'t get 1:16 opt" >&2; exit 1; fi\n' \
            if dump_fails else ""
        f = bindir / "criu"
        f.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "Version: 4.1"; exit 0; fi\n{crippled}'
                     f'exec "{real}" "$@"\n')
        f.chmod(0o755)
        runtime.locate.cache_clear()
        criuprobe.passes.cache_clear()
        return str(f)

    monkeypatch.setenv("PATH", f"{bindir}:{__import__('os').environ['PATH']}")
    monkeypatch.delenv("PITSTOP_CRIU", raising=False)
    monkeypatch.delenv("PITSTOP_FORCE_PRIVATE_CRIU", raising=False)
    monkeypatch.setenv("PITSTOP_CRIU_STOCK", "1")  # the choice among stock CRIUs; the carried one would win
    yield make
    runtime.locate.cache_clear()
    criuprobe.passes.cache_clear()


def test_an_older_host_criu_that_works_here_is_used(fake_host_criu):
    host = fake_host_criu(dump_fails=False)
    rt = runtime.locate()
    assert (rt.binary, rt.version, rt.source) == (host, (4, 1), "host")


def test_an_older_host_criu_that_fails_here_is_passed_over_for_the_private_one(fake_host_criu):
    host = fake_host_criu(dump_fails=True)
    ok, why = criuprobe.probe(host)
    assert not ok and why.startswith("dump failed")
    rt = runtime.locate()
    assert rt.binary != host and rt.source != "host"


def test_the_carried_criu_runs_first_unless_the_stock_one_is_asked_for(tmp_path, monkeypatch):
    real = runtime.locate().binary
    prefix = tmp_path / "carried"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "pycriu").mkdir()
    criu = prefix / "bin" / "criu"
    criu.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "Version: 4.2.1"; exit 0; fi\nexec "{real}" "$@"\n')
    criu.chmod(0o755)
    (prefix / "PATCHES").write_text("# the series\n0001-a.patch\n\n0002-b.patch\n")
    monkeypatch.setenv("PITSTOP_CRIU_CARRIED_PREFIX", str(prefix))
    monkeypatch.delenv("PITSTOP_CRIU", raising=False)
    monkeypatch.delenv("PITSTOP_CRIU_STOCK", raising=False)
    try:
        runtime.locate.cache_clear()
        rt = runtime.locate()
        assert (rt.binary, rt.source, rt.carried, rt.patches) == (str(criu), "carried", True,
                                                                 ("0001-a.patch", "0002-b.patch"))
        assert rt.pycriu_path == str(prefix / "pycriu")
        monkeypatch.setenv("PITSTOP_CRIU_STOCK", "1")
        runtime.locate.cache_clear()
        rt = runtime.locate()
        assert rt.source != "carried" and not rt.carried and rt.patches == ()
    finally:
        runtime.locate.cache_clear()
