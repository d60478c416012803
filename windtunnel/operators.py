"""Differentiable PyTorch modules for classical ML operators, initialised from fitted ones.

Every module holds its operator's fitted numbers as ``nn.Parameter``\\ s, so
the same module computes the operator exactly (hard mode, the translation's
first use: serving) and can be trained end to end with its neighbours
(fine-tuning, WindTunnel's second).  Only trees behave differently in the
two modes: a hard split is a comparison, which has no gradient, so in soft
mode each split becomes a sigmoid of the distance to its threshold and each
leaf is reached with the product of its path's probabilities.  At a
temperature near 0 the soft tree is the hard tree.

Hard trees are walked: every tree of a forest one level per step, each step
a gather of the node's feature and threshold for all rows and trees at once
(``depth`` steps of ``[N, T]``), then the reached leaves' values are read.
Two layouts, chosen per forest from its shape: trees shallow enough are laid
out as *perfect* binary trees (a leaf above the last level stands for its
whole subtree), where a node's children are at ``2j`` and ``2j + 1`` of the
next level, so a step is an index doubling and no child lookups; deeper
trees keep their own node order and look their children up, in memory of
the trees' own size (a perfect layout doubles with every level).  Soft trees take the GEMM form (one matrix per
tree level of the computation, not per node): compare every internal node's
feature with its threshold (``[N, T, I]``) and weigh each leaf with one
batched product against the tree's path matrix, built on first use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


class Affine(nn.Module):
    """Per-feature ``x · weight + bias``: StandardScaler and MinMaxScaler
    (``clip`` bounds the output as MinMaxScaler(clip=True) does).

    The fitted ``weight`` and ``bias`` are buffers, and training moves a
    ``gain`` (1) and a ``shift`` (0) applied after them: a scaler's weight is
    1/σ of its raw feature (1e-4 for an income), where every Adam step of
    ~lr would wreck it; on the scaled side the parameters are O(1).
    """

    def __init__(self, weight: np.ndarray, bias: np.ndarray, clip: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", torch.as_tensor(weight, dtype=torch.float64))
        self.register_buffer("bias", torch.as_tensor(bias, dtype=torch.float64))
        self.gain = nn.Parameter(torch.ones_like(self.weight))
        self.shift = nn.Parameter(torch.zeros_like(self.bias))
        self.clip = clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.weight + self.bias
        y = y * self.gain + self.shift
        return y.clamp(*self.clip) if self.clip is not None else y


class Impute(nn.Module):
    """SimpleImputer: each column's NaNs become its fill value (a parameter: fine-tuning may move it)."""

    def __init__(self, fills: list[float]) -> None:
        super().__init__()
        self.fills = nn.Parameter(torch.as_tensor(fills, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isnan(x), self.fills, x)


class Projection(nn.Module):
    """``x @ weight.T + bias``: PCA (centring and whitening folded in)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.as_tensor(weight, dtype=torch.float64))
        self.bias = nn.Parameter(torch.as_tensor(bias, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class OneHot(nn.Module):
    """OneHotEncoder as embedding lookups, one table per column.

    Input: category indices ``[N, C]`` (``-1``: a category not seen in
    training, encoded as all zeros, as ``handle_unknown='ignore'`` does).
    Each table starts as the identity, so the lookup is the one-hot vector;
    fine-tuning may move it into a dense embedding.
    """

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.sizes = list(sizes)
        self.tables = nn.ParameterList(
            nn.Parameter(torch.cat([torch.eye(n, dtype=torch.float64), torch.zeros(1, n, dtype=torch.float64)]))
            for n in sizes
        )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        parts = []
        for j, (n, table) in enumerate(zip(self.sizes, self.tables, strict=True)):
            index = codes[:, j].clone()
            index[index < 0] = n  # the all-zeros row
            parts.append(table[index])
        return torch.cat(parts, dim=1)


class LinearHead(nn.Module):
    """A linear model's scores ``x @ coef.T + intercept`` and their link.

    ``link``: ``"logistic"`` (one score → [1 - σ, σ]), ``"softmax"``, or
    ``"identity"`` (LinearSVC: decision scores, not probabilities).
    """

    def __init__(self, coef: np.ndarray, intercept: np.ndarray, link: str) -> None:
        super().__init__()
        self.coef = nn.Parameter(torch.as_tensor(np.atleast_2d(coef), dtype=torch.float64))
        self.intercept = nn.Parameter(torch.as_tensor(np.atleast_1d(intercept), dtype=torch.float64))
        self.link = link

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_link(nn.functional.linear(x, self.coef, self.intercept), self.link)


def apply_link(scores: torch.Tensor, link: str) -> torch.Tensor:
    if link == "logistic":
        p = torch.sigmoid(scores[:, 0])
        return torch.stack([1.0 - p, p], dim=1)
    if link == "softmax":
        return torch.softmax(scores, dim=1)
    if link == "exp":  # a log-link regressor (Poisson, gamma): one score per row, exponentiated
        return torch.exp(scores[:, 0])
    if link == "identity":
        return scores[:, 0] if scores.shape[1] == 1 else scores
    raise ValueError(f"unknown link {link!r}")


@dataclass(frozen=True)
class TreeArrays:
    """One fitted tree, leaves and internal nodes numbered in node order.

    Its size is the tree's own (a few numbers per node): the GEMM form's path
    matrix, ``[internal nodes, leaves]``, is quadratic in the tree's size (a
    forest at scikit-learn's default unlimited depth would need gigabytes) and
    is built only when a soft (trainable) tree needs it (``dense_path``).
    """

    features: np.ndarray  # [I] feature of each internal node
    thresholds: np.ndarray  # [I] go left when x <= threshold
    values: np.ndarray  # [L, K] leaf outputs
    # Each internal node's children, an internal node as its index i ≥ 0 and a
    # leaf j as -(j + 1); the root's code; the tree's depth.
    left_code: np.ndarray  # [I]
    right_code: np.ndarray  # [I]
    root: int
    depth: int

    @property
    def internal(self) -> int:
        """Internal nodes (1 for a lone leaf, padded with one that is never read)."""
        return len(self.features)

    @property
    def leaves(self) -> int:
        return len(self.values)

    def dense_path(self) -> tuple[np.ndarray, np.ndarray]:
        """The GEMM form: ``path[i, j]`` is +1 when leaf j lies under node i's left child, -1 under its
        right, else 0; ``lefts[j]`` the left turns on leaf j's path."""
        path = np.zeros((self.internal, self.leaves), dtype=np.float64)
        lefts = np.zeros(self.leaves, dtype=np.float64)
        stack: list[tuple[int, list[tuple[int, int]]]] = [(self.root, [])]
        while stack:
            code, turns = stack.pop()
            if code < 0:
                j = -code - 1
                for i, turn in turns:
                    path[i, j] = turn
                lefts[j] = sum(1 for _, turn in turns if turn > 0)
                continue
            stack.append((int(self.left_code[code]), [*turns, (code, 1)]))
            stack.append((int(self.right_code[code]), [*turns, (code, -1)]))
        return path, lefts

    @classmethod
    def from_sklearn(cls, tree: object, values: np.ndarray) -> TreeArrays:
        """``tree``: a fitted ``sklearn.tree._tree.Tree``; ``values``: ``[nodes, K]`` outputs per node."""
        left, right = tree.children_left, tree.children_right
        is_leaf = left == -1
        internal, leaves = np.flatnonzero(~is_leaf), np.flatnonzero(is_leaf)
        # code of every node: its index among internal nodes, or -(its index among leaves + 1)
        codes = np.empty(tree.node_count, dtype=np.int64)
        codes[internal] = np.arange(len(internal))
        codes[leaves] = -(np.arange(len(leaves)) + 1)
        if len(internal):
            features = tree.feature[internal].astype(np.int64)
            thresholds = tree.threshold[internal].astype(np.float64)
            left_code, right_code = codes[left[internal]], codes[right[internal]]
        else:  # a lone leaf: one padding node, never read
            features, thresholds = np.zeros(1, np.int64), np.full(1, np.inf)
            left_code = right_code = np.full(1, -1, np.int64)
        return cls(features, thresholds, values[leaves], left_code, right_code, int(codes[0]), int(tree.max_depth))


# The soft form's path matrices, past which fine-tuning is refused rather than run out of memory.
DENSE_PATH_LIMIT_BYTES = 1 << 30
# The perfect layout (``PerfectLayout``) is used while a forest's trees padded to perfect ones hold at most this
# many nodes in all (8 MiB of node numbers and 4 of thresholds at the limit), and no tree is deeper than
# ``PERFECT_MAX_DEPTH``.
PERFECT_MAX_NODES = 1 << 20
PERFECT_MAX_DEPTH = 12
# The node-order walk drops its finished walks at most every this many levels (``_walk_nodes``).
COMPACT_EVERY = 4
# From this many rows the perfect walk runs tree-major (``_walk_perfect``): 1.4x faster at 1,024 rows of
# a 100-tree depth-8 forest on a 2-vCPU EPYC, even at 10,000, 0.8x at 64.
TREE_MAJOR_ROWS = 256


def perfect_layout(trees: list[TreeArrays], depth: int, internal: int) -> tuple[np.ndarray, np.ndarray]:
    """Every tree padded to a perfect one of ``depth`` levels, in breadth-first order.

    Returns ``nodes`` ``[T, 2^depth - 1]``: at each position, the index of the internal node there in the
    forest's flat node arrays (``t·internal + i``), or of the tree's first node where a leaf above stands
    (its answer is never read); and ``leaf_of`` ``[T, 2^depth]``: the leaf each bottom position reaches.
    Built with array operations, one level at a time: a leaf hands itself down to both of its positions.
    ``level_major`` reorders ``nodes`` for the walk.
    """
    T = len(trees)
    width = (1 << depth) - 1
    nodes = np.zeros((T, width), dtype=np.int64)
    leaf_of = np.zeros((T, 1 << depth), dtype=np.int64)
    for k, tree in enumerate(trees):
        codes = np.array([tree.root], dtype=np.int64)
        for level in range(depth):
            inner = codes >= 0
            at = np.where(inner, codes, 0)
            start = (1 << level) - 1
            nodes[k, start : start + len(codes)] = k * internal + at
            left = np.where(inner, tree.left_code[at], codes)
            right = np.where(inner, tree.right_code[at], codes)
            codes = np.stack([left, right], axis=1).reshape(-1)
        if (codes >= 0).any():
            raise ValueError(f"tree {k} is deeper than {depth} levels")
        leaf_of[k] = -codes - 1
    return nodes, leaf_of


def level_major(nodes: np.ndarray) -> np.ndarray:
    """``nodes`` ``[T, 2^D - 1]`` (breadth-first per tree) as one flat array, level by level: level ``l``'s
    block holds ``T·2^l`` entries at ``T·(2^l - 1)``, tree ``t``'s position ``p`` at ``t·2^l + p``.

    So a walk's index within a level, ``t·2^l + p``, becomes ``2·(t·2^l + p) + turn`` at the next level
    (``t·2^(l+1) + 2p + turn``): one multiply-add per level, no per-tree offsets, and at the bottom it is
    the row-major index into ``leaf_of`` ``[T, 2^D]``.
    """
    T, width = nodes.shape
    depth = (width + 1).bit_length() - 1
    return np.concatenate([nodes[:, (1 << level) - 1 : (1 << (level + 1)) - 1].reshape(-1) for level in range(depth)])


def node_walk_layout(
    left_code: np.ndarray, right_code: np.ndarray, root: np.ndarray, leaves: int
) -> dict[str, np.ndarray]:
    """Tables for walking trees of any depth in their own node order, one step per level.

    ``left_code``/``right_code`` ``[T, I]`` are the trees' child codes (``c >= 0`` an internal node,
    ``-c-1`` a leaf).  Each tree gets ``N = I + leaves`` slots, internal nodes then leaves, and a slot's
    number is global (``t·N + j``), so a step needs no per-tree offset.  A leaf's two children are
    itself: a walk that has reached its leaf stays there for the remaining levels, with no test of
    whether it has.  Returns ``child`` ``[T·N·2]`` (slot ``g``'s left at ``2g``, right at ``2g+1``),
    ``node`` ``[T·N]`` (the flat internal node each slot reads its feature and threshold from),
    ``is_leaf`` ``[T·N]``, ``leaf`` ``[T·N]`` (a leaf slot's leaf number) and ``start`` ``[T]`` (each
    root's slot).
    """
    T, I = left_code.shape  # noqa: E741
    N = I + leaves
    base = (np.arange(T, dtype=np.int64) * N)[:, None]

    def slot(code: np.ndarray) -> np.ndarray:
        return base + np.where(code >= 0, code, I + (-code - 1))

    child = np.empty((T, N, 2), dtype=np.int64)
    child[:, :I, 0], child[:, :I, 1] = slot(left_code), slot(right_code)
    child[:, I:, 0] = child[:, I:, 1] = base + np.arange(I, N)
    node = np.broadcast_to(np.arange(T, dtype=np.int64)[:, None] * I, (T, N)).copy()
    node[:, :I] += np.arange(I)
    is_leaf = np.zeros((T, N), dtype=bool)
    is_leaf[:, I:] = True
    leaf = np.zeros((T, N), dtype=np.int64)
    leaf[:, I:] = np.arange(leaves)
    start = slot(root.reshape(T, 1)).reshape(-1)
    return {"child": child.reshape(-1), "node": node.reshape(-1), "is_leaf": is_leaf.reshape(-1),
            "leaf": leaf.reshape(-1), "start": start}  # fmt: skip


def float32_at_or_below(x: np.ndarray) -> np.ndarray:
    """The largest float32 ≤ x, elementwise.

    scikit-learn compares float32 features with float64 thresholds; for a
    float32 ``v``, ``v <= t`` exactly when ``v <= float32_at_or_below(t)``, so
    the comparison can run in float32 and still agree with it on every input.
    """
    down = x.astype(np.float32)
    above = down.astype(np.float64) > x
    down[above] = np.nextafter(down[above], np.float32(-np.inf))
    return down


class TreeEnsemble(nn.Module):
    """A forest of ``T`` trees: padded to one shape, evaluated in one pass.

    ``combine``: ``"mean"`` (a random forest's averaged class distributions), ``"average"`` (a
    regression forest's mean prediction)
    or ``"sum"`` (boosting: ``scale · Σ trees + init``, then ``link``).
    """

    def __init__(
        self,
        trees: list[TreeArrays],
        n_features: int,
        combine: str,
        link: str,
        scale: float = 1.0,
        init: np.ndarray | None = None,
        compare_float64: bool = False,
    ) -> None:
        super().__init__()
        T = len(trees)
        I = max(t.internal for t in trees)  # noqa: E741 (the paper's names)
        L = max(t.leaves for t in trees)
        K = trees[0].values.shape[1]
        features = np.zeros((T, I), dtype=np.int64)
        thresholds = np.full((T, I), np.inf)
        values = np.zeros((T, L, K))
        for k, t in enumerate(trees):
            features[k, : t.internal], thresholds[k, : t.internal] = t.features, t.thresholds
            values[k, : t.leaves] = t.values
        if features.max(initial=0) >= n_features:
            raise ValueError(f"a tree reads feature {features.max()} of {n_features}")
        left_code, right_code = np.full((T, I), -1, dtype=np.int64), np.full((T, I), -1, dtype=np.int64)
        for k, t in enumerate(trees):
            left_code[k, : len(t.left_code)], right_code[k, : len(t.right_code)] = t.left_code, t.right_code
        self.register_buffer("left_code", torch.as_tensor(left_code.reshape(-1)))
        self.register_buffer("right_code", torch.as_tensor(right_code.reshape(-1)))
        self.register_buffer("root", torch.as_tensor([t.root for t in trees], dtype=torch.long))
        self.depth = max(t.depth for t in trees)
        self.register_buffer("features", torch.as_tensor(features.reshape(-1)))
        # scikit-learn's trees compare float32 features with float64 thresholds: rounded down to float32,
        # the comparison runs in float32 alike.  Histogram boosting compares float64 with float64:
        # ``compare_float64`` keeps its thresholds and walks in float64.
        self.compare_dtype = torch.float64 if compare_float64 else torch.float32
        kept = thresholds if compare_float64 else float32_at_or_below(thresholds).astype(np.float64)
        self.thresholds = nn.Parameter(torch.as_tensor(kept))
        # The perfect layout where it is small enough (module doc); derived from the trees, so not saved.
        self.perfect = 0 < self.depth <= PERFECT_MAX_DEPTH and T * (1 << self.depth) <= PERFECT_MAX_NODES
        if self.perfect:
            nodes, leaf_of = perfect_layout(trees, self.depth, I)
            flat_nodes = torch.as_tensor(level_major(nodes))
            self.register_buffer("perfect_nodes", flat_nodes, persistent=False)
            self.register_buffer("perfect_features", self.features.index_select(0, flat_nodes), persistent=False)
            self.register_buffer("perfect_leaf", torch.as_tensor(leaf_of.reshape(-1)), persistent=False)
        # The node-order walk's tables (``node_walk_layout``): built on its first use (a perfect forest
        # never walks in node order when serving), derived, not saved.
        self._walk_tables: dict[str, torch.Tensor] | None = None
        # Thresholds as the walks read them, and the perfect layout's leaf values per bottom position: keyed by
        # the parameter's version, so rebuilt after training.
        self._derived_tables: dict[str, tuple[tuple[int, int, torch.device], torch.Tensor]] = {}
        self._trees = trees  # for the soft form's path matrices, built on first use (``dense``)
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None
        self.values = nn.Parameter(torch.as_tensor(values))
        self.shape = (T, I, L, K)
        self.combine, self.link, self.scale = combine, link, scale
        self.init = nn.Parameter(torch.as_tensor(np.zeros(K) if init is None else init, dtype=torch.float64))
        self.soft = False
        # A soft split's width, per internal node, in its feature's units
        # (``set_temperature``); 1 until data says what the features' scales are.
        self.register_buffer("temperature", torch.ones(T, I, dtype=torch.float64))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # noqa: ANN001
        # Weights saved before the path matrices were built on demand carry them; they are derived, not learned.
        for key in ("path", "lefts"):
            state_dict.pop(prefix + key, None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The GEMM form's ``path`` ``[T, I, L]`` and ``lefts`` ``[T, L]`` (-1 on a padding leaf, never
        reached), built on first use; refused, naming its size, past ``DENSE_PATH_LIMIT_BYTES``."""
        if self._dense is not None and self._dense[0].device != self.values.device:
            self._dense = tuple(t.to(self.values.device) for t in self._dense)
        if self._dense is None:
            T, I, L, _ = self.shape  # noqa: E741
            size = T * I * L * 8
            if size > DENSE_PATH_LIMIT_BYTES:
                raise ValueError(f"the soft (trainable) form of these {T} trees needs a {size / 2**30:.1f} GiB path "
                                 f"matrix ({I} internal nodes × {L} leaves per tree); fine-tune trees with a "
                                 f"max_depth or max_leaf_nodes that keeps it under "
                                 f"{DENSE_PATH_LIMIT_BYTES / 2**30:.0f} GiB")  # fmt: skip
            path, lefts = np.zeros((T, I, L)), np.full((T, L), -1.0)
            for k, tree in enumerate(self._trees):
                path[k, : tree.internal, : tree.leaves], lefts[k, : tree.leaves] = tree.dense_path()
            device = self.values.device
            self._dense = (torch.as_tensor(path, device=device), torch.as_tensor(lefts, device=device))
        return self._dense

    def set_temperature(self, x: torch.Tensor, factor: float) -> None:
        """Each node's softness: ``factor`` × the spread of its feature over ``x``
        (the tree's input rows), so one factor fits features of any scale."""
        trees, nodes, _, _ = self.shape
        spread = x.std(dim=0).clamp_min(1e-6) if x.shape[0] > 1 else torch.ones(x.shape[1], dtype=x.dtype)
        self.temperature = (factor * spread.index_select(0, self.features)).view(trees, nodes).to(self.values.dtype)

    def leaves(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, T]``: the leaf each sample reaches in each tree, by walking the
        trees level by level (``depth`` gathers of ``[N, T]``): the hard mode's
        fast path, O(depth) per tree where the GEMM form is O(nodes × leaves).
        Both layouts compare as scikit-learn does: float32 features against
        thresholds rounded down to float32, left when ``x <= t``.  A NaN goes right in every form (the
        encoders refuse one that no imputer fills, so none reaches a tree through a pipeline)."""
        return self._walk_perfect(x) if self.perfect else self._walk_nodes(x)

    def _node_walk(self) -> dict[str, torch.Tensor]:
        """The node-order walk's tables on the module's device, built from the trees' child codes once."""
        device = self.left_code.device
        if self._walk_tables is None or self._walk_tables["child"].device != device:
            T, I, L, _ = self.shape  # noqa: E741
            walk = node_walk_layout(self.left_code.view(T, I).cpu().numpy(), self.right_code.view(T, I).cpu().numpy(),
                                    self.root.cpu().numpy(), L)  # fmt: skip
            node = torch.as_tensor(walk["node"], device=device)
            self._walk_tables = {
                "child": torch.as_tensor(walk["child"], device=device).int(),
                "node": node,
                "features": self.features.index_select(0, node).int(),
                "is_leaf": torch.as_tensor(walk["is_leaf"], device=device),
                "leaf": torch.as_tensor(walk["leaf"], device=device),
                "start": torch.as_tensor(walk["start"], device=device).int(),
            }
        return self._walk_tables

    def derived_bytes(self) -> int:
        """Bytes of the tables built on first use (walk tables, thresholds, leaf values per position) beside the
        module's own parameters and buffers: what serving holds in memory on top of ``state_dict``."""
        tables = [*(self._walk_tables or {}).values(), *(t for _, t in self._derived_tables.values())]
        return sum(t.numel() * t.element_size() for t in tables)

    def _threshold_table(self, layout: str) -> torch.Tensor:
        """The thresholds as a walk reads them (``"perfect"``: in the perfect layout; ``"nodes"``: per
        node-walk slot, +inf on leaf slots so every input turns left into the leaf itself), as float32;
        rebuilt when training has changed them."""
        key = (self.thresholds._version, self.thresholds.data_ptr(), self.thresholds.device)
        cached = self._derived_tables.get(layout)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                flat = self.thresholds.detach().reshape(-1).to(self.compare_dtype)
                if layout == "perfect":
                    table = flat.index_select(0, self.perfect_nodes)
                else:
                    walk = self._node_walk()
                    table = flat.index_select(0, walk["node"]).masked_fill(walk["is_leaf"], float("inf"))
            cached = self._derived_tables[layout] = (key, table)
        return cached[1]

    def _walk_perfect(self, x: torch.Tensor) -> torch.Tensor:
        at, tree_major = self._perfect_positions(x)
        trees, n = self.shape[0], x.shape[0]
        leaf = self.perfect_leaf.index_select(0, at).view((trees, n) if tree_major else (n, trees))
        return leaf.t() if tree_major else leaf

    def _perfect_values(self) -> torch.Tensor:
        """``[T·2^D, K]``: the values of the leaf each bottom position of the perfect layout reaches, so a walk's
        last position reads its answer in one lookup (no leaf index, no per-tree offset, no transpose);
        derived, rebuilt when training has changed the values."""
        key = (self.values._version, self.values.data_ptr(), self.values.device)
        cached = self._derived_tables.get("perfect_values")
        if cached is None or cached[0] != key:
            trees, _, leaves, k = self.shape
            offset = torch.arange(trees, device=self.values.device).repeat_interleave(1 << self.depth) * leaves
            with torch.no_grad():
                table = self.values.detach().reshape(trees * leaves, k).index_select(0, self.perfect_leaf + offset)
            cached = self._derived_tables["perfect_values"] = (key, table)
        return cached[1]

    def _perfect_positions(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Each (tree, row)'s bottom position in the perfect layout, flat (tree-major ``[T·N]`` or row-major
        ``[N·T]``), and which of the two."""
        # Tables level-major (``level_major``): each level reads its own slice with 1-D index_select,
        # which costs a fraction of advanced indexing (``table[index]``) on CPU.  From
        # ``TREE_MAJOR_ROWS`` rows the walk runs tree by tree ([T, N]: neighbours share a tree's slice of
        # each table, and a feature's column of x is read in order), below it row by row ([N, T]).
        trees, n = self.shape[0], x.shape[0]
        features, thresholds = self.perfect_features, self._threshold_table("perfect")
        tree_major = n >= TREE_MAJOR_ROWS
        # A NaN goes right (``x <= t`` is false); as +inf it goes right under ``x > t`` too,
        # every threshold being finite, so each level is one comparison and one multiply-add.
        xf = x.to(self.compare_dtype)
        xf = xf.t().contiguous() if tree_major else xf
        xf = xf.masked_fill(xf.isnan(), float("inf"))
        # int32 positions (the layout holds at most PERFECT_MAX_NODES): half the bytes per level, and
        # index_select takes them as they are.  Level 0 reads every tree's root at once (tree t's root is
        # at t, all rows alike): one column read per tree, no per-row lookups.
        tree = torch.arange(trees, dtype=torch.int32, device=x.device)
        shape = (trees, n) if tree_major else (n, trees)
        roots = features.narrow(0, 0, trees)
        if tree_major:
            right = xf.index_select(0, roots) > thresholds.narrow(0, 0, trees).unsqueeze(1)
            at = torch.add(right, tree.unsqueeze(1), alpha=2).reshape(-1)
        else:
            right = xf.index_select(1, roots) > thresholds.narrow(0, 0, trees)
            at = torch.add(right, tree, alpha=2).reshape(-1)
        for level in range(1, self.depth):
            start, size = trees * ((1 << level) - 1), trees << level
            feature = features.narrow(0, start, size).index_select(0, at).view(shape)
            value = xf.gather(0 if tree_major else 1, feature).reshape(-1)
            right = value > thresholds.narrow(0, start, size).index_select(0, at)
            at = torch.add(right, at, alpha=2)
        return at, tree_major

    def _walk_nodes(self, x: torch.Tensor) -> torch.Tensor:
        # One step per level over the slots of ``node_walk_layout``: a leaf's children are itself and its
        # threshold +inf, so a finished walk stays put and no step tests whether it has finished.  Tree-major
        # (neighbours read one tree's slots, which stay in cache), with x read by flat index (feature·N + row)
        # so that finished walks can be dropped: every ``COMPACT_EVERY`` levels, once a quarter of the walks
        # still carried are at their leaves, these are written out and the rest go on.  Deep forests end
        # most walks well above their deepest leaf.
        trees, n = self.shape[0], x.shape[0]
        walk = self._node_walk()
        thresholds, child, features = self._threshold_table("nodes"), walk["child"], walk["features"]
        flat = x.to(self.compare_dtype).t().contiguous()
        flat = flat.masked_fill(flat.isnan(), float("inf")).reshape(-1)  # right at every split, as the others
        index_dtype = torch.int32 if flat.numel() < 2**31 and trees * n < 2**31 else torch.long
        at = walk["start"].repeat_interleave(n)
        row = torch.arange(n, dtype=index_dtype, device=x.device).repeat(trees)
        out: torch.Tensor | None = None
        pair = torch.empty(0, dtype=torch.long, device=x.device)  # the walks still carried, while ``out`` is set
        for level in range(self.depth):
            value = flat.index_select(0, torch.add(row, features.index_select(0, at), alpha=n))
            right = value > thresholds.index_select(0, at)
            at = child.index_select(0, torch.add(right, at, alpha=2))
            if level % COMPACT_EVERY == COMPACT_EVERY - 1 and level + 1 < self.depth:
                done = walk["is_leaf"].index_select(0, at)
                if 4 * int(done.sum()) >= at.numel():
                    if out is None:
                        out = torch.empty(trees * n, dtype=torch.long, device=x.device)
                        pair = torch.arange(trees * n, device=x.device)
                    gone, keep = done.nonzero().squeeze(1), (~done).nonzero().squeeze(1)
                    out.index_copy_(
                        0, pair.index_select(0, gone), walk["leaf"].index_select(0, at.index_select(0, gone))
                    )
                    pair, at, row = pair.index_select(0, keep), at.index_select(0, keep), row.index_select(0, keep)
        last = walk["leaf"].index_select(0, at)
        if out is None:
            out = last
        else:
            out.index_copy_(0, pair, last)
        return out.view(trees, n).t()

    def leaf_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, T, L]``: which leaf each sample reaches in each tree (0/1 hard, probabilities soft)."""
        trees, nodes, _, _ = self.shape
        path, lefts = self.dense()
        chosen = x.index_select(1, self.features).view(-1, trees, nodes)
        if not self.soft:
            # scikit-learn's own comparison: float32 features against thresholds
            # rounded down to float32 (see float32_at_or_below).
            dtype = self.compare_dtype
            went_left = (chosen.to(dtype) <= self.thresholds.to(dtype)).to(path.dtype)
            reached = torch.einsum("nti,til->ntl", went_left, path)
            return (reached == lefts).to(x.dtype)
        go_left = torch.sigmoid((self.thresholds - chosen) / self.temperature)
        log_left, log_right = torch.log(go_left.clamp_min(1e-12)), torch.log((1 - go_left).clamp_min(1e-12))
        left_turns, right_turns = path.clamp(min=0), (-path).clamp(min=0)
        log_p = torch.einsum("nti,til->ntl", log_left, left_turns) + torch.einsum(
            "nti,til->ntl", log_right, right_turns
        )
        return torch.exp(log_p) * (lefts >= 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trees, _, leaves, k = self.shape
        tree_dim = 1
        if self.soft:
            per_tree = torch.einsum("ntl,tlk->ntk", self.leaf_weights(x), self.values)
        elif self.perfect and not (torch.is_grad_enabled() and self.values.requires_grad):
            # Serving: each walk's bottom position reads its leaf's values from the derived table.
            at, tree_major = self._perfect_positions(x)
            per_tree = self._perfect_values().index_select(0, at)
            per_tree = per_tree.view(trees, x.shape[0], k) if tree_major else per_tree.view(x.shape[0], trees, k)
            tree_dim = 0 if tree_major else 1
        else:  # hard, values trained or a deep forest: walk the trees, then read each reached leaf's values
            reached = self.leaves(x) + torch.arange(trees, device=x.device) * leaves
            per_tree = self.values.reshape(trees * leaves, -1).index_select(0, reached.reshape(-1))
            per_tree = per_tree.view(x.shape[0], trees, -1)
        if self.combine == "average":  # a regression forest: the trees' mean prediction
            return apply_link(per_tree.mean(dim=tree_dim), self.link)
        if self.combine == "mean":
            # A forest's mean of class distributions; after fine-tuning the leaf
            # values may leave the simplex, so the answer is put back on it.
            out = per_tree.mean(dim=tree_dim).clamp_min(0.0)
            return out / out.sum(dim=1, keepdim=True).clamp_min(1e-300)
        scores = self.init + self.scale * per_tree.sum(dim=tree_dim)
        return apply_link(scores, self.link)
