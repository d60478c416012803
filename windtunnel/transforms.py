"""Tensor forms of scikit-learn's fixed preprocessing steps, and of steps that combine others.

The scalers with numbers worth tuning are ``operators.Affine`` (``RobustScaler`` and ``MaxAbsScaler``
become one too).  What is here holds no trainable numbers: its outputs are fixed functions of the
fitted state (a row's norm, bin edges, exponents, which columns survive), kept as buffers, and each
answers as its scikit-learn step does on float64 input.  ``Union`` runs several step chains on the same
input and concatenates them: a ``FeatureUnion``, or a ``ColumnTransformer`` after the first step (on
numbers, choosing its columns by position).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

# scikit-learn treats a norm below 10 machine epsilons as zero and leaves such a row as it is.
_TINY = 10 * np.finfo(np.float64).eps


class Normalize(nn.Module):
    """``Normalizer``: each row divided by its l1, l2 or max norm (a zero row unchanged)."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        if norm not in ("l1", "l2", "max"):
            raise ValueError(f"unknown norm {norm!r}")
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm == "l1":
            norms = x.abs().sum(dim=1)
        elif self.norm == "l2":
            norms = (x * x).sum(dim=1).sqrt()
        else:
            norms = x.abs().amax(dim=1)
        norms = torch.where(norms < _TINY, torch.ones_like(norms), norms)
        return x / norms.unsqueeze(1)


class Binarize(nn.Module):
    """``Binarizer``: 1 where a value is above the threshold, else 0."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = float(threshold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x > self.threshold).to(x.dtype)


class Discretize(nn.Module):
    """``KBinsDiscretizer``: each value's bin (the inner edges searched from the right), as the bin's
    number (``ordinal``) or one-hot over each feature's bins (``onehot``, ``onehot-dense``)."""

    def __init__(self, bin_edges: list[np.ndarray], one_hot: bool) -> None:
        super().__init__()
        inner = [np.asarray(e, dtype=np.float64)[1:-1] for e in bin_edges]
        width = max((len(e) for e in inner), default=0)
        # Every feature's inner edges padded with +inf to one width: searchsorted per row of a 2-D table.
        table = np.full((len(inner), width), np.inf)
        for j, e in enumerate(inner):
            table[j, : len(e)] = e
        self.register_buffer("edges", torch.as_tensor(table))
        self.bins = [len(e) + 1 for e in inner]
        self.one_hot = one_hot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.edges.shape[1] == 0:  # one bin per feature
            index = torch.zeros_like(x, dtype=torch.long)
        else:
            index = torch.searchsorted(self.edges, x.t().contiguous(), right=True).t()
        if not self.one_hot:
            return index.to(x.dtype)
        parts = [nn.functional.one_hot(index[:, j], n).to(x.dtype) for j, n in enumerate(self.bins)]
        return torch.cat(parts, dim=1)


class Polynomial(nn.Module):
    """``PolynomialFeatures``: each output column the product of the inputs raised to its row of
    ``powers`` (``powers_``; a zero row is the bias column)."""

    def __init__(self, powers: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("powers", torch.as_tensor(np.asarray(powers), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ones(x.shape[0], self.powers.shape[0], dtype=x.dtype, device=x.device)
        for i in range(self.powers.shape[1]):
            exponent = self.powers[:, i]
            used = exponent > 0
            if bool(used.any()):
                out[:, used] = out[:, used] * x[:, i : i + 1].pow(exponent[used])
        return out


class Select(nn.Module):
    """A feature selector (``SelectKBest``, ``VarianceThreshold``, …): the columns it keeps."""

    def __init__(self, keep: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("keep", torch.as_tensor(np.flatnonzero(keep), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(1, self.keep)


class Union(nn.Module):
    """Several chains of steps on (columns of) one input, their outputs side by side, each scaled by
    its weight: a ``FeatureUnion`` (every chain sees every column) or a later ``ColumnTransformer``
    (each chain its own columns, by position)."""

    def __init__(self, parts: list[tuple[list[int] | None, list[nn.Module], float]]) -> None:
        super().__init__()
        self.chains = nn.ModuleList(nn.Sequential(*ops) for _, ops, _ in parts)
        self.columns = [None if cols is None else torch.as_tensor(cols, dtype=torch.long) for cols, _, _ in parts]
        self.weights = [float(w) for _, _, w in parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for chain, cols, weight in zip(self.chains, self.columns, self.weights, strict=True):
            y = chain(x if cols is None else x.index_select(1, cols.to(x.device)))
            outs.append(y if weight == 1.0 else y * weight)
        return torch.cat(outs, dim=1)
