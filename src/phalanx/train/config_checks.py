"""What a :class:`~phalanx.train.config.TrainConfig`'s fields may hold, alone and together, checked as it
is made: the choices, the counts, which option applies to which setting; each refusal one line that names
the flag and the fix.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..data.datasets import DATASETS
from ..errors import PhalanxError
from ..task.models import MODELS
from ..precision import PRECISIONS
from ..strategies import STRATEGIES
from ..task.schedules import SCHEDULES

if TYPE_CHECKING:
    from .config import TrainConfig

OPTIMIZERS = ("sgd", "adam", "adamw")
PROGRESS = ("auto", "bar", "lines", "none", "silent")
#: --steps beyond this is a typo, not a plan: a billion steps of a millisecond each already take 12 days
MAX_STEPS = 10**9

#: The optimisation settings: on --resume each one given wins over the checkpoint's (see resume.py).
SETTINGS = ("optimizer", "lr", "momentum", "weight_decay", "lr_schedule", "lr_decay_every", "lr_decay_factor",
            "staircase", "warmup_steps", "lr_base_batch", "lr_scheduler", "clip_grad_norm")
#: phalanx's own schedule's settings, which a scheduler of the user's (--lr-scheduler) replaces
OWN_SCHEDULE = ("lr_schedule", "lr_decay_every", "lr_decay_factor", "staircase", "warmup_steps")
#: Settings whose default is the same for every model (None until resolved, so that giving one is seen).
PLAIN_DEFAULTS: dict[str, Any] = {"weight_decay": 0.0, "lr_schedule": "constant", "warmup_steps": 0}

#: field -> (the setting it belongs to, the values of that setting it applies to, its default there)
ONLY_FOR: dict[str, tuple[str, tuple[str, ...], Any]] = {
    "momentum": ("optimizer", ("sgd",), 0.9),
    "lr_decay_every": ("lr_schedule", ("exponential",), 100),
    "lr_decay_factor": ("lr_schedule", ("exponential",), 0.5),
    "staircase": ("lr_schedule", ("exponential",), False),
    "data_dir": ("data", ("cifar10",), None),
    "synthetic_shape": ("data", ("synthetic",), (3, 24, 24)),
    "synthetic_size": ("data", ("synthetic",), 4096),
}


def check_fields(cfg: TrainConfig) -> None:
    """Every field alone, and the options that apply only to a setting (not again once resolved: the recipe's
    values are filled in then)."""
    check_paths(cfg)
    check_names(cfg)
    check_counts(cfg)
    check_choices(cfg)
    check_numbers(cfg)
    if not cfg._resolved:
        check_applicable(cfg)


def check_recompute(cfg: TrainConfig) -> None:
    """--activation-checkpointing wraps the model's blocks before the strategy does: a strategy whose engine
    traces or splits the model, or that has not been wired and tested for it, refuses it."""
    if not isinstance(cfg.activation_checkpointing, bool):
        raise PhalanxError(f"--activation-checkpointing is on or off, got {cfg.activation_checkpointing!r}")
    if cfg.activation_checkpointing and not cfg.options.checkpoints_activations:
        takes = ", ".join(name for name, cls in STRATEGIES.items() if cls.checkpoints_activations)
        raise PhalanxError(f"--strategy {cfg.options.name} does not take --activation-checkpointing; use one of "
                           f"{takes}, or drop the flag")


def check_paths(cfg: TrainConfig) -> None:
    """An empty path would mean the current directory (or nothing): never what was meant."""
    for name in ("checkpoint_dir", "metrics", "data_dir", "resume", "tensorboard", "init_from"):
        value = getattr(cfg, name)
        if value is not None:  # no --checkpoint-dir: each run gets its own (rundir.placed)
            if not isinstance(value, str) or not value.strip():
                raise PhalanxError(f"{flag(name)} is empty ({value!r}); give a path, e.g. "
                                   f"{_PATH_EXAMPLES[name]}")
    if cfg.overwrite and cfg.resume is not None:
        raise PhalanxError("--overwrite starts a new run and --resume continues one: give one of them")
    if cfg.init_from is not None and cfg.resume is not None:
        raise PhalanxError("--init-from starts a new run from a checkpoint's weights and --resume continues a "
                           "run with its optimizer and step: give one of them")


def check_names(cfg: TrainConfig) -> None:
    """An empty name would fall back to the default silently: ``--metric ''`` is a typo, not a choice."""
    for name, example in (("loss", "mymodule:my_loss"), ("metric", "accuracy")):
        value = getattr(cfg, name)
        if isinstance(value, str) and not value.replace(",", "").strip():
            raise PhalanxError(f"{flag(name)} is empty ({value!r}); name one, e.g. {flag(name)} {example}, "
                               f"or drop {flag(name)} for the default")


def check_counts(cfg: TrainConfig) -> None:
    if cfg.steps is not None and not isinstance(cfg.steps, bool) and isinstance(cfg.steps, int) \
            and cfg.steps > MAX_STEPS:
        raise PhalanxError(f"--steps {cfg.steps} is more than a run can take (at most {MAX_STEPS:,}); give "
                           "fewer, e.g. --steps 1000")
    for name in ("batch_size", "accumulate", "log_every", "keep_checkpoints"):
        _positive_int(name, getattr(cfg, name))
    for name in ("steps", "lr_decay_every", "lr_base_batch", "synthetic_size"):
        if getattr(cfg, name) is not None:
            _positive_int(name, getattr(cfg, name))
    for name in ("workers", "threads"):
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise PhalanxError(f"--{name} must be at least 1, got {value!r}")
    for name in ("eval_every", "checkpoint_every", "warmup_steps", "seed", "max_restarts", "loader_workers",
                 "prefetch"):
        value = getattr(cfg, name)
        if value is None and (name in PLAIN_DEFAULTS or name == "prefetch"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PhalanxError(f"{flag(name)} must be 0 or more, got {value!r}")
    if cfg.batch_size % cfg.accumulate:
        raise PhalanxError(
            f"--batch-size {cfg.batch_size} does not split into --accumulate {cfg.accumulate} equal "
            f"micro-batches ({cfg.batch_size} / {cfg.accumulate} = {cfg.batch_size / cfg.accumulate:g})"
        )
    if cfg.synthetic_shape is not None and (not cfg.synthetic_shape or any(s < 1 for s in cfg.synthetic_shape)):
        raise PhalanxError(f"--synthetic-shape {tuple(cfg.synthetic_shape)}: every dimension must be at least 1")
    if cfg.synthetic_size is not None and cfg.synthetic_size < 10:
        raise PhalanxError(f"--synthetic-size {cfg.synthetic_size} is too small: a fifth is held out for "
                           "testing; use at least 10")


def check_choices(cfg: TrainConfig) -> None:
    for name, choices in (("optimizer", OPTIMIZERS), ("lr_schedule", SCHEDULES), ("progress", PROGRESS),
                          ("model", tuple(MODELS)), ("data", DATASETS), ("precision", PRECISIONS)):
        value = getattr(cfg, name)
        if name in ("optimizer", "model", "data") and isinstance(value, str) and ":" in value:
            continue  # an import path, resolved (or refused in one line) when the task is built
        if value is not None and value not in choices:
            what = {"optimizer": "optimizer", "model": "model", "data": "data set"}.get(name, flag(name))
            raise PhalanxError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")


def check_numbers(cfg: TrainConfig) -> None:
    if cfg.lr is not None and not (isinstance(cfg.lr, (int, float)) and 0 < cfg.lr < math.inf):
        raise PhalanxError(f"--lr must be positive and finite, got {cfg.lr}")
    if cfg.momentum is not None and not 0 <= cfg.momentum < 1:
        raise PhalanxError(f"--momentum must be in [0, 1) (0.9 is usual), got {cfg.momentum}")
    if cfg.weight_decay is not None and not 0 <= cfg.weight_decay < math.inf:
        raise PhalanxError(f"--weight-decay must be 0 or a small positive number (e.g. 5e-4), "
                           f"got {cfg.weight_decay}")
    if cfg.validation_split is not None and not 0 < cfg.validation_split < 1:
        raise PhalanxError(f"--validation-split must be a fraction in (0, 1), e.g. 0.1, got {cfg.validation_split}")
    if cfg.clip_grad_norm is not None and not (isinstance(cfg.clip_grad_norm, (int, float))
                                                and 0 < cfg.clip_grad_norm < math.inf):
        raise PhalanxError(f"--clip-grad-norm must be a positive, finite norm (e.g. 1.0), got {cfg.clip_grad_norm}")
    if cfg.lr_scheduler is not None and not (isinstance(cfg.lr_scheduler, str) and ":" in cfg.lr_scheduler):
        raise PhalanxError(f"--lr-scheduler {cfg.lr_scheduler}: write MODULE:CALLABLE, a function of the "
                           "optimizer returning a torch LR scheduler (e.g. mymod:one_cycle)")
    if cfg.lr_decay_factor is not None and not 0 < cfg.lr_decay_factor <= 1:
        raise PhalanxError(f"--lr-decay-factor must be in (0, 1], got {cfg.lr_decay_factor}")
    if cfg.stop_at_accuracy is not None:
        if not (isinstance(cfg.stop_at_accuracy, (int, float)) and 0 < cfg.stop_at_accuracy <= 1):
            raise PhalanxError(f"--stop-at-accuracy must be in (0, 1], e.g. 0.95, got {cfg.stop_at_accuracy}")
        if cfg.stop_at is not None:
            raise PhalanxError(f"--stop-at {cfg.stop_at} and --stop-at-accuracy {cfg.stop_at_accuracy:g} both "
                               "set a target: give one")
    if cfg.target is not None and not cfg.eval_every:
        flag = "--stop-at" if cfg.stop_at is not None else "--stop-at-accuracy"
        raise PhalanxError(f"{flag} needs evaluations during training: add --eval-every N (e.g. 20)")
    if not 0 < cfg.timeout_s < math.inf:
        raise PhalanxError(f"--timeout must be a positive number of seconds, got {cfg.timeout_s}")
    if not 0 <= cfg.hang_timeout_s < math.inf:
        raise PhalanxError(f"--hang-timeout must be 0 (never) or a number of seconds, got {cfg.hang_timeout_s}")


def check_applicable(cfg: TrainConfig) -> None:
    """A value given for an option that does nothing with the chosen setting is refused."""
    if isinstance(cfg.optimizer, str) and ":" in cfg.optimizer:  # a factory sets its own lr and decay
        for name in ("lr", "weight_decay", "lr_base_batch"):
            if getattr(cfg, name) is not None:
                raise PhalanxError(f"{flag(name)} applies to the built-in optimizers ({', '.join(OPTIMIZERS)}); "
                                   f"--optimizer {cfg.optimizer} builds its own: set it there, or drop "
                                   f"{flag(name)}")
    if cfg.lr_scheduler is not None:
        for name in OWN_SCHEDULE:
            if getattr(cfg, name) is not None:
                raise PhalanxError(f"--lr-scheduler {cfg.lr_scheduler} replaces phalanx's own schedule, and "
                                   f"{flag(name)} sets that one: drop {flag(name)}, or --lr-scheduler")
    for name, (setting, applies_to, _) in ONLY_FOR.items():
        value = getattr(cfg, name)
        chosen = getattr(cfg, setting)
        chosen = PLAIN_DEFAULTS.get(setting) if chosen is None else chosen
        if value is None or chosen is None or chosen in applies_to:
            continue
        raise PhalanxError(f"{flag(name)} applies to {flag(setting)} {' or '.join(applies_to)}, and this run "
                           f"has {flag(setting)} {chosen}; drop {flag(name)} or set {flag(setting)} "
                           f"{applies_to[0]}")


_PATH_EXAMPLES = {"checkpoint_dir": "--checkpoint-dir checkpoints", "metrics": "--metrics metrics.jsonl",
                  "data_dir": "--data-dir cifar-10-batches-bin", "resume": "--resume checkpoints/step-00000100.pt",
                  "tensorboard": "--tensorboard runs",
                  "init_from": "--init-from pretrained/step-00000300.pt"}


def flag(name: str) -> str:
    return {"timeout_s": "--timeout", "hang_timeout_s": "--hang-timeout"}.get(name, "--" + name.replace("_", "-"))


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PhalanxError(f"{flag(name)} must be a positive integer, got {value!r}")
