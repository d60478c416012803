"""Tabular data for tests and benchmarks, made here or shipped with scikit-learn (nothing downloaded).

``synthetic_tabular`` is the documented recipe for a table with numeric and
categorical columns, the shape of data WindTunnel's pipelines are built for
(scikit-learn ships no such set).  Seven columns:

- ``age`` ~ N(40, 12), ``income`` ~ LogNormal(10, 0.6), ``score`` ~ U(0, 1),
  ``visits`` ~ Poisson(4): numbers;
- ``region`` (5 levels), ``plan`` (3), ``device`` (4): strings, uniform.

The label is Bernoulli(σ(logit)) with
``logit = 0.8·z(age) − 0.6·z(log income) + 1.2·sin(3·score) + 0.3·(visits − 4)
+ region effect + plan effect · [score > 0.5] + device effect − 0.2``
(effects fixed below).  The sine and the plan × score interaction are what
a linear model cannot fit exactly and trees fit only stepwise, so there is
something for fine-tuning to gain; the Bernoulli draw keeps AUC below 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REGIONS = {"north": 0.6, "south": -0.4, "east": 0.0, "west": 0.3, "central": -0.7}
PLANS = {"basic": -0.8, "plus": 0.2, "pro": 1.0}
DEVICES = {"ios": 0.2, "android": -0.1, "web": 0.0, "tv": -0.5}


@dataclass(frozen=True)
class Table:
    X: np.ndarray  # object array, one row per sample, columns in ``columns`` order
    y: np.ndarray
    columns: list[str]
    numeric: list[int]  # positions of the numeric columns
    categorical: list[int]
    name: str = ""


def synthetic_tabular(n: int, seed: int = 0) -> Table:
    rng = np.random.default_rng(seed)
    age = rng.normal(40, 12, n)
    income = rng.lognormal(10, 0.6, n)
    score = rng.uniform(0, 1, n)
    visits = rng.poisson(4, n).astype(np.float64)
    region = rng.choice(list(REGIONS), n)
    plan = rng.choice(list(PLANS), n)
    device = rng.choice(list(DEVICES), n)

    def z(v: np.ndarray) -> np.ndarray:
        return (v - v.mean()) / v.std()

    logit = (
        0.8 * z(age) - 0.6 * z(np.log(income)) + 1.2 * np.sin(3 * score) + 0.3 * (visits - 4)
        + np.vectorize(REGIONS.get)(region) + np.vectorize(PLANS.get)(plan) * (score > 0.5)
        + np.vectorize(DEVICES.get)(device) - 0.2
    )  # fmt: skip
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    X = np.empty((n, 7), dtype=object)
    for j, column in enumerate((age, region, income, plan, score, device, visits)):
        X[:, j] = column
    columns = ["age", "region", "income", "plan", "score", "device", "visits"]
    return Table(X, y, columns, numeric=[0, 2, 4, 6], categorical=[1, 3, 5], name="synthetic")


def breast_cancer() -> Table:
    """scikit-learn's bundled Wisconsin breast cancer set: 569 rows, 30 numbers, binary."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    columns = [str(c) for c in data.feature_names]
    return Table(data.data.astype(object), data.target, columns, list(range(len(columns))), [], "breast_cancer")
