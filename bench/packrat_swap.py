"""Packrat live reconfiguration under a load step (the paper's Figure 6 analogue).

    python -m bench.packrat_swap --model resnet50 --json out.json

Starts TorchServe under the full Packrat controller (default estimator:
5 ms sampling, α = 0.1, n = 10, 1 s timeout) with the model's profile, then
drives an open-loop Poisson load that steps from a low rate to a high rate.
Every request is counted; the result reports failures (any non-200, or a
connection error), the swap's duration, and the plans before and after, and
plots per-request latency over time with the swap marked.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.report import markdown_table, provenance, provenance_block, write_outputs
from model_store.build import ARCHIVE_DIR, build_archive
from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.controller import ControllerConfig, ModelTarget, PackratController
from packrat_plugin.estimator import EstimatorConfig
from packrat_plugin.loadgen import open_loop, run
from packrat_plugin.plan_types import format_instances
from packrat_plugin.profile import load_profile


def plot(samples, swaps, load_start_wall: float, phases, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    ok = [(s.sent, s.latency_s * 1e3) for s in samples if s.status == 200]
    bad = [(s.sent, s.latency_s * 1e3) for s in samples if s.status != 200]
    ax.scatter([x for x, _ in ok], [y for _, y in ok], s=4, label="request latency")
    if bad:
        ax.scatter([x for x, _ in bad], [y for _, y in bad], s=12, c="red", marker="x", label="failed")
    for swap in swaps:
        start = swap["started"] - load_start_wall
        ax.axvspan(start, start + swap["seconds"], color="orange", alpha=0.3)
        ax.annotate(f"{swap['kind']} ({swap['seconds']:.1f} s)", (start, ax.get_ylim()[1] * 0.9), fontsize=8)
    edge = 0.0
    for seconds, _rate in phases[:-1]:
        edge += seconds
        ax.axvline(edge, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("time since load start (s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--mode", default="script", choices=("eager", "script", "compile"))
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--low-rate", type=float, default=1.0, help="requests/s before the step")
    parser.add_argument("--high-rate", type=float, default=8.0, help="requests/s after the step")
    parser.add_argument("--low-seconds", type=float, default=10.0)
    parser.add_argument("--high-seconds", type=float, default=30.0)
    parser.add_argument("--sample-ms", type=float, default=5.0)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    spec = get_spec(args.model, args.mode)
    profile = load_profile(args.profile or Path("profiles") / f"{args.model}.json", force=args.force)
    archive = build_archive(spec, ARCHIVE_DIR)
    config = ControllerConfig(estimator=EstimatorConfig(sample_period_s=args.sample_ms / 1000))
    payloads = [client_payload(spec, seed=i) for i in range(32)]
    phases = [(args.low_seconds, args.low_rate), (args.high_seconds, args.high_rate)]
    prov = provenance("bench.packrat_swap")
    with tempfile.TemporaryDirectory(prefix="packrat-swap-") as tmp:
        controller = PackratController(Path(tmp), [ModelTarget(spec.name, archive, profile)], config, status_port=None)
        with controller:
            url = f"{controller.server.inference_url}/predictions/{spec.name}"
            before = controller.status()["models"][spec.name]
            load_start_wall = time.time()
            result = run(open_loop(url, lambda i: payloads[i % len(payloads)], phases))
            time.sleep(1.0)
            after = controller.status()["models"][spec.name]
            swaps = [s.to_dict() for s in controller.models[spec.name].swaps]
    live = [s for s in swaps if s["kind"] != "initial"]
    data = {
        "model": spec.name,
        "requests": len(result.samples),
        "failed": result.failed,
        "swap_seconds": live[0]["seconds"] if live else None,
        "swap_serving_after_s": live[0]["serving_after_s"] if live else None,
        "swaps": live,
        "before_plan": before["plan"]["instances"],
        "after_plan": after["plan"]["instances"],
        "phases": [{"seconds": s, "rate": r} for s, r in phases],
        "mean_latency_ms": result.mean_latency_ms(),
        "p99_latency_ms": result.percentile_ms(99),
        "provenance": prov,
    }
    stem = f"packrat_swap_{spec.name}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(result.samples, live, load_start_wall, phases, args.out_dir / f"{stem}.png",
         f"Packrat under a load step: {spec.name} ({args.low_rate:g} → {args.high_rate:g} req/s)")  # fmt: skip
    table = markdown_table(
        ["requests", "failed", "plan before", "plan after", "reconfigurations",
         "first swap: new plan serving / done (s)"],
        [[data["requests"], data["failed"], format_instances(data["before_plan"]), format_instances(data["after_plan"]),
          ", ".join(f"{s['kind']} → {format_instances(s['after'])}" for s in live) or "none",
          "-" if data["swap_seconds"] is None
          else f"{data['swap_serving_after_s']:.2f} / {data['swap_seconds']:.2f}"]],
    )  # fmt: skip
    phase_table = markdown_table(
        ["swap", "bring up (s)", "switch (s)", "drain (s)", "retire (s)", "total (s)"],
        [[f"{format_instances(s['before'])} → {format_instances(s['after'])}",
          *(f"{s['phases'].get(k, 0.0):.2f}" for k in ("bring_up", "switch", "drain", "retire")),
          f"{s['seconds']:.2f}"] for s in live],
    )  # fmt: skip
    markdown = (
        f"# Packrat live reconfiguration: {spec.name} ({spec.mode})\n\n"
        f"Open-loop Poisson load, {args.low_rate:g} req/s for {args.low_seconds:g} s, then "
        f"{args.high_rate:g} req/s for {args.high_seconds:g} s, JPEG requests; the controller runs with its "
        f"defaults (sampling every {args.sample_ms:g} ms, α=0.1, n=10, 1 s timeout).\n\n{table}\n\n"
        f"Mean latency {data['mean_latency_ms']:.0f} ms, p99 {data['p99_latency_ms']:.0f} ms over the whole run.\n\n"
        f"Where each swap's time went:\n\n{phase_table}\n\n"
        f"![latency over time]({stem}.png)\n\n{provenance_block(prov)}"
    )
    write_outputs(stem, markdown, data, args.out_dir)
    if args.json:
        args.json.write_text((args.out_dir / f"{stem}.json").read_text())
    print(markdown)
    return 0 if data["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
