"""What a strategy's simulated rule answers, and the registry that reaches it from the options class.

``phalanx compare --simulate`` never asks which strategy it holds: it asks the options class for
its :class:`SimulatedRule` (:func:`simulated_rule`), which plays that strategy's schedule in
simulated time on a :class:`~phalanx.simulate.world.World` (real gradients of the real model, the
clock of the strategy's cost model). Filled by the strategy's one registration, in its own module
(``register(Sync, cost=SyncCost(), simulated=LOCKSTEP)``, ``strategies/registry.py``), so a new
strategy adds its runtime, its cost and its simulated rule in one place. Exact classes, as in
``costs/model.py``: ``ssp`` and ``backup`` subclass ``ps``'s options and register their own (the
same server rule).

Nothing here imports the strategies: they import this module.
"""

from __future__ import annotations

from typing import Any, Optional


class SimulatedRule:
    """How a strategy's workers combine their updates, played out in simulated time."""

    #: whether its optimizer steps one module's own tensors (the common parameters), so that an optimizer factory
    #: that takes the model gets one; False where it steps the workers' copies stacked
    steps_a_module: bool = True

    def run(self, options: Any, world: Any) -> None:
        """Train on ``world`` until it says stop (target reached, or its last step), recording evaluations."""
        raise NotImplementedError


#: options class -> its simulated rule. Filled by each strategy's registration (``strategies.registry.register``).
RULES: dict[type, SimulatedRule] = {}


def simulated_rule(options: Any) -> Optional[SimulatedRule]:
    """The simulated rule of an options object or class; None: the strategy cannot be simulated yet."""
    cls = options if isinstance(options, type) else type(options)
    return RULES.get(cls)
