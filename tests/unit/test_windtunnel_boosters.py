"""LightGBM models through WindTunnel: equal to LightGBM's own answers, split thresholds' float64
neighbours included; what cannot be answered exactly is refused by name.  Skipped without lightgbm."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.compose import ColumnTransformer
from sklearn.datasets import load_breast_cancer, load_wine
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from windtunnel import UntranslatableError, translate
from windtunnel.datasets import synthetic_tabular

lightgbm = pytest.importorskip("lightgbm")


def cases():
    X, y = load_breast_cancer(return_X_y=True)
    W, w = load_wine(return_X_y=True)
    target = X[:, 0] * 0.3 + X[:, 1] ** 0.5
    quiet = {"verbose": -1, "random_state": 0}
    return {
        "binary": (lightgbm.LGBMClassifier(n_estimators=30, **quiet), X, y),
        "multiclass": (lightgbm.LGBMClassifier(n_estimators=15, num_leaves=8, **quiet), W, w),
        "regression": (lightgbm.LGBMRegressor(n_estimators=30, **quiet), X, target),
        "huber": (lightgbm.LGBMRegressor(n_estimators=20, objective="huber", **quiet), X, target),
        "poisson": (lightgbm.LGBMRegressor(n_estimators=20, objective="poisson", **quiet), X, target),
    }


def answers(model, X: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(*model.encode_array(X)).numpy()


@pytest.mark.parametrize("name", list(cases()))
def test_a_lightgbm_model_answers_as_lightgbm_on_its_thresholds_and_their_float64_neighbours(name):
    estimator, X, y = cases()[name]
    estimator.fit(X[::2], y[::2])
    model = translate(estimator)
    rows = X[1::2].copy()
    nodes = []
    for info in estimator.booster_.dump_model()["tree_info"]:
        stack = [info["tree_structure"]]
        while stack:
            node = stack.pop()
            if "split_feature" in node:
                nodes.append((node["split_feature"], node["threshold"]))
                stack += [node["left_child"], node["right_child"]]
    rng = np.random.default_rng(0)
    for r in range(len(rows)):
        feature, t = nodes[rng.integers(len(nodes))]
        rows[r, feature] = (t, np.nextafter(t, -np.inf), np.nextafter(t, np.inf))[r % 3]
    want = estimator.predict(rows) if model.output == "prediction" else estimator.predict_proba(rows)
    np.testing.assert_allclose(answers(model, rows), want, rtol=1e-12, atol=1e-12)


def test_a_pipeline_ending_in_lightgbm_answers_from_named_columns():
    table = synthetic_tabular(800, seed=2)
    columns = ColumnTransformer([("num", StandardScaler(), table.numeric),
                                 ("cat", OneHotEncoder(handle_unknown="ignore"), table.categorical)])  # fmt: skip
    estimator = lightgbm.LGBMClassifier(n_estimators=20, verbose=-1, random_state=0)
    pipeline = Pipeline([("columns", columns), ("model", estimator)]).fit(table.X[:600], table.y[:600])
    model = translate(pipeline, table.columns)
    np.testing.assert_allclose(answers(model, table.X[600:]), pipeline.predict_proba(table.X[600:]), atol=1e-12)


def test_lightgbm_settings_that_cannot_be_answered_exactly_are_refused_by_name():
    X, y = load_breast_cancer(return_X_y=True)
    quiet = {"verbose": -1, "n_estimators": 3}
    refused = [
        (lightgbm.LGBMClassifier(boosting_type="rf", bagging_freq=1, bagging_fraction=0.5, **quiet), "averages"),
        (lightgbm.LGBMClassifier(zero_as_missing=True, **quiet), "zero_as_missing=True"),
        (lightgbm.LGBMRegressor(objective="cross_entropy", **quiet), "objective 'cross_entropy'"),
    ]
    for estimator, message in refused:
        target = y if estimator.objective != "cross_entropy" else y.astype(float)
        with pytest.raises(UntranslatableError, match=message):
            translate(estimator.fit(X, target))
    codes = np.stack([np.arange(300) % 5, np.arange(300.0)], axis=1)
    categorical = lightgbm.LGBMClassifier(min_data_per_group=5, cat_smooth=1, **quiet)
    categorical.fit(codes, (np.arange(300) % 5 == 2).astype(int), categorical_feature=[0])
    with pytest.raises(UntranslatableError, match="categorical split"):
        translate(categorical)
