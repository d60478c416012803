"""WindTunnel's translation: each operator, whole pipelines, refusals, row encoding.

Tolerance: the translated module runs in float64 and its tree splits are
scikit-learn's own float32 comparisons, so probabilities agree to 1e-9
(measured: ≤ 2e-15) and every predicted class is the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.compose import ColumnTransformer
from sklearn.datasets import load_breast_cancer, load_wine
from sklearn.decomposition import PCA
from sklearn.ensemble import ExtraTreesClassifier, GradientBoostingClassifier, RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import KNeighborsClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import MinMaxScaler, OneHotEncoder, QuantileTransformer, StandardScaler
from sklearn.svm import LinearSVC
from sklearn.tree import DecisionTreeClassifier

from windtunnel import RowError, UntranslatableError, translate
from windtunnel.datasets import synthetic_tabular

TOL = 1e-9


def outputs(model, X: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(*model.encode_array(X)).numpy()


def assert_same(pipeline, X: np.ndarray, columns=None) -> None:
    model = translate(pipeline, columns)
    got = outputs(model, X)
    if model.output == "decision":
        want = pipeline.decision_function(X)
    else:
        want = pipeline.predict_proba(X)
        assert (np.asarray(model.classes)[got.argmax(1)] == pipeline.predict(X)).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


@pytest.fixture(scope="module")
def cancer():
    X, y = load_breast_cancer(return_X_y=True)
    return X[:400], y[:400], X[400:]  # fit on the first rows, compare on held-out ones


@pytest.fixture(scope="module")
def wine():
    X, y = load_wine(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    return X[order[:120]], y[order[:120]], X[order[120:]]


@pytest.mark.parametrize("scaler", [StandardScaler(), StandardScaler(with_mean=False), MinMaxScaler(),
                                    MinMaxScaler(feature_range=(-1, 2), clip=True)], ids=repr)  # fmt: skip
def test_scalers(cancer, scaler):
    X, y, held_out = cancer
    assert_same(make_pipeline(scaler, LogisticRegression(max_iter=5000)).fit(X, y), held_out)


@pytest.mark.parametrize("whiten", [False, True])
def test_pca(cancer, whiten):
    X, y, held_out = cancer
    assert_same(make_pipeline(StandardScaler(), PCA(6, whiten=whiten), LogisticRegression()).fit(X, y), held_out)


@pytest.mark.parametrize(
    "estimator",
    [
        LogisticRegression(max_iter=5000),
        LinearSVC(),
        DecisionTreeClassifier(max_depth=6, random_state=0),
        RandomForestClassifier(n_estimators=25, max_depth=8, random_state=0),
        ExtraTreesClassifier(n_estimators=10, random_state=0),
        GradientBoostingClassifier(n_estimators=30, max_depth=3, random_state=0),
    ],
    ids=lambda e: type(e).__name__,
)
def test_estimators_binary_and_multiclass(cancer, wine, estimator):
    for X, y, held_out in (cancer, wine):
        assert_same(make_pipeline(StandardScaler(), estimator).fit(X, y), held_out)


def test_a_bare_estimator_and_unscaled_trees_split_exactly_at_float32_thresholds(cancer):
    X, y, held_out = cancer
    forest = RandomForestClassifier(n_estimators=10, random_state=0).fit(X, y)
    assert_same(forest, held_out)
    # Inputs that sit exactly on the float32 neighbours of every threshold:
    # where a rounded-to-nearest float32 threshold would go the wrong way.
    tree = forest.estimators_[0].tree_
    node = int(np.nonzero(tree.children_left != -1)[0][0])
    f, t = tree.feature[node], tree.threshold[node]
    probe = np.repeat(held_out[:1], 3, axis=0)
    probe[:, f] = [
        np.float32(t),
        np.nextafter(np.float32(t), np.float32(-np.inf)),
        np.nextafter(np.float32(t), np.float32(np.inf)),
    ]  # noqa: E501
    assert_same(forest, probe)


def test_a_whole_pipeline_with_categorical_columns():
    data = synthetic_tabular(800, seed=1)
    fit, held_out = data.X[:600], data.X[600:]
    for estimator in (LogisticRegression(max_iter=2000), GradientBoostingClassifier(n_estimators=40, random_state=0),
                      RandomForestClassifier(n_estimators=20, random_state=0)):  # fmt: skip
        columns = ColumnTransformer([
            ("num", make_pipeline(StandardScaler(), PCA(2)), data.numeric),
            ("cat", OneHotEncoder(handle_unknown="ignore"), data.categorical),
        ])  # fmt: skip
        pipeline = Pipeline([("columns", columns), ("scale", MinMaxScaler()), ("model", estimator)])
        pipeline.fit(fit, data.y[:600])
        assert_same(pipeline, held_out, data.columns)


def test_rows_are_encoded_by_name_and_bad_rows_are_refused_with_the_column_named():
    data = synthetic_tabular(300, seed=2)
    columns = ColumnTransformer([("num", StandardScaler(), data.numeric),
                                 ("cat", OneHotEncoder(handle_unknown="error"), data.categorical)])  # fmt: skip
    pipeline = Pipeline([("columns", columns), ("model", LogisticRegression(max_iter=2000))]).fit(data.X, data.y)
    model = translate(pipeline, data.columns)
    row = dict(zip(data.columns, data.X[0].tolist(), strict=True))
    with torch.no_grad():
        got = model(*model.encode_rows([row])).numpy()
    np.testing.assert_allclose(got, pipeline.predict_proba(data.X[:1]), atol=TOL)
    cat = data.columns[data.categorical[0]]
    num = data.columns[data.numeric[0]]
    for bad, message in [
        ({k: v for k, v in row.items() if k != num}, f"missing column\\(s\\) \\['{num}'\\]"),
        ({**row, num: "12"}, f"column '{num}' must be a finite number"),
        ({**row, num: float("nan")}, f"column '{num}' must be a finite number"),
        ({**row, cat: "no-such-category"}, f"column '{cat}': unknown category 'no-such-category'"),
        ({**row, cat: [1]}, f"column '{cat}' must be a category"),
    ]:
        with pytest.raises(RowError, match=message):
            model.encode_rows([row, bad])
    with pytest.raises(RowError, match="expected an object"):
        model.encode_rows([[1, 2, 3]])


def test_an_unseen_category_encodes_as_zeros_when_the_encoder_ignores_it():
    data = synthetic_tabular(300, seed=3)
    columns = ColumnTransformer([("cat", OneHotEncoder(handle_unknown="ignore"), data.categorical)])
    pipeline = Pipeline([("columns", columns), ("model", LogisticRegression())]).fit(data.X, data.y)
    model = translate(pipeline, data.columns)
    row = dict(zip(data.columns, data.X[0].tolist(), strict=True))
    probe = data.X[:1].copy()
    probe[0, data.categorical[0]] = "never-seen"
    with torch.no_grad():
        got = model(*model.encode_rows([{**row, data.columns[data.categorical[0]]: "never-seen"}])).numpy()
    np.testing.assert_allclose(got, pipeline.predict_proba(probe), atol=TOL)


@pytest.mark.parametrize(
    "pipeline, message",
    [
        (
            make_pipeline(QuantileTransformer(n_quantiles=50), LogisticRegression()),
            "step 'quantiletransformer': QuantileTransformer is not translatable",
        ),
        (make_pipeline(StandardScaler(), KNeighborsClassifier()), "estimator KNeighborsClassifier is not translatable"),
        (make_pipeline(StandardScaler(), LogisticRegression()), "is not fitted"),
    ],
    ids=["transformer", "estimator", "unfitted"],
)
def test_untranslatable_operators_are_refused_by_name(cancer, pipeline, message):
    X, y, _ = cancer
    if message != "is not fitted":
        pipeline.fit(X, y)
    with pytest.raises(UntranslatableError, match=message):
        translate(pipeline)


def test_one_hot_settings_that_change_the_encoding_are_refused():
    data = synthetic_tabular(300, seed=4)
    for encoder, message in [(OneHotEncoder(drop="first"), "drop='first'"),
                             (OneHotEncoder(min_frequency=200), "infrequent categories")]:  # fmt: skip
        columns = ColumnTransformer([("cat", encoder, data.categorical)])
        pipeline = Pipeline([("columns", columns), ("model", LogisticRegression())]).fit(data.X, data.y)
        with pytest.raises(UntranslatableError, match=message):
            translate(pipeline, data.columns)


def test_the_tree_walk_and_the_gemm_form_reach_the_same_leaves(cancer):
    X, y, held_out = cancer
    for estimator in (RandomForestClassifier(n_estimators=8, max_depth=9, random_state=0),
                      GradientBoostingClassifier(n_estimators=8, max_depth=3, random_state=0)):  # fmt: skip
        model = translate(make_pipeline(StandardScaler(), estimator).fit(X, y))
        (forest,) = model.trees()
        with torch.no_grad():
            x = model.features(*model.encode_array(held_out))
            gemm = forest.leaf_weights(x)  # one-hot over leaves in hard mode
            assert torch.equal(gemm.sum(dim=2), torch.ones_like(gemm[:, :, 0]))
            assert torch.equal(gemm.argmax(dim=2), forest.leaves(x))


def rows_on_thresholds(forest, X: np.ndarray, rng, n: int = 600) -> np.ndarray:
    """``n`` rows of ``X``, each with one node's feature set to its float32 threshold or either neighbour."""
    rows = X[rng.integers(0, len(X), n)].astype(np.float64)
    at = rng.integers(0, forest.features.numel(), n)
    t32 = forest.thresholds.detach().reshape(-1)[at].numpy().astype(np.float32)
    side = rng.integers(0, 3, n)
    rows[np.arange(n), forest.features[at].numpy()] = np.where(
        side == 0, t32, np.where(side == 1, np.nextafter(t32, np.float32(-np.inf)), np.nextafter(t32, np.inf))
    )
    return rows


def test_the_perfect_layout_walks_to_the_same_leaves_as_the_node_order_even_on_the_thresholds():
    """Shallow forests are walked in the perfect layout: the same leaf as walking the trees' own node order for
    every row, including rows on the float32 neighbours of thresholds and NaN; a threshold changed in place (a
    training step) is read on the next walk; a forest too deep for the layout keeps the node order."""
    X, y = load_breast_cancer(return_X_y=True)
    rng = np.random.default_rng(1)
    for estimator in (RandomForestClassifier(n_estimators=12, max_depth=7, random_state=0),
                      GradientBoostingClassifier(n_estimators=12, max_depth=3, random_state=0),
                      ExtraTreesClassifier(n_estimators=6, max_depth=11, random_state=0)):  # fmt: skip
        model = translate(estimator.fit(X[:400], y[:400]))
        (forest,) = model.trees()
        assert forest.perfect
        # Every row of a probe batch sits on a threshold or one of its float32 neighbours, on that node's feature.
        rows = rows_on_thresholds(forest, X, rng)
        rows[::50, 0] = np.nan
        with torch.no_grad():
            x = torch.as_tensor(rows)
            gemm = forest.leaf_weights(x).argmax(dim=2)  # the dense path form: a third, independent walk
            assert torch.equal(forest._walk_perfect(x), gemm)  # tree-major (600 rows ≥ TREE_MAJOR_ROWS)
            assert torch.equal(forest._walk_perfect(x[:100]), gemm[:100])  # row-major
            assert torch.equal(forest._walk_nodes(x), gemm)
            forest.thresholds.mul_(0.5)  # in place, as an optimizer steps
            assert torch.equal(forest._walk_perfect(x), forest._walk_nodes(x))
            assert torch.equal(forest._walk_perfect(x[:100]), forest._walk_nodes(x[:100]))
    deep = translate(RandomForestClassifier(n_estimators=2, random_state=0).fit(X, y))
    (forest,) = deep.trees()
    assert forest.depth > 0 and forest.perfect == (forest.depth <= 12)


def test_a_perfect_forest_served_reads_its_leaf_values_table_and_follows_trained_values():
    """Serving (no gradient) reads the leaf values by bottom position; the same answer as the walk to each
    leaf and its values (what runs while values are being trained), row- and tree-major, for each way of
    combining trees, and again after the values change in place (an optimizer step)."""
    X, y = load_breast_cancer(return_X_y=True)
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor

    cases = [(RandomForestClassifier(n_estimators=9, max_depth=6, random_state=0), y),
             (GradientBoostingClassifier(n_estimators=9, max_depth=3, random_state=0), y),
             (RandomForestRegressor(n_estimators=9, max_depth=6, random_state=0), X[:, 0]),
             (GradientBoostingRegressor(n_estimators=9, max_depth=3, random_state=0), X[:, 0])]  # fmt: skip
    for estimator, target in cases:
        (forest,) = translate(estimator.fit(X[:400], target[:400])).trees()
        assert forest.perfect and forest.combine in ("mean", "sum", "average")
        x = torch.as_tensor(np.concatenate([X, X]))  # 1138 rows: tree-major; the first 100: row-major
        for step in range(2):
            for rows in (x, x[:100]):
                served = forest(rows)  # with a gradient: the walk to each leaf, then its values
                with torch.no_grad():
                    assert torch.allclose(forest(rows), served, rtol=1e-12, atol=1e-12), (estimator, step)
            with torch.no_grad():
                forest.values.mul_(1.5).add_(0.01)  # in place: the table must follow


def test_the_node_order_walk_drops_finished_walks_and_still_reaches_every_leaf_as_scikit_learn():
    """Deep trees are walked in their own node order, dropping walks that reached their leaves on the way:
    every row's leaf in every tree is the one scikit-learn's ``apply`` names, also on rows at a threshold and
    its float32 neighbours, and the forest's probabilities are scikit-learn's."""
    from sklearn.datasets import make_classification

    X, y = make_classification(n_samples=3000, n_features=12, n_informative=8, flip_y=0.2, random_state=0)
    estimator = RandomForestClassifier(n_estimators=5, random_state=0).fit(X[:2000], y[:2000])
    model = translate(estimator)
    (forest,) = model.trees()
    assert not forest.perfect and forest.depth > 12  # so the node-order walk, with several drops
    rows = X[2000:].copy()
    root = estimator.estimators_[0].tree_
    t32 = np.float32(root.threshold[0])
    feature = int(root.feature[0])
    rows[0::3, feature] = t32  # the first tree's root threshold, and its float32 neighbours
    rows[1::3, feature] = np.nextafter(t32, np.float32(-np.inf))
    rows[2::9, feature] = np.nextafter(t32, np.float32(np.inf))
    with torch.no_grad():
        reached = forest._walk_nodes(torch.as_tensor(rows)).numpy()
        probabilities = model(*model.encode_array(rows)).numpy()
    for k, tree in enumerate(estimator.estimators_):
        leaf_nodes = np.flatnonzero(tree.tree_.children_left == -1)  # scikit-learn's leaves, in node order
        assert np.array_equal(leaf_nodes[reached[:, k]], tree.apply(rows.astype(np.float32))), k
    np.testing.assert_allclose(probabilities, estimator.predict_proba(rows), rtol=0, atol=1e-12)


@pytest.mark.slow
def test_the_archive_command_refuses_an_untranslatable_pipeline_and_archives_a_good_one(cancer, tmp_path):
    import subprocess
    import sys
    import zipfile

    import joblib
    import yaml

    X, y, _ = cancer
    bad, good = tmp_path / "bad.joblib", tmp_path / "good.joblib"
    joblib.dump(make_pipeline(QuantileTransformer(n_quantiles=50), LogisticRegression()).fit(X, y), bad)
    joblib.dump(make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000)).fit(X, y), good)
    cmd = [sys.executable, "-m", "packrat_plugin.cli", "sklearn-archive", "--out-dir", str(tmp_path)]
    refused = subprocess.run([*cmd, str(bad), "--name", "bad"], capture_output=True, text=True)
    assert refused.returncode == 2 and "QuantileTransformer is not translatable" in refused.stderr
    assert not (tmp_path / "bad.mar").exists()
    built = subprocess.run([*cmd, str(good), "--name", "good", "--max-rows", "10"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    with zipfile.ZipFile(tmp_path / "good.mar") as mar:
        config = yaml.safe_load(mar.read("model-config.yaml"))
        assert "pipeline.joblib" in mar.namelist()
    assert config["handler"]["windtunnel"] == {"soft": False, "max_rows": 10, "max_payload_bytes": 4 * 1024 * 1024}


def test_missing_values_are_imputed_as_the_pipeline_imputes_them():
    from sklearn.impute import SimpleImputer

    data = synthetic_tabular(700, seed=6)
    X = data.X.copy()
    holes = np.random.default_rng(0).random(X.shape) < 0.1
    X[holes] = np.nan
    numeric = make_pipeline(SimpleImputer(strategy="median"), StandardScaler())
    categorical = make_pipeline(SimpleImputer(strategy="most_frequent"), OneHotEncoder(handle_unknown="ignore"))
    columns = ColumnTransformer([("num", numeric, data.numeric), ("cat", categorical, data.categorical)])
    for estimator in (LogisticRegression(max_iter=2000), GradientBoostingClassifier(n_estimators=20, random_state=0)):
        pipeline = Pipeline([("columns", columns), ("model", estimator)]).fit(X[:500], data.y[:500])
        assert_same(pipeline, X[500:], data.columns)
        model = translate(pipeline, data.columns)
        row = {
            c: (None if isinstance(v, float) and np.isnan(v) else v) for c, v in zip(data.columns, X[500], strict=True)
        }
        with torch.no_grad():  # JSON null is a missing value too
            np.testing.assert_allclose(model(*model.encode_rows([row])).numpy(), pipeline.predict_proba(X[500:501]),
                                       atol=TOL)  # fmt: skip
    # Without an imputer a missing value is still an error naming the column.
    plain = Pipeline([("columns", ColumnTransformer([("num", StandardScaler(), data.numeric)])),
                      ("model", LogisticRegression())]).fit(data.X[:500], data.y[:500])  # fmt: skip
    row = dict(zip(data.columns, data.X[0].tolist(), strict=True))
    with pytest.raises(RowError, match=f"column '{data.columns[data.numeric[0]]}' must be a finite number"):
        translate(plain, data.columns).encode_rows([{**row, data.columns[data.numeric[0]]: None}])


def test_a_top_level_imputer_and_imputer_settings_it_cannot_express():
    from sklearn.impute import SimpleImputer

    clean, y = load_breast_cancer(return_X_y=True)
    X = clean.copy()
    X[np.random.default_rng(1).random(X.shape) < 0.05] = np.nan
    pipeline = make_pipeline(SimpleImputer(), StandardScaler(), LogisticRegression(max_iter=5000)).fit(X[:400], y[:400])
    assert_same(pipeline, X[400:])
    for imputer, message in [(SimpleImputer(add_indicator=True), "add_indicator=True"),
                             (SimpleImputer(missing_values=-1.0), "missing_values=-1.0")]:  # fmt: skip
        fitted = make_pipeline(imputer, LogisticRegression(max_iter=5000)).fit(clean[:400], y[:400])
        with pytest.raises(UntranslatableError, match=message):
            translate(fitted)


@pytest.mark.slow
def test_a_depth_unlimited_forest_translates_exactly_in_memory_of_its_own_size():
    """scikit-learn's default forest (no max_depth): the dense path matrices would take gigabytes; the
    translation holds a few numbers per node, answers exactly, and refuses only the soft form, by size."""
    import tracemalloc

    rng = np.random.default_rng(0)
    X = rng.standard_normal((13000, 20))
    y = (X[:, 0] + np.sin(3 * X[:, 1]) + 0.5 * rng.standard_normal(13000) > 0).astype(int)
    forest = RandomForestClassifier(n_estimators=100, random_state=0).fit(X[:12000], y[:12000])
    nodes = max(e.tree_.node_count for e in forest.estimators_)
    dense_bytes = 100 * (nodes // 2) * (nodes // 2 + 1) * 8
    tracemalloc.start()
    model = translate(forest)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert dense_bytes > 1 << 30, dense_bytes  # the old form's size: a real deep forest, not a toy
    assert peak < 200 * 2**20 and held < 200 * 2**20, (peak, held)
    assert_same(forest, X[12000:])
    with pytest.raises(ValueError, match=r"soft \(trainable\) form of these 100 trees needs a [\d.]+ GiB path matrix"):
        model.set_soft(True)


def test_a_number_matrix_encodes_as_its_columns_do_and_a_bad_value_is_named_by_row_and_column():
    """``encode_array`` on a float matrix for a pipeline of numbers alone (whole-matrix operations): the same
    tensors as column by column, a column the pipeline does not read left out, NaN kept only where an imputer
    fills it, and anything else not finite refused naming its row and column."""
    from sklearn.impute import SimpleImputer

    data = synthetic_tabular(300, seed=5)
    X = np.asarray(data.X[:, data.numeric], dtype=np.float64)
    names = [data.columns[j] for j in data.numeric]
    columns = ColumnTransformer([("filled", SimpleImputer(), [1]), ("plain", StandardScaler(), [0, 2])])
    pipeline = Pipeline([("columns", columns), ("model", RandomForestClassifier(10, max_depth=5, random_state=0))])
    pipeline.fit(X[:200], data.y[:200])
    model = translate(pipeline, names)
    held = X[200:].copy()
    held[::5, 1] = np.nan
    numeric, codes = model.encode_array(held)
    by_column = model.encode_columns({c: held[:, i] for i, c in enumerate(names)})
    np.testing.assert_array_equal(numeric.numpy(), by_column[0].numpy())
    assert codes.shape == (len(held), 0) and torch.equal(codes, by_column[1])
    with torch.no_grad():
        np.testing.assert_allclose(model(numeric, codes).numpy(), pipeline.predict_proba(held), atol=TOL)
    for column, value, shown in [(1, np.inf, "inf"), (2, np.nan, "nan"), (0, -np.inf, "-inf")]:
        bad = held.copy()
        bad[7, column] = value
        with pytest.raises(RowError, match=rf"^row 7: column '{names[column]}' must be a finite number, got {shown}$"):
            model.encode_array(bad)
    held[7, 3] = np.inf  # a column no step reads: never looked at
    assert torch.equal(model.encode_array(held)[0].nan_to_num(), numeric.nan_to_num())


def test_columns_rows_and_arrays_encode_alike_and_a_bad_value_is_named_by_row_and_column():
    """``encode_columns`` (array operations) against ``encode_rows`` and ``encode_array``: the same tensors on a
    table with string and numeric categories, missing values an imputer fills, and an unseen category the
    encoder ignores; and the same refusal, naming row and column, whichever way the values came."""
    from sklearn.impute import SimpleImputer

    data = synthetic_tabular(400, seed=4)
    X = data.X.copy()
    num, cat = data.numeric[0], data.categorical[0]
    X[::7, num] = np.nan
    X[::11, cat] = np.nan  # what the imputer takes as missing (JSON null in a row)
    columns = ColumnTransformer([
        ("num", make_pipeline(SimpleImputer(), StandardScaler()), data.numeric),
        ("cat", make_pipeline(SimpleImputer(strategy="most_frequent"), OneHotEncoder(handle_unknown="ignore")),
         data.categorical),
    ])  # fmt: skip
    pipeline = Pipeline([("columns", columns), ("model", LogisticRegression(max_iter=2000))]).fit(X[:300], data.y[:300])
    model = translate(pipeline, data.columns)
    held = X[300:].copy()
    held[3, cat] = "never-seen"
    rows = [{c: (None if isinstance(v, float) and np.isnan(v) else v) for c, v in zip(data.columns, r, strict=True)}
            for r in held]  # fmt: skip
    by_name = {c: [row[c] for row in rows] for c in data.columns}
    from_rows, from_columns, from_array = (
        model.encode_rows(rows),
        model.encode_columns(by_name),
        model.encode_array(held),
    )
    for a, b in [(from_rows, from_columns), (from_rows, from_array)]:
        assert torch.equal(a[1], b[1])
        np.testing.assert_array_equal(a[0].numpy(), b[0].numpy())  # NaN where the imputer fills, in both
    assert from_rows[1][3, data.categorical.index(cat)] == -1  # the unseen category: all zeros
    with torch.no_grad():
        np.testing.assert_allclose(model(*from_columns).numpy(), pipeline.predict_proba(held), atol=TOL)
    # Numbers as a float array (what a v2 FP64 tensor gives) take the same path as a list.
    name = data.columns[num]
    as_array = {**by_name, name: np.asarray([np.nan if v is None else v for v in by_name[name]], dtype=np.float64)}
    assert torch.equal(model.encode_columns(as_array)[0].nan_to_num(), from_rows[0].nan_to_num())

    strict = translate(Pipeline([("columns", ColumnTransformer([("num", StandardScaler(), data.numeric),
                                 ("cat", OneHotEncoder(), data.categorical)])),
                                 ("model", LogisticRegression(max_iter=2000))]).fit(data.X, data.y),
                       data.columns)  # fmt: skip
    good = {c: list(data.X[:5, i]) for i, c in enumerate(data.columns)}
    cat_name = data.columns[cat]
    for column, value, message in [
        (name, "12", f"row 2: column '{name}' must be a finite number, got '12'"),
        (name, float("inf"), f"row 2: column '{name}' must be a finite number, got inf"),
        (name, True, f"row 2: column '{name}' must be a finite number, got True"),
        (cat_name, "no-such", f"row 2: column '{cat_name}': unknown category 'no-such'"),
        (cat_name, None, f"row 2: column '{cat_name}' must be a category"),
    ]:
        values = list(good[column])
        values[2] = value
        with pytest.raises(RowError, match=message.replace("(", "\\(").replace("[", "\\[")):
            strict.encode_columns({**good, column: values})
        rows_in = [{c: good[c][r] for c in good} for r in range(5)]
        rows_in[2][column] = value
        with pytest.raises(RowError, match=message.replace("(", "\\(").replace("[", "\\[")):
            strict.encode_rows(rows_in)
    with pytest.raises(RowError, match="different numbers of rows"):
        strict.encode_columns({**good, name: good[name][:4]})
    with pytest.raises(RowError, match="missing column"):
        strict.encode_columns({c: v for c, v in good.items() if c != cat_name})


# -- regressors -----------------------------------------------------------------


def regression_target(table) -> np.ndarray:
    """A continuous label from the synthetic table's own columns (numbers and categories), with noise."""
    age, income, score, visits = (table.X[:, j].astype(np.float64) for j in table.numeric)
    plan = np.asarray([len(str(v)) for v in table.X[:, table.categorical[1]]], dtype=np.float64)
    noise = np.random.default_rng(7).normal(0, 0.5, len(table.X))
    return 0.05 * age + 0.8 * np.log(income) + 3 * np.sin(4 * score) + 0.4 * visits + 0.3 * plan + noise


def regressors():
    from sklearn.ensemble import ExtraTreesRegressor, GradientBoostingRegressor, RandomForestRegressor
    from sklearn.linear_model import ElasticNet, Lasso, LinearRegression, Ridge
    from sklearn.tree import DecisionTreeRegressor

    return [
        LinearRegression(), Ridge(alpha=2.0), Lasso(alpha=0.01), ElasticNet(alpha=0.01, l1_ratio=0.3),
        DecisionTreeRegressor(max_depth=7, random_state=0),
        RandomForestRegressor(n_estimators=15, random_state=0),  # unlimited depth: the node-order walk
        ExtraTreesRegressor(n_estimators=15, max_depth=9, random_state=0),
        GradientBoostingRegressor(n_estimators=30, max_depth=3, random_state=0),
        GradientBoostingRegressor(n_estimators=20, loss="huber", random_state=0),
        GradientBoostingRegressor(n_estimators=20, loss="quantile", alpha=0.8, init="zero", random_state=0),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "estimator", regressors(), ids=lambda e: f"{type(e).__name__}-{e.get_params().get('loss', '')}"
)
def test_a_regressor_pipeline_answers_its_own_predictions(estimator):
    table = synthetic_tabular(1500, seed=3)
    y = regression_target(table)
    columns = ColumnTransformer([("num", StandardScaler(), table.numeric),
                                 ("cat", OneHotEncoder(handle_unknown="ignore"), table.categorical)])  # fmt: skip
    pipeline = Pipeline([("columns", columns), ("model", estimator)]).fit(table.X[:1000], y[:1000])
    model = translate(pipeline, table.columns)
    assert model.output == "prediction" and model.classes == []
    got = outputs(model, table.X[1000:])
    assert got.shape == (500,)
    np.testing.assert_allclose(got, pipeline.predict(table.X[1000:]), rtol=1e-12, atol=1e-12)


def test_tree_regressors_agree_on_thresholds_and_their_float32_neighbours():
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor

    X, _ = load_breast_cancer(return_X_y=True)
    y = X[:, 0] * 0.3 + X[:, 1] ** 0.5
    rng = np.random.default_rng(2)
    for estimator in (RandomForestRegressor(n_estimators=8, random_state=0),
                      GradientBoostingRegressor(n_estimators=10, max_depth=4, random_state=0)):  # fmt: skip
        estimator.fit(X[:400], y[:400])
        model = translate(estimator)
        (forest,) = model.trees()
        rows = rows_on_thresholds(forest, X, rng)
        rows = np.where(np.isfinite(rows), rows, 0.0)  # padding nodes' +inf thresholds
        np.testing.assert_allclose(outputs(model, rows), estimator.predict(rows), rtol=1e-12, atol=1e-12)


def test_regressors_that_cannot_be_translated_are_refused_by_name():
    from sklearn.dummy import DummyRegressor
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor
    from sklearn.linear_model import LinearRegression
    from sklearn.neighbors import KNeighborsRegressor

    X, _ = load_breast_cancer(return_X_y=True)
    two = np.stack([X[:, 0], X[:, 1]], axis=1)
    with pytest.raises(UntranslatableError, match="LinearRegression fitted to several targets"):
        translate(LinearRegression().fit(X, two))
    with pytest.raises(UntranslatableError, match="RandomForestRegressor fitted to several targets"):
        translate(RandomForestRegressor(n_estimators=2, max_depth=2).fit(X, two))
    with pytest.raises(UntranslatableError, match=r"GradientBoostingRegressor\(init=LinearRegression\(\)\)"):
        translate(GradientBoostingRegressor(n_estimators=2, init=LinearRegression()).fit(X, X[:, 0]))
    median = GradientBoostingRegressor(n_estimators=5, init=DummyRegressor(strategy="median")).fit(X, X[:, 0])
    np.testing.assert_allclose(outputs(translate(median), X), median.predict(X), rtol=1e-12, atol=1e-12)
    with pytest.raises(
        UntranslatableError, match="KNeighborsRegressor is not translatable.*regressors: LinearRegression"
    ):
        translate(KNeighborsRegressor().fit(X, X[:, 0]))


# -- more preprocessing steps, and steps that combine others --------------------------------------


def preprocessing_cases():
    from sklearn.feature_selection import SelectKBest, VarianceThreshold, f_classif
    from sklearn.pipeline import FeatureUnion
    from sklearn.preprocessing import (
        Binarizer,
        KBinsDiscretizer,
        MaxAbsScaler,
        Normalizer,
        PolynomialFeatures,
        RobustScaler,
    )

    lr = LogisticRegression(max_iter=5000)
    quantiles = "averaged_inverted_cdf"
    return {
        "robust": make_pipeline(RobustScaler(quantile_range=(10, 90)), lr),
        "robust-uncentred": make_pipeline(RobustScaler(with_centering=False), lr),
        "maxabs": make_pipeline(MaxAbsScaler(), lr),
        "normalizer-l2": make_pipeline(Normalizer(), StandardScaler(), lr),
        "normalizer-l1": make_pipeline(Normalizer(norm="l1"), StandardScaler(), lr),
        "normalizer-max": make_pipeline(Normalizer(norm="max"), StandardScaler(), lr),
        "binarizer": make_pipeline(StandardScaler(), Binarizer(threshold=0.3), lr),
        "kbins-onehot": make_pipeline(KBinsDiscretizer(n_bins=5, encode="onehot-dense", quantile_method=quantiles), lr),
        "kbins-ordinal-uniform": make_pipeline(KBinsDiscretizer(n_bins=4, encode="ordinal", strategy="uniform"),
                                               RandomForestClassifier(n_estimators=10, random_state=0)),
        "polynomial": make_pipeline(StandardScaler(), SelectKBest(f_classif, k=6), PolynomialFeatures(2), lr),
        "polynomial-interactions": make_pipeline(StandardScaler(), SelectKBest(f_classif, k=5),
                                                 PolynomialFeatures(3, interaction_only=True, include_bias=False), lr),
        "variance-threshold": make_pipeline(VarianceThreshold(0.5), StandardScaler(), lr),
        "feature-union": make_pipeline(
            FeatureUnion([("scaled", StandardScaler()), ("pca", make_pipeline(StandardScaler(), PCA(3))),
                          ("bins", KBinsDiscretizer(n_bins=3, encode="ordinal", quantile_method=quantiles))],
                         transformer_weights={"pca": 2.0}),
            GradientBoostingClassifier(n_estimators=10, random_state=0)),
        "later-column-transformer": make_pipeline(
            StandardScaler(),
            ColumnTransformer([("poly", PolynomialFeatures(2), [0, 1]), ("bin", Binarizer(), slice(2, 6)),
                               ("drop", "drop", [6])], remainder=MaxAbsScaler()),
            lr),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(preprocessing_cases()))
def test_each_preprocessing_step_answers_as_scikit_learn(name):
    X, y = load_breast_cancer(return_X_y=True)
    pipeline = preprocessing_cases()[name].fit(X[:400], y[:400])
    assert_same(pipeline, X[400:])


def test_a_later_column_transformer_must_choose_columns_by_position_and_encoders_stay_first():
    from windtunnel.translate import _positions

    assert _positions([True, False, True], 3, "w") == [0, 2] and _positions([-1], 4, "w") == [3]
    with pytest.raises(UntranslatableError, match="w: a ColumnTransformer after the first step must choose its "
                                                  "columns by position .* got \\['age'\\]"):  # fmt: skip
        _positions(["age"], 3, "w")  # what a frame's names would resolve to
    X = np.stack([np.arange(100.0) % 3, np.arange(100.0)], axis=1)
    inner = make_pipeline(StandardScaler(), ColumnTransformer([("oh", OneHotEncoder(), [0])]), LogisticRegression())
    inner.fit(X, np.arange(100) % 2)
    with pytest.raises(UntranslatableError, match="branch 'oh': OneHotEncoder is not translatable"):
        translate(inner)


# -- histogram gradient boosting ----------------------------------------------------------------------


def hist_cases():
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

    X, y = load_breast_cancer(return_X_y=True)
    W, w = load_wine(return_X_y=True)
    target = X[:, 0] * 0.3 + X[:, 1] ** 0.5
    return {
        "binary": (HistGradientBoostingClassifier(max_iter=40, random_state=0), X, y),
        "multiclass": (HistGradientBoostingClassifier(max_iter=20, max_depth=4, random_state=0), W, w),
        "squared_error": (HistGradientBoostingRegressor(max_iter=40, random_state=0), X, target),
        "absolute_error": (HistGradientBoostingRegressor(loss="absolute_error", max_iter=20), X, target),
        "quantile": (HistGradientBoostingRegressor(loss="quantile", quantile=0.8, max_iter=20), X, target),
        "poisson": (HistGradientBoostingRegressor(loss="poisson", max_iter=20), X, target),
        "gamma": (HistGradientBoostingRegressor(loss="gamma", max_iter=20), X, target),
    }


@pytest.mark.parametrize("name", list(hist_cases()))
def test_histogram_boosting_answers_as_scikit_learn_on_its_float64_thresholds(name):
    """Its trees compare float64 with float64: rows at a threshold and at both float64 neighbours (which a
    float32 comparison would send the same way) take scikit-learn's side."""
    estimator, X, y = hist_cases()[name]
    estimator.fit(X[::2], y[::2])
    model = translate(estimator)
    (forest,) = model.trees()
    rows = X[1::2].copy()
    rng = np.random.default_rng(0)
    for r in range(len(rows)):
        tree = estimator._predictors[rng.integers(len(estimator._predictors))][0].nodes
        node = tree[rng.integers(len(tree))]
        if not node["is_leaf"]:
            t = float(node["num_threshold"])
            rows[r, node["feature_idx"]] = (t, np.nextafter(t, -np.inf), np.nextafter(t, np.inf))[r % 3]
    got = outputs(model, rows)
    want = estimator.predict(rows) if model.output == "prediction" else estimator.predict_proba(rows)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_histogram_boosting_with_native_categories_is_refused_by_name():
    from sklearn.ensemble import HistGradientBoostingClassifier

    X = np.stack([np.arange(200) % 4, np.arange(200.0)], axis=1)
    y = (np.arange(200) % 4 == 1).astype(int)
    estimator = HistGradientBoostingClassifier(max_iter=5, categorical_features=[0]).fit(X, y)
    with pytest.raises(UntranslatableError, match="HistGradientBoostingClassifier with categorical_features"):
        translate(estimator)
