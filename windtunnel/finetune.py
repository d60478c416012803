"""Fine-tune a translated pipeline end to end, from its fitted weights (warm) or from random ones (cold).

A scikit-learn pipeline fits each operator alone, each to its own
objective: the scaler to the data's moments, PCA to its variance, each
boosting stage greedily, the encoder not at all.  Translated into one
network (``translate.py``), every operator's numbers become parameters of one
differentiable function, and gradient descent on the classification loss
moves all of them together; the trees train with soft splits
(``operators.TreeEnsemble``).  Warm start begins at the translation, i.e.
at the pipeline itself; cold start re-draws every parameter of the same
network, which is what the translation saves.

``tune`` searches the learning rate and the soft-split width by validation
AUC, the same search for either start.

Training keeps the epoch with the best validation AUC (epoch 0 included),
then the better of that soft model and the same weights with hard splits;
if neither beats the model it was given, that model comes back unchanged:
fine-tuning never returns something worse on the validation rows.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from windtunnel.operators import Affine, LinearHead, OneHot, Projection
from windtunnel.translate import TranslatedPipeline


@dataclass(frozen=True)
class FineTuneConfig:
    epochs: int = 40
    batch_size: int = 64
    lr: float = 1e-3  # Adam
    temperature: float = 0.1  # soft split width, as a fraction of each split feature's spread
    patience: int = 10  # epochs without a better validation AUC before stopping
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 0 or self.batch_size < 1 or self.patience < 1:
            raise ValueError("epochs ≥ 0, batch_size ≥ 1 and patience ≥ 1 required")
        if not self.lr > 0 or not self.temperature > 0:
            raise ValueError("lr and temperature must be positive")


@dataclass
class Split:
    """Encoded rows and their labels (indices into the model's classes)."""

    numeric: torch.Tensor
    codes: torch.Tensor
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class FineTuneResult:
    model: TranslatedPipeline
    soft: bool  # the mode the returned model runs in
    best_epoch: int
    valid_auc: float  # a classifier's validation ROC AUC; a regressor's validation R² (``auc``)
    history: list[float] = field(default_factory=list)  # that score per epoch (0: before training)


@dataclass(frozen=True)
class TunedResult:
    result: FineTuneResult
    config: FineTuneConfig  # the setting that won


def auc(model: TranslatedPipeline, split: Split) -> float:
    """The validation score training keeps the best epoch by: ROC AUC of a classifier's scores (one-vs-rest
    macro for several classes), R² of a regressor's predictions (``split.y`` its targets); higher is better."""
    from sklearn.metrics import r2_score, roc_auc_score

    with torch.no_grad():
        scores = model(split.numeric, split.codes).numpy()
    if model.output == "prediction":
        return float(r2_score(split.y, scores))
    if scores.ndim == 1:  # decision scores of a binary LinearSVC
        return float(roc_auc_score(split.y, scores))
    if scores.shape[1] == 2:
        return float(roc_auc_score(split.y, scores[:, 1]))
    return float(roc_auc_score(split.y, scores, multi_class="ovr", labels=list(range(scores.shape[1]))))


def _loss(model: TranslatedPipeline, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if model.output == "prediction":  # a regressor: squared error
        return nn.functional.mse_loss(out, y)
    if model.output == "decision":  # LinearSVC: logistic loss on its scores
        if out.ndim == 1:
            return nn.functional.binary_cross_entropy_with_logits(out, y.to(out.dtype))
        return nn.functional.cross_entropy(out, y)
    return nn.functional.nll_loss(torch.log(out.clamp_min(1e-12)), y)


def fine_tune(model: TranslatedPipeline, train: Split, valid: Split,
              config: FineTuneConfig = FineTuneConfig()) -> FineTuneResult:  # fmt: skip
    """Train a copy of ``model`` on ``train``; ``model`` itself is left as it was."""
    torch.manual_seed(config.seed)
    model = copy.deepcopy(model)
    start_soft = any(t.soft for t in model.trees())
    start_state, start_auc = copy.deepcopy(model.state_dict()), auc(model, valid)
    model.set_temperature(train.numeric, train.codes, config.temperature)
    model.set_soft(True)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    y = torch.as_tensor(train.y, dtype=torch.float64 if model.output == "prediction" else torch.long)
    history = [auc(model, valid)]
    best_state, best_auc, best_epoch = copy.deepcopy(model.state_dict()), history[0], 0
    generator = torch.Generator().manual_seed(config.seed)
    for epoch in range(1, config.epochs + 1):
        model.train()
        for index in torch.randperm(len(train), generator=generator).split(config.batch_size):
            optimizer.zero_grad()
            loss = _loss(model, model(train.numeric[index], train.codes[index]), y[index])
            loss.backward()
            optimizer.step()
        model.eval()
        history.append(auc(model, valid))
        if history[-1] > best_auc:
            best_state, best_auc, best_epoch = copy.deepcopy(model.state_dict()), history[-1], epoch
        elif epoch - best_epoch >= config.patience:
            break
    model.load_state_dict(best_state)
    model.set_soft(False)
    hard_auc = auc(model, valid) if model.trees() else -math.inf
    soft = not hard_auc >= best_auc
    best_auc = max(best_auc, hard_auc)
    if start_auc > best_auc:  # nothing beat the model as it was given: return it unchanged
        model.load_state_dict(start_state)
        model.set_soft(start_soft)
        return FineTuneResult(model, start_soft, 0, start_auc, history)
    model.set_soft(soft)
    return FineTuneResult(model, soft, best_epoch, best_auc, history)


def tune(model: TranslatedPipeline, train: Split, valid: Split, lrs: Sequence[float] = (1e-3,),
         temperatures: Sequence[float] = (0.1,), config: FineTuneConfig = FineTuneConfig()) -> TunedResult:  # fmt: skip
    """``fine_tune`` at every (learning rate, temperature); the run the validation rows prefer.

    Why a search and not one default: the better soft-split width depends on
    the trees and the data (the benchmark's pipelines chose 0.1 to 1 × the
    feature's spread), and a too narrow one leaves a warm start stuck near the
    greedy trees.  Temperatures are tried only where there are trees; ties go
    to the first setting tried.
    """
    if not lrs or not temperatures:
        raise ValueError("at least one learning rate and one temperature required")
    if not model.trees():
        temperatures = temperatures[:1]
    best: TunedResult | None = None
    for lr in lrs:
        for temperature in temperatures:
            setting = replace(config, lr=lr, temperature=temperature)
            result = fine_tune(model, train, valid, setting)
            if best is None or result.valid_auc > best.result.valid_auc:
                best = TunedResult(result, setting)
    assert best is not None
    return best


def cold_start(model: TranslatedPipeline, train: Split, seed: int = 0) -> TranslatedPipeline:
    """The same network with every parameter drawn at random (the structure kept:
    columns, branches, tree shapes and split features)."""
    gen = torch.Generator().manual_seed(seed)
    model = copy.deepcopy(model)

    def normal(shape: torch.Size, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64) * std

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Affine):  # no knowledge of the data's scale: the identity, perturbed
                module.weight.fill_(1.0)
                module.bias.zero_()
                module.gain.copy_(1.0 + normal(module.gain.shape, 0.1))
                module.shift.copy_(normal(module.shift.shape, 0.1))
            elif isinstance(module, (Projection, LinearHead)):
                weight = module.weight if isinstance(module, Projection) else module.coef
                bias = module.bias if isinstance(module, Projection) else module.intercept
                weight.copy_(normal(weight.shape, 1.0 / math.sqrt(weight.shape[1])))
                bias.zero_()
            elif isinstance(module, OneHot):
                for table in module.tables:
                    table.copy_(normal(table.shape, 1.0))
        x = model.features(train.numeric, train.codes)
        for tree in model.trees():
            # Thresholds at random training values of each node's feature.
            rows = torch.randint(0, x.shape[0], (tree.features.numel(),), generator=gen)
            drawn = x[rows, tree.features].view_as(tree.thresholds)
            tree.thresholds.copy_(torch.where(torch.isfinite(tree.thresholds), drawn, tree.thresholds))
            values = normal(tree.values.shape, 0.1)
            tree.values.copy_(torch.softmax(values, dim=-1) if tree.combine == "mean" else values)
            tree.init.zero_()
    return model
