"""Bytes on the wire: what each rank sends and receives through torch.distributed, counted in one place.

    with metering() as meter:      # inside a worker, around the training loop
        meter.begin()              # the training steps start: count from here
        ...                        # every collective and point-to-point call is priced and passed on
        meter.end()
        meter.sent, meter.received

Why a wrapper around torch.distributed: torch has no hook on its Python collectives, and the
engines phalanx uses call them directly (FSDP2's all-gathers and reduce-scatters, the pipelining
schedules' isend/irecv, the model averagers' all-reduce, the parameter server's send/recv). While
metering, the public functions of ``torch.distributed`` and the same names inside
``distributed_c10d`` (through which torch's object collectives reach their tensor collectives) are
replaced by one counting wrapper each, restored on the way out, and so are torch's functional
collectives (``_functional_collectives``), which DTensor calls for tensor parallelism's activations
and gradients, in forward and in backward, without passing through those functions. Only the outermost call counts
(``all_gather_into_tensor`` calls ``all_gather_single``), and the counting is a few Python operations
per call: nothing is sent.

DDP's buckets never pass through Python: its C++ reducer all-reduces them. Routing them through a
Python communication hook only to count them cost sync 1.6-3.2% of a step, and a lost peer's error
came out of the hook's callback on gloo's thread. They need no wrapper: what DDP all-reduces
per synchronised backward is known in advance (every bucket once: the gradients of the parameters it
reduces), so ``reduce.py`` prices that with :func:`count` as each such backward is armed.

Each call is priced by the traffic of the algorithm gloo runs, measured on a namespace's loopback
counters (torch 2.13, 2 and 3 ranks, 4 MiB tensors; totals over the ranks within 1%). Per rank,
S the bytes of the tensor this rank passes in and N the group's size:

    all_reduce             ring (reduce-scatter, all-gather): sends and receives 2(N-1)/N * S
    reduce                 the ring's reduce-scatter, then every other rank's 1/N to the root:
                           the root sends (N-1)/N * S, receives 2(N-1)/N * S; the others send S
    reduce_scatter         gloo all-reduces the whole input (S = every rank's part): 2(N-1)/N * S
                           (NCCL's ring sends only (N-1)/N * S)
    all_gather             every rank's S to every other: sends and receives (N-1) * S
    all_to_all             sends and receives (N-1)/N * S
    broadcast, scatter     the root sends (N-1) copies of S, every other rank receives one
    gather                 every other rank sends S, the root receives (N-1) * S
    send / recv            S
    barrier                nothing counted (a few bytes of gloo's own)

What is counted is payload: the TCP/IP headers, acknowledgements and gloo's small control messages
that a real link also carries are not (``tests/test_wire.py`` sets the two side by side on a
shaped link), and neither is the rendezvous store's traffic (progress heartbeats, stop checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from .shaped_link import size

#: what each wrapped call's bytes are priced as (see the module's table)
KINDS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "reduce": "reduce",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "all_gather": "all_gather", "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather", "all_gather_coalesced": "all_gather",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "scatter": "broadcast", "gather": "gather",
    "send": "send", "isend": "send", "recv": "recv", "irecv": "recv",
}
#: the argument holding the tensor(s) whose bytes are S, per wrapped function
INPUTS = {
    "all_reduce": "tensor", "all_reduce_coalesced": "tensors", "reduce": "tensor",
    "reduce_scatter": "input_list", "reduce_scatter_single": "input", "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
    "all_gather": "tensor", "all_gather_single": "input_tensor", "all_gather_into_tensor": "input_tensor",
    "_all_gather_base": "input_tensor", "all_gather_coalesced": "input_tensor_list",
    "all_to_all": "input_tensor_list", "all_to_all_single": "input",
    "broadcast": "tensor", "scatter": "tensor", "gather": "tensor",
    "send": "tensor", "isend": "tensor", "recv": "tensor", "irecv": "tensor",
}
#: torch's functional collectives (``torch.distributed._functional_collectives``: what DTensor, and so tensor
#: parallelism and its redistributions, calls in forward and in its backward), priced as the table prices the call
#: they make; the tensor(s) they are given are S
FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_single": "all_gather", "all_gather_tensor": "all_gather", "all_gather_single_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}
#: the argument naming the root (a global rank), and its group-rank form
ROOTS = {"reduce": ("dst", "group_dst"), "broadcast": ("src", "group_src"), "scatter": ("src", "group_src"),
         "gather": ("dst", "group_dst")}


def traffic(kind: str, nbytes: int, size: int, root: bool = False) -> tuple[float, float]:
    """(sent, received) by one rank for a call of ``kind`` over ``size`` ranks, ``nbytes`` its S
    (``root``: this rank is the call's root). Pure: the module's table."""
    if size < 2 and kind not in ("send", "recv"):
        return 0.0, 0.0
    n, s = size, float(nbytes)
    if kind in ("all_reduce", "reduce_scatter"):
        return 2 * (n - 1) / n * s, 2 * (n - 1) / n * s
    if kind == "reduce":
        return ((n - 1) / n * s, 2 * (n - 1) / n * s) if root else (s, (n - 1) / n * s)
    if kind == "all_gather":
        return (n - 1) * s, (n - 1) * s
    if kind == "all_to_all":
        return (n - 1) / n * s, (n - 1) / n * s
    if kind == "broadcast":
        return ((n - 1) * s, 0.0) if root else (0.0, s)
    if kind == "gather":
        return (0.0, (n - 1) * s) if root else (s, 0.0)
    if kind == "send":
        return s, 0.0
    if kind == "recv":
        return 0.0, s
    raise ValueError(f"no traffic model for {kind!r}")


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclasses.dataclass
class Meter:
    """This rank's bytes sent and received in the counted window (the training steps).

    Counts from :meth:`begin` to :meth:`end`, except what the calling thread does inside
    :meth:`aside` (an evaluation or a checkpoint between steps); other threads (a parameter server's
    receivers and senders) count throughout the window. Safe to update from several threads.
    """

    sent: float = 0.0
    received: float = 0.0
    calls: int = 0
    counting: bool = False
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    _local: threading.local = dataclasses.field(default_factory=threading.local, repr=False)

    def begin(self) -> None:
        self.counting = True

    def end(self) -> None:
        self.counting = False

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Inside, this thread's calls are not counted (they are not a training step's traffic)."""
        was = getattr(self._local, "aside", False)
        self._local.aside = True
        try:
            yield
        finally:
            self._local.aside = was

    def add(self, sent: float, received: float) -> None:
        if not self.counting or getattr(self._local, "aside", False):
            return
        with self._lock:
            self.sent += sent
            self.received += received
            self.calls += 1

    @property
    def total(self) -> float:
        """Sent and received."""
        return self.sent + self.received


class _Wrapped:
    """The counting stand-in for one torch.distributed function (the same object in both modules,
    so that ``P2POp(dist.isend, ...)`` still passes torch's ``op is isend`` checks)."""

    def __init__(self, name: str, original: Callable, meter: Meter, depth: threading.local):
        self.name, self.original, self.meter, self.depth = name, original, meter, depth
        self.signature = inspect.signature(original)
        self.kind, self.input, self.roots = self._priced_as(name)
        self.__wrapped__ = original
        self.__name__ = self.__qualname__ = name
        self.__doc__ = original.__doc__

    def _priced_as(self, name: str) -> tuple[str, str, Optional[tuple[str, str]]]:
        """(the table's kind, the argument holding S, the arguments naming the root)."""
        return KINDS[name], INPUTS[name], ROOTS.get(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outermost = not getattr(self.depth, "n", 0)
        if outermost and self.meter.counting:
            self._count(args, kwargs)
        self.depth.n = getattr(self.depth, "n", 0) + 1
        try:
            return self.original(*args, **kwargs)
        finally:
            self.depth.n -= 1

    def _count(self, args: tuple, kwargs: dict) -> None:
        bound = self.signature.bind(*args, **kwargs).arguments
        group = bound.get("group")
        if c10d._rank_not_in_group(group):
            return
        size = dist.get_world_size(group)
        root = False
        if self.roots is not None:
            global_root, group_root = (bound.get(k) for k in self.roots)
            root = dist.get_rank(group) == group_root if group_root is not None else dist.get_rank() == global_root
        self.meter.add(*traffic(self.kind, _nbytes(bound.get(self.input)), size, root))


class _WrappedFunctional(_Wrapped):
    """The counting stand-in for one functional collective: its group is a process group, a mesh, a mesh and a
    dimension, a list of ranks or a group's name, and its first argument is S."""

    def _priced_as(self, name: str) -> tuple[str, str, Optional[tuple[str, str]]]:
        return FUNCTIONAL[name], next(iter(self.signature.parameters)), None

    def _count(self, args: tuple, kwargs: dict) -> None:
        bound = self.signature.bind(*args, **kwargs).arguments
        size, rank = _place(bound.get("group"))
        root = self.kind == "broadcast" and bound.get("src") == rank
        self.meter.add(*traffic(self.kind, _nbytes(bound.get(self.input)), size, root))


def _place(group: Any) -> tuple[int, int]:
    """(how many ranks a functional collective's ``group`` spans, this rank's place in it), ``group`` in any of
    torch's ``RANK_TYPES``."""
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, dim = group
        return mesh.size(dim), mesh.get_local_rank(dim)
    if isinstance(group, DeviceMesh):
        return group.size(), group.get_local_rank()
    if isinstance(group, str):  # a group known by its name (private: how torch resolves one)
        group = c10d._resolve_process_group(c10d.GroupName(group))
    if isinstance(group, dist.ProcessGroup):
        return group.size(), group.rank()
    ranks = group[0] if group and isinstance(group[0], list) else list(group or [])  # (a 2-D list: one row each)
    me = dist.get_rank()
    return len(ranks), ranks.index(me) if me in ranks else -1


#: the meters of the metering() blocks open in this process, innermost last
_OPEN: list[Meter] = []


def count(kind: str, nbytes: int, size: int) -> None:
    """Price a ``kind`` collective of ``nbytes`` over ``size`` ranks that torch makes out of Python's
    sight (DDP's reducer), on every open meter, as the wrappers price the calls they see."""
    if _OPEN:
        sent, received = traffic(kind, nbytes, size)
        for meter in _OPEN:
            meter.add(sent, received)


@contextlib.contextmanager
def metering(meter: Optional[Meter] = None) -> Iterator[Meter]:
    """Inside, every torch.distributed call of this process is counted on ``meter`` (a new one by
    default) while it is counting; the original functions are back on the way out."""
    meter = meter or Meter()
    depth = threading.local()
    saved = []
    for name in KINDS:
        original = getattr(c10d, name, None)
        if original is None:  # not in this torch
            continue
        wrapper = _Wrapped(name, original, meter, depth)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                saved.append((module, name, original))
                setattr(module, name, wrapper)
    for name in FUNCTIONAL:
        original = getattr(funcol, name, None)
        if original is not None:  # (in this torch)
            saved.append((funcol, name, original))
            setattr(funcol, name, _WrappedFunctional(name, original, meter, depth))
    _OPEN.append(meter)
    try:
        yield meter
    finally:
        _OPEN[:] = [m for m in _OPEN if m is not meter]  # (by identity: meters compare by value)
        for module, name, original in saved:
            setattr(module, name, original)


def summary_fields(meter: Meter, job: Optional[float], steps: int, link_at: Sequence[int] = ()) -> dict[str, Any]:
    """The summary's figures: this rank's (rank 0's) sent and received bytes, the job's (what every rank
    sent: None where not known) in all and per step, and, on a shaped link, the link's own count over
    the same steps (``link_at``: its counter as the steps began and after they ended)."""
    fields = {"wire_sent_bytes": round(meter.sent), "wire_received_bytes": round(meter.received),
              "wire_bytes": None if job is None else round(job),
              "wire_bytes_per_step": None if job is None or steps < 1 else job / steps}
    if len(link_at) == 2:
        fields["link_bytes_steps"] = link_at[1] - link_at[0]
    return fields


def summary_line(meter: Meter, job: Optional[float], steps: int) -> str:
    """``bytes on the wire: 1.21 MB per step, 24.21 MB in 20 steps (what every rank sent; rank 0 ...)``."""
    per = max(steps, 1)
    mine = f"rank 0 sent {size(meter.sent / per)} and received {size(meter.received / per)} per step"
    if job is None:
        return f"bytes on the wire: {mine} (the other ranks' are not known here)"
    return f"bytes on the wire: {size(job / per)} per step, {size(job)} in {steps} steps (what every rank sent; {mine})"


__all__ = ["Meter", "count", "metering", "size", "summary_fields", "summary_line", "traffic"]
