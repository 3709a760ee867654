"""tests/gpu (the one-shot GPU validation) exercised as far as a machine without a GPU allows:
its usage errors, its skip reasons, and the CRIU half of check (b) on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "gpu" / "gpu_check.py"
pytestmark = pytest.mark.timeout(240)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("args,msg", [
    (["--only", "x"], "--only takes letters from a,b,c,d,e,f,g"),
    (["--sizes-gib", "1,lots"], "--sizes-gib takes numbers"),
    (["--sizes-gib", "0"], "between 0 and 1024"),
    (["--steps", "10"], "--steps must be at least 100"),
    (["--host-gib", "-1"], "--host-gib must be between 0 and 65536"),
    (["--d-rounds", "0"], "--d-rounds must be between 1 and 5"),
])
def test_bad_arguments_say_what_is_wrong(args, msg, tmp_path):
    p = subprocess.run([sys.executable, str(CHECK), "--report", str(tmp_path / "r.json"), *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and msg in p.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.skipif(_cuda(), reason="a GPU is present: run tests/gpu/run.sh for the real checks")
@pytest.mark.slow
def test_run_sh_without_a_gpu_skips_every_check_with_its_reason(tmp_path):
    scratch = set(Path("/tmp").glob("pitstop-gpu-run.*"))
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "run.sh"), "--out", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads((tmp_path / "gpu-report.json").read_text())
    assert set(r["checks"]) == {"a_cuda_checkpoint_roundtrip", "b_criu_with_cuda", "c_shim_under_processgroupnccl",
                                "d_checkpoint_throughput", "e_evacuation_through_agents",
                                "f_cuda_tree_evacuation_through_agents", "g_live_device_bytes"}
    for c in r["checks"].values():
        assert c["status"] == "skipped" and c["reason"].startswith("no CUDA device"), c
    assert r["machine"]["torch"] and r["date"] and "criu" in r["machine"]
    assert set(Path("/tmp").glob("pitstop-gpu-run.*")) == scratch  # its scratch directory is gone


def _dry_run(tmp_path, only: str, timeout: float) -> dict:
    """gpu_check.py --cpu-dry-run: the checks that need no GPU, on the CPU; its report."""
    p = subprocess.run([sys.executable, str(CHECK), "--cpu-dry-run", "--only", only,
                        "--report", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((tmp_path / "r.json").read_text())["checks"]


@pytest.mark.e2e
@pytest.mark.skipif(_cuda(), reason="a GPU is present: the real check (b) runs in tests/gpu")
def test_check_b_harness_dumps_and_restores_a_torch_worker_bitwise(tmp_path):
    checks = _dry_run(tmp_path, "a,b", 200)
    b = checks["b_criu_with_cuda"]
    assert b["status"] == "passed" and b["cpu_dry_run"] is True and b["sha256"] == b["reference_sha256"]
    assert b["criu_dump_s"] > 0 and b["image_bytes"] > 10_000_000
    assert checks["a_cuda_checkpoint_roundtrip"]["status"] == "skipped"


@pytest.mark.e2e
@pytest.mark.skipif(_cuda(), reason="a GPU is present: the real check (e) runs in tests/gpu")
def test_check_e_harness_evacuates_a_torch_job_through_agents_bitwise(tmp_path):
    e = _dry_run(tmp_path, "e", 220)["e_evacuation_through_agents"]
    assert e["status"] == "passed" and e["cpu_dry_run"] is True and e["sha256"] == e["reference_sha256"]
    assert e["worker_host"] == "gpu-spare" and e["result"] == "succeeded" and e["downtime_s"] > 0


@pytest.mark.e2e
@pytest.mark.skipif(_cuda(), reason="a GPU is present: the real check (f) runs in tests/gpu")
def test_check_f_harness_evacuates_a_tree_of_three_training_processes_bitwise(tmp_path):
    f = _dry_run(tmp_path, "f", 240)["f_cuda_tree_evacuation_through_agents"]
    assert f["status"] == "passed" and f["cpu_dry_run"] is True and f["sha256"] == f["reference_sha256"]
    assert f["children"] == 2 and f["children_agree"] is True and f["worker_host"] == "gpu-spare"


def test_lent_host_script_refuses_an_unknown_option_before_it_starts_anything(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "bench" / "lent_gpu_host.sh"), "--out", str(tmp_path / "o"), "--fast"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "unknown option --fast" in p.stderr
    assert not (tmp_path / "o").exists()
