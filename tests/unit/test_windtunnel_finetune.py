"""WindTunnel's soft trees and fine-tuning, on small seeded data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.compose import ColumnTransformer
from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from windtunnel import translate
from windtunnel.datasets import synthetic_tabular
from windtunnel.finetune import FineTuneConfig, Split, auc, cold_start, fine_tune, tune


@pytest.fixture(scope="module", params=["boosting", "forest"])
def setup(request):
    t = synthetic_tabular(900, seed=7)
    estimator = (GradientBoostingClassifier(n_estimators=15, max_depth=3, random_state=0) if request.param == "boosting"
                 else RandomForestClassifier(n_estimators=10, max_depth=5, random_state=0))  # fmt: skip
    columns = ColumnTransformer([("num", StandardScaler(), t.numeric), ("cat", OneHotEncoder(), t.categorical)])
    pipeline = Pipeline([("columns", columns), ("model", estimator)]).fit(t.X[:600], t.y[:600])
    model = translate(pipeline, t.columns)
    train = Split(*model.encode_array(t.X[:600]), t.y[:600])
    valid = Split(*model.encode_array(t.X[600:]), t.y[600:])
    return pipeline, model, train, valid


def test_soft_splits_approach_the_hard_trees_as_they_narrow(setup):
    _, model, train, valid = setup
    with torch.no_grad():
        hard = model(valid.numeric, valid.codes).numpy()
        gaps = []
        for factor in (0.3, 0.03, 1e-6):
            model.set_temperature(train.numeric, train.codes, factor)
            model.set_soft(True)
            gaps.append(np.abs(model(valid.numeric, valid.codes).numpy() - hard).max())
            model.set_soft(False)
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-3, gaps


def test_fine_tuning_trains_a_copy_and_never_returns_worse_on_validation(setup):
    _, model, train, valid = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = fine_tune(model, train, valid, FineTuneConfig(epochs=4, seed=0))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the original is untouched
    assert result.valid_auc >= max(result.history[0], auc(model, valid)) - 1e-12
    assert result.valid_auc == pytest.approx(auc(result.model, valid))  # the returned model is the one scored
    assert len(result.history) == 5 and 0 <= result.best_epoch <= 4
    changed = [k for k, v in result.model.state_dict().items() if k in before and not torch.equal(before[k], v)]
    assert any("thresholds" in k for k in changed) and any("values" in k for k in changed), changed


def test_tune_keeps_the_setting_validation_prefers_and_the_weights_carry_its_width(setup):
    pipeline, model, train, valid = setup
    lrs, temperatures = (1e-3, 3e-3), (0.1, 1.0)
    tuned = tune(model, train, valid, lrs, temperatures, FineTuneConfig(epochs=2, seed=0))
    runs = {(lr, t): fine_tune(model, train, valid, FineTuneConfig(epochs=2, lr=lr, temperature=t, seed=0)).valid_auc
            for lr in lrs for t in temperatures}  # fmt: skip
    assert tuned.result.valid_auc == max(runs.values())
    assert runs[(tuned.config.lr, tuned.config.temperature)] == tuned.result.valid_auc
    # What an archive serves: a fresh translation loading the saved weights
    # answers as the tuned model does, soft splits at the width that won.
    served = translate(pipeline, synthetic_tabular(10).columns)
    served.load_state_dict(tuned.result.model.state_dict())
    served.set_soft(tuned.result.soft)
    with torch.no_grad():
        expected = tuned.result.model(valid.numeric, valid.codes)
        assert torch.equal(served(valid.numeric, valid.codes), expected)


def test_tune_tries_temperatures_only_where_there_are_trees():
    from sklearn.linear_model import LogisticRegression

    t = synthetic_tabular(400, seed=3)
    columns = ColumnTransformer([("num", StandardScaler(), t.numeric), ("cat", OneHotEncoder(), t.categorical)])
    pipeline = Pipeline([("columns", columns), ("model", LogisticRegression())]).fit(t.X[:300], t.y[:300])
    model = translate(pipeline, t.columns)
    train = Split(*model.encode_array(t.X[:300]), t.y[:300])
    valid = Split(*model.encode_array(t.X[300:]), t.y[300:])
    tuned = tune(model, train, valid, (1e-3,), (0.5, 2.0), FineTuneConfig(epochs=1))
    assert tuned.config.temperature == 0.5
    with pytest.raises(ValueError, match="at least one"):
        tune(model, train, valid, (), (0.1,))


def test_cold_start_keeps_the_structure_and_redraws_the_numbers(setup):
    _, model, train, _ = setup
    cold = cold_start(model, train, seed=0)
    for (name, a), (_, b) in zip(model.state_dict().items(), cold.state_dict().items(), strict=True):
        assert a.shape == b.shape, name
        if name.endswith(("features", "path", "lefts", "indices")):
            assert torch.equal(a, b), name  # the network: which feature each split reads, the tree shapes
    assert not torch.equal(model.trees()[0].thresholds, cold.trees()[0].thresholds)
    assert not torch.equal(model.trees()[0].values, cold.trees()[0].values)


@pytest.mark.slow
def test_the_finetune_command_reads_a_csv_and_writes_weights_the_archive_can_serve(tmp_path):
    import csv
    import re
    import subprocess
    import sys

    import joblib
    from sklearn.impute import SimpleImputer
    from sklearn.pipeline import make_pipeline

    t = synthetic_tabular(700, seed=8)
    numeric = make_pipeline(SimpleImputer(), StandardScaler())
    columns = ColumnTransformer([("num", numeric, t.numeric), ("cat", OneHotEncoder(), t.categorical)])
    pipeline = Pipeline([("columns", columns), ("model", GradientBoostingClassifier(n_estimators=10))])
    joblib.dump(pipeline.fit(t.X, t.y), tmp_path / "p.joblib")
    data = tmp_path / "rows.csv"
    with data.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*t.columns, "churned"])
        for i, (row, label) in enumerate(zip(t.X.tolist(), t.y.tolist(), strict=True)):
            if i % 10 == 0:
                row[t.numeric[0]] = ""  # a missing number: the imputer's column takes it
            writer.writerow([*row, label])
    cmd = [sys.executable, "-m", "packrat_plugin.cli", "sklearn-finetune", str(tmp_path / "p.joblib"),
           "--data", str(data), "--columns", ",".join(t.columns), "--epochs", "3", "--temperatures", "0.1,1",
           "--out", str(tmp_path / "w.pt")]  # fmt: skip
    done = subprocess.run([*cmd, "--label", "churned"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before, after = map(float, re.search(r"pipeline ([0-9.]+), fine-tuned ([0-9.]+)", done.stdout).groups())
    assert after >= before and "packrat sklearn-archive" in done.stdout
    assert re.search(r"learning rate 0\.00[13], temperature (0\.1|1)\)", done.stdout), done.stdout
    model = translate(pipeline, t.columns)
    model.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))  # the archive's loading path
    wrong = subprocess.run([*cmd, "--label", "nope"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "no column(s) ['nope']" in wrong.stderr
    bad = subprocess.run([*cmd, "--label", "churned", "--temperatures", "0.1,-1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "expected positive numbers" in bad.stderr


@pytest.mark.parametrize("kind", ["boosting", "forest", "linear"])
def test_a_regressor_fine_tunes_on_squared_error_and_is_scored_by_r2(kind):
    """Regressors train on squared error and keep the epoch with the best validation R²: an underfit
    boosting (5 stages), a shallow forest and a ridge all come back no worse than they went in, and the
    trees' numbers move."""
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor
    from sklearn.linear_model import Ridge
    from sklearn.metrics import r2_score

    t = synthetic_tabular(900, seed=7)
    age, income, score, visits = (t.X[:, j].astype(float) for j in t.numeric)
    y = 0.05 * age + np.log(income) + 3 * np.sin(4 * score) + 0.3 * visits
    estimator = {"boosting": GradientBoostingRegressor(n_estimators=5, max_depth=3, random_state=0),
                 "forest": RandomForestRegressor(n_estimators=8, max_depth=4, random_state=0),
                 "linear": Ridge()}[kind]  # fmt: skip
    columns = ColumnTransformer([("num", StandardScaler(), t.numeric), ("cat", OneHotEncoder(), t.categorical)])
    pipeline = Pipeline([("columns", columns), ("model", estimator)]).fit(t.X[:600], y[:600])
    model = translate(pipeline, t.columns)
    train, valid = Split(*model.encode_array(t.X[:600]), y[:600]), Split(*model.encode_array(t.X[600:]), y[600:])
    assert auc(model, valid) == pytest.approx(r2_score(y[600:], pipeline.predict(t.X[600:])), abs=1e-12)
    result = fine_tune(model, train, valid, FineTuneConfig(epochs=6, lr=3e-3, temperature=0.3, seed=0))
    assert result.valid_auc >= result.history[0] - 1e-12
    assert result.valid_auc == pytest.approx(auc(result.model, valid))
    if kind == "boosting":  # 5 stages leave room: squared error finds it
        assert result.valid_auc > result.history[0] + 0.01, result.history


@pytest.mark.slow
def test_the_finetune_command_takes_a_regressors_numeric_target(tmp_path):
    import csv
    import re
    import subprocess
    import sys

    import joblib
    from sklearn.ensemble import GradientBoostingRegressor

    t = synthetic_tabular(500, seed=9)
    y = [0.1 * a + 2 * s for a, s in zip(t.X[:, t.numeric[0]].tolist(), t.X[:, t.numeric[2]].tolist(), strict=True)]
    columns = ColumnTransformer([("num", StandardScaler(), t.numeric), ("cat", OneHotEncoder(), t.categorical)])
    pipeline = Pipeline([("columns", columns), ("model", GradientBoostingRegressor(n_estimators=5))]).fit(t.X, y)
    joblib.dump(pipeline, tmp_path / "r.joblib")
    data = tmp_path / "rows.csv"
    with data.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*t.columns, "spend"])
        writer.writerows([*row, target] for row, target in zip(t.X.tolist(), y, strict=True))
    cmd = [sys.executable, "-m", "packrat_plugin.cli", "sklearn-finetune", str(tmp_path / "r.joblib"), "--data",
           str(data), "--columns", ",".join(t.columns), "--epochs", "2", "--out", str(tmp_path / "w.pt")]  # fmt: skip
    done = subprocess.run([*cmd, "--label", "spend"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before, after = map(
        float, re.search(r"validation R²: pipeline ([0-9.]+), fine-tuned ([0-9.]+)", done.stdout).groups()
    )
    assert after >= before
    rows = data.read_text().splitlines()
    rows[3] = rows[3].rsplit(",", 1)[0] + ",lots"
    data.write_text("\n".join(rows) + "\n")
    bad = subprocess.run([*cmd, "--label", "spend"], capture_output=True, text=True)
    assert bad.returncode == 2 and "rows.csv:4: label 'lots' is not a finite number" in bad.stderr, bad.stderr
