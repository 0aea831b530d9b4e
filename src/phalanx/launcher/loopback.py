"""A job on one machine is reachable from that machine only.

Who listens: the launcher's store (a ``TCPStore`` the parent owns; every worker joins the job through it,
and its keys include ``phalanx/stop``), and each worker's process group (gloo opens a listening socket per
rank; NCCL's bootstrap one too). torch's ``TCPStore`` server binds every interface (``*:PORT``) whatever
host it is given, and gloo binds the address the machine's hostname resolves to, which on most servers is
a public one. So the parent binds the store's socket itself, on ``addr`` (loopback), and hands it to the
store (``master_listen_fd``: the store owns and closes it); and the workers' groups are pinned to the
loopback interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) unless the user set those.

A job that torchrun or Slurm started is not this: its store and groups listen where those launchers say
(docs/reliability.md, Security).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

IFF_LOOPBACK = 0x8  #: the loopback flag of a network interface (Linux's if.h)
#: the variables that choose the interface gloo and NCCL listen on
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def store(addr: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The launcher's store, listening on ``addr`` only, at a port the kernel chose."""
    family = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0][0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((addr, 0))
        listener.listen(max(128, world_size))
        port = listener.getsockname()[1]
        # detach: from here the store owns the socket (it closes it), Python must not close it under it
        return dist.TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach())
    finally:
        listener.close()  # (a no-op once detached; the socket where binding failed)


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux)."""
    for _, name in socket.if_nameindex():
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):  # no /sys (not Linux): go by the name
            flags = IFF_LOOPBACK if name.startswith("lo") else 0
        if flags & IFF_LOOPBACK:
            return name
    return "lo"


def worker_environment() -> dict[str, str]:
    """The environment a worker of a one-machine job gets: this one, its groups on the loopback interface
    (where the user chose no interface)."""
    env = dict(os.environ)
    interface = None
    for name in INTERFACE_VARIABLES:
        if name not in env:
            interface = interface or loopback_interface()
            env[name] = interface
    return env
