"""Join a job that torchrun or Slurm's srun started: this process is one of its workers.

There is nothing to start: the launcher's environment says this process's rank and where the job
rendezvouses (:mod:`phalanx.launcher.env`), and the process leaves through :func:`leave`.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import warnings
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from .context import init_worker, shutdown
from ..errors import PeerLost
from .env import Joined
from .watch import say_raised

#: How gloo says the other end of a connection went away (reading from it, writing to it, reconnecting)
#: and how NCCL says a remote rank did; said by gloo or NCCL (a data loader's broken pipe is no lost peer).
PEER_GONE = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|Connection refused|remote process exited")
BACKENDS = re.compile(r"gloo|NCCL", re.I)


def lost_peer(error: BaseException) -> Optional[str]:
    """How a collective's error says that another rank went away (e.g. ``Connection reset by peer``); None:
    it is some other error."""
    text = str(error)
    gone = PEER_GONE.search(text) if isinstance(error, RuntimeError) and BACKENDS.search(text) else None
    return gone.group(0) if gone else None


#: Why a restart on several nodes can hang under torchrun's shared store (see phalanx.torchrun), and what avoids it.
SHARED_STORE_RESTARTS = (
    "torchrun --max-restarts on more than one node with torch's shared rendezvous store: a restart can hang (each "
    "agent counts its own restarts; a node that was rank 0 keeps its old store address); start each agent with "
    "python -m phalanx.torchrun, or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")


def _attempt_store(job: Joined, timeout_s: float) -> Optional[dist.Store]:
    """Under torchrun's agent store, a client of it keyed by the restart attempt (None: join by init_method).

    torchrun serves every attempt's workers the same store without an attempt prefix, so after a
    restart a fast new rank could read the gloo addresses of the dead attempt and wait forever on
    them (seen on a loaded machine: benchmarks/README.md, "Figures behind the code"). Keys of their
    own per attempt make that impossible.
    """
    if job.launcher != "torchrun" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or job.world_size < 2:
        return None
    if job.rank == 0 and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and \
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        warnings.warn(SHARED_STORE_RESTARTS)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), job.world_size, is_master=False,
                           timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"phalanx/attempt_{attempt}", client)


def run_joined(job: Joined, fn, devices, args, threads, timeout_s):
    """This process is rank ``job.rank`` of a job torchrun or srun started: join it and run ``fn``.

    torchrun passes SIGTERM (and a terminal's SIGINT reaches every rank): once training has begun
    each asks this rank to stop at the step boundary all ranks agree on, through the job's store
    (the loop installs that handler; until then the signals keep their default, immediate effect,
    since a handler cannot run while start-up is blocked inside gloo's rendezvous).
    """
    global _joined_a_group
    device = devices[job.local_rank % len(devices)]
    ctx = init_worker(job.rank, job.world_size, job.local_rank, device, threads, _attempt_store(job, timeout_s),
                      timeout_s, job.init_method)
    _joined_a_group = ctx.distributed
    try:
        return fn(ctx, *args)
    except BaseException as e:  # (torch's DistError is a RuntimeError)
        gone = lost_peer(e) if ctx.distributed else None
        if gone is None:
            say_raised(ctx.store, ctx.rank)  # (so that a parameter server does not take it for a lost worker)
            raise
        # The one line that a lost peer is worth (the dead rank's own log says why it died), then out
        # through leave(): an uncaught error would end in the interpreter's teardown, where gloo's
        # threads can abort the process (see leave).
        raise PeerLost(f"worker {ctx.rank} lost a peer in {ctx.progress.phase} (step {ctx.progress.step}): "
                       f"{gone}; another worker or its node died (its own log says why); under "
                       "torchrun --max-restarts the job restarts from the newest checkpoint") from None
    finally:
        ctx.progress.close()
        shutdown()


#: Whether this process was a worker of a job torchrun or srun started (see :func:`leave`).
_joined_a_group = False


def joined_a_group() -> bool:
    """Whether this process became a worker of a job torchrun or srun started (so far)."""
    return _joined_a_group


def leave(code: int) -> int:
    """The last step of the ``phalanx`` command: return ``code``, or, in a worker of a joined job,
    flush and end the process with it at once.

    Why not the interpreter's own teardown: gloo has no ``shutdown()``; its worker threads are
    joined only when the C++ process group is destroyed, and once DDP has run, torch keeps
    references to that group which Python cannot drop (``destroy_process_group`` and
    ``gc.collect()`` leave both of its threads running). A gloo thread that retires the last
    collective's work drops Python tensors and takes the GIL to do so; during interpreter
    finalization that ``pthread_exit``s the thread inside a noexcept C++ destructor, and
    ``std::terminate`` aborts a finished run ("terminate called without an active exception",
    SIGABRT; seen under torchrun: benchmarks/README.md, "Figures behind the code"). Everything of
    ours is stopped and closed before this point (the watch thread joined, the prefetcher joined,
    the process group destroyed, the metrics file closed), so ending here loses nothing. The spawned workers end
    the same way (see :func:`.local._spawned_worker`).
    """
    if not _joined_a_group:
        return code
    collect_before_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def collect_before_exit() -> None:
    """Collect reference cycles before ``os._exit``, so that the finalizers of what they hold run: a
    DataLoader iterator, once its workers are ended, still holds its queues' semaphores, registered
    with the job's resource tracker, and left to ``os._exit`` they were reported at the job's end
    ("There appear to be 4 leaked semaphore objects", seen with ``--loader-workers 2`` stopped by SIGTERM;
    none after the collection: benchmarks/README.md, "Figures behind the code")."""
    gc.collect()
