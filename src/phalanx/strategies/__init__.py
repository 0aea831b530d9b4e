"""Strategies: how the towers/workers combine their work."""

from __future__ import annotations

from ..errors import PhalanxError
from .base import Strategy
from .hogwild import Hogwild
from .local_sgd import LocalSGD
from .ps import SSP, ParameterServer
from .sync import Sync
from ..pipeline.strategy import Pipeline  # after .base: the pipeline strategy builds on it

#: CLI name -> strategy class. Each class maps its own options (dataclass fields).
STRATEGIES: dict[str, type[Strategy]] = {"sync": Sync, "local-sgd": LocalSGD, "hogwild": Hogwild,
                                         "ps": ParameterServer, "ssp": SSP, "pipeline": Pipeline}


def strategy_from_name(name: str, **options) -> Strategy:
    if name not in STRATEGIES:
        raise PhalanxError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}")
    cls = STRATEGIES[name]
    fields = {f.name for f in cls.__dataclass_fields__.values()}
    return cls(**{k: v for k, v in options.items() if k in fields})


__all__ = ["Hogwild", "LocalSGD", "ParameterServer", "Pipeline", "SSP", "STRATEGIES", "Strategy", "Sync",
           "strategy_from_name"]
