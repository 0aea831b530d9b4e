"""A model built without materialising it whole (``--init-device meta``).

Every rank runs the model's factory under ``torch.device("meta")``: shapes and dtypes, no storage,
no random draws. The runtime then materialises the model **one shard unit at a time**: a unit's
tensors are allocated on the rank's device, filled by the modules' own ``reset_parameters()`` and what
the model declares (transformers' ``_init_weights``: Llama's RMSNorm, GPT-2's Conv1D; then
the user's ``--init-weights`` function, called on each module as ``model.apply(fn)`` calls it, children
before their parent), and handed at once to ``fully_shard``, which keeps this rank's slice and frees
the rest. So a rank never holds more than its shards plus one whole unit (the block fsdp gathers in
every forward anyway), instead of the whole model.

Why whole units, not torch's route (shard the meta model, ``to_empty``, initialise each shard):
DTensor's random operators keep ranks' shards slices of one random tensor only on CUDA-like devices
(``torch.distributed.tensor._random.is_rng_supported_mesh`` is False on CPU); on CPU every rank would
draw the same numbers into different rows, duplicating neurons. Initialising a whole unit from the
same seed, in the same order, on every rank makes every shard a slice of one reference model: the
one a single process materialises the same way (what the tests compare). It equals the eagerly built
model where the eager constructor draws the same numbers in the same order (an ``nn.Sequential`` of
layers initialised by their ``reset_parameters``); a model whose constructor re-initialises after
building (GPT-2's ``apply(_init_weights)``) gets the same distributions from other draws.

Freshly allocated tensors are filled with NaN, so a parameter or buffer that no initialisation wrote is
found and named, not trained from whatever the allocator left there.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from ..errors import PhalanxError

META = torch.device("meta")
#: ``fn(module)``: initialise this module's own parameters and buffers (``model.apply(fn)``'s convention)
InitFn = Callable[[nn.Module], None]


def building(on_meta: bool) -> contextlib.AbstractContextManager:
    """Where a factory builds the model: on the meta device (nothing allocated) or as it always does."""
    return torch.device("meta") if on_meta else contextlib.nullcontext()


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(name, module), children before their parent: the order a constructor finishes them in."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers this module holds itself (not its children's)."""
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def declared_init(model: nn.Module) -> dict[int, nn.Module]:
    """{id(module): the model that declares how to initialise it}: transformers' ``PreTrainedModel`` (an
    ``_init_weights(module)`` beside ``post_init``/``init_weights``), the nearest one above each module, as its
    ``initialize_weights`` dispatches a composite model's sub-models (``smart_apply``). Empty where none declares."""
    owners: dict[int, nn.Module] = {}

    def walk(module: nn.Module, owner: Optional[nn.Module]) -> None:
        if _declares_init(module):
            owner = module
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            walk(child, owner)
    walk(model, None)
    return owners


def _declares_init(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and any(
        callable(getattr(module, name, None)) for name in ("post_init", "init_weights", "_initialize_weights"))


def check_initialisable(model: nn.Module, init: Optional[InitFn], flag: str = "--init-weights") -> None:
    """Refuse, in one line, a model with a module that holds tensors and nothing that would initialise them: no
    model above it declaring how (``_init_weights``), no ``reset_parameters()``, no ``--init-weights``."""
    if init is not None:
        return  # the user's function owns what reset_parameters does not cover (checked after, by NaN)
    declared = declared_init(model)
    for name, module in _post_order(model):
        own = _own(module)
        if own and id(module) not in declared and not callable(getattr(module, "reset_parameters", None)):
            held = ", ".join(n for n, _ in own[:3]) + (", ..." if len(own) > 3 else "")
            where = f"'{name}'" if name else "the model itself"
            raise PhalanxError(
                f"--init-device meta: {where} ({type(module).__name__}) holds {held} and has no reset_parameters(), "
                "nor a model above it that declares how it initialises (transformers' _init_weights), to initialise "
                f"it after the model is built on the meta device; give {flag} MODULE:CALLABLE (a function of one "
                "module, called on each as model.apply(fn) calls it), or drop --init-device meta")


def check_run(init_from: Optional[str], straggler: object, build: Callable[[], nn.Module]) -> None:
    """What a run cannot do with a model that exists only as shards: one line each, in the parent. ``build``: the
    task's factory, run here on the meta device (nothing allocated) to see that it builds there."""
    with building(True):
        probe = build()
    real = [name for name, t in [*probe.named_parameters(), *probe.named_buffers()] if not t.is_meta]
    if real:
        raise PhalanxError(f"--init-device meta: the model's factory made '{real[0]}' with storage although it ran "
                           "under torch.device('meta') (a model object given to the API is copied, not built; a "
                           "factory may name a device): name a factory that builds it, e.g. --model mymodule:Net, "
                           "or drop --init-device meta")
    if init_from is not None:
        raise PhalanxError(f"--init-from {init_from} loads the whole model into every worker, and --init-device meta "
                           "builds none: drop one (to fine-tune a model too large for one device, --resume from a "
                           "checkpoint of this model)")
    if straggler is not None:
        raise PhalanxError("--straggler times the model on every worker before it is sharded, and --init-device meta "
                           "builds none there: drop one")


def materialise(root: nn.Module, device: torch.device, init: Optional[InitFn] = None, where: str = "",
                declared: Optional[dict[int, nn.Module]] = None) -> int:
    """Allocate and initialise every meta tensor under ``root`` (named ``where`` in the model) on ``device``;
    returns the bytes allocated.

    A tensor two modules share (tied embeddings) stays one tensor: the memo maps it, within this call only
    (across calls it would keep every unit's whole tensors alive after fully_shard kept only a slice; fsdp's
    units never split a tied pair). Modules are initialised children first: ``reset_parameters()`` on each that
    held meta tensors, then the ``_init_weights`` of the model that declares it (``declared``: see
    :func:`declared_init`, computed on the whole model) and the user's ``init``, on those and on every module above
    them (a parent may set its children's tensors: GPT-2's scaled projections); a unit already materialised and
    sharded is never touched again.
    """
    fresh, touched, allocated = _allocate_all(root, device, where)
    declared = declared_init(root) if declared is None else declared
    with torch.no_grad():
        for _, module in _post_order(root):
            if id(module) not in touched:
                continue
            if id(module) in fresh and callable(getattr(module, "reset_parameters", None)):
                getattr(module, "reset_parameters")()  # (the module's own: nn.Module declares none)
            if id(module) in declared:
                getattr(declared[id(module)], "_init_weights")(module)  # (transformers' PreTrainedModel's)
            if init is not None:
                init(module)
    for name, module in fresh.values():
        _check_written(name, module)
    return allocated


def _allocate_all(root: nn.Module, device: torch.device, where: str) -> tuple[dict, set, int]:
    """Every meta tensor under ``root`` replaced by one allocated on ``device``: ({id: (name, module)} of the
    modules that held them, the ids of those and of every module above them, the bytes allocated)."""
    fresh: dict[int, tuple[str, nn.Module]] = {}
    touched: set[int] = set()
    allocated = 0
    # id -> (the meta tensor, held so that its id stays unique meanwhile; what replaces it)
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, module in _post_order(root, where):
        if any(id(child) in touched for child in module.children()):
            touched.add(id(module))  # a parent's init may set its children's tensors (GPT-2's scaled projections)
        own = [(n, t) for n, t in _own(module) if t.is_meta]
        if not own:
            continue
        for attr, tensor in own:
            if id(tensor) not in memo:
                memo[id(tensor)] = (tensor, _allocate(tensor, device))
                allocated += tensor.numel() * tensor.element_size()
            made = memo[id(tensor)][1]
            if attr in module._parameters:
                assert isinstance(made, nn.Parameter), "_allocate keeps a Parameter one"
                module._parameters[attr] = made
            else:
                module._buffers[attr] = made
        fresh[id(module)] = (name, module)
        touched.add(id(module))
    return fresh, touched, allocated


def _allocate(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """NaN where floating (an unwritten value is then found), zero otherwise; a Parameter stays one."""
    fill = float("nan") if tensor.is_floating_point() else 0
    made = torch.full(tensor.shape, fill, dtype=tensor.dtype, device=device)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(made, requires_grad=tensor.requires_grad)
    return made


def _check_written(name: str, module: nn.Module) -> None:
    for attr, tensor in _own(module):
        if tensor.is_floating_point() and torch.isnan(tensor).any():
            where = f"{name}.{attr}" if name else attr
            raise PhalanxError(
                f"--init-device meta: '{where}' ({type(module).__name__}) was not initialised (still NaN after its "
                "reset_parameters() and --init-weights): give --init-weights MODULE:CALLABLE that sets it, e.g. a "
                "buffer the constructor computes, or drop --init-device meta")


def reseed() -> None:
    """Every rank draws from the start of the run's seed again (the loop seeded it before building the model;
    nothing drew on the meta device), so every rank initialises its units with the same numbers."""
    torch.manual_seed(torch.initial_seed())


__all__ = ["building", "check_initialisable", "check_run", "declared_init", "materialise", "on_meta", "reseed"]
