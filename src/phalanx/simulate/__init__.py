"""``phalanx compare --simulate``: every strategy at 8 to 1,024 workers, by a discrete-event simulation
that computes the real gradients of the user's model in the order a modelled schedule dictates.

One process plays W virtual workers. Each reads its real shard of the data and computes real
gradients of the real model with the parameters it actually holds in the simulated schedule (the
version it pulled from a parameter server, its local copy in local SGD and DiLoCo, the common one
in sync); each strategy's own rule combines them in simulated-time order, so staleness and drops
are what the schedule makes them. The clock is the estimate's: the step measured here (or
``--step-time``), the straggler scenario's pure pause schedule, and each strategy's cost model on
the link (``--link-bandwidth/--link-latency``).

This package is the engine and knows no strategy:

- ``registry.py``: :class:`SimulatedRule` and the registry keyed by the options class (each strategy
  registers its rule with its cost model, in one call: ``strategies/registry.py``);
- ``lockstep.py``: the rule every step averages by (sync, fsdp); the other rules live with their strategies
  (``strategies/ps/simulated.py``, ``strategies/local_sgd/simulated.py``, ``strategies/diloco/simulated.py``);
- ``gradients.py``: the model as a function of flat parameters, many workers' gradients at once;
  ``versions.py``: shared, reference-counted parameter versions; ``params.py``: flat vectors;
- ``problem.py``: the task, the data and the clock's inputs; ``world.py``: one run.

The comparison that drives it (worker counts x scenarios x strategies x repeats) and its report are
``compare --simulate``'s back end: ``compare/simulated.py``, ``compare/simulated_report.py``.
"""

from .lockstep import LOCKSTEP
from .registry import RULES, SimulatedRule, simulated_rule

__all__ = ["LOCKSTEP", "RULES", "SimulatedRule", "simulated_rule"]
