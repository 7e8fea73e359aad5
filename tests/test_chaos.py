"""Chaos trials: a 2-worker job under every kind of fault ends bitwise equal to a clean run."""

import os

import pytest

from tf_distrib import chaos
from tf_distrib.chaos import Fault


def _plans():
    """Every fault kind once, several to a trial (a short `make chaos`)."""
    plans = [[Fault("startup", 0, 1, 0, "transport/stop"), Fault("kill_in_collective", 1, 0, 15),
              Fault("sigkill", 2, 1, 12), Fault("kill_in_snapshot", 3, 0, 3)],
             [Fault("sigterm", 0, 1, 25), Fault("kill_in_write", 1, 0, 2),
              Fault("sigstop", 2, 1, 12), Fault("torn_snapshot", 3, 1, 4)]]
    if os.geteuid() == 0:  # a full disk mounts a small tmpfs
        plans[1].append(Fault("full_disk", 4, 0, 5))
    return plans


@pytest.mark.multiprocess
def test_every_fault_kind_ends_bitwise_equal_to_the_fault_free_run(tmp_path):
    lines = []
    results = chaos.run_trials(_plans(), str(tmp_path), echo=lines.append)
    assert all(r.outcome == "equal" and r.struck for r in results), "\n".join(lines)
    # Each restarting fault was named by the launcher.
    failures = "\n".join(f for r in results for f in r.failures)
    assert "worker 1" in failures and "stopped (process state T" in failures
    assert "preempted" in failures or "42" in failures
    assert "all trials | 2 | 2 | 0 | 0 | 2 |" in chaos.table(results)


def test_draws_are_reproducible_and_well_formed():
    import random

    rng, again = random.Random(7), random.Random(7)
    first = [chaos.draw(rng) for _ in range(50)]
    assert first == [chaos.draw(again) for _ in range(50)]
    assert {f.kind for faults in first for f in faults} == set(chaos.FAULT_KINDS)
    for faults in first:
        assert 1 <= len(faults) <= 2 and len({f.kind for f in faults}) == len(faults)
        restarting = [f for f in faults if f.kind != "full_disk"]
        assert [f.attempt for f in restarting] == list(range(len(restarting)))
        assert all(f.attempt == len(restarting) for f in faults if f.kind == "full_disk")
