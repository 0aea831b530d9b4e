"""``phalanx compare --simulate``: every strategy at 8 to 1,024 workers, by a discrete-event simulation
that computes the real gradients of the user's model in the order a modelled schedule dictates.

One process plays W virtual workers. Each reads its real shard of the data and computes real
gradients of the real model with the parameters it actually holds in the simulated schedule (the
version it pulled from a parameter server, its local copy in local SGD and DiLoCo, the common one
in sync); each strategy's own rule combines them in simulated-time order, so staleness and drops
are what the schedule makes them. The clock is the estimate's: the step measured here (or
``--step-time``), the straggler scenario's pure pause schedule, and each strategy's cost model on
the link (``--link-bandwidth/--link-latency``).

- ``registry.py``: :class:`SimulatedRule` and the registry keyed by the options class (each strategy
  registers its rule with its cost model, in one call: ``strategies/registry.py``);
- the rules: ``lockstep.py`` (sync, fsdp), ``server.py`` (ps, ssp, backup), ``periodic.py``
  (local-sgd, diloco);
- ``gradients.py``: the model as a function of flat parameters, many workers' gradients at once;
  ``versions.py``: shared, reference-counted parameter versions; ``params.py``: flat vectors;
- ``problem.py``: the task, the data and the clock's inputs, read once; ``world.py``: one run;
- ``compare.py``: the comparison (worker counts x scenarios x strategies x repeats) and
  ``report.py``: its report, marked simulated, with time to target against worker count.

This ``__init__`` imports only the registry and the rules: the strategies import it.
"""

from .lockstep import LOCKSTEP
from .registry import RULES, SimulatedRule, simulated_rule

__all__ = ["LOCKSTEP", "RULES", "SimulatedRule", "simulated_rule"]
