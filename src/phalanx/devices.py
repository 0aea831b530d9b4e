"""Device specs: parse what the user asked for, and place it on what exists.

Accepted specs (CLI ``--devices`` and every API that takes ``devices=``):

- ``"auto"``: every CUDA device if there is one, else the CPU;
- ``"cpu"``; ``"cuda"`` (every CUDA device); ``"cuda:0,2"`` or ``"cuda:1"``;
- an ``int`` n: n devices (the first n GPUs, or n CPU towers where there is no GPU);
- a list of any of the single forms, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``.

Soft placement: asking for CUDA where none exists falls back to the CPU with one warning,
unless ``strict=True``. Asking for a GPU index that does not exist on a machine that has GPUs
is always an error: it is a typo, not a portability question.
"""

from __future__ import annotations

import re
import warnings
from typing import Sequence, Union

import torch

from .errors import PhalanxError

DeviceSpec = Union[str, int, torch.device, Sequence[Union[str, torch.device]]]

_SINGLE = re.compile(r"^(cpu|cuda)(?::(\d+(?:,\d+)*))?$")


def cuda_count() -> int:
    """Number of visible CUDA devices (0 where torch has no CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_names(n: int) -> str:
    return ", ".join(f"cuda:{i}" for i in range(n)) or "none"


def _parse_one(text: str) -> tuple[str, list[int] | None]:
    m = _SINGLE.match(text.strip().lower())
    if not m:
        raise PhalanxError(
            f"unknown device {text!r}: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'cuda:N,M'"
        )
    kind, idx = m.group(1), m.group(2)
    if kind == "cpu" and idx is not None:
        raise PhalanxError(f"unknown device {text!r}: the CPU takes no index; use 'cpu'")
    return kind, ([int(i) for i in idx.split(",")] if idx else None)


def _fallback(asked: str, n: int, strict: bool) -> list[torch.device]:
    if strict:
        raise PhalanxError(
            f"{asked} requested but no CUDA device exists here; use --devices cpu, "
            "or drop --strict-devices to fall back to the CPU"
        )
    warnings.warn(f"{asked} requested but no CUDA device exists; falling back to the CPU", stacklevel=3)
    return [torch.device("cpu")] * n


def resolve_devices(spec: DeviceSpec = "auto", strict: bool = False) -> list[torch.device]:
    """Turn a device spec into a list of concrete devices (one per tower/worker slot)."""
    n_cuda = cuda_count()
    if isinstance(spec, torch.device):
        spec = str(spec)
    if isinstance(spec, bool):
        raise PhalanxError(f"unknown device {spec!r}: use 'auto', 'cpu', 'cuda' or a count")
    if isinstance(spec, int):
        if spec < 1:
            raise PhalanxError(f"device count must be at least 1, got {spec}")
        if n_cuda == 0:
            return [torch.device("cpu")] * spec
        if spec > n_cuda:
            raise PhalanxError(
                f"{spec} devices requested but only {n_cuda} CUDA devices exist ({_cuda_names(n_cuda)})"
            )
        return [torch.device("cuda", i) for i in range(spec)]
    if isinstance(spec, str):
        if spec.strip().lower() == "auto":
            return [torch.device("cuda", i) for i in range(n_cuda)] or [torch.device("cpu")]
        parts: list[str | torch.device] = [spec]
    else:
        parts = list(spec)
        if not parts:
            raise PhalanxError("empty device list: name at least one device, e.g. ['cpu']")
    out: list[torch.device] = []
    for part in parts:
        kind, idx = _parse_one(str(part))
        if kind == "cpu":
            out.append(torch.device("cpu"))
            continue
        if n_cuda == 0:
            out.extend(_fallback(str(part), len(idx) if idx else 1, strict))
            continue
        for i in idx if idx is not None else range(n_cuda):
            if i >= n_cuda:
                raise PhalanxError(
                    f"cuda:{i} requested but only {n_cuda} CUDA device"
                    f"{'s exist' if n_cuda > 1 else ' exists'} ({_cuda_names(n_cuda)})"
                )
            out.append(torch.device("cuda", i))
    return out


def backend_for(devices: Sequence[torch.device]) -> str:
    """The torch.distributed backend for these devices: NCCL on CUDA, gloo on CPU."""
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise PhalanxError("workers must all be on CUDA or all on the CPU, not a mix: " f"{sorted(kinds)}")
    return "nccl" if kinds == {"cuda"} else "gloo"
