"""``make_parallel``: one process, one tower per device, one shared set of parameters.

    par = phalanx.make_parallel(model, devices=["cuda:0", "cuda:1"])   # or "cuda", "auto", 2, ["cpu", "cpu"]
    out = par(x, y=y)          # tensor arguments split along dim 0, one slice per tower
    out.mean().backward()      # gradients land in model's own parameters
    opt.step()

How a call flows: every tensor argument is cut into contiguous slices along dimension 0 (10 rows
over 3 towers: 4, 3, 3; fewer rows than devices: fewer towers, never an empty one). Each tower is
a *view* of the model on its device: its parameters are the model's own (same device) or
differentiable copies of them (``p.to(device)``), so every tower's backward runs on its device
and the gradients flow back through the copies and accumulate in the model's parameters.
Towers run concurrently, one thread each; outputs are concatenated along dimension 0 on the
output device. The result equals running the model on the whole batch.

Buffers (BatchNorm running statistics and the like), as ``nn.DataParallel`` does it: every tower
normalises with the statistics of its own slice in training mode, and only the first tower's
updates of the running statistics are kept (written into the model's buffers); the other
towers update private copies that are dropped. In eval mode every tower reads the model's
buffers, so the result equals the model's exactly.

Why not ``torch.nn.parallel.replicate``/``parallel_apply`` as they are: both are CUDA-only (a
coalesced CUDA broadcast; the current accelerator's streams), and ``replicate`` cannot place
two towers on one device. Towers here may repeat a device (``["cpu", "cpu"]``), which is what
makes everything testable on a CPU-only machine. The tower modules are built with the same
shallow-replica mechanism torch uses (``Module._replicate_for_data_parallel``).
"""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .devices import DeviceSpec, resolve_devices
from .errors import PhalanxError


def make_parallel(module: nn.Module, devices: DeviceSpec = "auto", output_device: Optional[str] = None,
                  strict: bool = False) -> "ParallelModule":
    """Run ``module`` as one tower per device on slices of each batch (see the module docstring)."""
    return ParallelModule(module, devices, output_device, strict)


class ParallelModule(nn.Module):
    """An ``nn.Module`` that splits its inputs across towers sharing ``module``'s parameters.

    Its ``state_dict()`` is the bare module's (no ``module.`` prefix), so it loads into the bare
    model and back.
    """

    def __init__(self, module: nn.Module, devices: DeviceSpec = "auto", output_device: Optional[str] = None,
                 strict: bool = False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise PhalanxError(f"make_parallel needs an nn.Module, got {type(module).__name__}")
        self.module = module
        self.devices = resolve_devices(devices, strict=strict)
        self.source_device = module_device(module)
        self.output_device = torch.device(output_device) if output_device else self.source_device
        try:
            self._signature: Optional[inspect.Signature] = inspect.signature(module.forward)
        except (TypeError, ValueError):
            self._signature = None
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.devices) == 1 and self.devices[0] == self.source_device:
            return self.module(*args, **kwargs)  # one tower: a transparent pass-through
        rows = batch_rows(self._named_tensors(args, kwargs))
        sizes = [len(c) for c in torch.arange(rows).tensor_split(min(rows, len(self.devices)))]
        devices = self.devices[: len(sizes)]
        towers = [self._tower(device, first=i == 0) for i, device in enumerate(devices)]
        inputs = [_slice(args, start, size, d) for start, size, d in zip(_starts(sizes), sizes, devices)]
        kw_inputs = [_slice(kwargs, start, size, d) for start, size, d in zip(_starts(sizes), sizes, devices)]
        outputs = run_towers([t for t, _ in towers], inputs, kw_inputs, devices)
        for tower, write_back in towers:
            if write_back:
                _copy_buffers_back(tower, self.module)
        return gather(outputs, self.output_device)

    def _named_tensors(self, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
        names = [f"argument {i}" for i in range(len(args))]
        if self._signature is not None:
            try:
                bound = self._signature.bind(*args, **kwargs)
                names = list(bound.arguments)[: len(args)]
            except TypeError:
                pass
        named = [(n, a) for n, a in zip(names, args)] + list(kwargs.items())
        return [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.dim() > 0]

    def _tower(self, device: torch.device, first: bool) -> tuple[nn.Module, bool]:
        """The module for one tower, and whether its buffer updates must be copied back."""
        if first and device == self.source_device:
            return self.module, False  # the model itself: its buffer updates land in place
        return tower_replica(self.module, device), first and self.module.training

    def extra_repr(self) -> str:
        return f"devices={[str(d) for d in self.devices]}, output_device={self.output_device}"


def module_device(module: nn.Module) -> torch.device:
    """The one device holding all of ``module``'s parameters and buffers (the CPU if it has none)."""
    found = {t.device for t in list(module.parameters()) + list(module.buffers())}
    if len(found) > 1:
        names = ", ".join(sorted(str(d) for d in found))
        raise PhalanxError(
            f"the model's parameters are spread over several devices ({names}); make_parallel replicates a "
            "model that lives on one device: move it there first (model.to('cuda:0')), or use a pipeline "
            "to split a model across devices"
        )
    return found.pop() if found else torch.device("cpu")


def batch_rows(named: list[tuple[str, torch.Tensor]]) -> int:
    """The batch size all tensor arguments agree on; a clear error when they do not."""
    if not named:
        raise PhalanxError("make_parallel got no tensor argument to split: pass the batch as a tensor")
    first_name, first = named[0]
    for name, t in named[1:]:
        if len(t) != len(first):
            raise PhalanxError(f"argument {name} has {len(t)} rows but {first_name} has {len(first)}: "
                               "every tensor argument is split along its first dimension")
    if len(first) == 0:
        raise PhalanxError(f"empty batch: {first_name} has 0 rows; give make_parallel at least one example")
    return len(first)


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _slice(value: Any, start: int, size: int, device: torch.device) -> Any:
    """This tower's slice of every tensor (rows start..start+size, moved to its device)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value.to(device)
        return value[start:start + size].to(device, non_blocking=True)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_slice(v, start, size, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_slice(v, start, size, device) for v in value)
    if isinstance(value, dict):
        return {k: _slice(v, start, size, device) for k, v in value.items()}
    return value


def tower_replica(module: nn.Module, device: torch.device) -> nn.Module:
    """A view of ``module`` on ``device``: parameters shared (or differentiable copies), buffers copied.

    Each submodule is shallow-copied the way torch's own ``replicate`` does it; a parameter on
    the same device is the very same tensor, so its gradient lands in the model directly.
    """
    memo: dict[int, nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}

    def copy_tensor(t: torch.Tensor, buffer: bool) -> torch.Tensor:
        if id(t) not in tensors:
            moved = t.to(device)
            tensors[id(t)] = moved.clone() if buffer and moved is t else moved
        return tensors[id(t)]

    def copy_module(m: nn.Module) -> nn.Module:
        if id(m) in memo:  # a submodule used twice stays one module
            return memo[id(m)]
        replica = m._replicate_for_data_parallel()
        memo[id(m)] = replica
        for name, child in m._modules.items():
            replica._modules[name] = None if child is None else copy_module(child)
        for name, p in m._parameters.items():
            setattr(replica, name, None if p is None else copy_tensor(p, buffer=False))
        for name, b in m._buffers.items():
            replica._buffers[name] = None if b is None else copy_tensor(b, buffer=True)
        return replica

    return copy_module(module)


def _copy_buffers_back(tower: nn.Module, module: nn.Module) -> None:
    with torch.no_grad():
        for (_, theirs), (_, ours) in zip(tower.named_buffers(), module.named_buffers()):
            ours.copy_(theirs)


def run_towers(towers: Sequence[nn.Module], inputs: Sequence[tuple], kwargs: Sequence[dict],
               devices: Sequence[torch.device]) -> list[Any]:
    """Call every tower on its inputs, one thread each; re-raise the first tower's error."""
    grad_enabled = torch.is_grad_enabled()
    results: list[Any] = [None] * len(towers)
    failures: list[tuple[int, BaseException]] = []

    def work(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled), _on_device(devices[i]):
                results[i] = towers[i](*inputs[i], **kwargs[i])
        except BaseException as e:  # handed to the caller's thread below
            failures.append((i, e))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(1, len(towers))]
    for t in threads:
        t.start()
    work(0)  # the caller's thread is a tower too
    for t in threads:
        t.join()
    if failures:
        i, error = min(failures, key=lambda f: f[0])
        error.add_note(f"(raised in tower {i} on {devices[i]})")
        raise error
    return results


def _on_device(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.device(device)
    import contextlib

    return contextlib.nullcontext()


def gather(outputs: list[Any], device: torch.device) -> Any:
    """Concatenate the towers' outputs along dimension 0 on ``device`` (recursively)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            warnings.warn("towers returned scalars: gathering them into a vector, one value per tower",
                          stacklevel=3)
            return torch.stack([o.to(device) for o in outputs])
        return torch.cat([o.to(device) for o in outputs], dim=0)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(gather(list(parts), device) for parts in zip(*outputs)))
    if isinstance(first, (list, tuple)):
        return type(first)(gather(list(parts), device) for parts in zip(*outputs))
    if isinstance(first, dict):
        return _same_mapping(first, {k: gather([o[k] for o in outputs], device) for k in first})
    return first  # not a tensor: every tower computed the same thing


def _same_mapping(first: dict, items: dict) -> dict:
    """``items`` in the towers' own mapping type, where it can be made from them (a Hugging Face ``ModelOutput``
    keeps its attributes, ``out.loss`` and ``out.logits``, as ``nn.DataParallel`` keeps them); else a dict."""
    if type(first) is dict:
        return items
    try:
        return type(first)(**items) if all(isinstance(k, str) for k in items) else type(first)(items)
    except TypeError:
        return items


def _strip_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for table in (state_dict, getattr(state_dict, "_metadata", {})):  # metadata keeps module versions
        for key in [k for k in table if k.startswith(prefix + "module")]:
            rest = key[len(prefix) + len("module"):].lstrip(".")
            table[prefix + rest if rest else prefix.rstrip(".")] = table.pop(key)


def _add_prefix(module: nn.Module, state_dict: dict, prefix: str, *rest: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "module.")]:
        state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)
