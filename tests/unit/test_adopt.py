"""Taking over a running worker set: which TorchServe versions are Packrat's, and what the adopted plan is
(plain describe answers; the kill-and-restart itself runs in tests/serving/test_packrat_restart.py); and how
long a swap's drain holds the new set, on scripted queue lengths."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from handlers.pinning.slots import PlanStore
from packrat_plugin.plan_types import PlanItem
from packrat_plugin.swapper import (
    ActivePassiveSwapper,
    SwapError,
    parse_version_name,
    version_name,
    version_slots,
)
from serving_harness.topology import CpuTopology


def swapper(core_tag: str = "") -> ActivePassiveSwapper:
    # No TorchServe is reached: adopt reads the describe answers it is given and calls out only to drain
    # a non-default version that still has workers, which these cases do not have.
    return ActivePassiveSwapper(None, None, "resnet50", Path("x.mar"), Path("store"), CpuTopology({0: (0, 1)}),
                                core_tag=core_tag)  # fmt: skip


def described(name: str, workers: int) -> dict:
    return {"modelVersion": name, "workers": [{"id": str(i), "status": "READY"} for i in range(workers)]}


def test_version_names_round_trip_and_others_are_not_packrats():
    item = PlanItem(2, 1, 4)
    assert parse_version_name(version_name(item)) == (1, 4, "")
    assert parse_version_name(version_name(item, "-c0-1")) == (1, 4, "-c0-1")
    for other in ("1.0", "t1b4x", "mix-2x1t4b", "T1B4", "t1b"):
        assert parse_version_name(other) is None, other


def test_the_default_version_becomes_the_active_plan_and_idle_versions_stay_registered():
    s = swapper()
    plan = s.adopt([described("t2b1", 0), described("t1b4", 2)], default="t1b4")
    assert plan.instances == (PlanItem(2, 1, 4),) and plan.batch == 8
    assert s.active == "t1b4" and s.registered == {"t2b1", "t1b4"} and s.standby == {}


@pytest.mark.parametrize(
    ("versions", "default", "says"),
    [
        ([described("1.0", 1)], "1.0", "not one Packrat serves"),
        ([described("t2b1", 1), described("mix-2x1t4b", 1)], "t2b1", "not one Packrat serves"),
        ([described("t2b1-c0", 1)], "t2b1-c0", "not one Packrat serves"),  # another model's share of the cores
        ([described("t2b1", 0)], "t2b1", "has no workers"),
    ],
)
def test_a_worker_set_packrat_did_not_make_is_refused_untouched(versions, default, says):
    s = swapper()
    with pytest.raises(SwapError, match=says):
        s.adopt(versions, default)
    assert s.active is None and s.registered == set()


class _ScriptedQueue:
    """TorchServe's describe answers for one version, its queue length taken from a script (then 0)."""

    def __init__(self, pending: list[int]) -> None:
        self.pending = list(pending)
        self.calls = 0

    def describe(self, model: str, version: str) -> list[dict]:
        self.calls += 1
        queued = self.pending.pop(0) if self.pending else 0
        return [{"modelVersion": version, "jobQueueStatus": {"pendingRequests": queued}, "workers": []}]


@pytest.mark.parametrize("settle", [False, True])
def test_the_new_sets_hold_ends_at_the_first_empty_reading_and_retiring_waits_for_the_settle(tmp_path, settle):
    # A version of batch 1 whose queue empties on the third reading (no worker counts requests in service).
    queue = _ScriptedQueue([3, 1, 0, 0, 0])
    s = swapper()
    s.management, s.store = queue, PlanStore(tmp_path)
    s.store.write(version_slots("resnet50", "t2b1", PlanItem(1, 2, 1), s.topology))
    s.config.poll_s = 0.001
    started = time.monotonic()
    s._drain("t2b1", settle=settle)
    waited = time.monotonic() - started
    if settle:
        assert waited >= s.config.drain_settle_s and queue.calls > 3  # zeros held for the settle window
    else:
        assert queue.calls == 3 and waited < s.config.drain_settle_s  # released at the first zero
