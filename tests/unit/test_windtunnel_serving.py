"""A scikit-learn pipeline archive in a real TorchServe: good rows answered exactly, bad ones refused alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import joblib
import numpy as np
import pytest
import torch
from sklearn.compose import ColumnTransformer
from sklearn.ensemble import GradientBoostingClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from windtunnel import translate
from windtunnel.archive import build_sklearn_archive
from windtunnel.datasets import synthetic_tabular
from windtunnel.finetune import FineTuneConfig, Split, fine_tune


@pytest.fixture(scope="module")
def table():
    return synthetic_tabular(600, seed=5)


@pytest.fixture(scope="module")
def pipeline(table):
    columns = ColumnTransformer([("num", StandardScaler(), table.numeric),
                                 ("cat", OneHotEncoder(handle_unknown="error"), table.categorical)])  # fmt: skip
    model = GradientBoostingClassifier(n_estimators=20, max_depth=3, random_state=0)
    return Pipeline([("columns", columns), ("model", model)]).fit(table.X[:500], table.y[:500])


def rows_of(table, lo: int, hi: int) -> list[dict]:
    return [dict(zip(table.columns, row.tolist(), strict=True)) for row in table.X[lo:hi]]


def register(torchserve, tmp_path, pipeline, name: str, **options) -> str:
    path = tmp_path / f"{name}.joblib"
    joblib.dump(pipeline, path)
    build_sklearn_archive(path, torchserve.model_store, name, batch_size=8, max_batch_delay_ms=500, max_rows=64,
                          **options)  # fmt: skip
    torchserve.management().register(f"{name}.mar", model_name=name)
    return name


@pytest.mark.slow
def test_a_pipeline_archive_answers_the_pipelines_own_probabilities(torchserve, tmp_path, table, pipeline):
    name = register(torchserve, tmp_path, pipeline, "wt_gbdt", columns=table.columns)
    client = torchserve.inference()
    one = client.predict(name, rows_of(table, 500, 501)[0])
    assert one.status == 200, one.body
    assert one.body["classes"] == [0, 1]
    np.testing.assert_allclose(one.body["probabilities"], pipeline.predict_proba(table.X[500:501]), atol=1e-9)
    many = client.predict(name, {"rows": rows_of(table, 500, 560)})
    assert many.status == 200, many.body
    np.testing.assert_allclose(many.body["probabilities"], pipeline.predict_proba(table.X[500:560]), atol=1e-9)


@pytest.mark.slow
def test_bad_rows_get_a_4xx_naming_the_problem_and_only_their_request_fails(torchserve, tmp_path, table, pipeline):
    name = register(torchserve, tmp_path, pipeline, "wt_bad", columns=table.columns)
    client = torchserve.inference()
    good = rows_of(table, 500, 508)
    cat, num = table.columns[table.categorical[0]], table.columns[table.numeric[0]]
    bad = [
        ({k: v for k, v in good[1].items() if k != num}, 400, f"missing column(s) ['{num}']"),
        ({**good[2], cat: "mars"}, 400, f"column '{cat}': unknown category 'mars'"),
        ({**good[3], num: "forty"}, 400, f"column '{num}' must be a finite number"),
        (b'{"rows": [', 400, "malformed JSON"),
        ({"rows": []}, 400, "'rows' must be a non-empty list"),
        ({"rows": good * 9}, 413, "72 rows exceed the limit of 64"),
    ]
    payloads = [good[0], *[b for b, _, _ in bad], good[4]]
    # Eight requests inside one 500 ms batch window: the bad ones fail alone.
    with ThreadPoolExecutor(len(payloads)) as pool:
        answers = list(pool.map(lambda p: client.predict(name, p, content_type="application/json"), payloads))
    assert answers[0].status == 200 and answers[-1].status == 200, [a.body for a in answers]
    for answer, (_, status, message) in zip(answers[1:-1], bad, strict=True):
        assert answer.status == status and message in answer.body["message"], answer.body
    np.testing.assert_allclose(answers[-1].body["probabilities"], pipeline.predict_proba(table.X[504:505]), atol=1e-9)
    assert client.predict(name, good[5]).status == 200  # and the server keeps serving


@pytest.mark.slow
def test_a_fine_tuned_archive_serves_its_fine_tuned_weights(torchserve, tmp_path, table, pipeline):
    model = translate(pipeline, table.columns)
    split = Split(*model.encode_array(table.X[:500]), table.y[:500])
    tuned = fine_tune(model, split, split, FineTuneConfig(epochs=2, seed=0)).model
    tuned.set_soft(True)
    weights = tmp_path / "weights.pt"
    torch.save(tuned.state_dict(), weights)
    name = register(torchserve, tmp_path, pipeline, "wt_tuned", columns=table.columns, weights=weights, soft=True)
    answer = torchserve.inference().predict(name, {"rows": rows_of(table, 500, 510)})
    assert answer.status == 200, answer.body
    with torch.no_grad():
        expected = tuned(*tuned.encode_array(table.X[500:510])).numpy()
    np.testing.assert_allclose(answer.body["probabilities"], expected, atol=1e-9)
    assert not np.allclose(expected, pipeline.predict_proba(table.X[500:510]), atol=1e-6)  # really other weights


@pytest.mark.slow
def test_a_regressor_archive_answers_its_own_predictions(torchserve, tmp_path, table):
    """A regression pipeline (forest of unlimited depth) served: one number per row, equal to ``predict``."""
    from sklearn.ensemble import RandomForestRegressor

    y = table.X[:, table.numeric[0]].astype(float) * 0.1 + table.X[:, table.numeric[3]].astype(float)
    columns = ColumnTransformer([("num", StandardScaler(), table.numeric),
                                 ("cat", OneHotEncoder(handle_unknown="ignore"), table.categorical)])  # fmt: skip
    model = RandomForestRegressor(n_estimators=10, random_state=0)
    pipeline = Pipeline([("columns", columns), ("model", model)]).fit(table.X[:500], y[:500])
    name = register(torchserve, tmp_path, pipeline, "wt_forest_regressor", columns=table.columns)
    client = torchserve.inference()
    many = client.predict(name, {"rows": rows_of(table, 500, 540)})
    assert many.status == 200, many.body
    assert set(many.body) == {"predictions"}
    np.testing.assert_allclose(many.body["predictions"], pipeline.predict(table.X[500:540]), rtol=1e-12, atol=1e-12)
    bad = client.predict(name, {**rows_of(table, 500, 501)[0], table.columns[table.numeric[0]]: None})
    assert bad.status == 400 and "must be a finite number" in bad.body["message"], bad.body
