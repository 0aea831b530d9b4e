"""The strategies phalanx knows: each registered once, beside its options class, with what it owns.

One call at the end of a strategy package's ``__init__.py``, ``register(Sync, cost=SyncCost(), simulated=LOCKSTEP)``,
makes it a strategy: its name a ``--strategy`` choice (:data:`STRATEGIES`, in the order registered:
the order of the help and of ``--strategy all``), its cost model the one ``phalanx estimate`` asks
(``costs.cost_model``), its simulated rule the one ``compare --simulate`` plays
(``simulate.simulated_rule``). Its layout and runtime are methods of the options class. So a new
strategy is one package ending in this call, plus the line in ``strategies/__init__.py`` that imports
it; nothing that uses strategies names one: it asks the options what the strategy can do (docs/architecture.md,
"How the code reads").

Why the cost models and rules are kept in dicts of their engines (``costs.COSTS``, ``simulate.RULES``)
rather than here: the engines are below the strategies (docs/architecture.md, "Layers") and know none of
them; the estimate and the simulation's clock ask them without importing a runtime.
Keyed by the exact class, not ``isinstance``: ``ssp`` and ``backup`` subclass ``ps``'s options but
cost something else, so they inherit no cost model by accident.
"""

from __future__ import annotations

from typing import Optional, TypeVar

from ..costs.model import COSTS, CostModel
from ..simulate.registry import RULES, SimulatedRule
from .options import Options

OptionsClass = TypeVar("OptionsClass", bound=type[Options])

#: CLI name -> options class, in the order registered.
STRATEGIES: dict[str, type[Options]] = {}


def register(options_class: OptionsClass, *, cost: Optional[CostModel] = None,
             simulated: Optional[SimulatedRule] = None) -> OptionsClass:
    """Make ``options_class`` a strategy named ``options_class.name``; ``cost``: what its step costs (None:
    ``estimate`` does not predict it); ``simulated``: how ``compare --simulate`` plays it (None: not simulated)."""
    known = STRATEGIES.get(options_class.name)
    if known is not None and known is not options_class:
        raise ValueError(f"strategy name {options_class.name!r} is taken by {known.__qualname__}: give "
                         f"{options_class.__qualname__} a name of its own")
    STRATEGIES[options_class.name] = options_class
    if cost is not None:
        COSTS[options_class] = cost
    if simulated is not None:
        RULES[options_class] = simulated
    return options_class


def unregister(options_class: type[Options]) -> None:
    """Forget a strategy (a test's own, or a plug-in's): its name, cost model and simulated rule."""
    if STRATEGIES.get(options_class.name) is options_class:
        del STRATEGIES[options_class.name]
    COSTS.pop(options_class, None)
    RULES.pop(options_class, None)
