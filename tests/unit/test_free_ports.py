"""``Ports.free``: five distinct free ports, never one the caller has reserved for itself."""

from __future__ import annotations

import serving_harness.torchserve as torchserve
from serving_harness.torchserve import Ports


def test_free_ports_are_distinct_and_skip_the_ones_the_caller_will_bind(monkeypatch):
    offered = iter([9001, 9001, 9002, 9003, 9004, 9005, 9006, 9007])  # what the kernel hands out, in turn
    monkeypatch.setattr(torchserve, "free_port", lambda: next(offered))
    ports = Ports.free(exclude=[9002, None])  # 9002: the status server's port, bound later
    assert (ports.inference, ports.management, ports.metrics, ports.grpc_inference, ports.grpc_management) == (
        9001, 9003, 9004, 9005, 9006,
    )  # fmt: skip


def test_free_ports_are_bindable_now():
    ports = Ports.free()
    chosen = [ports.inference, ports.management, ports.metrics, ports.grpc_inference, ports.grpc_management]
    assert len(set(chosen)) == 5 and all(1024 <= p < 65536 for p in chosen)
