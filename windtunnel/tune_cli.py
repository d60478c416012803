"""``packrat sklearn-finetune``: fine-tune a pipeline's translation on labelled rows from a CSV file.

    packrat sklearn-finetune churn.joblib --data labelled.csv --label churned --out churn.pt
    packrat sklearn-archive churn.joblib --name churn --weights churn.pt [--soft]

The CSV has a header with the pipeline's input columns and the label
column.  Numbers are read as numbers for numeric columns, categories as
they appear (or as numbers when the encoder learned numbers); an empty cell
is a missing value, which only an imputed column accepts.  Rows are shuffled
with ``--seed`` and split into training and validation
(``--valid-fraction``); each learning rate and soft-split width
(``--lrs``, ``--temperatures``) is tried and validation AUC picks one; the printout gives the validation AUC of the
pipeline itself and of the fine-tuned network, and the archive command that
serves the result.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np


def read_rows(path: Path, model: Any, label: str) -> tuple[list[dict[str, Any]], np.ndarray]:
    """The CSV's rows as the model's encoder takes them, and the labels as class indices (a regressor's:
    its numeric targets)."""
    from windtunnel.translate import CATEGORICAL, NUMERIC, RowError

    classes = {str(c): i for i, c in enumerate(model.classes)}
    rows, labels = [], []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c.name for c in model.columns if c.name not in (reader.fieldnames or [])]
        if label not in (reader.fieldnames or []):
            missing.append(label)
        if missing:
            raise RowError(f"{path}: no column(s) {missing} in the header")
        for line, record in enumerate(reader, start=2):
            row: dict[str, Any] = {}
            for col in model.columns:
                text = (record[col.name] or "").strip()
                if text == "":
                    row[col.name] = None
                elif col.kind == NUMERIC:
                    try:
                        row[col.name] = float(text)
                    except ValueError:
                        raise RowError(f"{path}:{line}: column {col.name!r} is not a number: {text!r}") from None
                elif (
                    col.kind == CATEGORICAL
                    and col.categories
                    and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in col.categories)
                ):
                    try:
                        row[col.name] = float(text)  # 3.0 == 3 and hashes alike: finds an integer category
                    except ValueError:
                        row[col.name] = text  # refused as an unknown category by the encoder, naming it
                else:
                    row[col.name] = text
            value = (record[label] or "").strip()
            if model.output == "prediction":  # a regressor's target: a finite number
                if not _is_number(value):
                    raise RowError(f"{path}:{line}: label {value!r} is not a finite number (the target)")
                rows.append(row)
                labels.append(float(value))
                continue
            key = value
            if key not in classes and _is_number(value):  # "1.0" for class 1
                number = float(value)
                key = str(int(number)) if number.is_integer() else str(number)
            if key not in classes:
                raise RowError(f"{path}:{line}: label {value!r} is not one of the classes {list(classes)}")
            rows.append(row)
            labels.append(classes[key])
    return rows, np.asarray(labels, dtype=np.float64 if model.output == "prediction" else np.int64)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def positive_floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(v > 0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pipeline", type=Path, help="a fitted scikit-learn pipeline saved with joblib.dump")
    parser.add_argument("--data", type=Path, required=True, help="CSV with a header: input columns and the label")
    parser.add_argument("--label", required=True, help="the label column")
    parser.add_argument("--out", type=Path, required=True, help="where to write the fine-tuned weights")
    parser.add_argument("--columns", help="comma-separated input column names, as for sklearn-archive")
    parser.add_argument("--valid-fraction", type=float, default=0.2)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument(
        "--lrs",
        type=positive_floats,
        default=positive_floats("1e-3,3e-3"),
        help="Adam learning rates to try, comma-separated; validation AUC picks one",
    )
    parser.add_argument(
        "--temperatures",
        type=positive_floats,
        default=positive_floats("0.1,0.3,1"),
        help="soft-split widths to try (× each split feature's spread; tree pipelines only)",
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import joblib
    import torch

    from windtunnel.finetune import FineTuneConfig, Split, auc, tune
    from windtunnel.translate import RowError, UntranslatableError, translate

    if not 0.0 < args.valid_fraction < 1.0:
        raise ValueError(f"--valid-fraction must be in (0, 1), got {args.valid_fraction}")
    columns = [c.strip() for c in args.columns.split(",")] if args.columns else None
    try:
        model = translate(joblib.load(args.pipeline), columns)
        rows, y = read_rows(args.data, model, args.label)
        numeric, codes = model.encode_rows(rows)
    except (UntranslatableError, RowError) as exc:
        print(f"packrat sklearn-finetune: {exc}", file=sys.stderr)
        return 2
    order = np.random.default_rng(args.seed).permutation(len(y))
    cut = int(round(len(y) * (1.0 - args.valid_fraction)))
    train_i, valid_i = torch.as_tensor(order[:cut]), torch.as_tensor(order[cut:])
    regressor = model.output == "prediction"
    if len(valid_i) < 2 or len(set(y[order[cut:]].tolist())) < 2:
        need = "two different targets" if regressor else "both classes"
        print(f"packrat sklearn-finetune: the validation rows need {need}; give more rows", file=sys.stderr)
        return 2
    train = Split(numeric[train_i], codes[train_i], y[order[:cut]])
    valid = Split(numeric[valid_i], codes[valid_i], y[order[cut:]])
    before = auc(model, valid)
    tuned = tune(model, train, valid, args.lrs, args.temperatures, FineTuneConfig(epochs=args.epochs, seed=args.seed))
    result = tuned.result
    torch.save(result.model.state_dict(), args.out)
    soft = " --soft" if result.soft else ""
    print(f"validation {'R²' if regressor else 'AUC'}: pipeline {before:.4f}, fine-tuned {result.valid_auc:.4f} "
          f"(best epoch {result.best_epoch}, {'soft' if result.soft else 'hard'} splits, learning rate "
          f"{tuned.config.lr:g}" + (f", temperature {tuned.config.temperature:g}" if model.trees() else "")
          + f"); wrote {args.out}\n"
          f"serve it: packrat sklearn-archive {args.pipeline} --name NAME --weights {args.out}{soft}"
          + (f" --columns {args.columns}" if args.columns else ""))  # fmt: skip
    return 0
