"""LightGBM models (``LGBMClassifier``, ``LGBMRegressor``) as ``TreeEnsemble``s.

LightGBM is an optional dependency: nothing here imports it; a fitted model is read through the
JSON its booster dumps (``booster_.dump_model()``), whose thresholds are printed with 17 significant
digits, so they come back as the same float64.  Its numerical splits compare the float64 feature with
the float64 threshold (``x <= t`` goes left), so the ensemble does too.  Refused by name: categorical
splits, ``zero_as_missing`` (a zero would take the missing-value direction), random-forest mode
(averaged trees), and objectives whose answer is not a sum of trees through a known link.  The
initial score is part of the first tree's leaves (``boost_from_average``), so the sum starts at 0.
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
    """A LightGBM model this translation cannot answer exactly; the message names why."""


def is_lightgbm(estimator: Any) -> bool:
    return type(estimator).__module__.split(".")[0] == "lightgbm"


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
