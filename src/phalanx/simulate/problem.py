"""The user's problem as a simulated comparison holds it: the task, the data, the clock's inputs.

Built once per comparison by ``compare/simulated_problem.py`` (which measures the clock's inputs as
``phalanx estimate`` does); every :class:`~phalanx.simulate.world.World` reads its model and data from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..costs import Compute, ModelFacts, Network
from ..data import DataBundle, load_data
from ..data.user import cast_to_model
from ..task import Task


@dataclasses.dataclass
class Problem:
    #: the run's TrainConfig, resolved (the recipe's optimizer, lr and steps filled in); typed loosely because
    #: train/ sits above this engine (docs/architecture.md)
    config: Any
    task: Task
    compute: Compute
    facts: ModelFacts
    network: Network
    clock_notes: tuple[str, ...] = ()  #: where the compute and the link figures come from
    #: where the workers' gradients, parameters, optimizer states and evaluations live (``--devices``: the first)
    device: torch.device = torch.device("cpu")
    _data: dict = dataclasses.field(default_factory=dict)

    def data(self, seed: int) -> DataBundle:
        """The data a real run of ``seed`` trains on (a built-in set's split depends on the seed)."""
        if seed not in self._data:
            cfg = self.config
            bundle = self.task.data or load_data(cfg.data, cfg.data_dir, tuple(cfg.synthetic_shape),
                                                 cfg.synthetic_size, seed)
            self._data[seed] = bundle
        return self._data[seed]

    def model(self, seed: int) -> nn.Module:
        """The model a real run of ``seed`` starts from (every worker builds it after seeding), on :attr:`device`:
        built on the CPU, as a real worker builds it before moving it, so its initial weights are the same on
        any device."""
        data = self.data(seed)
        torch.manual_seed(seed)
        model = self.task.make_model(data.input_shape, data.num_classes)
        cast_to_model(data, model)
        return model.to(self.device)
