"""What a strategy's cost model answers, and the registry that reaches it from the options class.

``phalanx estimate`` never asks which strategy it holds: it asks the strategy's options class for
its :class:`CostModel` (:func:`cost_model`), the options' ``layout()`` whether a worker count can
run and how many processes it starts, and the cost model for the rest: the step time
(:meth:`CostModel.predict`), which of its options the estimate takes as flags (``fields``),
how the report heads its table (``title``), whether the step has a bubble, and which changes of its
options might help (:meth:`CostModel.alternatives`).

Why a registry keyed by the options class, filled in the strategy's own module (its one
registration, ``strategies/registry.py``): the strategy owns its cost model, as it owns its layout
and runtime, and a new strategy is one new module plus its cost model, with no edit to
the estimate. Why the formulas
live here and not beside each runtime: they are pure (no torch), both the strategies and the
estimate import them, and the estimate's measuring code (which starts processes) stays out of the
strategies. Exact classes, not ``isinstance``: ``ssp`` and ``backup`` subclass ``ps``'s options but
cost something else, so they inherit no cost model by accident.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from ..errors import PhalanxError
from .inputs import Compute, ModelFacts, Network
from .prediction import Prediction


@dataclasses.dataclass(frozen=True)
class Alternative:
    """One change the advice tries: new values for some options, or another strategy in place of this one."""

    label: str  #: the flag as the user would type it, and what it does
    changes: dict = dataclasses.field(default_factory=dict)  #: option field -> new value (this strategy)
    strategy: Optional[type] = None  #: another strategy's options class (the estimate's own options of it)
    note: str = ""  #: what the figure assumes


class CostModel:
    """A strategy's step in seconds, from measured compute, the model's sizes and the network. Pure.

    The defaults describe a data-parallel strategy whose options change nothing in its cost.
    """

    title: str = ""  #: how the report heads this strategy's table
    fields: tuple[str, ...] = ()  #: the options' fields that change the cost: ``estimate`` takes them as flags
    bubble: bool = False  #: the step has stages idling (fill and drain): the table shows the share
    #: twice the per-worker batch can be predicted from the measured compute (forward and backward doubled)
    scales_with_batch: bool = True

    def plans(self, options: Any, workers: int, blocks: int, per_node: int) -> Sequence[Any]:
        """The options to try on ``workers`` workers (``per_node`` to a machine, on a model of ``blocks``
        blocks), best first; the estimate predicts the first one whose ``layout()`` accepts the job (a
        pipeline chooses its stage count here, a hierarchical reduction its islands: the machines)."""
        return [options]

    def predict(self, options: Any, compute: Compute, facts: ModelFacts, net: Network, workers: int) -> Prediction:
        raise NotImplementedError

    def alternatives(self, options: Any, compute: Compute, net: Network, workers: int) -> list[Alternative]:
        """Changes worth predicting at ``workers`` (the advice keeps those that pay)."""
        return []

    def micro_batches(self, options: Any, batch_size: int) -> tuple[int, ...]:
        """Micro-batch counts M at which it needs every block's time measured (at batch / M); () for none."""
        return ()

    def bucket_mb(self, options: Any) -> Optional[float]:
        """The gradient bucket cap (MiB) its engine packs gradients into (DDP's); None: no buckets."""
        return None


#: options class -> its cost model. Filled by each strategy's registration (``strategies.registry.register``).
COSTS: dict[type, CostModel] = {}


def cost_model(options: Any) -> Optional[CostModel]:
    """The cost model of an options object or class; None: the estimate does not model that strategy."""
    cls = options if isinstance(options, type) else type(options)
    return COSTS.get(cls)


def modelled_cost(options: Any) -> CostModel:
    """The cost model of a strategy known to have one (the estimate predicts only those, the simulation plays only
    those); one line where it has none."""
    model = cost_model(options)
    if model is None:
        cls = options if isinstance(options, type) else type(options)
        raise PhalanxError(f"strategy {getattr(cls, 'name', cls.__name__)} has no cost model: phalanx estimate and "
                           "compare --simulate do not model it")
    return model
