"""Activation checkpointing (``--activation-checkpointing``): each block keeps only its input for backward
and runs its forward again there, trading about one more forward per step for the activations inside it.

The blocks are the strategy's own (``Options.units``: fsdp's units, the model's repeated blocks for the
others), each given torch's composable ``checkpoint`` (non-reentrant ``torch.utils.checkpoint``, the
engine of ``checkpoint_wrapper``) in place, before any strategy wraps the model, as torchtitan orders it.
Not ``checkpoint_wrapper`` itself: it puts a module around each block, which renames every parameter in
it (``_checkpoint_wrapped_module.``), and the names are what fsdp numbers its optimizer state by and what
``--blocks`` and a user's optimizer factory see; the composable form keeps the model as written.

Where the model declares how it recomputes (transformers' ``supports_gradient_checkpointing``), its own
``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before transformers 5) is called
with ``use_reentrant=False``, as Hugging Face's Trainer and Accelerate call it: it checkpoints the layers the
model names (each layer's ``forward``, so fsdp's hooks stay outside) and turns the key/value cache off while
it does, which a recomputation otherwise appends to a second time (a 128-long key against a 64-long mask); its
config's ``use_cache`` is set off too, so that the model does not warn of it in every process.
Elsewhere the rule above; a block's keyword inputs (masks, position embeddings) reach it unchanged, and its
cache keywords (``use_cache``, ``past_key_values``, ``layer_past``, ``cache``) are turned off in training, as
transformers' ``GradientCheckpointingLayer`` does, so the recomputation computes exactly what the forward did.

What it saves is measured once, on rank 0, by counting what autograd keeps for backward in one forward
of the first batch (``saved_tensors_hooks``: each distinct storage once, parameters not counted, and a
checkpointed block's input, which the recomputation holds), without and with: CPU memory statistics do
not exist, and on a GPU the same count is what a step's peak grows by.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from .task.models import declared_blocks, describe_blocks


@dataclasses.dataclass(frozen=True)
class Recomputed:
    """What ``--activation-checkpointing`` did: the blocks, and the bytes kept for backward (rank 0 measures)."""

    blocks: str  #: the blocks, as the plan line names them
    count: int
    saved_without: Optional[int] = None  #: bytes autograd keeps for backward in one forward, plain
    saved_with: Optional[int] = None  #: the same with every block checkpointed
    unmeasured: str = ""  #: why nothing was measured, where the line should say so

    def line(self) -> str:
        measured = ""
        if self.saved_without is not None and self.saved_with is not None:
            measured = (f"; kept for backward in one forward of this rank's batch: {_mb(self.saved_without)} -> "
                        f"{_mb(self.saved_with)} ({self.saved_with / max(self.saved_without, 1):.2f}x)")
        elif self.saved_with is not None:  # the plain forward did not fit: what checkpointing is for
            measured = (f"; kept for backward in one forward of this rank's batch: {_mb(self.saved_with)} (without "
                        "checkpointing the forward did not fit the device)")
        elif self.unmeasured:
            measured = f" (what it saves not measured: {self.unmeasured})"
        return (f"activation checkpointing: {self.count} blocks ({self.blocks}) keep only their input and run "
                f"their forward again in backward{measured}")

    def fields(self) -> dict[str, Any]:
        return {"blocks": self.count, "saved_bytes_without": self.saved_without, "saved_bytes_with": self.saved_with}


def checkpoint_blocks(model: nn.Module, units: list[tuple[str, nn.Module]],
                      measure: Optional[Callable[[], Any]] = None, unmeasured: str = "") -> Recomputed:
    """Checkpoint every unit of ``model`` in place; ``measure``: one forward of a batch (and its loss), run before
    and after to count what is kept for backward. The model's state (buffers, random generators) is left unchanged."""
    declaring = declares_recompute(model)
    if declaring:  # the layers the model recomputes, by its own word (fsdp's units where it names none)
        units = declared_blocks(model) or units
    modules = [module for _, module in units]
    without = None
    if measure is not None:
        try:
            without = saved_bytes(model, modules, measure)
        except torch.OutOfMemoryError:  # the run asked for checkpointing because this does not fit: go on with it
            pass
    if declaring:
        for root in declaring:
            _enable_declared(root)
    else:
        _checkpoint_each(modules)
    with_ = saved_bytes(model, modules, measure) if measure is not None else None
    how = f"; by {type(declaring[0]).__name__}'s own {_enabler_name(declaring[0])}()" if declaring else ""
    return Recomputed(describe_blocks(units) + how, len(units), without, with_, unmeasured)


def declares_recompute(model: nn.Module) -> list[nn.Module]:
    """The outermost modules in ``model`` that declare how they recompute (transformers'
    ``supports_gradient_checkpointing`` with its ``activation_checkpointing_enable`` or
    ``gradient_checkpointing_enable``): the model itself, or the Hugging Face model a user's module holds."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if getattr(module, "supports_gradient_checkpointing", False) is True and _enabler(module) is not None:
            found.append(module)
            inside |= {id(m) for m in module.modules()}
    return found


def _enabler(module: nn.Module) -> Optional[Callable[..., Any]]:
    """The model's switch: the newer name first (the older warns that it is deprecated from transformers 5 on)."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        if callable(getattr(module, name, None)):
            return getattr(module, name)
    return None


def _enabler_name(module: nn.Module) -> str:
    """The name of the switch of a module :func:`declares_recompute` found (it has one)."""
    enable = _enabler(module)
    assert enable is not None, "declares_recompute keeps only the modules that have a switch"
    return enable.__name__


def _enable_declared(module: nn.Module) -> None:
    """The model's own switch, non-reentrant (its keyword inputs pass through; the default's, from transformers
    4.35 on, said explicitly as Accelerate does). The model turns its cache off while it recomputes, and warns
    that it does in every process at its first training step, unless its config already says so: it is said
    here (``use_cache``, which no training step reads)."""
    enable = getattr(module, _enabler_name(module))
    kwargs = {"use_reentrant": False}
    if enable.__name__ == "activation_checkpointing_enable":
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        enable(gradient_checkpointing_kwargs=kwargs)
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        config.use_cache = False


#: a block's inputs that keep or extend a key/value cache (transformers' names across its models), and what
#: turns them off
CACHES = {"past_key_values": None, "past_key_value": None, "layer_past": None, "cache": None, "use_cache": False}


def _checkpoint_each(modules: list[nn.Module]) -> None:
    from torch.distributed._composable import checkpoint

    for module in modules:
        # (first: the checkpoint's own pre-hook keeps the inputs it is given, to run the block again on them)
        module.register_forward_pre_hook(_caches_off, with_kwargs=True, prepend=True)
        checkpoint(module)  # non-reentrant: hooks around the block's forward, the model's names unchanged


def _caches_off(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """A block in training is given no cache, by keyword or by position (GPT-2's blocks take it second): a
    recomputation would append to it a second time."""
    if not (module.training and torch.is_grad_enabled()):
        return None
    given, kwargs, changed = list(args), dict(kwargs), False
    for name, index in _cache_inputs(module).items():
        if index is not None and index < len(given):
            if given[index] is not None and given[index] is not False:
                given[index], changed = CACHES[name], True
        elif kwargs.get(name) is not None and kwargs[name] is not False:
            kwargs[name], changed = CACHES[name], True
    return (tuple(given), kwargs) if changed else None


def _cache_inputs(module: nn.Module) -> dict[str, Optional[int]]:
    """{name: its position (None: keyword only)} of the cache inputs ``module.forward`` takes."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return dict.fromkeys(CACHES)
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {name: positional.index(name) if name in positional else None for name in CACHES}


def saved_bytes(model: nn.Module, blocks: list[nn.Module], forward: Callable[[], Any]) -> int:
    """Bytes autograd keeps for backward in one ``forward()``: every distinct storage it saves, and the inputs of
    ``blocks`` (a checkpointed block holds its input to run again), parameters not counted. Nothing changes:
    the random generators are forked, the buffers (BatchNorm's running statistics) put back."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: Any) -> None:
        if torch.is_tensor(t) and t.layout == torch.strided:
            storage = t.untyped_storage()
            if storage.data_ptr() not in parameters:
                kept[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    def inputs(module: nn.Module, args: tuple) -> None:
        for a in args:
            keep(a)

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    hooks = [block.register_forward_pre_hook(inputs) for block in blocks]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.enable_grad():
            forward()
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    return sum(kept.values())


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


__all__ = ["Recomputed", "checkpoint_blocks", "declares_recompute", "saved_bytes"]
