"""A fitted scikit-learn pipeline → one ``nn.Module`` that computes the same predictions.

``translate(pipeline)`` walks a ``Pipeline`` (or a bare estimator): an
optional ``ColumnTransformer`` first, whose branches may hold a
``OneHotEncoder`` and numeric transforms; then ``StandardScaler``,
``MinMaxScaler`` or ``PCA`` steps; then the estimator (``LogisticRegression``,
``LinearSVC``, ``DecisionTreeClassifier``, ``RandomForestClassifier``,
``ExtraTreesClassifier``, ``GradientBoostingClassifier``).  Anything else is
refused with ``UntranslatableError`` naming the operator and where it sits:
a silently different model is worse than none.

The module takes two tensors, the numeric columns ``[N, Fn]`` (float64)
and the categorical columns as category codes ``[N, Fc]`` (long), because
strings cannot enter a tensor; ``TranslatedPipeline.encode_rows`` makes them
from JSON-like rows (named columns), with a ``RowError`` for a missing
column, a wrong type or a category the encoder refuses.  Before any
fine-tuning the module's ``forward`` equals the pipeline's ``predict_proba``
(``decision_function`` for LinearSVC) up to float64 rounding, and its tree
splits are scikit-learn's own float32 comparisons (``operators.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np
import torch
from torch import nn

from windtunnel.boosters import BoosterError, is_lightgbm, is_xgboost, lightgbm_ensemble, xgboost_ensemble
from windtunnel.operators import Affine, Impute, LinearHead, OneHot, Projection, TreeArrays, TreeEnsemble
from windtunnel.transforms import Binarize, Discretize, Normalize, Polynomial, Select, Union


class UntranslatableError(ValueError):
    """The pipeline holds an operator (or a setting) this translator does not cover."""


class RowError(ValueError):
    """A request row the pipeline cannot take; the message names the column."""


NUMERIC, CATEGORICAL, DROPPED = "numeric", "categorical", "dropped"  # dropped: required, not read


@dataclass
class Column:
    """One input column as the pipeline sees it."""

    name: str
    kind: str = NUMERIC
    categories: list[Any] = field(default_factory=list)  # a categorical column's, in the encoder's order
    unknown_ok: bool = False  # handle_unknown='ignore': an unseen category encodes as all zeros
    fill: Any = None  # a SimpleImputer's value for a missing one (null or NaN); None: a value is required
    codes: dict[Any, int] = field(default_factory=dict, repr=False)  # category → its code

    def make_categorical(self, categories: list[Any], unknown_ok: bool) -> None:
        self.kind, self.categories, self.unknown_ok = CATEGORICAL, categories, unknown_ok
        self.codes = {_plain(c): i for i, c in enumerate(categories)}

    def code(self, value: Any) -> int:
        try:
            return self.codes[_plain(value)]
        except (KeyError, TypeError):
            if self.unknown_ok:
                return -1
            shown = ", ".join(repr(_plain(c)) for c in self.categories[:8])
            more = ", …" if len(self.categories) > 8 else ""
            raise RowError(f"column {self.name!r}: unknown category {value!r} (known: {shown}{more})") from None

    # -- a whole column at once (TranslatedPipeline.encode_columns) ---------------

    def numbers(self, values: Sequence[Any] | np.ndarray) -> np.ndarray:
        """A numeric column's values as float64 (NaN where a missing one will be imputed); RowError names the
        first row that is not a finite number.  Arrays and lists of plain numbers convert in one call."""
        if isinstance(values, np.ndarray) and values.dtype.kind == "O":
            values = values.tolist()  # a mixed table's column: its values' own types decide
        if isinstance(values, np.ndarray) and values.dtype.kind in "iuf":
            x = values.astype(np.float64, copy=False)
        elif not isinstance(values, np.ndarray) and set(map(type, values)) <= {int, float}:
            x = np.asarray(values, dtype=np.float64)
        else:
            return np.asarray([self._number(r, v) for r, v in enumerate(values)], dtype=np.float64)
        bad = ~np.isfinite(x)
        if self.fill is not None:
            bad &= ~np.isnan(x)  # NaN is missing: the module's Impute step fills it
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise RowError(f"row {r}: column {self.name!r} must be a finite number, got {_plain(values[r])!r}")
        return x

    def _number(self, r: int, value: Any) -> float:
        value = _plain(value)
        if self.fill is not None and _missing(value):
            return math.nan
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RowError(f"row {r}: column {self.name!r} must be a finite number, got {value!r}")
        return float(value)

    def codes_of(self, values: Sequence[Any] | np.ndarray) -> np.ndarray:
        """A categorical column's category codes (-1: an unknown one the encoder ignores); RowError names the
        first row it cannot take.  A column of strings (or of plain numbers) against categories of that type is
        looked up by one binary search over the sorted categories; anything else value by value."""
        if isinstance(values, np.ndarray) and values.dtype.kind in "OU":
            values = values.tolist()
        table = self._sorted_categories()
        if table is not None and table[0].dtype.kind == "U" and not isinstance(values, np.ndarray):
            # String categories: one dict lookup per value, in C (only a str can equal a str key); the
            # rows it misses (unknown, missing, or not a string) take the value-by-value rules.
            try:
                out = np.fromiter(map(self.codes.get, values, repeat(-1)), dtype=np.int64, count=len(values))
            except TypeError:  # an unhashable value (a JSON list or object): named by the rule below
                out = np.full(len(values), -1, dtype=np.int64)
            for r in np.flatnonzero(out < 0).tolist():
                out[r] = self._code_at(r, values[r])
            return out
        kinds = set(map(type, values)) if not isinstance(values, np.ndarray) else None
        if table is not None:
            keys, codes = table
            arr = None
            if keys.dtype.kind == "U" and (kinds == {str} or (kinds is None and values.dtype.kind == "U")):
                arr = np.asarray(values, dtype=str)
            elif keys.dtype.kind == "f" and (
                (kinds is not None and kinds <= {int, float}) or (kinds is None and values.dtype.kind in "iuf")
            ):
                arr = np.asarray(values, dtype=np.float64)
                if np.isnan(arr).any():
                    arr = None  # missing values: filled, or refused, value by value
            if arr is not None and len(keys):
                pos = np.minimum(np.searchsorted(keys, arr), len(keys) - 1)
                found = keys[pos] == arr
                out = np.where(found, codes[pos], -1)
                if not found.all() and not self.unknown_ok:
                    r = int(np.flatnonzero(~found)[0])
                    self._code_at(r, values[r])  # raises, naming the category
                return out
        return np.asarray([self._code_at(r, v) for r, v in enumerate(values)], dtype=np.int64)

    def _code_at(self, r: int, value: Any) -> int:
        value = _plain(value)
        if self.fill is not None and _missing(value):
            value = self.fill
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise RowError(f"row {r}: column {self.name!r} must be a category (string or number), got {value!r}")
        try:
            return self.code(value)
        except RowError as exc:
            raise RowError(f"row {r}: {exc}") from None

    def _sorted_categories(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(sorted categories, their codes) when they are all strings or all plain numbers; built once."""
        table = self.__dict__.get("_lookup")
        if table is None and "_lookup" not in self.__dict__:
            plain = [_plain(c) for c in self.categories]
            if plain and all(isinstance(c, str) for c in plain):
                keys = np.asarray(plain, dtype=str)
            elif plain and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in plain):
                keys = np.asarray(plain, dtype=np.float64)
            else:
                keys = None
            if keys is not None:
                order = np.argsort(keys, kind="stable")
                table = (keys[order], order.astype(np.int64))
            self.__dict__["_lookup"] = table
        return table


def _missing(value: Any) -> bool:
    """JSON null, or a NaN (what a SimpleImputer with missing_values=NaN fills)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _plain(value: Any) -> Any:
    """numpy scalars as Python values, so that JSON's 3 and a fitted np.int64(3) match."""
    return value.item() if isinstance(value, np.generic) else value


def _name(op: Any) -> str:
    return type(op).__name__


class Branch(nn.Module):
    """One ColumnTransformer branch: its input columns and its operators."""

    def __init__(self, source: str, indices: list[int], ops: list[nn.Module]) -> None:
        super().__init__()
        self.source = source
        self.register_buffer("indices", torch.as_tensor(indices, dtype=torch.long))
        self.ops = nn.Sequential(*ops)

    def forward(self, numeric: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        x = numeric if self.source == NUMERIC else codes
        return self.ops(x.index_select(1, self.indices))


class TranslatedPipeline(nn.Module):
    """The translated pipeline; ``forward(numeric, codes)`` → probabilities (or decision scores)."""

    def __init__(self, columns: list[Column], branches: list[Branch], steps: list[nn.Module], head: nn.Module,
                 classes: list[Any], output: str) -> None:  # fmt: skip
        super().__init__()
        self.columns = columns
        self.branches = nn.ModuleList(branches)
        self.steps = nn.Sequential(*steps)
        self.head = head
        self.classes = classes
        self.output = output  # "probabilities" | "decision" | "prediction" (a regressor's, one per row)
        self.numeric = [c for c in columns if c.kind == NUMERIC]
        self.categorical = [c for c in columns if c.kind == CATEGORICAL]

    def features(self, numeric: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """What the pipeline hands its estimator."""
        return self.steps(torch.cat([b(numeric, codes) for b in self.branches], dim=1))

    def forward(self, numeric: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(numeric, codes))

    def trees(self) -> list[TreeEnsemble]:
        return [m for m in self.modules() if isinstance(m, TreeEnsemble)]

    def set_soft(self, soft: bool) -> None:
        """Soft (differentiable) or hard (exact) tree splits; soft builds the trees' path matrices now,
        so trees too large for them are refused here, by size, not half-way through training."""
        for tree in self.trees():
            if soft:
                tree.dense()
            tree.soft = soft

    def set_temperature(self, numeric: torch.Tensor, codes: torch.Tensor, factor: float) -> None:
        """Soft splits ``factor`` × each split feature's spread wide, measured on these rows."""
        with torch.no_grad():
            x = self.features(numeric, codes)
        for tree in self.trees():
            tree.set_temperature(x, factor)

    # -- rows → tensors ------------------------------------------------------

    def encode_rows(self, rows: Sequence[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """JSON-like rows with named columns → (numeric, codes); RowError names what is wrong.

        The rows are turned into columns (one list per column) and encoded a column at a time
        (``encode_columns``): per-value Python work, which cost more than the forward pass at large
        batches, is left only where a column holds mixed or missing values."""
        names = [c.name for c in self.columns]
        wanted = set(names)
        for r, row in enumerate(rows):
            if not isinstance(row, dict):
                raise RowError(f"row {r}: expected an object of named columns, got {type(row).__name__}")
            if not wanted <= row.keys():
                raise RowError(f"row {r}: missing column(s) {[n for n in names if n not in row]}")
        read = [c.name for c in (*self.numeric, *self.categorical)]
        return self.encode_columns({name: [row[name] for row in rows] for name in read}, count=len(rows))

    def encode_columns(self, columns: dict[str, Sequence[Any] | np.ndarray],
                       count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Columns by name (lists or 1-D arrays, all of one length) → (numeric, codes), with array operations
        where a column's values allow it; RowError names the row and column.  A dropped column (one the
        pipeline requires but does not read) need not be given here."""
        read = (*self.numeric, *self.categorical)
        missing = [c.name for c in read if c.name not in columns]
        if missing:
            raise RowError(f"missing column(s) {missing}")
        lengths = sorted({len(columns[c.name]) for c in read})
        if len(lengths) > 1:
            raise RowError(f"columns hold different numbers of rows: {lengths}")
        n = lengths[0] if lengths else (count or 0)
        numeric = np.empty((n, len(self.numeric)), dtype=np.float64)
        for j, col in enumerate(self.numeric):
            numeric[:, j] = col.numbers(columns[col.name])
        codes = np.empty((n, len(self.categorical)), dtype=np.int64)
        for j, col in enumerate(self.categorical):
            codes[:, j] = col.codes_of(columns[col.name])
        return torch.from_numpy(numeric), torch.from_numpy(codes)

    def encode_array(self, X: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A 2-D array with the pipeline's input columns in order (what it was fitted on)."""
        X = np.asarray(X)
        if X.ndim != 2 or X.shape[1] != len(self.columns):
            raise RowError(f"expected a 2-D array of {len(self.columns)} columns, got shape {list(X.shape)}")
        if X.dtype.kind in "iuf" and not self.categorical:
            return self._encode_number_matrix(X)
        by_name = {c.name: X[:, i] for i, c in enumerate(self.columns)}
        read = {c.name: by_name[c.name] for c in (*self.numeric, *self.categorical)}
        return self.encode_columns(read, count=len(X))

    def _encode_number_matrix(self, X: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A numeric array for a pipeline of numbers alone: its columns taken and checked in a few whole-matrix
        operations.  Column by column (``Column.numbers``) cost ~5 NumPy calls per column, 56 µs for 16
        columns, a sixth of the forest's own time at 64 rows."""
        position = {c.name: i for i, c in enumerate(self.columns)}
        take = [position[c.name] for c in self.numeric]
        numeric = np.ascontiguousarray(X if take == list(range(X.shape[1])) else X[:, take], dtype=np.float64)
        bad = ~np.isfinite(numeric)
        filled = [j for j, c in enumerate(self.numeric) if c.fill is not None]
        if filled:
            bad[:, filled] &= ~np.isnan(numeric[:, filled])  # NaN is missing there: the Impute step fills it
        if bad.any():
            r, j = (int(i) for i in np.argwhere(bad)[0])
            raise RowError(f"row {r}: column {self.numeric[j].name!r} must be a finite number, "
                           f"got {_plain(X[r, take[j]])!r}")  # fmt: skip
        return torch.from_numpy(numeric), torch.empty((len(X), 0), dtype=torch.int64)


# -- operators -----------------------------------------------------------------


NUMERIC_STEPS = (
    "SimpleImputer, StandardScaler, MinMaxScaler, RobustScaler, MaxAbsScaler, Normalizer, Binarizer, "
    "KBinsDiscretizer, PolynomialFeatures, PCA, feature selectors (SelectKBest, VarianceThreshold, …), "
    "FeatureUnion, ColumnTransformer (after the first step: columns by position), Pipeline"
)


def _numeric_op(op: Any, where: str) -> nn.Module:
    """One step on numbers (a matrix in, a matrix out) as a module; anything else refused by name."""
    from sklearn.compose import ColumnTransformer
    from sklearn.decomposition import PCA
    from sklearn.feature_selection import SelectorMixin
    from sklearn.impute import SimpleImputer
    from sklearn.pipeline import FeatureUnion, Pipeline
    from sklearn.preprocessing import (
        Binarizer,
        KBinsDiscretizer,
        MaxAbsScaler,
        MinMaxScaler,
        Normalizer,
        PolynomialFeatures,
        RobustScaler,
        StandardScaler,
    )

    if isinstance(op, StandardScaler):
        mean = op.mean_ if op.with_mean else np.zeros(op.n_features_in_)
        scale = op.scale_ if op.with_std else np.ones(op.n_features_in_)
        return Affine(1.0 / scale, -mean / scale)
    if isinstance(op, MinMaxScaler):
        return Affine(op.scale_, op.min_, tuple(op.feature_range) if op.clip else None)
    if isinstance(op, RobustScaler):
        center = op.center_ if op.with_centering else np.zeros(op.n_features_in_)
        scale = op.scale_ if op.with_scaling else np.ones(op.n_features_in_)
        return Affine(1.0 / scale, -center / scale)
    if isinstance(op, MaxAbsScaler):
        return Affine(1.0 / op.scale_, np.zeros(op.n_features_in_))
    if isinstance(op, SimpleImputer):
        return Impute(_imputer_fills(op, where))
    if isinstance(op, PCA):
        weight = op.components_
        if op.whiten:
            weight = weight / np.sqrt(op.explained_variance_)[:, None]
        return Projection(weight, -weight @ op.mean_)
    if isinstance(op, Normalizer):
        return Normalize(op.norm)
    if isinstance(op, Binarizer):
        return Binarize(op.threshold)
    if isinstance(op, KBinsDiscretizer):
        return Discretize(list(op.bin_edges_), one_hot=op.encode != "ordinal")
    if isinstance(op, PolynomialFeatures):
        return Polynomial(op.powers_)
    if isinstance(op, SelectorMixin):
        return Select(op.get_support())
    if isinstance(op, Pipeline):
        return nn.Sequential(*_numeric_chain(op, where))
    if isinstance(op, FeatureUnion):
        weights = op.transformer_weights or {}
        parts = [(None, _numeric_chain(t, f"{where}, part {name!r}"), weights.get(name, 1.0))
                 for name, t in op.transformer_list if t != "drop"]  # fmt: skip
        return Union(parts)
    if isinstance(op, ColumnTransformer):
        parts = []
        for branch, transformer, selector in op.transformers_:
            if transformer == "drop":
                continue
            inner = f"{where}, branch {branch!r}"
            positions = _positions(selector, op.n_features_in_, inner)
            if positions:
                parts.append((positions, _numeric_chain(transformer, inner), 1.0))
        return Union(parts)
    raise UntranslatableError(f"{where}: {_name(op)} is not translatable (numeric steps: {NUMERIC_STEPS})")


def _numeric_chain(transformer: Any, where: str) -> list[nn.Module]:
    """A transformer (a Pipeline's steps, one step, or ``"passthrough"``) as a list of modules."""
    from sklearn.pipeline import Pipeline

    if transformer in (None, "passthrough"):
        return []
    steps = [s for _, s in transformer.steps] if isinstance(transformer, Pipeline) else [transformer]
    return [_numeric_op(s, where) for s in steps if s not in (None, "passthrough")]


def _positions(selector: Any, width: int, where: str) -> list[int]:
    """A ColumnTransformer selector after the first step: positions only (its input has no names)."""
    if isinstance(selector, slice):
        return list(range(width))[selector]
    items = [_plain(i) for i in np.atleast_1d(selector)]
    if items and all(isinstance(i, bool) for i in items):
        return [i for i, keep in enumerate(items) if keep]
    if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return [i % width for i in items]
    raise UntranslatableError(f"{where}: a ColumnTransformer after the first step must choose its columns by "
                              f"position (its input has no column names), got {items[:4]!r}")  # fmt: skip


def _imputer_fills(op: Any, where: str) -> list[Any]:
    """A SimpleImputer's fill value per column, or why it cannot be translated."""
    if not (isinstance(op.missing_values, float) and math.isnan(op.missing_values)):
        raise UntranslatableError(f"{where}: SimpleImputer(missing_values={op.missing_values!r}) is not "
                                  f"translatable; use the default (NaN)")  # fmt: skip
    if op.add_indicator:
        raise UntranslatableError(f"{where}: SimpleImputer(add_indicator=True) is not translatable")
    fills = [_plain(v) for v in op.statistics_]
    if any(isinstance(v, float) and math.isnan(v) for v in fills):
        raise UntranslatableError(f"{where}: SimpleImputer learned no value for a column that was all "
                                  f"missing (it drops it); drop the column first")  # fmt: skip
    return fills


def _one_hot(op: Any, where: str) -> tuple[OneHot, list[list[Any]], bool]:
    if op.drop is not None:
        raise UntranslatableError(f"{where}: OneHotEncoder(drop={op.drop!r}) is not translatable; use drop=None")
    if getattr(op, "infrequent_categories_", None) is not None and any(
        c is not None for c in op.infrequent_categories_
    ):
        raise UntranslatableError(f"{where}: OneHotEncoder with infrequent categories (min_frequency / "
                                  f"max_categories) is not translatable")  # fmt: skip
    categories = [list(c) for c in op.categories_]
    return OneHot([len(c) for c in categories]), categories, op.handle_unknown != "error"


def _estimator(op: Any, n_features: int) -> tuple[nn.Module, list[Any], str]:
    """The estimator's module, its classes ([] for a regressor) and what the module answers:
    ``"probabilities"``, ``"decision"`` (LinearSVC's scores) or ``"prediction"`` (a regressor's value)."""
    from sklearn.ensemble import (
        ExtraTreesClassifier,
        ExtraTreesRegressor,
        GradientBoostingClassifier,
        GradientBoostingRegressor,
        HistGradientBoostingClassifier,
        HistGradientBoostingRegressor,
        RandomForestClassifier,
        RandomForestRegressor,
    )
    from sklearn.linear_model import ElasticNet, Lasso, LinearRegression, LogisticRegression, Ridge
    from sklearn.svm import LinearSVC
    from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor  # fmt: skip

    if isinstance(op, (LinearRegression, Ridge, Lasso, ElasticNet, DecisionTreeRegressor, RandomForestRegressor,
                       ExtraTreesRegressor, GradientBoostingRegressor)):  # fmt: skip
        return _regressor(op, n_features), [], "prediction"
    if is_lightgbm(op) or is_xgboost(op):
        try:
            ensemble, link = (lightgbm_ensemble if is_lightgbm(op) else xgboost_ensemble)(op)
        except BoosterError as exc:
            raise UntranslatableError(str(exc)) from None
        if link in ("logistic", "softmax"):
            return ensemble, [_plain(c) for c in op.classes_], "probabilities"
        return ensemble, [], "prediction"
    if isinstance(op, HistGradientBoostingRegressor):
        return _hist_boosting(op, n_features), [], "prediction"
    classes = [_plain(c) for c in op.classes_] if hasattr(op, "classes_") else []
    if isinstance(op, HistGradientBoostingClassifier):
        return _hist_boosting(op, n_features), classes, "probabilities"
    if isinstance(op, LogisticRegression):
        link = "logistic" if len(classes) == 2 else "softmax"
        return LinearHead(op.coef_, op.intercept_, link), classes, "probabilities"
    if isinstance(op, LinearSVC):
        return LinearHead(op.coef_, op.intercept_, "identity"), classes, "decision"
    if isinstance(op, (DecisionTreeClassifier, RandomForestClassifier, ExtraTreesClassifier)):
        fitted = [op] if isinstance(op, DecisionTreeClassifier) else list(op.estimators_)
        trees = []
        for est in fitted:
            value = est.tree_.value[:, 0, :]
            value = value / np.maximum(value.sum(axis=1, keepdims=True), 1e-300)  # class distributions
            trees.append(TreeArrays.from_sklearn(est.tree_, value))
        return TreeEnsemble(trees, n_features, "mean", "identity"), classes, "probabilities"
    if isinstance(op, GradientBoostingClassifier):
        return _boosting(op, n_features), classes, "probabilities"
    raise UntranslatableError(
        f"estimator {_name(op)} is not translatable (classifiers: LogisticRegression, LinearSVC, "
        f"DecisionTreeClassifier, RandomForestClassifier, ExtraTreesClassifier, GradientBoostingClassifier, "
        f"HistGradientBoostingClassifier; regressors: LinearRegression, Ridge, Lasso, ElasticNet, "
        f"DecisionTreeRegressor, RandomForestRegressor, ExtraTreesRegressor, GradientBoostingRegressor, "
        f"HistGradientBoostingRegressor; LightGBM's LGBMClassifier and LGBMRegressor; XGBoost's XGBClassifier "
        f"and XGBRegressor)"
    )


def _regressor(op: Any, n_features: int) -> nn.Module:
    """A single-output regressor: a linear model's ``x @ coef + intercept``; a tree's or forest's mean of
    leaf values; boosting's ``init + learning_rate · Σ trees`` (what ``predict`` returns for every loss)."""
    from sklearn.dummy import DummyRegressor
    from sklearn.ensemble import GradientBoostingRegressor
    from sklearn.tree import DecisionTreeRegressor

    if getattr(op, "n_outputs_", 1) != 1 or np.ndim(getattr(op, "coef_", np.zeros(1))) != 1:
        raise UntranslatableError(f"{_name(op)} fitted to several targets is not translatable; fit one per target")
    if hasattr(op, "coef_"):
        return LinearHead(np.atleast_2d(op.coef_), np.atleast_1d(op.intercept_), "identity")
    if isinstance(op, GradientBoostingRegressor):
        if op.init_ == "zero":
            init = 0.0
        elif isinstance(op.init_, DummyRegressor):
            init = float(np.ravel(op.init_.constant_)[0])
        else:
            raise UntranslatableError(f"GradientBoostingRegressor(init={op.init!r}) is not translatable; "
                                      f"use the default init")  # fmt: skip
        trees = [TreeArrays.from_sklearn(e.tree_, e.tree_.value[:, 0, :]) for e in op.estimators_[:, 0]]
        return TreeEnsemble(trees, n_features, "sum", "identity", op.learning_rate, np.array([init]))
    fitted = [op] if isinstance(op, DecisionTreeRegressor) else list(op.estimators_)
    trees = [TreeArrays.from_sklearn(e.tree_, e.tree_.value[:, 0, :]) for e in fitted]
    return TreeEnsemble(trees, n_features, "average", "identity")


# A histogram-boosting regressor's loss → the link from its raw score to ``predict``.
_HIST_LINKS = {"squared_error": "identity", "absolute_error": "identity", "quantile": "identity",
               "poisson": "exp", "gamma": "exp"}  # fmt: skip


def _hist_boosting(op: Any, n_features: int) -> TreeEnsemble:
    """``HistGradientBoosting*``: ``baseline + Σ trees`` (leaf values carry the learning rate), through
    the loss's link.  Its trees compare float64 features with float64 thresholds, so the ensemble does
    too.  Native categorical splits are refused by name; a NaN never reaches the trees (the row encoder
    refuses one that no imputer fills), so each node's missing-value direction is not needed."""
    from types import SimpleNamespace

    from sklearn.ensemble import HistGradientBoostingRegressor

    name = _name(op)
    if op.is_categorical_ is not None and np.any(op.is_categorical_):
        raise UntranslatableError(f"{name} with categorical_features is not translatable; one-hot encode "
                                  f"those columns in the pipeline instead")  # fmt: skip
    if isinstance(op, HistGradientBoostingRegressor):
        if op.loss not in _HIST_LINKS:
            raise UntranslatableError(f"{name}(loss={op.loss!r}) is not translatable (losses: {sorted(_HIST_LINKS)})")
        link = _HIST_LINKS[op.loss]
    else:
        link = "logistic" if op.n_trees_per_iteration_ == 1 else "softmax"
    K = op.n_trees_per_iteration_
    trees = []
    for iteration in op._predictors:
        for k, predictor in enumerate(iteration):
            nodes = predictor.nodes
            leaf = nodes["is_leaf"].astype(bool)
            as_tree = SimpleNamespace(
                children_left=np.where(leaf, -1, nodes["left"].astype(np.int64)),
                children_right=np.where(leaf, -1, nodes["right"].astype(np.int64)),
                feature=nodes["feature_idx"].astype(np.int64), threshold=nodes["num_threshold"].astype(np.float64),
                node_count=len(nodes), max_depth=int(nodes["depth"].max()),
            )  # fmt: skip
            values = np.zeros((len(nodes), K))
            values[:, k] = nodes["value"]
            trees.append(TreeArrays.from_sklearn(as_tree, values))
    init = np.asarray(op._baseline_prediction, dtype=np.float64).reshape(-1)
    return TreeEnsemble(trees, n_features, "sum", link, 1.0, init, compare_float64=True)


def _boosting(op: Any, n_features: int) -> TreeEnsemble:
    from sklearn.dummy import DummyClassifier

    stages, K = op.estimators_.shape  # K = 1 for two classes
    if op.init_ == "zero":
        init = np.zeros(K)
    elif isinstance(op.init_, DummyClassifier) and op.init_.strategy == "prior":
        prior = np.clip(op.init_.class_prior_, 1e-15, 1 - 1e-15)
        init = np.array([math.log(prior[1] / prior[0])]) if K == 1 else np.log(prior)
    else:
        raise UntranslatableError(f"GradientBoostingClassifier(init={op.init!r}) is not translatable; "
                                  f"use the default init")  # fmt: skip
    trees = []
    for s in range(stages):
        for k in range(K):
            tree = op.estimators_[s, k].tree_
            values = np.zeros((tree.node_count, K))
            values[:, k] = tree.value[:, 0, 0]
            trees.append(TreeArrays.from_sklearn(tree, values))
    return TreeEnsemble(trees, n_features, "sum", "logistic" if K == 1 else "softmax", op.learning_rate, init)


# -- the walk ------------------------------------------------------------------


def _input_columns(pipeline: Any, columns: Sequence[str] | None) -> list[str]:
    if columns is not None:
        return list(columns)
    names = getattr(pipeline, "feature_names_in_", None)
    if names is not None:
        return [str(n) for n in names]
    return [f"x{i}" for i in range(pipeline.n_features_in_)]


def _resolve(selector: Any, names: list[str], where: str) -> list[int]:
    """A ColumnTransformer column selector → input positions."""
    if isinstance(selector, slice):
        return list(range(len(names)))[selector]
    items = list(np.atleast_1d(selector))
    if items and all(isinstance(_plain(i), bool) for i in items):
        return [i for i, keep in enumerate(items) if keep]
    out = []
    for item in items:
        item = _plain(item)
        if isinstance(item, int):
            out.append(item)
        elif isinstance(item, str) and item in names:
            out.append(names.index(item))
        else:
            raise UntranslatableError(f"{where}: cannot resolve column selector {item!r}")
    return out


@dataclass
class BranchPlan:
    """What one branch does to its columns."""

    categorical: bool = False
    ops: list[nn.Module] = field(default_factory=list)  # the encoder first, if any
    categories: list[list[Any]] = field(default_factory=list)  # per column, a categorical branch's
    unknown_ok: bool = False
    fills: list[Any] | None = None  # per column, a leading SimpleImputer's fill values

    def mark(self, cols: list[Column], positions: list[int]) -> None:
        """Tell the input columns what this branch makes of them."""
        for k, p in enumerate(positions):
            if self.categorical:
                cols[p].make_categorical(self.categories[k], self.unknown_ok)
            if self.fills is not None:
                cols[p].fill = self.fills[k]


def _branch_plan(transformer: Any, where: str) -> BranchPlan:
    from sklearn.impute import SimpleImputer
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder

    if transformer == "passthrough":
        return BranchPlan()
    steps = [s for _, s in transformer.steps] if isinstance(transformer, Pipeline) else [transformer]
    steps = [s for s in steps if s not in (None, "passthrough")]
    plan = BranchPlan()
    if steps and isinstance(steps[0], SimpleImputer):
        plan.fills = _imputer_fills(steps[0], where)
        if len(steps) > 1 and isinstance(steps[1], OneHotEncoder):
            steps = steps[1:]  # categories: the row encoder puts the fill value in (handled in Python)
    if steps and isinstance(steps[0], OneHotEncoder):
        encoder, plan.categories, plan.unknown_ok = _one_hot(steps[0], where)
        plan.categorical = True
        plan.ops.append(encoder)
        steps = steps[1:]
    plan.ops += [_numeric_op(s, where) for s in steps]
    return plan


def translate(pipeline: Any, columns: Sequence[str] | None = None) -> TranslatedPipeline:
    """Translate a fitted pipeline; ``columns`` names its input columns (default: the names it
    was fitted with, else ``x0, x1, …``)."""
    from sklearn.compose import ColumnTransformer
    from sklearn.impute import SimpleImputer
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder
    from sklearn.utils.validation import check_is_fitted

    steps = list(pipeline.steps) if isinstance(pipeline, Pipeline) else [("estimator", pipeline)]
    estimator = steps[-1][1]
    try:
        check_is_fitted(estimator)
    except Exception as exc:  # NotFittedError, or not an estimator at all
        raise UntranslatableError(f"the pipeline's estimator {_name(estimator)} is not fitted: {exc}") from None
    names = _input_columns(pipeline, columns)
    cols = [Column(n) for n in names]
    kinds: dict[int, str] = {}
    branch_specs: list[tuple[str, list[int], list[nn.Module]]] = []
    rest = steps[:-1]
    if rest and isinstance(rest[0][1], ColumnTransformer):
        name, ct = rest[0]
        for branch, transformer, selector in ct.transformers_:
            if transformer == "drop":
                continue
            where = f"step {name!r}, branch {branch!r}"
            positions = _resolve(selector, names, where)
            if not positions:
                continue
            plan = _branch_plan(transformer, where)
            kind = CATEGORICAL if plan.categorical else NUMERIC
            for p in positions:
                if kinds.get(p, kind) != kind:
                    raise UntranslatableError(f"{where}: column {names[p]!r} is used both as a number and as a "
                                              f"category")  # fmt: skip
                kinds[p] = kind
            plan.mark(cols, positions)
            branch_specs.append((kind, positions, plan.ops))
        for p, col in enumerate(cols):
            if p not in kinds:
                col.kind = DROPPED
        rest = rest[1:]
    else:
        # No ColumnTransformer: every column goes the same way.  A leading
        # OneHotEncoder (after a SimpleImputer, perhaps) makes them categories;
        # a leading SimpleImputer alone lets numbers be missing.
        rest = [(n, op) for n, op in rest if op not in (None, "passthrough")]
        ops = [op for _, op in rest]
        positions = list(range(len(names)))
        lead = 0
        if ops and isinstance(ops[0], OneHotEncoder):
            lead = 1
        elif len(ops) >= 2 and isinstance(ops[0], SimpleImputer) and isinstance(ops[1], OneHotEncoder):
            lead = 2
        if lead:
            plan = _branch_plan(Pipeline(rest[:lead]), f"step {rest[0][0]!r}")
            plan.mark(cols, positions)
            branch_specs.append((CATEGORICAL, positions, plan.ops))
            rest = rest[lead:]
        else:
            if ops and isinstance(ops[0], SimpleImputer):
                for p, fill in zip(positions, _imputer_fills(ops[0], f"step {rest[0][0]!r}"), strict=True):
                    cols[p].fill = fill
            branch_specs.append((NUMERIC, positions, []))
    post = [_numeric_op(op, f"step {name!r}") for name, op in rest if op not in (None, "passthrough")]
    # Each input column's position within its own tensor (numeric, or codes).
    numeric_pos = {p: i for i, p in enumerate(p for p, c in enumerate(cols) if c.kind == NUMERIC)}
    codes_pos = {p: i for i, p in enumerate(p for p, c in enumerate(cols) if c.kind == CATEGORICAL)}
    branches = [
        Branch(kind, [(codes_pos if kind == CATEGORICAL else numeric_pos)[p] for p in positions], ops)
        for kind, positions, ops in branch_specs
    ]
    head, classes, output = _estimator(estimator, int(estimator.n_features_in_))
    return TranslatedPipeline(cols, branches, post, head, classes, output)
