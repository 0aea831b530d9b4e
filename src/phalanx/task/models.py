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

from ..errors import PhalanxError


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
    norm = dict(alpha=0.001 / 9.0, beta=0.75, k=1.0)
    return nn.Sequential(
        nn.Sequential(
            nn.Conv2d(c, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
            nn.LocalResponseNorm(4, **norm),
        ),
        nn.Sequential(
            nn.Conv2d(64, 64, 5, padding=2), nn.ReLU(), nn.LocalResponseNorm(4, **norm),
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
    """(name, module) of the model's blocks as ``--compile`` compiles them: the modules of its
    ``pipeline_blocks()`` if it has one, else its top-level children, a container among them (an
    ``nn.ModuleDict`` or ``nn.ModuleList``, which the model never calls) opened into its own children: nanoGPT's
    ``transformer`` dict gives ``wte``, ``wpe``, each block of ``h`` and ``ln_f``. Only those holding parameters."""
    if hasattr(model, "pipeline_blocks"):
        by_id = {id(m): n for n, m in model.named_modules() if n}
        # (a method the model declares: nn.Module's own __getattr__ knows only tensors and modules)
        units = [(by_id[id(b)], b) for b in getattr(model, "pipeline_blocks")() if id(b) in by_id]
    else:
        units = _called_children(model)
    return [(n, m) for n, m in units if _holds_parameters(m)]


def _called_children(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``module``'s children, each container replaced by its own children (their names dotted from the root)."""
    found = []
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            found += _called_children(child, f"{prefix}{name}.")
        else:
            found.append((f"{prefix}{name}", child))
    return found


def model_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the blocks fsdp shards and ``--activation-checkpointing`` recomputes, when none are
    named: a ``pipeline_blocks()`` method's modules or an ``nn.Sequential``'s children (every built-in model);
    else the blocks the model declares (transformers' ``_no_split_modules``); else its repeated blocks (a
    transformer's layers, as Accelerate's and Lightning's auto-wrap find
    them), the rest staying with the root; else its top-level children. Only modules holding parameters."""
    if hasattr(model, "pipeline_blocks") or isinstance(model, nn.Sequential):
        return model_blocks_by_default(model)
    return declared_blocks(model) or repeated_blocks(model) or model_blocks_by_default(model)


def declared_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules the model says must not be split (transformers' ``_no_split_modules``, read on every submodule
    as its ``_get_no_split_modules`` does: ``LlamaDecoderLayer``, ``T5Block``), outermost only, holding parameters,
    of a class the model holds twice or more (its layers); a module declared once (BERT's ``BertEmbeddings``) or
    sharing a parameter with a module outside it (an embedding tied to the head) is left to the root, as
    torchtitan leaves embeddings and the head. Empty where nothing is declared."""
    names: list[str] = []
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or ():
            if isinstance(name, str) and name not in names:
                names.append(name)
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    found: list[tuple[str, nn.Module]] = []
    for name in names:
        of_class = blocks_of_class(model, name)
        if len(of_class) >= 2:  # the layers; a module declared once (BERT's embeddings) stays with the root
            found += [(n, m) for n, m in of_class if not _shared_outside(m, uses)]
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(_outermost(found), key=lambda unit: order[unit[0]])


def _shared_outside(unit: nn.Module, uses: dict[int, int]) -> bool:
    mine: dict[int, int] = {}
    for _, p in unit.named_parameters(remove_duplicate=False):
        mine[id(p)] = mine.get(id(p), 0) + 1
    return any(uses[i] > n for i, n in mine.items())


def _outermost(units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in units if not any(n.startswith(f"{other}.") for other, _ in units)]


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of one class that an ``nn.ModuleList`` or ``nn.Sequential`` repeats (nanoGPT's
    ``transformer.h``, Hugging Face's ``transformer.h`` and ``bert.encoder.layer``), outermost only: a
    repeated block inside another (a Linear of a block's MLP) is part of it, and a module of the same
    class elsewhere (a head) is not a block."""
    units: list[tuple[str, nn.Module]] = []
    taken: set[str] = set()
    inside: tuple[str, ...] = ()  # (as prefixes: a block's own modules are not searched again)
    for name, container in model.named_modules():
        if name in taken or name.startswith(inside):
            continue
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        repeated = _repeated_classes(container)
        found = [(f"{name}.{n}" if name else n, m) for n, m in container.named_children() if type(m) in repeated]
        units += found
        taken |= {n for n, _ in found}
        inside += tuple(f"{n}." for n, _ in found)
    return units


def _repeated_classes(container: nn.Module) -> set[type]:
    """Classes of which ``container`` holds two children or more, each holding parameters."""
    counts: dict[type, int] = {}
    for child in container.children():
        if _holds_parameters(child):
            counts[type(child)] = counts.get(type(child), 0) + 1
    return {cls for cls, n in counts.items() if n >= 2}


def blocks_of_class(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose class is called ``name`` (``"Block"``, ``"GPT2Block"``), holding parameters."""
    units: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if path and type(module).__name__ == name and _holds_parameters(module) \
                and not any(path.startswith(f"{outer}.") for outer, _ in units):
            units.append((path, module))
    return units


def describe_blocks(units: list[tuple[str, nn.Module]], most: int = 8) -> str:
    """``0, 1, 2, 3``; past ``most`` blocks, the first and last and the classes: ``transformer.h.0 …
    transformer.h.11: Block × 12``."""
    names = [name for name, _ in units]
    if len(names) <= most:
        return ", ".join(names)
    counts: dict[str, int] = {}
    for _, module in units:
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return f"{names[0]} … {names[-1]}: " + ", ".join(f"{cls} × {n}" for cls, n in counts.items())


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a built-in model by name for data of ``input_shape`` (C, H, W)."""
    if name not in MODELS:
        raise PhalanxError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    if name in ("cnn", "cifar10") and len(input_shape) != 3:
        raise PhalanxError(f"model {name!r} needs image data (C, H, W), got shape {tuple(input_shape)}")
    return MODELS[name](tuple(input_shape), num_classes)
