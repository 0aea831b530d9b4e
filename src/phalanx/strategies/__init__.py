"""Strategies: how the towers/workers combine their work.

Each is options (a frozen dataclass whose fields are its CLI flags), a pure layout computed in
the parent, and a runtime built in every worker (see ``base.py``). One package per strategy, holding
its options and layout (``__init__.py``, ending in its one registration), its runtime, its cost model
(``costs.py``, for ``phalanx estimate``) and its simulated rule (``simulated.py``, for ``compare --simulate``):

- ``sync/``: :class:`Sync` (DDP); ``fsdp/``: :class:`FSDP` (torch's ``fully_shard``, tensor parallelism);
- ``ps/``: :class:`ParameterServer`, :class:`SSP` and :class:`Backup` (protocol, gate, aggregation rule,
  server, worker);
- ``hogwild/``: :class:`Hogwild`; ``local_sgd/``: :class:`LocalSGD`; ``diloco/``: :class:`DiLoCo`;
- ``pipeline/``: :class:`Pipeline` and its engine (split, trace, stages, schedule, checkpoint state);
- shared: ``registry.py`` (:data:`STRATEGIES` and :func:`register`, each strategy's one registration: its
  name, cost model and simulated rule), ``base.py``, ``replicas.py``, ``balance.py``, ``meta_init.py``.
"""

from __future__ import annotations

import dataclasses

from ..errors import PhalanxError
from .base import Build, Report, Runtime, nonfinite_values, runtime_for
from .options import Options
from .layout import Job, Layout, RankPlan, Role, StopRule
from .registry import STRATEGIES, register, unregister

# Each module registers its strategy as it is imported (registry.py), so this order is the order of
# STRATEGIES: of --strategy's help and of ``--strategy all``.
from .sync import Sync
from .ps import SSP, Backup, ParameterServer
from .hogwild import Hogwild
from .local_sgd import LocalSGD
from .diloco import DiLoCo
from .pipeline import Pipeline
from .fsdp import FSDP


def strategy_class(name: str) -> type[Options]:
    if name not in STRATEGIES:
        raise PhalanxError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def takers(field: str) -> list[str]:
    """The strategies that take option ``field``."""
    return [name for name, cls in STRATEGIES.items() if field in {f.name for f in dataclasses.fields(cls)}]


__all__ = ["Backup", "Build", "DiLoCo", "FSDP", "Hogwild", "Job", "Layout", "LocalSGD", "Options", "ParameterServer",
           "Pipeline", "RankPlan", "Report", "Role", "Runtime", "SSP", "STRATEGIES", "StopRule", "Sync",
           "nonfinite_values", "register", "runtime_for", "strategy_class", "takers", "unregister"]
