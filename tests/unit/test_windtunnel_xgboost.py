"""XGBoost models through WindTunnel: equal to XGBoost's own answers on its split thresholds and their float32
neighbours (XGBoost goes left when ``x < t`` in float32); what cannot be answered exactly is refused by name.
XGBoost sums in float32, the translation in float64: answers agree to 1e-6 of their size.  Skipped without
xgboost."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn.compose import ColumnTransformer
from sklearn.datasets import load_breast_cancer, load_wine
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from windtunnel import UntranslatableError, translate
from windtunnel.datasets import synthetic_tabular

xgboost = pytest.importorskip("xgboost")


def cases():
    X, y = load_breast_cancer(return_X_y=True)
    W, w = load_wine(return_X_y=True)
    target = X[:, 0] * 0.3 + X[:, 1] ** 0.5
    return {
        "binary": (xgboost.XGBClassifier(n_estimators=40, max_depth=4), X, y),
        "multiclass": (xgboost.XGBClassifier(n_estimators=15, max_depth=3), W, w),
        "regression": (xgboost.XGBRegressor(n_estimators=40, max_depth=5), X, target),
        "absolute error": (xgboost.XGBRegressor(n_estimators=20, objective="reg:absoluteerror"), X, target),
        "poisson": (xgboost.XGBRegressor(n_estimators=20, max_depth=3, objective="count:poisson"), X, target),
    }


def answers(model, X: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(*model.encode_array(X)).numpy()


def splits(estimator) -> list[tuple[int, np.float32]]:
    """Every split's (feature, threshold) in the booster's saved model."""
    trees = json.loads(bytes(estimator.get_booster().save_raw("json")))["learner"]["gradient_booster"]["model"]
    return [(f, np.float32(t)) for tree in trees["trees"]
            for f, t, left in zip(tree["split_indices"], tree["split_conditions"], tree["left_children"], strict=True)
            if left != -1]  # fmt: skip


@pytest.mark.parametrize("name", list(cases()))
def test_an_xgboost_model_answers_as_xgboost_on_its_thresholds_and_their_float32_neighbours(name):
    estimator, X, y = cases()[name]
    estimator.fit(X[::2], y[::2])
    model = translate(estimator)
    rows = X[1::2].copy()
    nodes = splits(estimator)
    rng = np.random.default_rng(0)
    for r in range(len(rows)):  # a third exactly on a threshold: x < t goes right there, x <= t would go left
        feature, t = nodes[rng.integers(len(nodes))]
        rows[r, feature] = (t, np.nextafter(t, np.float32(-np.inf)), np.nextafter(t, np.float32(np.inf)))[r % 3]
    want = estimator.predict(rows) if model.output == "prediction" else estimator.predict_proba(rows)
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(answers(model, rows), want, rtol=1e-6, atol=1e-6 * scale)


def test_a_pipeline_ending_in_xgboost_answers_from_named_columns():
    table = synthetic_tabular(800, seed=2)
    columns = ColumnTransformer([("num", StandardScaler(), table.numeric),
                                 ("cat", OneHotEncoder(handle_unknown="ignore"), table.categorical)])  # fmt: skip
    pipeline = Pipeline([("columns", columns), ("model", xgboost.XGBClassifier(n_estimators=20, max_depth=4))])
    pipeline.fit(table.X[:600], table.y[:600])
    model = translate(pipeline, table.columns)
    np.testing.assert_allclose(answers(model, table.X[600:]), pipeline.predict_proba(table.X[600:]), atol=1e-6)


def test_xgboost_settings_that_cannot_be_answered_exactly_are_refused_by_name():
    X, y = load_breast_cancer(return_X_y=True)
    refused = [
        (xgboost.XGBClassifier(n_estimators=3, booster="gblinear"), y, "booster='gblinear'"),
        (xgboost.XGBRegressor(n_estimators=3, objective="reg:logistic"), y.astype(float), "objective 'reg:logistic'"),
        (xgboost.XGBRegressor(n_estimators=3, tree_method="hist"), np.stack([y, 1.0 - y], axis=1), "several targets"),
    ]
    for estimator, target, message in refused:
        with pytest.raises(UntranslatableError, match=message):
            translate(estimator.fit(X, target))
    codes = np.stack([np.arange(300) % 5, np.arange(300.0)], axis=1)
    categorical = xgboost.XGBClassifier(n_estimators=3, enable_categorical=True, tree_method="hist",
                                        feature_types=["c", "q"], max_cat_to_onehot=1)  # fmt: skip
    categorical.fit(codes, (np.arange(300) % 5 == 2).astype(int))
    with pytest.raises(UntranslatableError, match="categorical split"):
        translate(categorical)


def test_an_xgboost_pipeline_fine_tunes_and_keeps_its_best_epoch():
    """An underfit XGBoost classifier (5 rounds of depth 3) trained end to end with its scaler: the validation
    AUC it starts from is the pipeline's own, and the epoch kept is the best one and no worse than that start
    (measured: 0.748 → 0.795)."""
    from sklearn.metrics import roc_auc_score

    from windtunnel.finetune import FineTuneConfig, Split, auc, fine_tune

    table = synthetic_tabular(900, seed=3)
    columns = ColumnTransformer([("num", StandardScaler(), table.numeric), ("cat", OneHotEncoder(), table.categorical)])
    estimator = xgboost.XGBClassifier(n_estimators=5, max_depth=3, learning_rate=0.3)
    pipeline = Pipeline([("columns", columns), ("model", estimator)]).fit(table.X[:600], table.y[:600])
    model = translate(pipeline, table.columns)
    train = Split(*model.encode_array(table.X[:600]), table.y[:600])
    valid = Split(*model.encode_array(table.X[600:]), table.y[600:])
    start = roc_auc_score(table.y[600:], pipeline.predict_proba(table.X[600:])[:, 1])
    assert auc(model, valid) == pytest.approx(start, abs=1e-6)
    result = fine_tune(model, train, valid, FineTuneConfig(epochs=6, lr=3e-3, temperature=0.3, seed=0))
    assert result.valid_auc >= max(result.history) - 1e-12 and result.valid_auc >= start
    assert result.valid_auc == pytest.approx(auc(result.model, valid))
