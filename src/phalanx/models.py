"""The built-in models. They know nothing about parallelism (strategies wrap them).

- ``cnn``: a small convolutional network for 8×8 digits (the default);
- ``mlp``: a two-layer perceptron, any input shape;
- ``cifar10``: the classic CIFAR-10 tutorial network (conv 5×5×64, max-pool, local response norm,
  conv 5×5×64, norm, max-pool, fc 384, fc 192, fc 10) on 24×24 crops;
- ``lstm``: a stacked LSTM that reads each image row by row (8 rows of 8 pixels for digits).

Every model is an ``nn.Sequential`` of blocks, so a pipeline can split it between blocks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
from torch import nn

from .errors import PhalanxError


def cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    c, h, w = input_shape
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(c, 32, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(64 * (h // 2) * (w // 2), 128), nn.ReLU()),
        nn.Linear(128, num_classes),
    )


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 256) -> nn.Sequential:
    return nn.Sequential(
        nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU()),
        nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        nn.Linear(hidden, num_classes),
    )


def cifar10(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    c, h, w = input_shape
    # Two 3/2 max-pools with padding 1 take 24 -> 12 -> 6.
    side_h, side_w = _pooled(_pooled(h)), _pooled(_pooled(w))
    norm = dict(size=4, alpha=0.001 / 9.0, beta=0.75, k=1.0)
    return nn.Sequential(
        nn.Sequential(
            nn.Conv2d(c, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
            nn.LocalResponseNorm(**norm),
        ),
        nn.Sequential(
            nn.Conv2d(64, 64, 5, padding=2), nn.ReLU(), nn.LocalResponseNorm(**norm),
            nn.MaxPool2d(3, 2, padding=1),
        ),
        nn.Sequential(nn.Flatten(), nn.Linear(64 * side_h * side_w, 384), nn.ReLU()),
        nn.Sequential(nn.Linear(384, 192), nn.ReLU()),
        nn.Linear(192, num_classes),
    )


def _pooled(n: int) -> int:
    return (n + 2 - 3) // 2 + 1


class RowLSTM(nn.Module):
    """One LSTM layer over image rows: (N, C, H, W) or (N, T, F) in, (N, T, hidden) out."""

    def __init__(self, in_features: int, hidden: int):
        super().__init__()
        self.lstm = nn.LSTM(in_features, hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:  # images: rows become time steps, the pixels of a row its features
            x = x.permute(0, 2, 1, 3).flatten(2)
        return self.lstm(x)[0]


class LastStep(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -1]


def lstm(input_shape: tuple[int, ...], num_classes: int, hidden: int = 64, layers: int = 4) -> nn.Sequential:
    c, h, w = input_shape
    blocks: list[nn.Module] = [RowLSTM(c * w, hidden)]
    blocks += [RowLSTM(hidden, hidden) for _ in range(layers - 1)]
    blocks += [nn.Sequential(LastStep(), nn.Linear(hidden, num_classes))]
    return nn.Sequential(*blocks)


MODELS: dict[str, Callable[..., nn.Module]] = {"cnn": cnn, "mlp": mlp, "cifar10": cifar10, "lstm": lstm}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a model trains by default: every field can be overridden by its flag."""

    optimizer: str
    lr: float
    steps: int


#: Each built-in model's recipe (each reaches >= 0.90 test accuracy on digits, sync and pipeline, 2 CPU
#: workers: tests/test_recipes.py). A model object given to the Trainer gets USER_RECIPE.
RECIPES: dict[str, Recipe] = {
    "cnn": Recipe("sgd", 0.05, 300),
    "mlp": Recipe("sgd", 0.05, 300),
    "cifar10": Recipe("sgd", 0.05, 300),
    "lstm": Recipe("adam", 0.01, 300),
}
USER_RECIPE = Recipe("sgd", 0.05, 300)


def model_blocks_by_default(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the model's blocks when none are named: the modules of its
    ``pipeline_blocks()`` if it has one, else its top-level children; only those holding parameters."""
    if hasattr(model, "pipeline_blocks"):
        by_id = {id(m): n for n, m in model.named_modules() if n}
        units = [(by_id[id(b)], b) for b in model.pipeline_blocks() if id(b) in by_id]
    else:
        units = list(model.named_children())
    return [(n, m) for n, m in units if any(True for _ in m.parameters())]


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a built-in model by name for data of ``input_shape`` (C, H, W)."""
    if name not in MODELS:
        raise PhalanxError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    if name in ("cnn", "cifar10") and len(input_shape) != 3:
        raise PhalanxError(f"model {name!r} needs image data (C, H, W), got shape {tuple(input_shape)}")
    return MODELS[name](tuple(input_shape), num_classes)
