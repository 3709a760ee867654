"""The fault matrix's rows for unplanned failures: a job with snapshots loses a host without
warning, and every fault around that ends with the job recovered or a clear failure with nothing
half-done.  The scenarios are the ones `make test` runs (tests/test_recovery_e2e.py); here each
also records its row, with the figures it saw."""

from __future__ import annotations

import pytest

from .. import test_recovery_e2e as scenario

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def test_host_dies_during_a_snapshot_and_the_first_spare_fails(cluster, tmp_path, record):
    got = scenario.host_dies_during_a_snapshot(cluster, tmp_path)
    m = got["recovery"]
    record("a host dies outright (agent and ranks SIGKILLed, link cut) while a snapshot is under way",
           f"snapshot {got['during']} never counted; recovered by itself from snapshot {m['snapshot']}, bitwise equal",
           f"pause {m['pause_s']:.2f} s, {m['lost_s']:.1f} s of work redone, ranks {m['lost_ranks']} onto "
           f"{m['destination']}")
    record("the spare dies during the recovery (SIGKILLed with its agent in the middle of the restore)",
           f"the next spare taken ({m['destination']}); bitwise equal", m["spares_failed"][0]["error"][:200])
    record("the lost host's agent comes back after the recovery",
           "told of the fence before anything else; runs nothing of the job; its reports move no rank", "")


def test_nccl_host_dies(cluster, tmp_path, record):
    m = scenario.nccl_host_dies(cluster, tmp_path)["recovery"]
    record("a host of an NCCL job dies outright", "recovered by itself at the shim's cut, communicators re-created, "
           "bitwise equal", f"pause {m['pause_s']:.2f} s, phases {sorted(m['phases'])}")
    record("the spare's restore fails during the recovery (an injected fault)",
           f"the failed spare emptied, the next one taken ({m['destination']}); bitwise equal",
           m["spares_failed"][0]["error"][:200])


def test_nccl_survivors_park(cluster, tmp_path, record):
    got = scenario.nccl_survivors_park(cluster, tmp_path)
    m = got["recovery"]
    record("a host of an NCCL job dies with its processes before its link: the survivors' all-reduces fail at once",
           "the survivors park in their shims (alive, reported by their agent), the recovery rolls them back live; "
           "bitwise equal", f"survivors {m['survivors']}"[:200] + f"; pause {m['pause_s']:.2f} s")


def test_partitioned_host_back_during_the_recovery_then_a_second_failure(cluster, tmp_path, record):
    got = scenario.partitioned_host_back_during_the_recovery_then_a_second_failure(cluster, tmp_path)
    record("a host cut off (partition), back while the recovery restores its ranks elsewhere",
           "its ranks isolated by its own agent, then ended (fenced) before the recovery ended; never rejoined",
           got["fenced"][:200])
    record("a second failure in a row (the spare now running the recovered ranks dies)",
           f"recovered again onto {got['second']['destination']}, bitwise equal",
           f"pauses {got['first']['pause_s']:.2f} s and {got['second']['pause_s']:.2f} s")


def test_ranks_fail_at_once_on_a_live_host(cluster, tmp_path, record):
    m = scenario.ranks_fail_at_once_on_a_live_host(cluster, tmp_path)["recovery"]
    record("every rank of a job on a host fails at once, its agent alive (as a GPU fallen off the bus)",
           f"that host taken for lost (its ranks failed first), fenced, the job recovered onto {m['destination']}; "
           "bitwise equal", m["requested_by"][:200])


def test_replicas_lost_with_their_host(cluster, tmp_path, record):
    e = scenario.replicas_lost_with_their_host(cluster, tmp_path)["error"]
    record("a host and the buddy holding its replicas die together",
           "recovery failed before it stopped anything, not retried; the survivors run on", f"{e['message'][:140]} -> "
           f"{e['action'][:100]}")


def test_buddy_changes_to_a_spare_that_joins(cluster, tmp_path, record):
    got = scenario.buddy_changes_to_a_spare_that_joins(cluster, tmp_path)
    w, n = got["whole"], got["next"]
    record("a host's buddy changes (a spare joins in another failure domain) while snapshots are taken",
           f"snapshot {w['number']} committed with that host's parts whole, the next ({n['number']}) a delta again; "
           "no snapshot failed", f"{w['whole']['host-a']}; {w['bytes'] / 2**20:.0f} MiB, then "
           f"{n['bytes'] / 2**20:.0f} MiB")


def test_operator_recovers_a_live_host(cluster, tmp_path, record):
    m = scenario.operator_recovers_a_live_host_with_an_appended_log(cluster, tmp_path)["recovery"]
    record("an operator recovers a job whose host still runs it (pitstop recover --wait --json)",
           "the host's copy fenced first; the log the job appends to cut back; it ends line for line as an "
           "uninterrupted run's", f"cut back: {[f['path'].rsplit('/', 1)[-1] for f in m['files']['cut_back']]}")


def test_snapshot_over_its_budget(cluster, tmp_path, record):
    err = scenario.snapshot_over_its_budget(cluster, tmp_path)["error"]
    record("a host's snapshot budget too small for its ranks", "refused at the check, before any rank paused",
           err[:200])


def test_ranks_die_first_then_their_host(cluster, tmp_path, record):
    from .. import test_recovery_orders_e2e as orders

    m = orders.ranks_die_first_then_their_host(cluster, tmp_path)["recovery"]
    record("a host's ranks die first (their DataLoader workers with them), the survivors end on connection resets, "
           "then the host's agent and link go",
           f"recovered by itself onto {m['destination']}, every rank rolled back; bitwise equal",
           f"{m['requested_by'][:120]}; found {m['detected_after_s']} s after the failure; pause {m['pause_s']:.2f} s")


def test_a_finished_job_is_never_recovered(cluster, tmp_path, record):
    from .. import test_recovery_orders_e2e as orders

    orders.a_finished_job_is_never_recovered(cluster, tmp_path)
    record("a job that finished, whose host then dies", "no recovery; its snapshots dropped as a finished job's", "")
