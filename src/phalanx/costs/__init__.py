"""The cost model: pure functions from measured compute, the model's sizes and the network to a step time.

An engine below the strategies: each strategy's cost model lives in its own package
(``strategies/<name>/costs.py``) and registers here; the estimate measures the inputs and asks.
Nothing here imports torch, starts a process or knows a strategy.

- ``model.py``: :class:`CostModel`, what every strategy's cost model answers, and the registry
  keyed by the options class (:data:`COSTS`, :func:`cost_model`; filled by ``strategies.registry``);
- ``link.py``: :class:`Link`, α and β; ``inputs.py``: :class:`Compute` (a worker's measured step),
  :class:`ModelFacts` (sizes), :class:`Network` (links, workers per node) and the collectives' costs;
- ``timeline.py``: compute and communication streams, and what overlaps;
- ``prediction.py``: :class:`Prediction`, one row of the report.
"""

from .inputs import Compute, ModelFacts, Network, allreduce, gather_or_scatter
from .link import Link
from .model import COSTS, Alternative, CostModel, cost_model, modelled_cost
from .prediction import Prediction
from .timeline import Op, finish, schedule

__all__ = ["COSTS", "Alternative", "Compute", "CostModel", "Link", "ModelFacts", "Network", "Op", "Prediction",
           "allreduce", "cost_model", "finish", "gather_or_scatter", "modelled_cost", "schedule"]
