"""Sharded data parallelism: torch's ``fully_shard`` (FSDP2) is the engine.

Every rank trains on its own shard of the batch, as with ``sync``, but no rank keeps a whole
replica: each parameter (a :class:`~torch.distributed.tensor.DTensor` sharded on dim 0 over a
1-D device mesh of all ranks) lives 1/W on each rank, and so do its gradient and its optimizer
state, because the optimizer only ever sees the local shards. Each block of the model is one
unit of communication:

- forward: before a block runs, its parameters are all-gathered (one collective per block);
  after it, they are freed again (``--reshard-after-forward``, the default) or kept until backward;
- backward: the block's parameters are all-gathered again (when they were freed), its gradients
  computed, then reduce-scattered: every rank receives the average over ranks of its own shard;
- the optimizer steps on the local shards only; nothing else moves.

So W workers with batch B compute what one process computes with batch W·B (the equivalence
test checks this in float64 for SGD and Adam on 2 and 3 ranks), while each rank holds about 1/W
of the parameters, gradients and optimizer state, plus one gathered block at a time.

Blocks are the model's own structure: an ``nn.Sequential``'s children (every built-in model), a
``pipeline_blocks()`` method's modules, any other model's repeated blocks (the modules of one class that
a ``ModuleList`` or ``Sequential`` repeats: a transformer's layers; the rest stays with the root), else
its top-level children; or the submodules or classes named in ``FSDP(blocks=...)`` / ``--blocks``. A
model with no block holding parameters is refused. ``--precision bf16`` on a GPU gives every unit torch's
``MixedPrecisionPolicy`` (bf16 parameters in compute, fp32 reduce-scatter).

Checkpoints are sharded: every rank saves its own shards of the parameters and the optimizer state
with torch's distributed checkpoint (``get_state_dict`` with sharded state dicts, ``dcp.save``; see
``train/sharded.py``), and no rank gathers the whole model. Loading reads each rank's part of every
tensor, whatever worker count wrote it (DCP reshards); ``sync``, one process and ``phalanx
evaluate`` read the whole. A single-file checkpoint (sync's, a pipeline's, a plain model's) loads
too: every rank takes its shard of the full state dict. :meth:`FSDPRuntime.state_dict` still gives
the full model and optimizer state, gathered to rank 0 in a plain optimizer's numbering.

Buffers (BatchNorm's running statistics) are not sharded and never synced by ``fully_shard``: each
rank's move with its own batches. An evaluation first gives every rank rank 0's (DDP's rule, and what
the checkpoint holds), so every part of the test set is evaluated by the saved model.

One process (world size 1) runs the plain model, with no process group and nothing to shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .costs import FSDPCost
from ...simulate import LOCKSTEP
from ...errors import PhalanxError
from ...task.models import blocks_of_class, describe_blocks, model_units, repeated_blocks
from ...options import option
from ...data.batch import head
from ...task.metrics import FORWARD_ONLY, Totals, add_up
from ...shard_read import ALIASES, read_entries, with_aliases
from .. import meta_init
from . import tensor_parallel
from ..base import (COUNT_CORRECT, Batch, Build, Job, Layout, Options, Report, Runtime, data_parallel,
                   require_positive)
from ..registry import register
from ..replicas import broadcast_buffers, verify_replicas


def parse_blocks(value: Union[str, Iterable[str]]) -> tuple[str, ...]:
    """``"encoder,decoder"`` or ``["Block"]`` -> a tuple of submodule or class names."""
    names = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(n).strip() for n in names if str(n).strip())
    if not names:
        raise PhalanxError("--blocks names no submodule: give names like 'encoder,decoder' or a class like 'Block', "
                           "or leave it out")
    return names


def shard_units(model: nn.Module, names: Optional[tuple[str, ...]] = None) -> list[tuple[str, nn.Module]]:
    """(name, module) of every unit that ``fully_shard`` makes, in the model's order; a clear error if none.

    Only modules that hold parameters are units; parameters outside every unit stay with the root.
    """
    units = named_units(model, names) if names is not None else model_units(model)
    if not units:
        raise PhalanxError(
            f"{type(model).__name__} has no blocks to shard: fsdp shards each block (a submodule holding parameters) "
            "over the workers; make the model an nn.Sequential of blocks, give it submodules, or name them with "
            "FSDP(blocks=...) / --blocks"
        )
    if names is None and _tied(units):  # fully_shard refuses a parameter in two groups
        raise PhalanxError(f"{type(model).__name__}'s blocks ({describe_blocks(units)}) share a parameter (tied "
                           "weights); name blocks that do not with --blocks, leaving the shared one to the root")
    return units


def named_units(model: nn.Module, names: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The units ``--blocks`` names: a submodule by its name in ``named_modules()``, or every (outermost) module
    of a class by the class's name; holding parameters, each once."""
    units: dict[str, nn.Module] = {}
    for name in names:
        try:
            found = [(name, model.get_submodule(name))]
        except AttributeError:
            found = blocks_of_class(model, name)
        if not found:
            raise PhalanxError(f"--blocks names {name!r}, neither a submodule nor a module class of "
                               f"{type(model).__name__} ({_what_it_has(model)}); name submodules as "
                               "model.named_modules() does, or classes as type(module).__name__ does")
        units.update((n, m) for n, m in found if any(True for _ in m.parameters()))
    return list(units.items())


def _what_it_has(model: nn.Module) -> str:
    """``its repeated blocks: Block (transformer.h.0, transformer.h.1); its children: transformer, lm_head``."""
    repeated = repeated_blocks(model)
    classes = sorted({type(m).__name__ for _, m in repeated})
    children = ", ".join(n for n, _ in model.named_children()) or "none"
    blocks = f"its repeated blocks: {', '.join(classes)} ({describe_blocks(repeated, 3)})" if repeated else \
        "no repeated blocks"
    return f"{blocks}; its children: {children}"


def _tied(units: list[tuple[str, nn.Module]]) -> bool:
    """Whether two units hold the same parameter (``fully_shard`` refuses a parameter in two groups)."""
    seen: set[int] = set()
    for _, unit in units:
        mine = {id(p) for p in unit.parameters()}
        if mine & seen:
            return True
        seen |= mine
    return False


@dataclasses.dataclass(frozen=True)
class FSDP(Options):
    """Shard parameters, gradients and optimizer state over the workers (FSDP2)."""

    name: ClassVar[str] = "fsdp"
    checkpoints_activations: ClassVar[bool] = True
    summary: ClassVar[str] = ("sharded data parallelism: parameters, gradients and optimizer state split over the "
                              "workers, gathered block by block; torch's fully_shard (FSDP2)")
    sharded_checkpoints: ClassVar[bool] = True

    reshard_after_forward: bool = option(True, "free each block's gathered parameters after its forward and gather "
                                               "them again for backward (less memory, one more all-gather per block)")
    blocks: Optional[tuple[str, ...]] = option(None, "the modules sharded as units: submodule names as "
                                                     "named_modules() gives them (e.g. 'encoder,head') or class "
                                                     "names, every module of that class (e.g. 'Block')",
                                               parse=parse_blocks, show="the model's repeated blocks")
    init_device: Optional[str] = option(None, "'meta': every worker builds the model on the meta device (no memory) "
                                              "and materialises it one block at a time, keeping its shard of each",
                                        choices=("meta",), show="the worker's device")
    init_weights: Optional[Any] = option(None, "with --init-device meta: MODULE:CALLABLE, a function of one module "
                                               "that initialises its own tensors (called on each as model.apply(fn) "
                                               "calls it, after its reset_parameters())", show="reset_parameters()")
    tensor_parallel: int = option(1, "split each block's attention and MLP Linear layers over N ranks (column- then "
                                     "row-wise, DTensor's parallelize_module); N divides the workers: a 2-D mesh "
                                     "(workers/N fsdp x N tensor-parallel)")

    def __post_init__(self) -> None:
        if not isinstance(self.reshard_after_forward, bool):
            raise PhalanxError(f"--reshard-after-forward is on or off, got {self.reshard_after_forward!r}")
        if self.blocks is not None:
            self._set(blocks=parse_blocks(self.blocks))
        if self.init_device not in (None, "meta"):
            raise PhalanxError(f"--init-device {self.init_device}: only 'meta' is known (build nothing, materialise "
                               "each rank's shards), or leave it out")
        if self.init_weights is not None and self.init_device != "meta":
            raise PhalanxError("--init-weights initialises a model built on the meta device: add --init-device meta")
        require_positive("--tensor-parallel", self.tensor_parallel)

    def builds_on_meta(self) -> bool:
        return self.init_device == "meta"

    def init_fn(self) -> Optional[meta_init.InitFn]:
        """The --init-weights function (an import path is resolved where it is asked for: parent and workers)."""
        if isinstance(self.init_weights, str):
            from ...task import resolve  # (the task layer: how a user's import path is found)

            return resolve(self.init_weights, "--init-weights", "a function of one module that initialises it")
        return self.init_weights

    def layout(self, job: Job) -> Layout:
        if self.tensor_parallel > 1:
            tensor_parallel.check_degree(self.tensor_parallel, job.processes or job.workers)
        if job.model is not None:  # refuse a model with nothing to shard (or to split) before anything starts
            units = shard_units(job.model, self.blocks)
            if self.builds_on_meta():
                meta_init.check_initialisable(job.model, self.init_fn())
            if self.tensor_parallel > 1:
                tensor_parallel.model_plan(units, self.tensor_parallel)
        if self.tensor_parallel > 1:
            return tensor_parallel.layout(job, self.tensor_parallel)
        return data_parallel(job)

    def describe(self) -> str:
        how = "fully_shard" if self.reshard_after_forward else "fully_shard, no reshard after forward"
        extra = f" x tensor parallel {self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return f"fsdp ({how}{extra}{', built on meta' if self.builds_on_meta() else ''})"

    def runtime(self, build: Build) -> Runtime:
        return FSDPRuntime(build, self)

    def units(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return shard_units(model, self.blocks)


# Its cost model, for phalanx estimate (costs.py); each step computes what sync computes: simulated as sync
# (simulate/lockstep.py), timed as fsdp.
register(FSDP, cost=FSDPCost(), simulated=LOCKSTEP)


class FSDPRuntime(Runtime):
    """One rank's shard of every block (and its tensor-parallel slice of them); the plain model when alone."""

    def __init__(self, build: Build, options: FSDP):
        ctx, model = build.ctx, build.model
        self.ctx = ctx  # (the notes below read it before Runtime.__init__ sets it again)
        self.units = shard_units(model, options.blocks)
        tp = options.tensor_parallel
        self.tp_plan = tensor_parallel.model_plan(self.units, tp) if tp > 1 else {}
        on_meta = meta_init.on_meta(model)
        if ctx.distributed and not on_meta:
            # fully_shard keeps each rank's own slice of its own copy (no broadcast from rank 0), so
            # replicas built differently would silently train a patchwork: check, as sync does. (A model
            # built on meta is materialised from one seed in one order on every rank: equal by construction.)
            verify_replicas(model, ctx)
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
        mixed = {"mp_policy": self.policy} if self.policy is not None else {}
        if on_meta:
            meta_init.reseed()
        # fully_shard goes bottom-up: a unit nested in another must be wrapped first.
        for name, block in sorted(self.units, key=lambda unit: -unit[0].count(".")):
            if on_meta:  # this unit whole, then at once only this rank's shard of it: one unit at a time
                made += meta_init.materialise(block, device, init, name)
            if self.tp_mesh is not None:
                tensor_parallel.apply(block, self.tp_plan[name], self.tp_mesh)
            if self.shard_mesh is not None:
                fully_shard(block, mesh=self.shard_mesh, reshard_after_forward=options.reshard_after_forward, **mixed)
        if on_meta:
            made += meta_init.materialise(model, device, init)
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
        plain = [name for name, value in model.items() if isinstance(value, torch.Tensor)
                 and not isinstance(value, DTensor)]
        copies = [model[name].detach().clone() for name in plain]
        broadcast_buffers(copies)
        model.update(zip(plain, copies))
        return {"model": model, "optimizer": optimizer}

    def _load_shards(self, path: str, keys: list[str]) -> None:
        """Every rank reads its part of each tensor of a sharded checkpoint, whatever worker count wrote it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        # The state dicts to fill in place: this rank's shards, with an optimizer state (torch makes one).
        target = {key: value for key, value in self.shard_state_dict().items() if key in keys}
        # A pipeline's checkpoint holds a tied weight once, under its first key: the others are filled from it.
        aliases = read_entries(path, [ALIASES]).get(ALIASES, {})
        dcp.load({**target, "model": {k: v for k, v in target["model"].items() if k not in aliases}},
                 checkpoint_id=path)
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
    model.set_requires_gradient_sync(False)  # recursive: every block of the model
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# --------------------------------------------------------------------------- optimizer state numbering


def by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A name-keyed optimizer state (torch's distributed-checkpoint form) as ``optimizer.state_dict()`` keys it.

    ``names[i]`` is the name of the parameter a plain optimizer numbers i (its position across the
    optimizer's param groups), so the result is exactly the dict the unsplit model's optimizer saves.
    """
    index = {name: i for i, name in enumerate(names)}
    ordered = sorted(state["state"].items(), key=lambda item: index[item[0]])
    return {"state": {index[name]: value for name, value in ordered},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`by_index`: a plain optimizer's ``state_dict()`` keyed by parameter names."""
    count = sum(len(group["params"]) for group in state["param_groups"])
    if count != len(names):
        raise PhalanxError(f"checkpoint's optimizer holds {count} parameters but this model has {len(names)}; resume "
                           "with the --model the checkpoint was trained with")
    return {"state": {names[int(i)]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                             for group in state["param_groups"]]}


__all__ = ["FSDP", "shard_units"]
