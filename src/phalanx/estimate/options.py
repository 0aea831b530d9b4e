"""``phalanx estimate``'s own options, declared once: the fields are the flags.

The model, data and batch flags are ``phalanx train``'s own (fields of ``TrainConfig``), and the
strategy flags are the strategies' own: those fields of each strategy's options that its cost model
says change the cost (``CostModel.fields``), so that an estimate describes exactly the run that the
same flags would start. Which strategies can be estimated is which have a cost model registered.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..costs import cost_model, modelled_cost
from ..errors import PhalanxError
from ..options import field_flag, option
from ..strategies import STRATEGIES, Options
from ..units import check_link_pair, parse_bandwidth, parse_duration, parse_workers



def estimated() -> tuple[str, ...]:
    """What --strategy may name: every strategy with a cost model registered, in phalanx's order of strategies.
    Asked each time, so a strategy registered after this module was imported is estimated too."""
    return tuple(name for name, cls in STRATEGIES.items() if cost_model(cls) is not None)


def strategy_choices() -> tuple[str, ...]:
    return estimated() + ("all",)


def __getattr__(name: str):
    """``ESTIMATED`` and ``STRATEGY_CHOICES``: the registry as it is now (see :func:`estimated`)."""
    if name == "ESTIMATED":
        return estimated()
    if name == "STRATEGY_CHOICES":
        return strategy_choices()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The flags of phalanx train that an estimate takes (they shape the measured step).
#: The task's (``--training-step``, ``--target-key``, ``--lr-scheduler``, ``--clip-grad-norm``) among them: the
#: step measured is the one train runs.
TRAIN_FLAGS = ("model", "data", "data_dir", "synthetic_shape", "synthetic_size", "batch_size", "optimizer",
               "training_step", "target_key", "lr_scheduler", "clip_grad_norm", "devices", "threads", "seed")


@dataclasses.dataclass(frozen=True)
class EstimateOptions:
    workers: tuple = option((1, 2, 4, 8), "worker counts to predict, e.g. 1,2,4,8,64,256", parse=parse_workers,
                            show="1,2,4,8")
    strategy: str = option("all", "which strategies to predict", choices=strategy_choices())
    per_node: Optional[int] = option(None, "workers per machine (they share its cores or hold one GPU each)",
                                     show="one per GPU here; on CPU, 2 as phalanx train")
    link_bandwidth: Optional[float] = option(
        None, "bus bandwidth of the network between machines, nccl-tests convention (e.g. 25GB/s, 200Gb/s)",
        parse=parse_bandwidth, show="measured or from the topology")
    link_latency: Optional[float] = option(None, "latency per message between machines (e.g. 10us)",
                                           parse=parse_duration, show="measured or from the topology")
    #: None: on CPU workers unless --link-* is given (nothing else tells the link between local processes)
    measure_link: Optional[bool] = option(
        None, "time all-reduces of 4 KiB to 64 MiB between 2 local ranks and fit α and β (--no-measure-link: "
              "the --link-* figures, or on GPUs the topology's datasheet figures)",
        show="on for CPU workers unless --link-* is given; off on GPUs")
    measure_steps: int = option(20, "timed steps per compute measurement, after 5 warm-up steps (more where they take "
                                       "under a second)")
    plot: Optional[str] = option(None, "write a scaling plot to this file (.png, .pdf or .svg)")
    json: bool = option(False, "print the estimate as JSON (progress goes to stderr)")

    def __post_init__(self) -> None:
        if isinstance(self.workers, str):
            object.__setattr__(self, "workers", parse_workers(self.workers))
        else:
            object.__setattr__(self, "workers", parse_workers(",".join(map(str, self.workers))))
        choices = strategy_choices()
        if self.strategy not in choices:
            raise PhalanxError(f"unknown --strategy {self.strategy!r}: choose one of {', '.join(choices)}")
        if self.per_node is not None and (not isinstance(self.per_node, int) or self.per_node < 1):
            raise PhalanxError(f"--per-node must be at least 1, got {self.per_node!r}")
        if not isinstance(self.measure_steps, int) or self.measure_steps < 3:
            raise PhalanxError(f"--measure-steps must be at least 3 (medians need a few), got {self.measure_steps!r}")
        check_link_pair(self.link_bandwidth, self.link_latency)
        if self.measure_link is not None and not isinstance(self.measure_link, bool):
            raise PhalanxError(f"--measure-link is on or off, got {self.measure_link!r}")
        if self.plot is not None:
            check_plot_suffix(self.plot)

    @property
    def strategies(self) -> tuple[str, ...]:
        return estimated() if self.strategy == "all" else (self.strategy,)

    @property
    def link_given(self) -> bool:
        return self.link_bandwidth is not None


def check_plot_suffix(path: str, flag: str = "--plot") -> None:
    """The scaling plot's file names a format matplotlib writes here, or one line."""
    if not path.lower().endswith((".png", ".pdf", ".svg")):
        raise PhalanxError(f"{flag} {path}: name a .png, .pdf or .svg file")


def owners() -> dict[str, list[type[Options]]]:
    """Strategy option -> the options classes that take it (several may: ``sync_every`` is local-sgd's and
    diloco's), in phalanx's order: the fields their cost models depend on."""
    from ..strategies import strategy_class

    found: dict[str, list[type[Options]]] = {}
    for cls in (strategy_class(name) for name in estimated()):
        for field in modelled_cost(cls).fields:
            found.setdefault(field, []).append(cls)
    return found


def split(settings: dict) -> tuple[EstimateOptions, dict, dict]:
    """The settings given (by flags or keywords) as the estimate's own options, the run's training values and
    the strategies' cost options; a strategy's option that no predicted strategy takes is refused."""
    own = {f.name for f in dataclasses.fields(EstimateOptions)}
    options = EstimateOptions(**{k: v for k, v in settings.items() if k in own})
    taken_by = owners()
    typed = {k: v for k, v in settings.items() if k in taken_by}
    for name in typed:
        takers = [cls.name for cls in taken_by[name]]
        if not set(takers) & set(options.strategies):
            flag = field_flag(taken_by[name][0], name)
            raise PhalanxError(f"{flag} is an option of {' and '.join(takers)}, and --strategy {options.strategy} does "
                               f"not predict it (drop {flag}, or use --strategy {' or '.join(takers)} or all)")
    return options, {k: v for k, v in settings.items() if k in TRAIN_FLAGS}, typed


def names() -> set[str]:
    """Every setting an estimate takes: its own options, the training flags, the strategies' cost options."""
    return {f.name for f in dataclasses.fields(EstimateOptions)} | set(TRAIN_FLAGS) | set(owners())
