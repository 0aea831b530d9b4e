"""Inside a worker: the run's checkpoints, saved at a step and restored at the start.

Every rank takes part in a save (the RNG states of ranks in step, a sharded checkpoint's shards and its
parameters' shapes are collectives); rank 0 writes a single file (``checkpoint/pt.py``), or every rank its
own shards (``checkpoint/dcp.py``; ``--async-checkpoint``: written in the background).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..data.loader import Position
from ..checkpoint import ALIASES, ShardWriter
from .. import checkpoint as ckpt
from .resume import data_position, restore_settings, settings_of


def restore(runtime: Any, state: dict[str, Any], fresh_optimizer: bool, rank: int,
            examples: int) -> tuple[int, Position]:
    """Parameters, optimizer state (unless the optimizer changed), data position and RNG of a checkpoint
    written by any strategy on any worker count; the hyperparameters stay this run's. Returns its step and
    data position (``examples``: the training set's length)."""
    for group in runtime.optimizer.param_groups:  # as a scheduled optimizer's, like the saved ones
        group.setdefault("initial_lr", group["lr"])  # (fsdp's loader wants the same keys in both)
    settings = [{k: v for k, v in group.items() if k != "params"} for group in runtime.optimizer.param_groups]
    if fresh_optimizer:
        state = ckpt.without_optimizer(state)
    if not runtime.writes_shards:  # a sharded checkpoint, read whole into this runtime's whole model
        state = ckpt.tensors(state)
    runtime.load_state_dict(state)
    restore_settings(runtime.optimizer, settings)
    rng = state.get("rng") or []
    if rank < len(rng) and rng[rank] is not None:  # (None: a rank lost before the survivors saved)
        torch.set_rng_state(rng[rank])
    return int(state["step"]), data_position(state, examples)


def run_meta(ctx: Any, plan: Any, cfg: Any, data: Any, global_batch: int, model_class: str) -> dict[str, Any]:
    """What every checkpoint of the run records of it (``parameter_shapes``: filled in at each save)."""
    return {"world_size": ctx.world_size, "workers": plan.workers, "batch_size": cfg.batch_size,
            "accumulate": cfg.accumulate, "global_batch": global_batch,
            "model": plan.task.model_name, "data": plan.task.data_name,
            "training_step": cfg.training_step, "target_key": cfg.target_key,
            "model_class": model_class,
            "parameter_shapes": None,
            "strategy": cfg.strategy.name,
            "seed": cfg.seed, "input_shape": list(data.input_shape),
            "num_classes": data.num_classes, "settings": settings_of(cfg)}


class Checkpointer:
    """This rank's part of every checkpoint of the run, and the seconds the saves held the training up.

    ``meta``: what every checkpoint records of the run (its settings, model and data; the parameters' shapes
    are added at each save); ``resumed``: the checkpoint the run started from (path, step), if any."""

    def __init__(self, ctx: Any, runtime: Any, layout: Any, cfg: Any, meter: Any, run_id: str, meta: dict[str, Any],
                 resumed: Optional[tuple[str, int]] = None):
        self.ctx, self.runtime, self.layout, self.cfg, self.meter = ctx, runtime, layout, cfg, meter
        self.run_id, self.meta = run_id, meta
        # Each rank writes its own shard of a checkpoint where the runtime holds one (else rank 0 one file).
        self.shard_writer = ShardWriter(ctx, cfg.async_checkpoint) if runtime.writes_shards else None
        self.blocked_s = 0.0  #: the seconds checkpoints held the training up (on this rank)
        self.last: Optional[str] = resumed[0] if resumed else None  #: the newest checkpoint (written or resumed)
        self.saved_step: Optional[int] = resumed[1] if resumed else None  #: its step

    def save(self, step: int, scheduler: dict[str, Any], position: Position,
             on_nonfinite: Callable[[float, int], None]) -> Optional[dict]:
        """Every rank: the checkpoint of ``step``, with the loop's own state (the scheduler's, the data
        position); ``on_nonfinite(loss, step)`` where the weights are not finite. Returns what the metrics
        file records of it (None on ranks other than rank 0)."""
        began = time.perf_counter()
        with self.meter.aside():  # gathering a checkpoint is not a training step's traffic
            path = self._write(step, scheduler, position, on_nonfinite)
        # What the step waited for: the whole save (a file; every rank's shards), or under --async-checkpoint
        # the save before it still in flight and the copy of this rank's shards to CPU memory.
        blocked = time.perf_counter() - began
        self.blocked_s += blocked
        if path is None:
            return None
        return dict(step=step, path=path, checkpoint_blocked_s=round(blocked, 6),
                    **({"in_background": True} if self.cfg.async_checkpoint else {}))

    def wait_for_save(self) -> None:
        """Until the checkpoint in flight (--async-checkpoint) is written; its time counts as blocked."""
        if self.shard_writer is not None and self.shard_writer.pending is not None:
            began = time.perf_counter()
            self.shard_writer.wait()
            self.blocked_s += time.perf_counter() - began

    def _write(self, step: int, scheduler: dict[str, Any], position: Position,
               on_nonfinite: Callable[[float, int], None]) -> Optional[str]:
        """Every rank: this step's checkpoint; the path rank 0 wrote (None on the others)."""
        # The loss of this step was finite, but its update may not be: never save such weights.
        self.ctx.progress.at(step, "checkpointing")
        if not all(torch.isfinite(p).all() for p in self.runtime.module.parameters()):
            on_nonfinite(float("nan"), step)
        shards = self.shard_writer is not None
        state = self.runtime.shard_state_dict() if shards else self.runtime.state_dict()
        rng = self._rng()
        path = str(ckpt.checkpoint_path(self.cfg.checkpoint_dir, step, sharded=shards))
        self.last, self.saved_step = path, step
        if state is None:  # (a rank whose part rank 0 gathered, e.g. a pipeline's later stage: nothing to write)
            return None
        small = self._small(step, rng, scheduler, position, self._shapes(state))
        if self.shard_writer is not None:  # every rank writes its own shards; rank 0 adds the small state, seals
            self.shard_writer.save(state, small, self.cfg.checkpoint_dir, step, self.cfg.keep_checkpoints)
        elif self.ctx.is_main:
            ckpt.save_checkpoint({**small, **state}, self.cfg.checkpoint_dir, step, self.cfg.keep_checkpoints)
        return path if self.ctx.is_main else None

    def save_alone(self, step: int, state: dict[str, Any], rng: list, scheduler: dict[str, Any], position: Position,
                   **extra: Any) -> str:
        """The checkpoint of ``step``, whole, written by this rank with no collective (a survivor of a lost peer:
        ``state`` and every rank's ``rng`` came without the job's group); the same file, digest and atomic
        rename as any other. ``extra``: what else it records (who survived). Returns its path."""
        shapes = {name: list(t.shape) for name, t in state["model"].items()}
        small = self._small(step, rng, scheduler, position, shapes)
        path = ckpt.save_checkpoint({**small, **extra, **state}, self.cfg.checkpoint_dir, step,
                                    self.cfg.keep_checkpoints)
        self.last, self.saved_step = str(path), step
        return str(path)

    def _small(self, step: int, rng: list, scheduler: dict[str, Any], position: Position,
               shapes: dict[str, list[int]]) -> dict[str, Any]:
        """Everything a checkpoint holds besides the model and optimizer state."""
        return {"format": ckpt.FORMAT, "step": step, "run_id": self.run_id, **scheduler, "rng": rng,
                "meta": {**self.meta, "parameter_shapes": shapes},
                "data_position": {"epoch": position.epoch, "examples_in_epoch": position.offset}}

    def _rng(self) -> list:
        """This rank's RNG state; every rank's where the ranks are in step (each resumes its own)."""
        rng = [torch.get_rng_state()]
        if self.ctx.distributed and self.layout.lockstep:
            gathered: list = [None] * self.ctx.world_size
            dist.all_gather_object(gathered, rng[0])
            rng = gathered
        return rng

    def _shapes(self, state: dict[str, Any]) -> dict[str, list[int]]:
        """Every tensor of the model, by name, and its shape: rank 0 records them all, also where each rank saves
        a part of the model only (a pipeline's stage: one small all-gather of the names and shapes), and a tied
        weight's every name (a pipeline's sharded checkpoint saves it once: ``checkpoint.ALIASES``)."""
        shapes = {name: list(t.shape) for name, t in state["model"].items()}
        shapes.update({alias: shapes[key] for alias, key in state.get(ALIASES, {}).items() if key in shapes})
        if self.shard_writer is None or not self.ctx.distributed:
            return shapes
        parts: list = [None] * self.ctx.world_size
        dist.all_gather_object(parts, shapes)
        return {name: shape for part in parts for name, shape in part.items()}

    def close(self) -> None:
        if self.shard_writer is not None:
            self.shard_writer.close()
