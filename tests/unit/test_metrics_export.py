"""Packrat's Prometheus metrics, from a status dict (plain data), and the dashboard that charts them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from packrat_plugin.metrics_export import METRICS, prometheus_text

ROOT = Path(__file__).resolve().parents[2]
SERIES = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The exposition's samples; fails on a line that is neither a comment nor a well-formed sample."""
    out = []
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = SERIES.match(line)
        assert match, f"malformed line: {line!r}"
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
        out.append((match["name"], labels, float(match["value"])))
    return out


def status(**model_overrides) -> dict:
    model = {
        "model": "resnet50", "active_version": "t1b2", "cores": [0, 1], "mode": "uniform",
        "plan": {"threads": 2, "batch": 4, "latency_ms": 190.0, "instances": [{"count": 2, "threads": 1, "batch": 2}]},
        "estimated_batch": 4, "arrival_rate": 12.5, "arrival_rate_long": 9.0, "pending_requests": 3, "in_service": 2,
        "calibration": {"slowdown": 1.3, "overhead_ms": 4.0, "updates": 2},
        "swaps_by_kind": {"initial": 1, "swap": 2}, "swap_errors": 1,
        "last_swap": {"kind": "swap", "seconds": 2.5, "serving_after_s": 0.4, "started": 1.7e9,
                      "phases": {"bring_up": 0.1, "switch": 0.3, "drain": 1.8, "retire": 0.3}},
    }  # fmt: skip
    model.update(model_overrides)
    return {"threads": 2, "cores_source": "2 CPUs in the affinity mask", "models": {"resnet50": model}}


def test_the_plan_swaps_and_load_are_series_with_the_model_as_label():
    samples = parse(prometheus_text(status()))
    by = {(n, tuple(sorted(labels.items()))): v for n, labels, v in samples}
    info = [labels for n, labels, _ in samples if n == "packrat_plan_info"]
    assert info == [{"model": "resnet50", "version": "t1b2", "mode": "uniform", "plan": "2×⟨t=1,b=2⟩"}]
    assert by[("packrat_plan_batch", (("model", "resnet50"),))] == 4
    assert by[("packrat_plan_workers", (("model", "resnet50"),))] == 2
    assert by[("packrat_predicted_latency_seconds", (("model", "resnet50"),))] == 0.19
    assert by[("packrat_swaps_total", (("kind", "swap"), ("model", "resnet50")))] == 2
    assert by[("packrat_last_swap_seconds", (("kind", "swap"), ("model", "resnet50"), ("phase", "drain")))] == 1.8
    assert by[("packrat_last_swap_seconds", (("kind", "swap"), ("model", "resnet50"), ("phase", "total")))] == 2.5
    assert by[("packrat_arrival_rate", (("model", "resnet50"), ("window", "long")))] == 9.0
    assert by[("packrat_usable_cores", ())] == 2
    text = prometheus_text(status())
    for name, (kind, _) in METRICS.items():  # every series that appears is declared once, with its type
        assert text.count(f"# TYPE {name} {kind}\n") == (1 if any(n == name for n, _, _ in samples) else 0)


def test_a_model_before_its_first_plan_and_odd_label_values_stay_well_formed():
    text = prometheus_text(status(plan=None, last_swap=None, swaps_by_kind={}, estimated_batch=None,
                                  active_version='a"b\\c'))  # fmt: skip
    names = {n for n, _, _ in parse(text)}
    assert "packrat_plan_info" not in names and "packrat_last_swap_seconds" not in names
    assert "packrat_arrival_rate" in names
    labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', prometheus_text(status(active_version='a"b'))))
    assert labels["version"] == 'a\\"b'


def test_every_dashboard_panel_queries_metrics_the_controller_exports():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "packrat-dashboard.json").read_text())
    exported = {n for n, _, _ in parse(prometheus_text(status()))}
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\bpackrat_[a-z_]+\b", target["expr"]))
            assert used, (panel["title"], target["expr"])
            assert used <= set(METRICS), (panel["title"], used - set(METRICS))
            assert used <= exported, (panel["title"], used - exported)
    templated = [v["query"] for v in dashboard["templating"]["list"] if v["name"] == "model"]
    assert templated == ["label_values(packrat_plan_info, model)"]
