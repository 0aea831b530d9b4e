"""``phalanx compare``: which strategy reaches a target accuracy first on the user's own problem.

Time to accuracy = steps needed (statistical efficiency: stale gradients cost steps) x time per
step (hardware efficiency: waiting for the slowest costs time); reporting one factor without the
other is why async-versus-sync studies disagree (Dai et al., ICLR 2019). A comparison trains every
strategy to the target under every straggler scenario, several times, interleaved, and reports
both factors and their product.

- ``options.py``: the comparison's own options (their fields are its flags), the training fields it shares;
- ``tokens.py``: strategy tokens (``ssp:2``) and scenarios (``slow:1:2``), parsed;
- ``setup.py``: the options and the training settings made one checked Setup;
- ``runner.py``: the runs: one TrainConfig each, checked first, interleaved, trained;
- ``results.py``: one run's figures from its metrics file; medians over repeats;
- ``report.py``: the tables, the answer in words, report.md and report.json;
- ``outcome.py``: what a comparison returns, and ``save(dir)`` (what ``--out`` writes);
- ``engine.py``: a comparison from start to end: set up, run, print, report (``--simulate``: ``simulated.py``);
- ``plots.py``: matplotlib figures; ``api.py``: ``phalanx.compare(...)``; ``cli.py``: the command's flags, then
  the engine.

This package is itself callable: ``phalanx.compare(model=..., train_data=...)`` runs
:func:`phalanx.compare.api.compare`. (``phalanx/callable_package.py`` says why a package).
"""

from ..callable_package import make_callable
from . import api
from .options import CompareOptions
from .outcome import Comparison
from .runner import Setup
from .tokens import parse_scenarios, parse_strategies

__all__ = ["CompareOptions", "Comparison", "Setup", "api", "parse_scenarios", "parse_strategies"]


make_callable(__name__, api.compare)
