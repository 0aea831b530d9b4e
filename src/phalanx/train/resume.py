"""What a resumed run takes from its checkpoint and what from its flags (pure: no processes).

A checkpoint holds the whole model's ``state_dict``, the optimizer state in a plain optimizer's
numbering (every strategy saves it so: see ``strategies/fsdp/state.by_index`` and ``strategies/pipeline/state.py``), the
step, the position in the data (examples consumed) and the settings the run used. That is
enough to continue on another worker count and under any other strategy. The rules:

- every optimisation setting the user gave (``TrainConfig._given``) wins over the checkpoint's,
  and the header names each one that changed; the others continue as the checkpoint has them;
- another optimizer (``--optimizer adam`` on an SGD checkpoint) starts from a fresh optimizer
  state, with one line saying so: the parameters, step, schedule and data position still carry
  over, which is why it is not refused; SGD's momentum has no meaning for Adam's moments;
- the per-worker batch stays and the global batch follows the worker count (the learning rate
  follows it only under ``--lr-base-batch``); ``--keep-global-batch`` keeps the global batch
  and adapts the per-worker batch (and ``--accumulate``, so the micro-batch never grows).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from ..data.loader import Position, advance
from ..errors import PhalanxError
from ..checkpoint import shapes
from .config import TrainConfig
from .config_checks import OWN_SCHEDULE, SETTINGS, flag
from ..task.schedules import scaled_lr


@dataclasses.dataclass
class Resumed:
    """The run's config with the checkpoint's settings filled in, and what the header says of it."""

    config: TrainConfig
    lines: list[str]
    fresh_optimizer: bool  #: the optimizer changed: its state is not loaded


def settings_of(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a checkpoint records (``meta["settings"]``)."""
    return {name: getattr(cfg, name) for name in SETTINGS}


def recorded_settings(state: dict[str, Any]) -> dict[str, Any]:
    """The settings the checkpoint's run used; older checkpoints: read back from its optimizer and schedule."""
    meta = state.get("meta", {})
    if "settings" in meta:
        return dict(meta["settings"])
    group = state["optimizer"]["param_groups"][0]
    found = {"optimizer": "adam" if "betas" in group else "sgd", "weight_decay": group.get("weight_decay", 0.0)}
    if "momentum" in group:
        found["momentum"] = group["momentum"]
    scheduler = state.get("scheduler") or {}
    if scheduler.get("base_lrs"):
        found["lr"] = scheduler["base_lrs"][0]  # already scaled by the batch rule, if there was one
    schedule = (scheduler.get("lr_lambdas") or [None])[0]
    if isinstance(schedule, dict):  # LambdaLR saved the Schedule's fields
        names = {"kind": "lr_schedule", "decay_every": "lr_decay_every", "decay_factor": "lr_decay_factor",
                 "staircase": "staircase", "warmup_steps": "warmup_steps"}
        found.update({names[k]: v for k, v in schedule.items() if k in names})
    return found


def recorded_batch(state: dict[str, Any]) -> tuple[int, int, int]:
    """(global batch, per-worker batch, accumulate) the checkpoint's run used."""
    meta = state.get("meta", {})
    batch = int(meta.get("batch_size", 1))
    global_batch = int(meta.get("global_batch") or batch * int(meta.get("workers") or 1))
    return global_batch, batch, int(meta.get("accumulate", 1))


def data_position(state: dict[str, Any], size: int) -> Position:
    """Where the checkpoint's run was in its data (older checkpoints counted batches of their global batch)."""
    where = state.get("data_position") or {}
    if "examples_in_epoch" in where:
        return Position(int(where["epoch"]), int(where["examples_in_epoch"]))
    global_batch, _, _ = recorded_batch(state)
    if "batch_in_epoch" in where:
        return Position(int(where["epoch"]), int(where["batch_in_epoch"]) * global_batch)
    return advance(Position(0, 0), int(state["step"]), size, global_batch)


def resume_config(cfg: TrainConfig, state: dict[str, Any], shards: int) -> Resumed:
    """The config a run resumed from ``state`` on ``shards`` data shards uses, and its header lines."""
    recorded = recorded_settings(state)
    taken = {name: value for name, value in recorded.items() if name in SETTINGS and name not in cfg._given}
    if any(name in cfg._given for name in OWN_SCHEDULE):  # phalanx's own schedule asked for: not the checkpoint's
        taken.pop("lr_scheduler", None)                   # scheduler of the user's, which would replace it
    batch, accumulate = batch_for(cfg, state, shards)
    run = dataclasses.replace(cfg, **taken, batch_size=batch, accumulate=accumulate)
    fresh = recorded.get("optimizer", run.optimizer) != run.optimizer
    lines = [line for line in [_batch_line(run, state, shards)] if line]
    for name in cfg._given:
        if name in recorded and recorded[name] != getattr(run, name) and name != "optimizer":
            lines.append(f"{flag(name)} {_show(getattr(run, name))} replaces the checkpoint's "
                         f"{_show(recorded[name])}")
    if fresh:
        lines.append(f"--optimizer {run.optimizer} replaces the checkpoint's {recorded['optimizer']}: {run.optimizer} "
                     f"starts from a fresh state ({recorded['optimizer']}'s does not translate); the parameters, "
                     "step, schedule and data position carry over")
    return Resumed(run, lines, fresh)


def batch_for(cfg: TrainConfig, state: dict[str, Any], shards: int) -> tuple[int, int]:
    """(per-worker batch, accumulate) on ``shards`` shards: this run's, or under ``--keep-global-batch`` the
    checkpoint's global batch split over them; refused with the arithmetic where it does not split."""
    old_global, old_batch, old_accumulate = recorded_batch(state)
    if not cfg.keep_global_batch or old_global == cfg.batch_size * shards:
        return cfg.batch_size, cfg.accumulate
    if old_global % shards:
        below = [n for n in range(1, shards) if old_global % n == 0][-1:]
        above = [n for n in range(shards + 1, old_global + 1) if old_global % n == 0][:1]
        hint = f" (it splits over {' or '.join(map(str, below + above))})"
        raise PhalanxError(f"global batch {old_global} cannot be kept on {shards} workers: {old_global} / {shards} "
                           f"is not whole; resume on another worker count{hint}, or without --keep-global-batch "
                           f"(global batch {cfg.batch_size * shards})")
    batch = old_global // shards
    # The fewest micro-batches whose size stays within the checkpoint's: memory per forward never grows.
    micro = old_batch // old_accumulate
    accumulate = next(a for a in range(1, batch + 1) if batch % a == 0 and batch // a <= micro)
    return batch, accumulate


def _batch_line(run: TrainConfig, state: dict[str, Any], shards: int) -> Optional[str]:
    """``resuming at step 20 with global batch 96 (was 64): ...``; None when the batch is as it was."""
    old_global, old_batch, old_accumulate = recorded_batch(state)
    new_global = run.batch_size * shards
    head = f"resuming at step {state['step']} with global batch {new_global}"
    micro = f", --accumulate {run.accumulate} (was {old_accumulate})" if run.accumulate != old_accumulate else ""
    if new_global == old_global:
        if run.batch_size == old_batch:
            return None
        kept = " (--keep-global-batch)" if run.keep_global_batch else ""
        return f"{head} as before{kept}: {run.batch_size} per worker x {shards} (was {old_batch} per worker){micro}"
    stays = f"the per-worker batch stays {run.batch_size}" if run.batch_size == old_batch else (
        f"{run.batch_size} per worker (the checkpoint's {old_batch}: --batch-size {old_batch} keeps it)")
    return f"{head} (was {old_global}): {stays}; {_lr_rule(run, old_global, new_global)}; " \
           f"--keep-global-batch keeps {old_global}"


def _lr_rule(run: TrainConfig, old_global: int, new_global: int) -> str:
    assert run.lr is not None, "a resolved run has its lr"
    if run.lr_base_batch is None:
        return f"lr {run.lr:g}, not scaled (--lr-base-batch would scale it with the global batch)"
    now = scaled_lr(run.lr, new_global, run.lr_base_batch)
    was = scaled_lr(run.lr, old_global, run.lr_base_batch)
    return f"lr {run.lr:g} x {new_global} / {run.lr_base_batch} = {now:g} (--lr-base-batch; was {was:g})"


def settings_line(run: TrainConfig) -> str:
    """The header's recipe line on a resume: ``settings: sgd, lr 0.01, 300 steps (the checkpoint's; ...)``."""
    given = [name for name in ("optimizer", "lr") if name in run._given]
    told = f"; set by flags: {', '.join(given)}" if given else "; any flag overrides"
    return f"settings: {run.optimizer}, lr {run.lr:g}, {run.steps} steps (the checkpoint's{told})"


def _show(value: Any) -> str:
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_fits(state: dict[str, Any], model: nn.Module, path: str, fix: str = "resume") -> None:
    """The checkpoint holds this model's parameters, or one line naming the first that differs; ``fix``:
    what to do with it (resume, start from it, evaluate it) with the model it was trained with."""
    saved, here = shapes(state), model.state_dict()
    for name, tensor in here.items():
        if name not in saved:
            why = f"this model's {name} is not in it"
        elif saved[name] != tuple(tensor.shape):
            why = f"{name} is {saved[name]} there and {tuple(tensor.shape)} here"
        else:
            continue
        raise PhalanxError(f"checkpoint {path} holds another model ({why}); {fix} with the model and data it was "
                           f"trained with{trained_with(state)}")
    extra = [name for name in saved if name not in here]
    if extra:
        raise PhalanxError(f"checkpoint {path} holds another model (its {extra[0]} is not in this one); {fix} with "
                           f"the model and data it was trained with{trained_with(state)}")


def trained_with(state: dict[str, Any]) -> str:
    """`` (--model gpt:make --data gpt:load --training-step gpt:step)``: the flags that name the checkpoint's
    task, as its run recorded them (empty where an older checkpoint did not, or a model object had no name)."""
    meta = state.get("meta", {})
    flags = [f"--{flag.replace('_', '-')} {meta[flag]}" for flag in ("model", "data", "training_step", "target_key")
             if meta.get(flag)]
    return f" ({' '.join(flags)})" if flags else ""


def restore_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """Put the run's hyperparameters back into param groups that a checkpoint's state overwrote, so
    the config in force (flags, else the checkpoint's settings) is what the optimizer uses."""
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)
        group["initial_lr"] = mine["lr"]  # where the schedule starts from (LambdaLR reads it on resume)
