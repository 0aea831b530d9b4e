"""``phalanx.estimate(...)``: the estimate from Python, on the caller's own model and data objects.

    import phalanx
    est = phalanx.estimate(model=Net(), train_data=(x, y), workers=(1, 2, 8), strategy="sync")
    print(est.table)              # what `phalanx estimate` prints
    est.to_dict()                 # what `phalanx estimate --json` prints
    est.plot("scaling.png")       # what `phalanx estimate --plot scaling.png` draws

The keywords are the command's flags (its own, the training flags it takes, the strategies' cost
options such as ``reduce="hierarchical"``), split by :func:`~phalanx.estimate.options.split`, then
:func:`~phalanx.estimate.setup.prepare` and :func:`~phalanx.estimate.run.run`. This is the engine: the
command (``cli.py``) calls it with the flags typed, so a bad value is the same one line either way.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..errors import PhalanxError
from ..options import parsed_as_flag
from .options import EstimateOptions


@dataclasses.dataclass
class EstimateResult:
    estimate: Any  #: the :class:`~phalanx.estimate.run.Estimate`: setup, measurements, predictions, advice

    @property
    def table(self) -> str:
        """What ``phalanx estimate`` prints: what was measured, a table per strategy, what would help."""
        from .report import describe

        return describe(self.estimate)

    @property
    def predictions(self) -> list:
        return self.estimate.predictions

    @property
    def advice(self) -> dict[str, list[str]]:
        """strategy -> what would help it (a larger batch, other options)."""
        return self.estimate.advice

    def __str__(self) -> str:
        return self.table

    def to_dict(self) -> dict[str, Any]:
        """What ``--json`` prints."""
        return self.estimate.to_dict()

    def plot(self, path: Union[str, Path]) -> Path:
        """What ``--plot PATH`` draws: examples/s and efficiency against workers (.png, .pdf or .svg)."""
        from .options import check_plot_suffix
        from .report import check_plot_path, plot

        path = str(path)
        check_plot_suffix(path, "plot")
        check_plot_path(path)
        plot(self.estimate, path)
        return Path(path)

    def save(self, out: Union[str, Path]) -> list[Path]:
        """``out``/estimate.txt (the printed table), estimate.json (``--json``) and estimate.png (``--plot``)."""
        out = Path(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PhalanxError(f"{out} cannot be written ({e.strerror or e}); choose another directory") from None
        (out / "estimate.txt").write_text(self.table + "\n")
        (out / "estimate.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return [out / "estimate.txt", out / "estimate.json", self.plot(out / "estimate.png")]


def estimate(*, model: Any = None, train_data: Any = None, test_data: Any = None, loss_fn: Optional[Callable] = None,
             optimizer: Any = None, training_step: Any = None, lr_scheduler: Any = None, quiet: bool = False,
             **settings: Any) -> EstimateResult:
    """Step time and scaling per strategy and worker count, predicted from this machine's measurements.

    ``model``: an ``nn.Module`` or a ``--model`` name; ``train_data``/``test_data`` (pairs, dicts, any batch
    tree), ``loss_fn``, ``optimizer`` (``params -> Optimizer`` or ``model -> Optimizer``), ``training_step``
    (``step(model, batch) -> loss``) and ``lr_scheduler``, each an object or a name: as ``phalanx.Trainer``
    takes them. The other
    keywords are the flags' (``workers=(1, 2, 8)``, ``strategy="sync"``, ``link_bandwidth="25GB/s"``,
    ``batch_size=64`` ...); unset ones take the command's defaults. Progress lines go to stderr
    (``quiet=True``: none).
    """
    from .options import names, split
    from .run import run
    from .setup import prepare

    if isinstance(model, str):
        settings["model"], model = model, None
    if isinstance(optimizer, str):
        settings["optimizer"], optimizer = optimizer, None
    if isinstance(training_step, str):
        settings["training_step"], training_step = training_step, None
    if isinstance(lr_scheduler, str):
        settings["lr_scheduler"], lr_scheduler = lr_scheduler, None
    known = names()
    for name in settings:
        if name not in known:
            raise PhalanxError(f"estimate() has no setting {name}=; it takes the flags of phalanx estimate as keywords "
                               f"({', '.join(sorted(known))})")
        if name in ("plot", "json"):
            raise PhalanxError(f"{name}= is the command's way to show the estimate; "
                               f"call .{name.replace('json', 'to_dict')}() on the result instead")
    options, train_values, strategy_values = split({name: parsed_as_flag(EstimateOptions, name, value)
                                                    for name, value in settings.items()})
    objects = {k: v for k, v in (("model", model), ("train_data", train_data), ("test_data", test_data),
                                 ("loss_fn", loss_fn), ("optimizer", optimizer), ("training_step", training_step),
                                 ("lr_scheduler", lr_scheduler)) if v is not None}
    setup = prepare(options, train_values, strategy_values, objects)
    say = (lambda line: None) if quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    return EstimateResult(run(setup, say))

