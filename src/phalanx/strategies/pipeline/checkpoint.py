"""A pipeline stage's checkpoints: whole (gathered to rank 0) or sharded (each rank its own part).

Who talks to whom: :meth:`StageCheckpoints.state_dict` gathers replica 0's stages to rank 0 over its
pipeline group (one ``gather_object``); a sharded checkpoint is written and read by every rank alone,
under the unsplit model's names (torch's distributed checkpoint, as fsdp's: see ``checkpoint/dcp.py``),
so any partition, stage count or strategy reads it. The optimizer state's numbering and renaming is
``state.py``'s; this module is what the runtime does with it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...checkpoint import ALIASES, model_aliases
from ...data.batch import to_cpu
from ..base import Build, Runtime, load_model_state
from . import state as opt_state
from .split import StageModule
from .traced import TracedStage


class StageCheckpoints(Runtime):
    """The checkpoint half of :class:`~phalanx.strategies.pipeline.runtime.PipelineRuntime`: saving and loading
    this stage's weights and optimizer state. It reads what the runtime sets up (its place on the mesh, its
    stage module, the split); it adds no state of its own but the cached param groups."""

    build: Build
    stages: int
    replica: int
    pipelined: bool  #: False: one stage, the whole model in-process
    pipe_group: Any  #: this replica's pipeline (None: the default group)
    traced: Optional[TracedStage]  #: the model split by tracing (None: cut at its blocks)
    stage_module: nn.Module
    local_to_global: list[int]  #: the whole model's parameter index of each of this stage's optimizer's
    _groups: Optional[list[list[str]]]  #: see _whole_groups

    def _cut_stage(self) -> StageModule:
        """This rank's stage where the model was cut at its blocks (not traced): its blocks as one module."""
        assert isinstance(self.stage_module, StageModule), "a pipelined stage cut at its blocks is a StageModule"
        return self.stage_module

    def state_dict(self) -> Optional[dict[str, Any]]:
        """Rank 0 gets the whole model's state_dict and one optimizer state (see ``pipeline/state.py``).

        Called on every rank; only replica 0's stages take part (replicas hold the same state).
        """
        if not self.pipelined:
            return super().state_dict()
        if self.replica != 0:
            return None  # every replica holds the same weights and optimizer state: replica 0's are saved
        weights = self.traced.state() if self.traced is not None else self._cut_stage().full_state_dict()
        part = (weights, opt_state.to_global(self.optimizer.state_dict(), self.local_to_global))
        parts: Optional[list] = [None] * self.stages if self.ctx.rank == 0 else None
        dist.gather_object(part, parts, dst=0, group=self.pipe_group)  # replica 0's pipeline; rank 0 is stage 0
        if parts is None:
            return None
        # Traced: the whole model's keys in its order, a parameter no stage uses as it started (nothing moved it).
        model = dict(to_cpu(self.build.model.state_dict())) if self.traced else {}
        for weights, _ in parts:
            model.update(weights)
        return {"model": model, "optimizer": opt_state.merge([o for _, o in parts])}

    @property
    def writes_shards(self) -> bool:
        # On 2+ workers (stages or replicas): each rank its own part, none holding the whole model's state.
        return self.ctx.distributed

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's part of the checkpoint, under the unsplit model's keys: its stage's parameters and
        buffers, and their optimizer state by parameter name (see ``pipeline/state.py``). Local: no collective.

        What several ranks hold alike, DCP writes once (its save plan keeps one rank's copy of an entry that
        several ranks name): a stage's replicas (equal after every step), a tied weight on two stages (equal:
        its gradients are summed between them), the optimizer's param groups (every rank lists the unsplit
        optimizer's). A tied weight's second key (``aliases``) is not saved again: readers restore it."""
        local = opt_state.by_name(self.optimizer.state_dict(), self._local_names(), self._whole_groups())
        aliases = model_aliases(self.build.model)  # (the whole model's: the same entry on every rank)
        model = {key: value for key, value in self._stage_state().items() if key not in aliases}
        return {"model": model, "optimizer": local, ALIASES: aliases}

    def _stage_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under the unsplit model's keys."""
        if not self.pipelined:
            return self.stage_module.state_dict()
        return self.traced.state() if self.traced is not None else self._cut_stage().full_state_dict()

    def _local_names(self) -> list[str]:
        """The unsplit model's name of each parameter of this stage's optimizer, in its order."""
        names = [name for name, _ in self.build.model.named_parameters()]  # (model.parameters()'s order)
        return [names[i] for i in self.local_to_global]

    def _whole_groups(self) -> list[list[str]]:
        """The names in each param group of the optimizer the user's factory makes for the unsplit model (its
        order is what a plain optimizer numbers by: sync reads the checkpoint in it). Made once, with no state."""
        if self._groups is None:
            whole = self.optimizer if not self.pipelined else self.build.make_optimizer(self.build.model)
            self._groups = opt_state.group_names(whole, self.build.model)
        return self._groups

    def _load_shards(self, state: dict[str, Any]) -> None:
        """This rank reads its own part of a sharded checkpoint by name, whatever partition, stage count or
        strategy wrote it (the keys are the unsplit model's); nothing else is read, no collective."""
        names = self._local_names()
        weights, optimizer = opt_state.read_part(state["shards"], list(self._stage_state()), names,
                                                 model_aliases(self.build.model), "optimizer" in state["shard_keys"])
        self._load_weights(weights)
        if optimizer is not None:
            self.optimizer.load_state_dict(opt_state.from_names(optimizer, names, self.optimizer))

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """This stage's parameters and buffers from ``weights`` (the unsplit model's keys: all, or this stage's)."""
        if not self.pipelined:
            load_model_state(self.stage_module, weights)
        elif self.traced is not None:  # the stage's tensors are the model's own (the rest as they are: unused here)
            load_model_state(self.build.model, {**self.build.model.state_dict(), **weights})
        else:
            self._cut_stage().load_full_state_dict(weights)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every stage takes its blocks' weights and its parameters' optimizer state: from a sharded
        checkpoint its own part only (:meth:`_load_shards`), from a whole one its share."""
        if "shards" in state:
            return self._load_shards(state)
        if not self.pipelined:
            return super().load_state_dict(state)
        self._load_weights(state["model"])
        if "optimizer" in state:  # absent: the run changed optimizers and starts this one fresh
            self.optimizer.load_state_dict(opt_state.split(state["optimizer"], self.local_to_global))
