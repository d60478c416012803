"""WindTunnel against Hummingbird and scikit-learn: the same fitted pipelines, side by side.

    python -m bench.windtunnel_vs_hummingbird --out-dir /tmp/wt

Hummingbird (``hummingbird-ml``, a benchmark-only dependency) is the public
library that turns trained scikit-learn models into tensor programs.  Each
pipeline here is fitted once on the synthetic table (``windtunnel/datasets.py``:
numbers and string categories, one-hot encoded) and then answered three ways:

- **scikit-learn**'s own ``predict_proba`` on the raw rows (an object array);
- **WindTunnel**: the rows encoded (``encode_array``: the table's columns, array
  operations) and the translated module's forward pass, and the forward pass
  alone on rows already encoded;
- **Hummingbird**: ``convert(pipeline, "torch")`` and its ``predict_proba`` on the
  same raw rows, where it converts the pipeline (it refuses string columns: then
  it answers on the columns already one-hot encoded and scaled by the fitted
  ``ColumnTransformer``, which this bench times separately and adds, and says so).

Timing: per repeat, every batch size, and within it every system in an order
rotated each repeat, each the median of calls over ``--min-seconds``;
``--repeats`` of that, so the ratios (WindTunnel's time over each other's,
per repeat) come with their spread.  ``--twin`` times WindTunnel twice in
each round, an A/A pair whose ratio says how far this machine moves two
identical measurements.  Every answer is checked against scikit-learn's
before any timing (WindTunnel to 1e-9; Hummingbird's reported as its largest
difference).  Memory: the bytes of each module's parameters and buffers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from tqdm import tqdm

from bench.report import add_output_arguments, markdown_table, provenance, provenance_block, publish
from handlers.runtime.timing import median_seconds

STEM = "windtunnel_vs_hummingbird"


@dataclass(frozen=True)
class Case:
    name: str
    estimator: Any  # () -> unfitted estimator
    tree: bool
    numbers_only: bool = False  # the table's number columns, scaled: a pipeline Hummingbird converts whole


def cases() -> list[Case]:
    from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression

    return [
        Case("random forest, 100 trees, depth 8",
             lambda: RandomForestClassifier(n_estimators=100, max_depth=8, random_state=0, n_jobs=1), True),
        Case("gradient boosting, 100 trees, depth 3",
             lambda: GradientBoostingClassifier(n_estimators=100, max_depth=3, random_state=0), True),
        Case("random forest, 100 trees, unlimited depth",
             lambda: RandomForestClassifier(n_estimators=100, random_state=0, n_jobs=1), True),
        Case("random forest, 100 trees, depth 8, numbers only",
             lambda: RandomForestClassifier(n_estimators=100, max_depth=8, random_state=0, n_jobs=1), True, True),
        Case("logistic regression", lambda: LogisticRegression(max_iter=2000), False),
    ]  # fmt: skip


def pipeline_for(case: Case, table: Any) -> Any:
    from sklearn.compose import ColumnTransformer
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    if case.numbers_only:  # fitted on the number columns alone, as a float array
        return Pipeline([("scale", StandardScaler()), ("model", case.estimator())])
    columns = ColumnTransformer([("num", StandardScaler(), table.numeric),
                                 ("cat", OneHotEncoder(handle_unknown="ignore"), table.categorical)])  # fmt: skip
    return Pipeline([("columns", columns), ("model", case.estimator())])


def rows_for(case: Case, table: Any) -> tuple[np.ndarray, list[str]]:
    """The rows a case's pipeline takes, and their column names."""
    if case.numbers_only:
        return np.asarray(table.X[:, table.numeric], dtype=np.float64), [table.columns[j] for j in table.numeric]
    return table.X, list(table.columns)


def module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


class Hummingbird:
    """Hummingbird's translation of a pipeline, and how it is fed: the raw rows where it converts the whole
    pipeline, else the fitted column transformer's output (timed with it: ``prepare``)."""

    def __init__(self, pipeline: Any, X: np.ndarray) -> None:
        from hummingbird.ml import convert

        self.whole, self.refusal = True, None
        try:
            self.model = convert(pipeline, "torch", X[:64])
            self.model.predict_proba(X[:4])
            self.prepare = None
        except Exception as exc:  # noqa: BLE001 (the library's own refusal: recorded, then the fallback)
            self.whole, self.refusal = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            self.prepare = pipeline[:-1]
            self.model = convert(pipeline[-1], "torch", np.asarray(self.prepare.transform(X[:64]), dtype=np.float64))
        # Its estimator alone, on rows scikit-learn has already transformed: the translation's own cost.
        self.estimator = self.model if not self.whole else convert(pipeline[-1], "torch",
                                                                   self.transformed(pipeline, X[:64]))  # fmt: skip

    @staticmethod
    def transformed(pipeline: Any, X: np.ndarray) -> np.ndarray:
        return np.asarray(pipeline[:-1].transform(X), dtype=np.float64)

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        if self.prepare is not None:
            X = np.asarray(self.prepare.transform(X), dtype=np.float64)
        return self.model.predict_proba(X)

    def nbytes(self) -> int:
        inner = getattr(self.model, "model", None)
        return module_bytes(inner) if isinstance(inner, torch.nn.Module) else 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from windtunnel import translate
    from windtunnel.datasets import synthetic_tabular

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    table = synthetic_tabular(args.train_rows + max(batches), seed=0)
    train = slice(0, args.train_rows)
    results = []
    chosen = [c for c in cases() if not args.only or any(word in c.name for word in args.only.split(","))]
    for case in tqdm(chosen, desc="pipelines", unit="pipeline"):
        X, columns = rows_for(case, table)
        test = X[args.train_rows :]
        pipeline = pipeline_for(case, table).fit(X[train], table.y[train])
        model = translate(pipeline, columns).eval()
        hb = Hummingbird(pipeline, test)
        want = pipeline.predict_proba(test)
        with torch.inference_mode():
            got = model(*model.encode_array(test)).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
        hb_diff = float(np.abs(hb.predict_proba(test) - want).max())
        trees = model.trees()
        row: dict[str, Any] = {
            "pipeline": case.name,
            "tree": case.tree,
            "windtunnel_layout": ("perfect" if all(t.perfect for t in trees) else "node order") if trees else "-",
            "depth": max((t.depth for t in trees), default=0),
            # Parameters and buffers, and the tables the tree walks built on the first call.
            "windtunnel_bytes": module_bytes(model) + sum(t.derived_bytes() for t in trees),
            "hummingbird_bytes": hb.nbytes(),
            "hummingbird_whole_pipeline": hb.whole,
            "hummingbird_refusal": None if hb.whole else hb.refusal,
            "hummingbird_max_abs_diff": hb_diff,
            "windtunnel_max_abs_diff": float(np.abs(got - want).max()),
        }
        row["batches"] = time_systems(pipeline, model, hb, test, batches, args)
        results.append(row)
    return {"batches": batches, "threads": args.threads, "repeats": args.repeats, "train_rows": args.train_rows,
            "min_seconds": args.min_seconds, "twin": args.twin, "pipelines": results}  # fmt: skip


def time_systems(pipeline: Any, model: Any, hb: Hummingbird, test: np.ndarray, batches: list[int],
                 args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Per batch size: each system's median time (ms) over the repeats, its range, and the speed-ups."""
    systems = {
        "sklearn": pipeline.predict_proba,
        "windtunnel": lambda X: model(*model.encode_array(X)),
        "windtunnel_module": None,  # per batch: the forward pass on rows encoded beforehand
        "hummingbird": hb.predict_proba,
        "hummingbird_module": None,  # per batch: its estimator on rows scikit-learn transformed beforehand
    }
    if args.twin:
        systems["windtunnel_twin"] = systems["windtunnel"]
    times: dict[int, dict[str, list[float]]] = {b: {s: [] for s in systems} for b in batches}
    with torch.inference_mode():
        for r in tqdm(range(args.repeats), desc="  repeats", unit="repeat", leave=False):
            for b in batches:
                X = test[:b]
                encoded = model.encode_array(X)
                ready = hb.transformed(pipeline, X)
                calls = dict(systems, windtunnel_module=lambda _X, e=encoded: model(*e),
                             hummingbird_module=lambda _X, z=ready: hb.estimator.predict_proba(z))  # fmt: skip
                names = list(calls)
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    fn = calls[name]
                    times[b][name].append(
                        median_seconds(lambda fn=fn, X=X: fn(X), budget_s=args.min_seconds, max_runs=None)
                    )
    out = {}
    for b in batches:
        t = times[b]
        out[str(b)] = {
            "ms": {s: 1e3 * statistics.median(v) for s, v in t.items()},
            "ms_range": {s: [1e3 * min(v), 1e3 * max(v)] for s, v in t.items()},
            # The other's time over WindTunnel's (from rows), per repeat: > 1 is WindTunnel faster.
            "speedup_vs": {
                other: ratio_summary([o / w for o, w in zip(t[other], t["windtunnel"], strict=True)])
                for other in t
                if other != "windtunnel"
            },
            # Hummingbird's estimator on transformed rows over WindTunnel's whole module on encoded rows
            # (which also scales and one-hot encodes): the translations' own costs.
            "module_speedup": ratio_summary(
                [h / w for h, w in zip(t["hummingbird_module"], t["windtunnel_module"], strict=True)]
            ),
        }
    return out


def ratio_summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def render(data: dict[str, Any]) -> str:
    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:.2f}× ({s['low']:.2f}-{s['high']:.2f})"

    lines = [
        "# WindTunnel against Hummingbird and scikit-learn",
        "",
        f"The same fitted pipelines (one-hot + scaler + the estimator, or a scaler + the estimator on the number "
        f"columns alone; fitted on {data['train_rows']:,} rows of the synthetic table), each answered from raw rows "
        f"by scikit-learn, by WindTunnel (encoding included) and by Hummingbird (where it refuses the pipeline, "
        f"scikit-learn's fitted column transformer and then its estimator); {data['threads']} threads, "
        f"{data['repeats']} interleaved repeats (order rotated), each time the median of calls over "
        f"{data['min_seconds']} s. Speed-up = the other's time / WindTunnel's, per repeat: median (range); "
        "> 1 means WindTunnel is faster. *Modules*: WindTunnel's whole module (scaling and one-hot encoding "
        "included) on rows encoded beforehand, against Hummingbird's estimator alone on rows scikit-learn "
        "transformed beforehand.",
        "",
    ]
    header = ["pipeline", "batch", "scikit-learn ms", "Hummingbird ms", "WindTunnel ms", "Hummingbird estimator ms",
              "WindTunnel module ms", "vs Hummingbird", "vs Hummingbird, modules", "vs scikit-learn"]  # fmt: skip
    if data["twin"]:
        header.append("A/A (WindTunnel twin)")
    rows = []
    for p in data["pipelines"]:
        for b in data["batches"]:
            m = p["batches"][str(b)]
            cells = [p["pipeline"], b, f"{m['ms']['sklearn']:.3f}", f"{m['ms']['hummingbird']:.3f}",
                     f"{m['ms']['windtunnel']:.3f}", f"{m['ms']['hummingbird_module']:.3f}",
                     f"{m['ms']['windtunnel_module']:.3f}", cell(m["speedup_vs"]["hummingbird"]),
                     cell(m["module_speedup"]), cell(m["speedup_vs"]["sklearn"])]  # fmt: skip
            if data["twin"]:
                cells.append(cell(m["speedup_vs"]["windtunnel_twin"]))
            rows.append(cells)
    lines += [markdown_table(header, rows), ""]
    lines += ["| pipeline | WindTunnel layout (depth) | module bytes: WindTunnel / Hummingbird | "
              "largest difference from scikit-learn: WindTunnel / Hummingbird | Hummingbird took |",
              "|---|---|---|---|---|"]  # fmt: skip
    for p in data["pipelines"]:
        took = "the whole pipeline" if p["hummingbird_whole_pipeline"] else (
            f"the estimator only, on the fitted column transformer's output (timed with it): "
            f"{p['hummingbird_refusal']}")  # fmt: skip
        size = f"{p['windtunnel_bytes'] / 2**20:.2f} MiB / {p['hummingbird_bytes'] / 2**20:.2f} MiB"
        diff = f"{p['windtunnel_max_abs_diff']:.1e} / {p['hummingbird_max_abs_diff']:.1e}"
        lines.append(f"| {p['pipeline']} | {p['windtunnel_layout']} ({p['depth']}) | {size} | {diff} | {took} |")
    lines += ["", f"![{STEM}]({STEM}.png)", "", provenance_block(data["provenance"])]
    return "\n".join(lines) + "\n"


SERIES = (("sklearn", "scikit-learn"), ("hummingbird", "Hummingbird"), ("windtunnel", "WindTunnel (from rows)"),
          ("windtunnel_module", "WindTunnel module"))  # fmt: skip


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pipelines = data["pipelines"]
    fig, axes = plt.subplots(1, len(pipelines), figsize=(3.2 * len(pipelines), 3.4), squeeze=False)
    for ax, p in zip(axes[0], pipelines, strict=True):
        for system, label in SERIES:
            ax.plot(data["batches"], [p["batches"][str(b)]["ms"][system] for b in data["batches"]], marker="o",
                    label=label)  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(p["pipeline"], fontsize=8)
        ax.set_xlabel("batch (rows)")
    axes[0][0].set_ylabel("ms per batch")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,1024,10000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.3, help="time each system at each batch this long")
    parser.add_argument("--train-rows", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated words: the pipelines whose names hold one")
    parser.add_argument("--twin", action="store_true", help="time WindTunnel twice each round (the A/A band)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    data = measure(args)
    data["provenance"] = provenance("bench.windtunnel_vs_hummingbird")
    print(publish(STEM, data, render, plot, args.out_dir, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
