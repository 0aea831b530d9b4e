"""``phalanx compare``'s own options, declared once (the fields are the flags), and which training flags it shares.

The training flags are :class:`~phalanx.train.TrainConfig`'s own (model, data, batch, recipe, devices, seed),
the same for every run; the ones a comparison sets per run (strategy, straggler, steps, evaluation,
checkpoints, metrics, progress) are its own options or are fixed (:data:`PER_RUN`), so they are not offered.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from ..errors import PhalanxError
from ..options import declared, option
from ..task.metrics import parse_target
from ..train import TrainConfig
from .tokens import parse_strategies

DEFAULT_STRATEGIES = "sync,ps,ssp:2,local-sgd:8,hogwild,backup:1"

#: TrainConfig fields a comparison sets for each run (the rest are the problem's, shared by every run).
PER_RUN = {"strategy", "straggler", "steps", "eval_every", "stop_at", "stop_at_accuracy", "metrics", "checkpoint_dir",
           "checkpoint_every", "keep_checkpoints", "resume", "overwrite", "progress", "log_every",
           "link"}  # a link is a scenario (link:RATE), not a flag shared by every run


@dataclasses.dataclass
class CompareOptions:
    """What to compare, how long to try, and where the report goes."""

    strategies: Optional[str] = option(None, "strategies to compare, each with its main option after a colon "
                                             "(ssp:K, local-sgd:H, backup:B)", parse=lambda text: _checked(text),
                                       show=f"{DEFAULT_STRATEGIES}; on GPUs without hogwild, which needs the CPU")
    target: Union[str, float] = option(0.95, "what each run trains to: accuracy>=0.95, loss<=0.30, perplexity<=5, or "
                                             "a --metric's name with >= or <=; a bare number is an accuracy",
                                       parse=lambda text: _target(text))
    scenarios: str = option("none,slow:1:2,pauses:0.1:4",
                            "scenarios: none, slow:RANK:FACTOR (that rank's compute FACTOR times as long "
                            "every step), pauses:P:FACTOR (every step, each worker FACTOR times as slow with "
                            "probability P), link:RATE (every run on one real link of RATE, e.g. link:100mbit: the "
                            "kernel shapes the job's loopback in a private network namespace; needs root and "
                            "iproute2)")
    repeats: int = option(3, "runs of each strategy in each scenario (medians and min-max)")
    max_steps: Optional[int] = option(None, "a run that has not reached the target after this many steps stops there",
                                      show="2 x the model's recipe steps")
    eval_every: Optional[int] = option(None, "evaluate every N steps (time to target is measured this finely)",
                                       show="about 20 evaluations over --max-steps")
    out: Optional[str] = option(None, "write report.md, report.json, the plots and every run's metrics file here",
                                parse=lambda text: _named_folder(text))

    def __post_init__(self) -> None:
        if self.strategies is not None:  # '' is not "the default": it names no strategy
            _checked(self.strategies)
        if self.out is not None:
            _named_folder(self.out)
        _target(self.target)
        for name in ("repeats", "max_steps", "eval_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise PhalanxError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _checked(strategies: str) -> str:
    """The --strategies text, once every entry in it parses (at parse time, before anything runs)."""
    parse_strategies(strategies)
    return strategies


def _target(text: Union[str, float]) -> Union[str, float]:
    """The --target as given, once it parses (the metric it names is checked with the problem's metrics)."""
    parse_target(text, "--target")
    return text


def _named_folder(out: str) -> str:
    if not str(out).strip():
        raise PhalanxError("--out '' names no folder: give a folder for the report, e.g. --out compare-digits")
    return out


def shared_fields() -> list[str]:
    """The TrainConfig fields that describe the problem: the same for every run, offered as flags and keywords."""
    return [f.name for f in declared(TrainConfig) if f.name not in PER_RUN]
