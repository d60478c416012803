"""WindTunnel: accuracy of fine-tuned pipelines, and tensor-program inference against scikit-learn.

    python -m bench.windtunnel --json /tmp/windtunnel.json

For each pipeline, on data made or shipped here (``windtunnel/datasets.py``:
the synthetic table with categorical columns, scikit-learn's breast cancer
set), split 60/20/20 with a fixed seed: the pipeline is fitted on the
training rows; then, on the test rows, ROC AUC of

- the pipeline itself (``predict_proba``),
- its translation, hard splits (must equal the pipeline's),
- the translation fine-tuned end to end (warm start), early-stopped on the
  validation rows,
- the same network from random parameters, trained the same way (cold start),

with fine-tuning repeated over ``--seeds`` (medians and range).  Then the
time per batch of scikit-learn's ``predict_proba`` against the translated
module's forward pass on the same rows, at each batch size, both on this
machine's CPU (``--device cuda`` adds the GPU where there is one), with the
rows already encoded as tensors, and with the encoding from JSON-like rows
that the TorchServe handler pays.
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
from windtunnel.tune_cli import positive_floats


@dataclass(frozen=True)
class Case:
    name: str
    dataset: str
    build: Any  # (Table) -> unfitted Pipeline
    throughput: bool = False


def _cases() -> list[Case]:
    from sklearn.compose import ColumnTransformer
    from sklearn.decomposition import PCA
    from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline, make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    def columns(t: Any) -> ColumnTransformer:
        return ColumnTransformer([("num", StandardScaler(), t.numeric),
                                  ("cat", OneHotEncoder(handle_unknown="ignore"), t.categorical)])  # fmt: skip

    return [
        Case("scaler + one-hot + gradient boosting (50 trees, depth 3)", "synthetic",
             lambda t: Pipeline([("columns", columns(t)), ("model", GradientBoostingClassifier(
                 n_estimators=50, max_depth=3, random_state=0))]), throughput=True),
        Case("scaler + one-hot + random forest (50 trees, depth 6)", "synthetic",
             lambda t: Pipeline([("columns", columns(t)), ("model", RandomForestClassifier(
                 n_estimators=50, max_depth=6, random_state=0))]), throughput=True),
        Case("scaler + one-hot + logistic regression", "synthetic",
             lambda t: Pipeline([("columns", columns(t)), ("model", LogisticRegression(max_iter=2000))])),
        Case("scaler + PCA(5) + logistic regression", "breast_cancer",
             lambda t: make_pipeline(StandardScaler(), PCA(5), LogisticRegression(max_iter=2000))),
        Case("scaler + gradient boosting (30 trees, depth 2)", "breast_cancer",
             lambda t: make_pipeline(StandardScaler(), GradientBoostingClassifier(
                 n_estimators=30, max_depth=2, random_state=0))),
    ]  # fmt: skip


def _table(name: str, rows: int, seed: int = 0) -> Any:
    from windtunnel.datasets import breast_cancer, synthetic_tabular

    return synthetic_tabular(rows, seed=seed) if name == "synthetic" else breast_cancer()


def _splits(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    a, b = int(0.6 * n), int(0.8 * n)
    return order[:a], order[a:b], order[b:]


def accuracy(case: Case, args: argparse.Namespace, draw: int = 0) -> dict[str, Any]:
    """``draw`` seeds the synthetic table's recipe and the split (breast cancer: the split only)."""
    from sklearn.metrics import roc_auc_score

    from windtunnel import translate
    from windtunnel.finetune import FineTuneConfig, Split, auc, cold_start, tune

    t = _table(case.dataset, args.rows, draw)
    train_i, valid_i, test_i = _splits(len(t.y), draw)
    pipeline = case.build(t).fit(t.X[train_i], t.y[train_i])
    model = translate(pipeline, t.columns)

    def split(index: np.ndarray) -> Split:
        return Split(*model.encode_array(t.X[index]), t.y[index])

    train, valid, test = split(train_i), split(valid_i), split(test_i)
    original = float(roc_auc_score(t.y[test_i], pipeline.predict_proba(t.X[test_i])[:, 1]))
    translated = auc(model, test)
    warm, cold, epochs, warm_settings, cold_settings = [], [], [], [], []
    for seed in range(args.seeds):
        config = FineTuneConfig(epochs=args.epochs, seed=seed)
        for start, aucs, settings in ((model, warm, warm_settings),
                                      (cold_start(model, train, seed), cold, cold_settings)):  # fmt: skip
            tuned = tune(start, train, valid, args.lrs, args.temperatures, config)
            aucs.append(auc(tuned.result.model, test))
            settings.append([tuned.config.lr, tuned.config.temperature])
            if start is model:
                epochs.append(tuned.result.best_epoch)
    return {
        "pipeline": case.name, "dataset": case.dataset, "rows": len(t.y), "draw": draw, "original_auc": original,
        "translated_auc": translated, "warm_auc": statistics.median(warm), "warm_range": [min(warm), max(warm)],
        "cold_auc": statistics.median(cold), "cold_range": [min(cold), max(cold)], "warm_best_epochs": epochs,
        "warm_settings": warm_settings, "cold_settings": cold_settings,  # [lr, temperature] per seed
        "warm_aucs": warm, "cold_aucs": cold,  # per seed, paired: the same seed's warm and cold runs
    }  # fmt: skip


def throughput(case: Case, args: argparse.Namespace, batches: list[int]) -> list[dict[str, Any]]:
    from windtunnel import translate

    t = _table(case.dataset, max(args.rows, max(batches)))
    pipeline = case.build(t).fit(t.X[: args.rows * 6 // 10], t.y[: args.rows * 6 // 10])
    model = translate(pipeline, t.columns).eval()
    devices = ["cpu"] + (["cuda"] if args.device == "cuda" and torch.cuda.is_available() else [])
    out = []
    for b in tqdm(batches, desc=f"throughput: {case.name[:40]}", unit="batch size"):
        X = t.X[:b]
        rows = [dict(zip(t.columns, r.tolist(), strict=True)) for r in X]
        numeric, codes = model.encode_rows(rows)
        row: dict[str, Any] = {"pipeline": case.name, "batch": b}
        row["sklearn_ms"] = 1e3 * median_seconds(
            lambda X=X: pipeline.predict_proba(X), budget_s=args.min_seconds, max_runs=None
        )
        with torch.inference_mode():
            for device in devices:
                m = model.to(device)
                x, c = numeric.to(device), codes.to(device)

                def forward(m: Any = m, x: Any = x, c: Any = c, device: str = device) -> None:
                    m(x, c)
                    if device == "cuda":
                        torch.cuda.synchronize()

                row[f"tensor_{device}_ms"] = 1e3 * median_seconds(forward, budget_s=args.min_seconds, max_runs=None)
            model.to("cpu")
            row["tensor_cpu_with_encoding_ms"] = 1e3 * median_seconds(
                lambda rows=rows: model(*model.encode_rows(rows)), budget_s=args.min_seconds, max_runs=None
            )
        out.append(row)
    return out


def render(data: dict[str, Any], stem: str) -> str:
    def rng(r: list[float]) -> str:
        return f"{r[0]:.4f}-{r[1]:.4f}"

    lrs = " / ".join(f"{x:g}" for x in data.get("lrs", [1e-3]))
    temperatures = " / ".join(f"{x:g}" for x in data.get("temperatures", [0.1]))

    def draw(r: dict[str, Any]) -> str:
        return f", draw {r['draw']}" if r.get("draw", 0) else ""

    def settings(r: dict[str, Any], start: str) -> str:
        return ", ".join(f"{lr:g}·{t:g}" for lr, t in r.get(f"{start}_settings", []))

    acc = markdown_table(
        ["pipeline", "data (rows)", "original AUC", "translated (hard)", "WindTunnel warm start (range)",
         "cold start (range)", "warm − original", "warm − cold", "warm − cold per seed",
         "lr·temperature per seed: warm; cold"],
        [[r["pipeline"], f"{r['dataset']} ({r['rows']}{draw(r)})", f"{r['original_auc']:.4f}",
          f"{r['translated_auc']:.4f}",
          f"{r['warm_auc']:.4f} ({rng(r['warm_range'])})", f"{r['cold_auc']:.4f} ({rng(r['cold_range'])})",
          f"{r['warm_auc'] - r['original_auc']:+.4f}", f"{r['warm_auc'] - r['cold_auc']:+.4f}",
          ", ".join(f"{w - c:+.4f}" for w, c in zip(r.get("warm_aucs", []), r.get("cold_aucs", []), strict=True)),
          f"{settings(r, 'warm')}; {settings(r, 'cold')}"]
         for r in data["accuracy"]],
    )  # fmt: skip
    devices = [k for k in data["throughput"][0] if k.startswith("tensor_") and k != "tensor_cpu_with_encoding_ms"]
    thr = markdown_table(
        ["pipeline", "batch", "scikit-learn ms", *[f"{k[7:-3]} ms" for k in devices], "scikit-learn ÷ tensor (cpu)",
         "cpu ms incl. encoding rows"],
        [[r["pipeline"], r["batch"], f"{r['sklearn_ms']:.3f}", *[f"{r[k]:.3f}" for k in devices],
          f"{r['sklearn_ms'] / r['tensor_cpu_ms']:.2f}×", f"{r['tensor_cpu_with_encoding_ms']:.3f}"]
         for r in data["throughput"]],
    )  # fmt: skip
    return (
        "# WindTunnel: scikit-learn pipelines as tensor programs\n\n"
        "Test-set ROC AUC (60/20/20 split seeded by the draw, 0 unless named; "
        f"fine-tuning {data['epochs']} epochs at most, early-stopped on "
        f"validation AUC; Adam learning rate {lrs} and soft-split temperature {temperatures} (× each split "
        "feature's spread; tree pipelines only) chosen per start and seed by validation AUC; median over "
        f"{data['seeds']} seeds):\n\n{acc}\n\n"
        f"Time per batch (median; torch {data['torch_threads']} threads; scikit-learn's predict_proba on the same "
        "rows as a numpy object array; the tensor program on rows already encoded as tensors, and with the "
        f"handler's encoding of JSON-like rows):\n\n{thr}\n\n![windtunnel]({stem}.png)\n\n"
        f"{provenance_block(data['provenance'])}"
    )


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = data["accuracy"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11 + 0.4 * max(0, len(rows) - 5), 4.5),
                                      gridspec_kw={"width_ratios": [max(1.0, len(rows) / 5), 1.0]})  # fmt: skip
    xs = np.arange(len(rows))
    for i, (key, label) in enumerate((("original_auc", "pipeline"), ("warm_auc", "warm start"),
                                      ("cold_auc", "cold start"))):  # fmt: skip
        left.bar(xs + 0.27 * (i - 1), [r[key] for r in rows], 0.27, label=label)
    labels = [f"{r['dataset'][:9]}{' d' + str(r['draw']) if r.get('draw') else ''}\n"
              f"{r['pipeline'].split(' + ')[-1][:18]}" for r in rows]  # fmt: skip
    left.set_xticks(xs, labels, fontsize=7, rotation=40, ha="right")
    left.set_ylim(min(min(r["cold_auc"], r["original_auc"]) for r in rows) - 0.05, 1.0)
    left.set_ylabel("test ROC AUC")
    left.legend(fontsize=8)
    for name in dict.fromkeys(r["pipeline"] for r in data["throughput"]):
        pts = [r for r in data["throughput"] if r["pipeline"] == name]
        right.plot([r["batch"] for r in pts], [r["sklearn_ms"] / r["tensor_cpu_ms"] for r in pts], marker="o",
                   label=name.split(" + ")[-1][:28])  # fmt: skip
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xscale("log", base=2)
    right.set_xlabel("batch (rows)")
    right.set_ylabel("scikit-learn ÷ tensor program time (CPU)")
    right.legend(fontsize=8)
    fig.suptitle("WindTunnel")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4000, help="rows of the synthetic table")
    parser.add_argument("--seeds", type=int, default=3, help="fine-tuning repeats")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--lrs", type=positive_floats, default=[1e-3],
                        help="Adam learning rates to try; each start (warm, cold) keeps the one its validation AUC "
                             "prefers, so both are tuned alike")  # fmt: skip
    parser.add_argument(
        "--temperatures",
        type=positive_floats,
        default=[0.1],
        help="soft-split temperatures to try (× each split feature's spread), tuned like --lrs",
    )
    parser.add_argument("--data-seeds", default="0",
                        help="draws of the data: the synthetic recipe's seed and the 60/20/20 split's, one table "
                             "row per pipeline and draw")  # fmt: skip
    parser.add_argument("--suffix", default="", help="appended to the output files' name (windtunnel<suffix>.*)")
    parser.add_argument("--batches", default="1,16,64,256,1024")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time each batch size at least this long")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.data_seeds = [int(x) for x in args.data_seeds.split(",")]
    prov = provenance("bench.windtunnel")
    cases = _cases()
    batches = [int(b) for b in args.batches.split(",")]
    runs = [(c, d) for d in args.data_seeds for c in cases]
    accuracy_rows = [accuracy(c, args, d) for c, d in tqdm(runs, desc="fine-tuning", unit="pipeline")]
    throughput_rows = [r for c in cases if c.throughput for r in throughput(c, args, batches)]
    data = {"accuracy": accuracy_rows, "throughput": throughput_rows, "seeds": args.seeds, "epochs": args.epochs,
            "lrs": args.lrs, "temperatures": args.temperatures,
            "torch_threads": torch.get_num_threads(), "provenance": prov}  # fmt: skip
    stem = f"windtunnel{args.suffix}"
    print(publish(stem, data, lambda d: render(d, stem), plot, args.out_dir, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
