"""A model split as written: torch's tracing front end (``torch.distributed.pipelining.pipeline``).

What is traced is the task's training step, ``step(model, batch)`` (see ``step.py``), not the bare
model: the loss the task defines (nanoGPT's ``model(idx, targets)``, Hugging Face's ``labels``, or the
task's loss on the model's logits) is then part of the graph and lands on the last stage, so a GPT
whose ``forward(idx)`` alone returns the last position only trains as its authors call it. The
wrapper returns the step's (loss, outputs, targets), flattened; the last stage hands them back.

Three details make the engine's traced stages carry any model and any batch:

- every input is cloned first: torch 2.13's traced stages take the root inputs on the *first*
  stage only ("_retrieve_recv_activations expected non-root _RecvInfo"), so a batch leaf that only
  the last stage reads (the targets) must be produced by stage 0 to travel; the clone is;
- the step's outputs and targets are cloned after the step: an op after the last split point
  belongs to the last stage, so all of (loss, outputs, targets) come out of it;
- torch copies a parameter that two stages use into both (its ``REPLICATE``, the tied embedding
  and output layer of a GPT); :func:`adopt` points every stage's tensors back at the model's own,
  so a rank's stage trains the model's parameters and buffers (BatchNorm's statistics) in place and
  a checkpoint reads them by the model's keys. The copies of a tied parameter on two stages are
  kept equal by the runtime (their gradients summed between those stages before the step).

Split points name submodules where a stage begins (``SplitPoint.BEGINNING``). By default they are
chosen among the model's repeated blocks (:func:`candidate_points`), balanced by measured time
(``trace_profile.py``) or parameter count.
Tracing specialises on shapes and on train/eval mode, so the runtime traces once per (mode, shape).
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import operator
import sys
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...errors import PhalanxError


def candidate_points(model: nn.Module) -> list[str]:
    """Where a stage may begin by default: the model's repeated blocks, in registration order (the
    children of a ModuleList or Sequential whose class appears there more than once; a block that
    begins where its container begins is left out, being the same point)."""
    points: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kids = [(f"{name}.{key}" if name else key, child) for key, child in module.named_children()]
        count = collections.Counter(type(child) for _, child in kids)
        points += [n for n, child in kids if count[type(child)] > 1]
    starts = set(points)
    return [p for p in points if not (p.endswith(".0") and p[:-2] in starts)]


def parse_points(value: Any) -> tuple[str, ...]:
    """``"a,b"`` or ``["a", "b"]`` as a tuple of names (empty: the default points)."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",")]
    return tuple(str(v).strip() for v in value or () if str(v).strip())


def check_points(model: nn.Module, points: Sequence[str]) -> None:
    """Every split point names a submodule of the model; one line listing the candidates otherwise."""
    names = {name for name, _ in model.named_modules() if name}
    unknown = [p for p in points if p not in names]
    if unknown:
        shown = ", ".join(candidate_points(model)[:12]) or "none found: name submodules of the model"
        raise PhalanxError(f"--split-points {','.join(unknown)}: no such submodule in {type(model).__name__}; "
                           f"candidates (its repeated blocks): {shown}")
    if len(set(points)) != len(points):
        raise PhalanxError(f"--split-points {','.join(points)} names a point twice: give each once")


def segment_params(model: nn.Module, points: Sequence[str]) -> list[int]:
    """Parameters between consecutive candidate points: segment 0 before ``points[0]``, segment k
    from ``points[k-1]`` on (by registration order, which models write in forward order; a tied
    parameter counts once, where it is first registered)."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    starts = [order[p] for p in points]
    counts = [0] * (len(points) + 1)
    seen: set[int] = set()
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            counts[sum(1 for s in starts if s <= order[name])] += p.numel()
    return counts


class _Stepped(nn.Module):
    """The step as one module over the batch's tensors: what torch.export traces (see the module docstring).

    Export traces a deep copy of it: the batch's tree travels in a closure (a function is not copied) and
    the tree of the step's result is left in a module-level table."""

    def __init__(self, model: nn.Module, step: Callable, rebuild: Callable[[Iterator[torch.Tensor]], Any]):
        super().__init__()
        self.model, self.step, self.rebuild = model, step, rebuild
        self.key = f"{id(self)}"

    def forward(self, *tensors: torch.Tensor) -> tuple:
        # made by stage 0, so any stage may read them
        batch = self.rebuild(t.clone(memory_format=torch.contiguous_format) for t in tensors)
        made = self.step(self.model, batch)
        flat, _OUT_SPECS[self.key] = pytree.tree_flatten((made.loss, made.outputs, made.targets))
        # The loss first, as is; the rest cloned after the step, so they come out of the last stage.
        return tuple(t if i == 0 or not isinstance(t, torch.Tensor) else t.clone() for i, t in enumerate(flat))


def _rebuilder(spec: Any, marked: list) -> Callable[[Iterator[torch.Tensor]], Any]:
    def rebuild(tensors: Iterator[torch.Tensor]) -> Any:
        return pytree.tree_unflatten([next(tensors) if c is _TENSOR else c for c in marked], spec)
    return rebuild


_TENSOR = object()
_OUT_SPECS: dict[str, Any] = {}


def flat_tensors(batch: Any) -> tuple[list[torch.Tensor], Any, list]:
    """(the batch's tensors, its tree spec, its leaves with each tensor marked): what a stage is fed."""
    leaves, spec = pytree.tree_flatten(batch)
    return ([leaf for leaf in leaves if isinstance(leaf, torch.Tensor)], spec,
            [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])


class Traced:
    """One trace of the step, split at ``points``: its ``Pipe`` and how to read the last stage's output."""

    def __init__(self, model: nn.Module, step: Callable, micro_batch: Any, points: Sequence[str], stages: int):
        from torch.distributed.pipelining import SplitPoint
        from torch.distributed.pipelining._IR import Pipe, annotate_split_points

        tensors, spec, marked = flat_tensors(micro_batch)
        wrapper = _Stepped(model, step, _rebuilder(spec, marked))
        with _restored_forwards(model, points), torch.random.fork_rng(), _unshadowed(model) as aliases:
            try:  # torch's pipeline(module, split_spec=...), with a pass of ours before the split (see there)
                annotate_split_points(wrapper, {f"model.{p}": SplitPoint.BEGINNING for p in points})
                with _quiet_unless_it_works():
                    self.pipe = Pipe.from_tracing(wrapper, tuple(tensors), split_policy=contiguous_crossings)
            except Exception as e:  # torch.export cannot follow the model: one line, and the way out
                cause = e.__cause__ or e
                first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
                raise PhalanxError(
                    f"--strategy pipeline cannot trace {type(model).__name__} with torch.export "
                    f"({type(cause).__name__}: {first}); make it an nn.Sequential of blocks or give it a "
                    "pipeline_blocks() method, and phalanx "
                    "cuts it at its blocks instead") from None
        if self.pipe.num_stages != stages:
            raise PhalanxError(f"split points {','.join(points)} gave {self.pipe.num_stages} stages, "
                               f"not {stages}: each "
                               f"must be a submodule the forward calls exactly once, in forward order")
        self.out_spec = _OUT_SPECS.pop(wrapper.key)
        self.positions = _last_stage_positions(self.pipe)
        for i in range(stages):
            adopt(self.pipe.get_stage_module(i), model, aliases)
            compiled_code(self.pipe.get_stage_module(i))

    def stage_module(self, index: int) -> nn.Module:
        return self.pipe.get_stage_module(index)

    def result(self, output: Any) -> tuple[torch.Tensor, Any, Any]:
        """The step's (loss, outputs, targets) from what the last stage returned."""
        outs = output if isinstance(output, (tuple, list)) else (output,)
        return pytree.tree_unflatten([outs[i] for i in self.positions], self.out_spec)


def contiguous_crossings(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Every value that a later stage reads, made contiguous where it is made (in the traced graph, before
    the split). Why: the engine sizes a stage's receive buffer with the value's strides, and gloo refuses
    a buffer that is not contiguous (an ``expand``ed attention mask of Hugging Face's GPT-2 is one); the
    cut front end does the same with ``.contiguous()`` on a stage's output."""
    from torch.distributed.pipelining._IR import aten_pipe_split_alias

    part, where = 0, {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten_pipe_split_alias:
            part += 1
        where[node] = part
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if node.op in ("placeholder", "get_attr", "output") or not isinstance(val, torch.Tensor):
            continue
        later = [user for user in node.users if user.op != "output" and where.get(user, part) > where[node]]
        if not later or val.is_contiguous():
            continue
        with gm.graph.inserting_after(node):
            made = gm.graph.call_function(torch.ops.aten.clone.default, (node,),
                                          {"memory_format": torch.contiguous_format})
        made.meta.update(node.meta)  # (where it sits in the model's modules: the split outlines by it)
        with val.fake_mode:  # type: ignore[attr-defined]  # a traced node's value is a FakeTensor
            made.meta["val"] = val.clone(memory_format=torch.contiguous_format)
        where[made] = where[node]
        for user in later:
            user.replace_input_with(node, made)
    gm.recompile()
    return gm


def _last_stage_positions(pipe: Any) -> list[int]:
    """For each of the traced step's flat outputs, its index in the last stage's output."""
    graph = pipe.split_gm.graph
    stages = [n for n in graph.nodes if n.op == "call_module"]
    last = stages[-1]
    out = next(n for n in graph.nodes if n.op == "output")
    positions = []
    for node in pytree.tree_leaves(out.args[0]):
        if node is last:
            positions.append(0)
        elif getattr(node, "target", None) is operator.getitem and node.args[0] is last:
            positions.append(int(node.args[1]))
        else:
            raise PhalanxError("the training step's loss is not computed on the last stage: split the model before "
                               "the module that computes it, not after")
    return positions


def compiled_code(stage: nn.Module) -> None:
    """Run the stage's outlined modules by their generated Python code, not torch.fx's Interpreter: the
    interpreter walks the graph node by node on every call and makes a (disabled) tqdm bar each time, whose
    first one allocates a multiprocessing lock that a worker never frees ("leaked semaphore objects" at
    exit). The code is the same graph; ``_run_with_interpreter`` is the switch torch itself reads."""
    for module in stage.modules():
        if hasattr(module, "_run_with_interpreter"):
            setattr(module, "_run_with_interpreter", False)  # (not a tensor or module: no attribute form)


def adopt(stage: nn.Module, model: nn.Module, aliases: Optional[dict[str, str]] = None) -> None:
    """Point the stage's parameters and buffers at the model's own tensors of the same name (the trace names
    them ``model.<key>``, a submodule traced under an alias by its alias: see :func:`_unshadowed`); tensors the
    trace made itself (lifted constants) stay the stage's."""
    own = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    for kind in ("_parameters", "_buffers"):
        for name in [n for n, _ in (stage.named_parameters(remove_duplicate=False) if kind == "_parameters"
                                    else stage.named_buffers(remove_duplicate=False))]:
            key = _original(name[len("model."):] if name.startswith("model.") else name, aliases or {})
            if key in own:
                parent, _, attr = name.rpartition(".")
                getattr(stage.get_submodule(parent), kind)[attr] = own[key]


#: submodule names that the traced graph's generated code cannot use as a variable's name (it names a call's
#: result after the submodule called: BERT's ``attention.self`` became a local ``self``, and the next line's
#: ``self.output`` a tensor's attribute)
SHADOWING = ("self",)


@contextlib.contextmanager
def _unshadowed(model: nn.Module) -> Iterator[dict[str, str]]:
    """While tracing, every submodule named ``self`` is registered under an alias (``self_``), so the trace names it
    and its tensors by the alias; its parent's forward still finds it as ``self.self`` (a plain attribute for that
    while). Yields {alias's qualified name: the original's}, by which :func:`adopt` maps the stages' names back;
    the model is given back as it was, so its ``state_dict`` (and every checkpoint) keeps the model's own keys."""
    changed: list[tuple[nn.Module, dict, list[str]]] = []
    aliases: dict[str, str] = {}
    for path, parent in list(model.named_modules()):
        names = [name for name in parent._modules if name in SHADOWING]
        if not names:
            continue
        before, renamed = parent._modules, {}
        for name, child in before.items():
            if name in names:
                alias = name + "_"
                while alias in before:
                    alias += "_"
                aliases[f"{path}.{alias}" if path else alias] = f"{path}.{name}" if path else name
                parent.__dict__[name] = child
                name = alias
            renamed[name] = child
        changed.append((parent, before, names))
        parent._modules = renamed
    try:
        yield aliases
    finally:
        for parent, before, names in changed:
            parent._modules = before
            for name in names:
                parent.__dict__.pop(name, None)


def _original(key: str, aliases: dict[str, str]) -> str:
    for alias in sorted(aliases, key=len, reverse=True):
        if key.startswith(alias + "."):
            return aliases[alias] + key[len(alias):]
    return key


@contextlib.contextmanager
def _quiet_unless_it_works() -> Iterator[None]:
    """What export writes while it traces, held back: on a failure it prints the partial graph (dozens of
    lines per rank) and warnings before raising, and the one line raised above says it all."""
    held, before = io.StringIO(), logging.root.manager.disable
    logging.disable(max(before, logging.WARNING))
    try:
        with contextlib.redirect_stderr(held), warnings.catch_warnings():
            # torch's own deep copy of its input tree spec (Pipe.from_tracing) trips its own deprecation
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            yield
    finally:
        logging.disable(before)
    sys.stderr.write(held.getvalue())  # (reached only when the trace worked: whatever it said, said)


@contextlib.contextmanager
def _restored_forwards(model: nn.Module, points: Sequence[str]) -> Iterator[None]:
    """torch marks a split point by replacing the module's ``forward`` on the instance; give the user's
    model back as it was once the trace is made."""
    modules = [model.get_submodule(p) for p in points]
    had = [m.__dict__.get("forward") for m in modules]
    try:
        yield
    finally:
        for m, own in zip(modules, had):
            m.__dict__.pop("_orig_forward", None)
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own


def stage_tensors(stage: nn.Module) -> set[int]:
    """Ids of the stage's parameters and buffers (after :func:`adopt`, the model's own)."""
    return {id(t) for t in stage.parameters()} | {id(t) for t in stage.buffers()}


def tied(traced: Traced, model: nn.Module, stages: int) -> dict[int, tuple[int, ...]]:
    """Whole-model parameter index -> the stages holding it, for every parameter on more than one stage."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    holders: dict[int, list[int]] = collections.defaultdict(list)
    for s in range(stages):
        for p in traced.stage_module(s).parameters():
            if id(p) in index:
                holders[index[id(p)]].append(s)
    return {i: tuple(s) for i, s in sorted(holders.items()) if len(s) > 1}
