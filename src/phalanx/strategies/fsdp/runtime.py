"""fsdp's runtime: one rank's shard of every block (FSDP2's ``fully_shard``), the plain model when alone.

Who talks to whom (see the package's docstring): every block's parameters are all-gathered before its
forward and backward and its gradients reduce-scattered after; the gradient norm is one small
all-reduce; an evaluation broadcasts rank 0's buffers and sums the counts. Checkpoints are sharded
(torch's distributed checkpoint), or gathered whole to rank 0 in a plain optimizer's numbering
(``state.py``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...data.batch import head
from ...errors import PhalanxError
from ...checkpoint import ALIASES, read_entries, with_aliases
from ...task.metrics import FORWARD_ONLY, Totals, add_up
from ...task.models import describe_blocks
from .. import meta_init
from ..base import COUNT_CORRECT, Batch, Build, Report, Runtime
from ..replicas import broadcast_buffers, contiguous_buffers, verify_replicas
from . import tensor_parallel
from .state import by_index, by_name
from .units import shard_units

if TYPE_CHECKING:
    from . import FSDP


class FSDPRuntime(Runtime):
    """One rank's shard of every block (and its tensor-parallel slice of them); the plain model when alone."""

    one_batch = True  # (the reduce-scatter averages every rank's gradients before each update)

    def __init__(self, build: Build, options: FSDP):
        ctx, model = build.ctx, build.model
        self.ctx = ctx  # (the notes below read it before Runtime.__init__ sets it again)
        self.units = shard_units(model, options.blocks)
        tp = options.tensor_parallel
        self.tp_plan = tensor_parallel.model_plan(model, self.units, tp) if tp > 1 else {}
        on_meta = meta_init.on_meta(model)
        if ctx.distributed and not on_meta:
            # fully_shard keeps each rank's own slice of its own copy (no broadcast from rank 0), so
            # replicas built differently would silently train a patchwork: check, as sync does. (A model
            # built on meta is materialised from one seed in one order on every rank: equal by construction.)
            verify_replicas(model, ctx)
        contiguous_buffers(model)  # (broadcast before every evaluation: any layout must survive it)
        self.shard_mesh, self.tp_mesh = (tensor_parallel.meshes(ctx.device.type, ctx.world_size, tp)
                                         if ctx.distributed else (None, None))
        # bf16 on a GPU: bf16 gathers and compute, fp32 reductions (None: the parameters' own dtype throughout)
        self.policy = build.precision.sharded_policy() if ctx.distributed else None
        self.materialised = self._shard(model, options, on_meta, ctx.device)
        if not ctx.distributed:
            super().__init__(build, description="fsdp (one process: nothing to shard)", notes=self._meta_note())
            return
        super().__init__(build, model, description=options.describe(), notes=self._plan_notes(options))

    def _shard(self, model: nn.Module, options: FSDP, on_meta: bool, device: torch.device) -> int:
        """Unit by unit: materialise it (a model built on meta), split its layers (tensor parallel), shard it; then
        the root. Returns the bytes materialised (0: the model was built whole)."""
        from torch.distributed.fsdp import fully_shard

        init, made = options.init_fn() if on_meta else None, 0
        declared = meta_init.declared_init(model) if on_meta else {}  # (read on the whole model: units are parts)
        mixed = {"mp_policy": self.policy} if self.policy is not None else {}
        if on_meta:
            meta_init.reseed()
        # fully_shard goes bottom-up: a unit nested in another must be wrapped first.
        for name, block in sorted(self.units, key=lambda unit: -unit[0].count(".")):
            if on_meta:  # this unit whole, then at once only this rank's shard of it: one unit at a time
                made += meta_init.materialise(block, device, init, name, declared)
            if self.tp_mesh is not None:
                tensor_parallel.apply(block, self.tp_plan[name], self.tp_mesh)
            if self.shard_mesh is not None:
                fully_shard(block, mesh=self.shard_mesh, reshard_after_forward=options.reshard_after_forward, **mixed)
        if on_meta:
            made += meta_init.materialise(model, device, init, declared=declared)
        if self.shard_mesh is not None:
            fully_shard(model, mesh=self.shard_mesh, **mixed)  # the root: what no block holds; stays gathered
        return made

    def _meta_note(self) -> list[str]:
        if not self.materialised:
            return []
        return [f"built on the meta device; materialised block by block on {self.ctx.device} "
                f"({self.materialised / 2**20:.1f} MiB, one block whole at a time)"]

    def _plan_notes(self, options: FSDP) -> list[str]:
        blocks = describe_blocks(self.units)
        gathers = ("gathered for forward, freed, gathered again for backward" if options.reshard_after_forward
                   else "gathered once per step (kept from forward to backward)")
        ctx, tp = self.ctx, options.tensor_parallel
        notes = []
        if self.shard_mesh is not None:
            over = (f"a 1-D mesh of {ctx.world_size} ranks" if tp == 1
                    else f"the shard dim of a 2-D mesh ({ctx.world_size // tp} ranks)")
            notes.append(f"fsdp plan: {len(self.units)} blocks ({blocks}) each sharded over {over} "
                         f"({ctx.device.type}, {ctx.backend}); parameters {gathers}")
        if self.tp_mesh is not None:
            notes.append(f"tensor parallel plan: mesh ({ctx.world_size // tp} shard x {tp} tp), every {tp} ranks "
                         f"split one replica and read one data shard; {tensor_parallel.describe(self.tp_plan)}")
        if self.policy is not None:
            notes.append("fsdp mixed precision: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): "
                         "blocks gathered and run in bf16, gradients reduce-scattered in fp32")
        return notes + self._meta_note()

    @property
    def sharded(self) -> bool:
        return self.ctx.distributed

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally (unsharded), reduce-scatter only after the last micro-batch."""
        return _no_gradient_sync(self.model) if self.shard_mesh is not None else contextlib.nullcontext()

    def gradient_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The whole model's gradient norm from this rank's shards: torch computes it on the DTensor gradients as
        a partial sum of every shard's; ``full_tensor`` adds those up over the mesh (one small all-reduce), so
        every rank clips by the same norm, the one the unsharded gradient has (as torchtitan does)."""
        if self.tp_mesh is not None:  # gradients on two meshes (blocks 2-D, the rest 1-D or plain)
            return tensor_parallel.gradient_norm(grads)
        norm = super().gradient_norm(grads)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip_gradients(self) -> None:
        if self.tp_mesh is None:
            return super().clip_gradients()
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.grad_norm = self.gradient_norm([p.grad for p in params])
        assert self.build.clip_grad_norm is not None, "called where the run clips (--clip-grad-norm)"
        tensor_parallel.clip(params, self.build.clip_grad_norm, self.grad_norm)

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch], totals: Totals = COUNT_CORRECT) -> tuple[float, ...]:
        """The sums and counts of ``totals`` over every rank's part of the test set.

        Every forward all-gathers each block (a collective), so every rank runs as many forwards
        as the rank with the most batches: a rank with fewer runs one-example forwards, uncounted.
        """
        if not self.sharded:
            return super().evaluate(batches, totals)
        broadcast_buffers(list(self.model.buffers()))
        batches = list(batches)
        most = torch.tensor([len(batches)], device=self.ctx.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        sums = add_up(self.model, batches, self.ctx.device, totals, self.build.step)
        source = batches[0] if batches else self.build.example
        missing = int(most) - len(batches)
        if missing and source is None:
            raise PhalanxError("fsdp evaluation: this rank has no test batch and no example batch to keep in step "
                               "with the others; give every rank a part of the test set")
        if missing:
            add_up(self.model, [head(source, 1)] * missing, self.ctx.device, FORWARD_ONLY, self.build.step)
        self._reshard()
        sums = sums.to(self.ctx.device)
        if self.tp_mesh is None:
            dist.all_reduce(sums)
        elif self.shard_mesh is not None:  # the tp ranks of a group evaluated the same part: count it once
            dist.all_reduce(sums, group=self.shard_mesh.get_group())
        return tuple(sums.tolist())

    def _reshard(self) -> None:
        """Free gathered parameters that a forward without backward left behind (eval, no reshard option)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # ---- checkpoints ----
    def state_dict(self) -> Optional[dict[str, Any]]:
        """The full model and optimizer state, gathered to rank 0 in a plain optimizer's numbering."""
        if not self.sharded:
            return super().state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # A collective on every rank; cpu_offload: only rank 0 receives the gathered tensors (on the CPU).
        model, optimizer = get_state_dict(self.model, self.optimizer,
                                          options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.ctx.rank != 0:
            return None
        return {"model": model, "optimizer": by_index(optimizer, self._names())}

    @property
    def writes_shards(self) -> bool:
        return self.sharded

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's shards (DTensors: nothing is gathered), keyed by parameter name, as torch's distributed
        checkpoint saves them; buffers (not sharded) as rank 0 holds them. A collective on every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        from torch.distributed.tensor import DTensor

        model, optimizer = get_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=False))
        # A buffer is a whole tensor on every rank, each rank's moved by its own batches; DCP writes one rank's
        # copy, not necessarily rank 0's. Copies of rank 0's, as a full checkpoint holds (the live ones stay).
        plain = {name: value for name, value in model.items() if isinstance(value, torch.Tensor)
                 and not isinstance(value, DTensor)}
        copies = [value.detach().clone() for value in plain.values()]
        broadcast_buffers(copies)
        model.update(zip(plain, copies))
        return {"model": model, "optimizer": optimizer}

    def _load_shards(self, path: str, keys: list[str]) -> None:
        """Every rank reads its part of each tensor of a sharded checkpoint, whatever worker count wrote it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        from ...checkpoint.safe_read import SafePlanner, SafeReader

        # The state dicts to fill in place: this rank's shards, with an optimizer state (torch makes one).
        target = {key: value for key, value in self.shard_state_dict().items() if key in keys}
        # A pipeline's checkpoint holds a tied weight once, under its first key: the others are filled from it.
        # (read_entries also refuses, in one line, a checkpoint that would run code when read)
        aliases = read_entries(path, [ALIASES]).get(ALIASES, {})
        dcp.load({**target, "model": {k: v for k, v in target["model"].items() if k not in aliases}},
                 storage_reader=SafeReader(path), planner=SafePlanner())
        target["model"] = with_aliases(target["model"], aliases)
        if "optimizer" in target:
            set_state_dict(self.model, self.optimizer, model_state_dict=target["model"],
                           optim_state_dict=target["optimizer"])
        else:  # the run changed optimizers: this one starts fresh
            set_model_state_dict(self.model, target["model"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every rank takes its shard of a checkpoint: a sharded one's shards (``state["shards"]``), or a full
        one's tensors (written by sync, a pipeline, a plain model or fsdp in one process)."""
        if not self.sharded:
            return super().load_state_dict(state)
        if "shards" in state:
            return self._load_shards(state["shards"], state["shard_keys"])
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        options = StateDictOptions(full_state_dict=True, strict=True)
        try:
            # Copies of the containers: set_state_dict writes this rank's DTensor shards into the
            # dicts it is given, and the caller's checkpoint must stay a plain one.
            if "optimizer" not in state:  # the run changed optimizers: this one starts fresh
                set_model_state_dict(self.model, _containers(state["model"]), options=options)
                return
            set_state_dict(self.model, self.optimizer, model_state_dict=_containers(state["model"]),
                           optim_state_dict=_containers(by_name(state["optimizer"], self._names())),
                           options=options)
        except (RuntimeError, KeyError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise PhalanxError(f"checkpoint does not fit this model ({first}); resume with the --model and data "
                               "the checkpoint was trained with") from None

    def _names(self) -> list[str]:
        """Parameter names in the optimizer's order: a plain optimizer's parameter i is names[i].

        A plain optimizer numbers its parameters by their position across its param groups; the
        same factory given the sharded parameters lists them in the same order.
        """
        name_of = {id(p): name for name, p in self.model.named_parameters()}
        return [name_of[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def report(self, final: bool = False) -> Report:
        tp = {"tensor_parallel": len(self.tp_mesh.mesh.flatten())} if self.tp_mesh is not None else {}
        return Report({"sharded_blocks": [name for name, _ in self.units] if self.shard_mesh is not None else [],
                       **tp})


def _containers(value: Any) -> Any:
    """A copy of nested dicts and lists that shares the tensors (nothing large is copied)."""
    if isinstance(value, dict):
        return {k: _containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_containers(v) for v in value]
    return value


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(model, FSDPModule), "fully_shard made the root an FSDPModule"
    model.set_requires_gradient_sync(False)  # recursive: every block of the model
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
