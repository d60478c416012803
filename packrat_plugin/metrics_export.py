"""Packrat's decisions as Prometheus metrics: the controller's status, in the text format a scraper reads.

``GET /metrics`` on the controller's status port (``status_server.py``)
answers this; ``deploy/grafana/packrat-dashboard.json`` charts it.  It is a
pure function of the status dict (``PackratController.status()``), so what a
dashboard shows and what ``packrat status`` prints cannot disagree.

Every series carries ``model``.  The plan serving a model is an info-style
gauge (``packrat_plan_info``, its labels the version, the mode and the plan
as text, value 1) beside numeric gauges for its batch size, workers and
predicted latency; swaps are counted by kind, and the last swap's phases
are gauges in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from packrat_plugin.plan_types import format_instances

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name → (type, help); the order is the order of the exposition.
METRICS: dict[str, tuple[str, str]] = {
    "packrat_usable_cores": ("gauge", "Cores Packrat plans for (affinity mask, limited by a cgroup CPU quota)."),
    "packrat_model_cores": ("gauge", "Cores given to a model (all of them unless several models divide them)."),
    "packrat_plan_info": ("gauge", "The plan serving a model: 1, with the version, mode and plan as labels."),
    "packrat_plan_batch": ("gauge", "B of the serving plan: requests it serves at once, over all its instances."),
    "packrat_plan_workers": ("gauge", "Instances in the serving plan."),
    "packrat_predicted_latency_seconds": ("gauge", "The profile's latency of the serving plan for one round of B."),
    "packrat_estimated_batch": ("gauge", "The level (B) the policy holds for the measured load."),
    "packrat_arrival_rate": ("gauge", "Arrivals per second over the policy's short and long windows."),
    "packrat_pending_requests": ("gauge", "Requests queued in TorchServe's frontend for the model."),
    "packrat_in_service_requests": ("gauge", "Requests inside the model's workers."),
    "packrat_calibration_slowdown": ("gauge", "Measured serving time over the profile's prediction."),
    "packrat_calibration_overhead_seconds": ("gauge", "Measured handler time per request outside the model."),
    "packrat_swaps_total": ("counter", "Reconfigurations, by kind (initial, scale, swap)."),
    "packrat_last_swap_seconds": ("gauge", "The last reconfiguration's duration, by phase and in total."),
    "packrat_last_swap_serving_after_seconds": ("gauge", "Seconds the last reconfiguration took to serve."),
    "packrat_last_swap_timestamp_seconds": ("gauge", "Unix time the last reconfiguration started."),
    "packrat_swap_errors_total": ("counter", "Reconfigurations that failed and were rolled back."),
}


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(name: str, labels: dict[str, object], value: float) -> str:
    body = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
    number = "NaN" if value is None or (isinstance(value, float) and math.isnan(value)) else repr(float(value))
    return f"{name}{{{body}}} {number}" if body else f"{name} {number}"


def _samples(status: dict[str, Any]) -> Iterable[tuple[str, dict[str, object], float]]:
    yield "packrat_usable_cores", {}, status.get("threads", 0)
    for name, m in (status.get("models") or {}).items():
        model = {"model": name}
        yield "packrat_model_cores", model, len(m.get("cores") or [])
        plan = m.get("plan")
        if plan:
            described = format_instances(plan.get("instances"), labels=True)
            labels = {**model, "version": m.get("active_version") or "", "mode": m.get("mode") or "", "plan": described}
            yield "packrat_plan_info", labels, 1
            yield "packrat_plan_batch", model, plan.get("batch", 0)
            yield "packrat_plan_workers", model, sum(i["count"] for i in plan.get("instances") or [])
            yield "packrat_predicted_latency_seconds", model, plan.get("latency_ms", float("nan")) / 1000.0
        if m.get("estimated_batch") is not None:
            yield "packrat_estimated_batch", model, m["estimated_batch"]
        yield "packrat_arrival_rate", {**model, "window": "short"}, m.get("arrival_rate", 0.0)
        yield "packrat_arrival_rate", {**model, "window": "long"}, m.get("arrival_rate_long", 0.0)
        yield "packrat_pending_requests", model, m.get("pending_requests") or 0
        yield "packrat_in_service_requests", model, m.get("in_service") or 0
        calibration = m.get("calibration") or {}
        if calibration:
            yield "packrat_calibration_slowdown", model, calibration.get("slowdown", 1.0)
            yield "packrat_calibration_overhead_seconds", model, calibration.get("overhead_ms", 0.0) / 1000.0
        for kind, count in sorted((m.get("swaps_by_kind") or {}).items()):
            yield "packrat_swaps_total", {**model, "kind": kind}, count
        last = m.get("last_swap")
        if last:
            for phase, seconds in sorted((last.get("phases") or {}).items()):
                yield "packrat_last_swap_seconds", {**model, "kind": last["kind"], "phase": phase}, seconds
            yield "packrat_last_swap_seconds", {**model, "kind": last["kind"], "phase": "total"}, last["seconds"]
            yield "packrat_last_swap_serving_after_seconds", model, last["serving_after_s"]
            yield "packrat_last_swap_timestamp_seconds", model, last["started"]
        yield "packrat_swap_errors_total", model, m.get("swap_errors", 0)


def prometheus_text(status: dict[str, Any]) -> str:
    """The status as Prometheus's text exposition format (version 0.0.4)."""
    by_name: dict[str, list[str]] = {name: [] for name in METRICS}
    for name, labels, value in _samples(status):
        by_name[name].append(_sample(name, labels, value))
    lines: list[str] = []
    for name, samples in by_name.items():
        if samples:
            kind, text = METRICS[name]
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"
