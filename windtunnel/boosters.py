"""LightGBM and XGBoost models as ``TreeEnsemble``s.

LightGBM is an optional dependency: nothing here imports it; a fitted model is read through the
JSON its booster dumps (``booster_.dump_model()``), whose thresholds are printed with 17 significant
digits, so they come back as the same float64.  Its numerical splits compare the float64 feature with
the float64 threshold (``x <= t`` goes left), so the ensemble does too.  Refused by name: categorical
splits, ``zero_as_missing`` (a zero would take the missing-value direction), random-forest mode
(averaged trees), and objectives whose answer is not a sum of trees through a known link.  The
initial score is part of the first tree's leaves (``boost_from_average``), so the sum starts at 0.

XGBoost (``XGBClassifier``, ``XGBRegressor``; the ``xgboost`` or ``xgboost-cpu`` wheel, also optional)
is read from the model JSON its booster saves (``save_raw("json")``), whose numbers are float32
printed to round-trip.  It compares float32 features with float32 thresholds, going left when
``x < t``; for float32 ``x`` that is ``x <= t⁻``, ``t⁻`` the float32 just below ``t``, which the
ensemble's float32 comparison takes as it is.  Its sums run in float32, so its answers differ from the
ensemble's float64 sums in the last float32 places (the tests hold them to 1e-6).  Refused by name:
categorical splits, vector leaves (multi-target trees), boosters other than ``gbtree``, and objectives
whose answer is not a sum of trees through a known link.  ``base_score`` is the intercept: for the
logistic and log links XGBoost stores it as a probability or a mean and adds its logit or log.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from windtunnel.operators import TreeArrays, TreeEnsemble

# LightGBM objective (its first word in the dump) → the link from the raw sum to what ``predict`` returns.
REGRESSION_LINKS = {"regression": "identity", "regression_l1": "identity", "huber": "identity", "fair": "identity",
                    "quantile": "identity", "mape": "identity", "poisson": "exp", "gamma": "exp",
                    "tweedie": "exp"}  # fmt: skip


class BoosterError(ValueError):
    """A LightGBM or XGBoost model this translation cannot answer exactly; the message names why."""


def is_lightgbm(estimator: Any) -> bool:
    return type(estimator).__module__.split(".")[0] == "lightgbm"


def is_xgboost(estimator: Any) -> bool:
    return type(estimator).__module__.split(".")[0] == "xgboost"


def lightgbm_ensemble(estimator: Any) -> tuple[TreeEnsemble, str]:
    """The fitted LightGBM model's trees and its link: ``"logistic"``, ``"softmax"``, ``"identity"`` or
    ``"exp"``; BoosterError when it cannot be translated exactly."""
    dump = estimator.booster_.dump_model()
    name = type(estimator).__name__
    objective, *params = dump["objective"].split()
    if dump.get("average_output"):
        raise BoosterError(f"{name}(boosting_type='rf') averages its trees; not translatable")
    if objective == "binary":
        if "sigmoid:1" not in params:
            raise BoosterError(f"{name} with objective {dump['objective']!r}: only sigmoid 1 is translatable")
        link = "logistic"
    elif objective == "multiclass":
        link = "softmax"
    elif objective in REGRESSION_LINKS:
        link = REGRESSION_LINKS[objective]
    else:
        raise BoosterError(f"{name} with objective {objective!r} is not translatable (binary, multiclass, "
                           f"{', '.join(sorted(REGRESSION_LINKS))})")  # fmt: skip
    per_iteration = int(dump["num_tree_per_iteration"])
    trees = [_tree(info["tree_structure"], info["tree_index"] % per_iteration, per_iteration, name)
             for info in dump["tree_info"]]  # fmt: skip
    if not trees:
        raise BoosterError(f"{name} has no trees")
    ensemble = TreeEnsemble(trees, int(dump["max_feature_idx"]) + 1, "sum", link, 1.0, np.zeros(per_iteration),
                            compare_float64=True)  # fmt: skip
    return ensemble, link


def _tree(root: dict[str, Any], column: int, width: int, name: str) -> TreeArrays:
    """One dumped tree (nested dicts) as arrays in node order, its leaf values in ``column`` of ``width``."""
    left: list[int] = []
    right: list[int] = []
    feature: list[int] = []
    threshold: list[float] = []
    value: list[float] = []
    depth = 0
    stack: list[tuple[dict[str, Any], int, int, int]] = [(root, -1, 0, 0)]  # node, parent, side, depth
    while stack:
        node, parent, side, level = stack.pop()
        index = len(left)
        if parent >= 0:
            (left if side == 0 else right)[parent] = index
        depth = max(depth, level)
        left.append(-1)
        right.append(-1)
        if "leaf_value" in node or "split_feature" not in node:
            feature.append(0)
            threshold.append(0.0)
            value.append(float(node.get("leaf_value", 0.0)))
            continue
        if node["decision_type"] != "<=":
            raise BoosterError(f"{name} has a categorical split (decision_type {node['decision_type']!r}); one-hot "
                               f"encode that column in the pipeline instead")  # fmt: skip
        if node["missing_type"] == "Zero":
            raise BoosterError(f"{name} was trained with zero_as_missing=True (a zero takes the missing-value "
                               f"direction); not translatable")  # fmt: skip
        feature.append(int(node["split_feature"]))
        threshold.append(float(node["threshold"]))
        value.append(0.0)
        stack.append((node["right_child"], index, 1, level + 1))
        stack.append((node["left_child"], index, 0, level + 1))
    values = np.zeros((len(left), width))
    values[:, column] = value
    as_tree = SimpleNamespace(children_left=np.asarray(left), children_right=np.asarray(right),
                              feature=np.asarray(feature), threshold=np.asarray(threshold, dtype=np.float64),
                              node_count=len(left), max_depth=depth)  # fmt: skip
    return TreeArrays.from_sklearn(as_tree, values)


# XGBoost objective → (link, how its stored base_score becomes the intercept on the sum's scale).
XGBOOST_OBJECTIVES = {
    "binary:logistic": ("logistic", "logit"), "multi:softprob": ("softmax", "as is"),
    "multi:softmax": ("softmax", "as is"), "reg:squarederror": ("identity", "as is"),
    "reg:absoluteerror": ("identity", "as is"), "reg:pseudohubererror": ("identity", "as is"),
    "reg:quantileerror": ("identity", "as is"),
    "count:poisson": ("exp", "log"), "reg:gamma": ("exp", "log"), "reg:tweedie": ("exp", "log"),
}  # fmt: skip


def xgboost_ensemble(estimator: Any) -> tuple[TreeEnsemble, str]:
    """The fitted XGBoost model's trees and its link (as ``lightgbm_ensemble``); BoosterError when it cannot be
    translated exactly."""
    import json

    name = type(estimator).__name__
    learner = json.loads(bytes(estimator.get_booster().save_raw("json")))["learner"]
    objective = learner["objective"]["name"]
    if objective not in XGBOOST_OBJECTIVES:
        raise BoosterError(f"{name} with objective {objective!r} is not translatable "
                           f"({', '.join(sorted(XGBOOST_OBJECTIVES))})")  # fmt: skip
    booster = learner["gradient_booster"]
    if booster["name"] != "gbtree":
        raise BoosterError(f"{name}(booster={booster['name']!r}): only booster='gbtree' is translatable")
    params = learner["learner_model_param"]
    if int(params.get("num_target", "1")) > 1:
        raise BoosterError(f"{name} with several targets is not translatable")
    link, intercept_form = XGBOOST_OBJECTIVES[objective]
    width = max(int(params.get("num_class", "0")), 1)
    base = np.asarray(json.loads(params["base_score"]) if params["base_score"].startswith("[")
                      else [float(params["base_score"])], dtype=np.float32).astype(np.float64)  # fmt: skip
    if intercept_form == "logit":
        base = np.log(base / (1.0 - base))
    elif intercept_form == "log":
        base = np.log(base)
    if base.size not in (1, width):
        raise BoosterError(f"{name}: base_score holds {base.size} values for {width} outputs")
    init = np.broadcast_to(base, (width,)).copy()
    model = booster["model"]
    trees = [_xgboost_tree(tree, column, width, name) for tree, column in zip(model["trees"], model["tree_info"],
                                                                             strict=True)]  # fmt: skip
    if not trees:
        raise BoosterError(f"{name} has no trees")
    ensemble = TreeEnsemble(trees, int(params["num_feature"]), "sum", link, 1.0, init)
    return ensemble, link


def _xgboost_tree(tree: dict[str, Any], column: int, width: int, name: str) -> TreeArrays:
    """One saved tree (flat arrays, children -1 at a leaf, a leaf's value in its ``split_conditions``) as
    arrays in node order, its leaf values in ``column`` of ``width``."""
    if int(tree["tree_param"].get("size_leaf_vector", "1")) > 1:
        raise BoosterError(f"{name} has vector leaves (multi_strategy='multi_output_tree'); not translatable")
    if any(tree["split_type"]):
        raise BoosterError(f"{name} has a categorical split (enable_categorical); one-hot encode that column in "
                           f"the pipeline instead")  # fmt: skip
    left = np.asarray(tree["left_children"], dtype=np.int64)
    right = np.asarray(tree["right_children"], dtype=np.int64)
    condition = np.asarray(tree["split_conditions"], dtype=np.float32)
    leaf = left == -1
    # ``x < t`` for float32 x is ``x <= `` the float32 below t, which the float32 walk compares as it is.
    below = np.nextafter(condition, np.float32(-np.inf)).astype(np.float64)
    depth, level, frontier = 0, 0, [0]
    while frontier:  # breadth first, for the depth
        depth, level = level, level + 1
        frontier = [c for n in frontier if not leaf[n] for c in (left[n], right[n])]
    values = np.zeros((len(left), width))
    values[leaf, column] = condition[leaf].astype(np.float64)
    as_tree = SimpleNamespace(children_left=left, children_right=right,
                              feature=np.asarray(tree["split_indices"], dtype=np.int64),
                              threshold=np.where(leaf, 0.0, below), node_count=len(left), max_depth=depth)  # fmt: skip
    return TreeArrays.from_sklearn(as_tree, values)
