"""Provenance and output helpers shared by the benchmarks.

DESIGN.md's rule for a trustworthy ratio on a shared machine: interleave the
compared systems, repeat, report the median and spread, and record the exact
command, git commit and machine fingerprint next to the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serving_harness.machine import hardware_fingerprint

BENCH_DIR = Path("docs/benchmarks")


def provenance(module: str) -> dict[str, Any]:
    """How this result was produced: ``module`` is the benchmark's ``-m`` name."""
    # A copy of the tree elsewhere (a lent GPU machine) may carry an older
    # .git than the tree it runs: the caller then names the commit.
    commit = os.environ.get("BENCH_COMMIT", "")
    try:
        if commit:
            raise OSError("commit given by BENCH_COMMIT")
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True).stdout.strip())  # fmt: skip
        commit += "-dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = commit or "unknown"
    machine = hardware_fingerprint()
    import torch

    if torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(0)
    return {
        "command": " ".join(["python", "-m", module, *(shlex.quote(a) for a in sys.argv[1:])]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine,
    }


def speedup_cell(row: dict[str, Any]) -> str:
    """``1.23× (1.01-1.40)``: median latency speedup with its min-max spread."""
    return f"{row['latency_speedup']:.2f}× ({row['latency_speedup_min']:.2f}-{row['latency_speedup_max']:.2f})"


def ratio_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


PACKRAT_ROW_HEADER = ["B", "Packrat plan", "fat ms", "Packrat ms", "latency speedup (min-max)", "throughput speedup",
                      "expected"]  # fmt: skip


def packrat_row_cells(row: dict[str, Any]) -> list[str]:
    """The cells of one B in a fat-vs-Packrat table (micro and end-to-end benchmarks alike)."""
    from packrat_plugin.plan_types import format_instances

    return [
        str(row["batch"]),
        format_instances(row["plan"]),
        f"{row['fat_latency_ms']:.1f}",
        f"{row['packrat_latency_ms']:.1f}",
        speedup_cell(row),
        f"{row['throughput_speedup']:.2f}×",
        ratio_cell(row["expected_speedup"]),
    ]


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance_block(prov: dict[str, Any]) -> str:
    machine = ", ".join(f"{k}={v}" for k, v in prov["machine"].items())
    return (
        f"- command: `{prov['command']}`\n- commit: `{prov['commit']}`\n- date: {prov['date']}\n- machine: {machine}\n"
    )


def new_figure(size: tuple[float, float] = (6.4, 3.6)) -> tuple[Any, Any]:
    """A figure and its axes, drawn headless (no display on servers or in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size)


def save_figure(
    fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str, log_y: bool = False, legend: dict | None = None
) -> None:
    """Label the axes, add the legend, write ``path`` and free the figure."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(**(legend or {"fontsize": 8}))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def speedup_bars(
    rows: list[dict[str, Any]], series: list[tuple[str, str]], xlabel: str, ylabel: str, title: str, path: Path
) -> None:
    """Grouped bars per row (one group per batch size), a line at 1×.

    ``series`` is ``[(label, key), ...]``; the first series is the measured
    latency speedup and carries its min-max spread as error bars.
    """
    xs = list(range(len(rows)))
    width = 0.8 / len(series)
    fig, ax = new_figure()
    for k, (label, key) in enumerate(series):
        values = [r[key] if r[key] is not None else 0.0 for r in rows]
        offsets = [x + (k - (len(series) - 1) / 2) * width for x in xs]
        err = None
        if k == 0:
            err = [[v - r["latency_speedup_min"] for v, r in zip(values, rows, strict=True)],
                   [r["latency_speedup_max"] - v for v, r in zip(values, rows, strict=True)]]  # fmt: skip
        ax.bar(offsets, values, width, yerr=err, capsize=3 if err else 0, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(xs, [str(r["batch"]) for r in rows])
    save_figure(fig, ax, path, xlabel, ylabel, title)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Which model, how it is compiled, and which profile of it (default: one valid on this machine)."""
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--mode", default="script", choices=("eager", "script", "compile"))
    parser.add_argument("--profile", type=Path, help="default: profiles/<model>.json, else profile this machine")
    parser.add_argument("--force", action="store_true", help="use a profile measured on other hardware")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", type=Path, default=BENCH_DIR, help="where the .md/.json/.png go")
    parser.add_argument("--json", type=Path, help="also write the JSON result here")


def publish(
    stem: str,
    data: dict[str, Any],
    render: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], None],
    out_dir: Path,
    json_copy: Path | None = None,
) -> str:
    """Write ``<stem>.png``, ``.md`` and ``.json`` (plus a JSON copy where asked); returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(data, out_dir / f"{stem}.png")
    markdown = render(data)
    write_outputs(stem, markdown, data, out_dir)
    if json_copy:
        json_copy.write_text((out_dir / f"{stem}.json").read_text())
    return markdown


def run_benchmark(
    module: str,
    args: argparse.Namespace,
    measure: Callable[[argparse.Namespace, Path], dict[str, Any]],
    summary: Callable[[dict[str, Any]], Any],
    stem_of: Callable[[dict[str, Any]], str],
    render: Callable[[dict[str, Any], str], str],
    plot: Callable[[dict[str, Any], Path], None],
) -> int:
    """Measure in a scratch directory, summarise, publish; exit status 1 when any request failed."""
    prov = provenance(module)
    with tempfile.TemporaryDirectory(prefix=f"{module.rsplit('.', 1)[-1]}-") as tmp:
        data = measure(args, Path(tmp))
    data["summary"] = summary(data)
    data["provenance"] = prov
    stem = stem_of(data)
    print(publish(stem, data, lambda d: render(d, stem), plot, args.out_dir, args.json))
    return 0 if all(r["failed"] == 0 for r in data["rows"]) else 1


def write_outputs(stem: str, markdown: str, data: dict[str, Any], out_dir: Path = BENCH_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(markdown)
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    return out_dir / f"{stem}.md"
