"""``phalanx estimate``: step time and scaling per strategy and worker count, before renting the machines.

Compute is measured here (a worker's forward, backward, optimizer and loop, under the conditions
it would run in); communication follows from an α–β model of the link (measured, given, or the
topology's defaults); the cost model per strategy is pure functions. The modules:

- ``options.py``: the command's own options (their fields are its flags);
- ``units.py``: ``25GB/s``, ``10us`` and back;
- ``setup.py``: every check before measuring; which conditions each row's worker computes under;
- ``facts.py``: the model's sizes, DDP's buckets; ``profile.py``: measuring a worker's step;
- ``link.py``: α and β, the least-squares fit, the GPU defaults and their sources;
- ``phalanx/costs/``: the cost model (pure), one per strategy, registered by its options class;
- ``run.py``: measure and predict; ``advice.py``: what would help; ``report.py``: table and plot;
- ``cli.py``: the flags; ``api.py``: ``phalanx.estimate(...)``, the same from Python.

Reading and accuracy: docs/estimate.md.

This package is itself callable: ``phalanx.estimate(model=..., train_data=...)`` runs
:func:`phalanx.estimate.api.estimate` (``phalanx/callable_package.py`` says why a package).
"""

from ..callable_package import make_callable
from ..costs import Compute, ModelFacts, Network, Prediction
from . import api
from .link import Link, fit_ring
from .options import EstimateOptions

__all__ = ["Compute", "EstimateOptions", "Link", "ModelFacts", "Network", "Prediction", "api", "fit_ring"]


make_callable(__name__, api.estimate)
