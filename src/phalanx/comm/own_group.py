"""A process group of this process's own, for a moment: the parent rehearsing a tensor-parallel plan on torch's fake
group, or timing a pipeline schedule in a group of one."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator


@contextlib.contextmanager
def own_group(backend: str, **init: Any) -> Iterator[None]:
    """torch.distributed's default group for the block, in a process that has none; after it, the process is as
    it was. torch's ``init_process_group`` also sets ``sys.excepthook`` to one that writes every later traceback of
    the process with a ``[rank0]:`` before each line, which the group's end leaves in place: a user's script that
    failed after its ``fit()`` said so as a rank."""
    import torch.distributed as dist

    hook = sys.excepthook
    dist.init_process_group(backend, **init)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
