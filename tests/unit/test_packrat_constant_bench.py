"""bench.packrat_constant's table (pure rendering of a run's data)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.packrat_constant import render

RUN = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "packrat_constant_resnet50.json"


def test_the_false_alarm_line_names_the_design_and_the_learned_rates_bound_where_one_was_used():
    data = json.loads(RUN.read_text())
    data.pop("uncertainty_z", None)  # a run from before the bound: the estimate itself
    line = next(x for x in render(data).splitlines() if x.startswith("False alarms"))
    assert "against a known rate" in line and "σ bound" not in line
    data["uncertainty_z"] = 1.5
    line = next(x for x in render(data).splitlines() if x.startswith("False alarms"))
    assert "tested at its 1.5σ bound" in line
