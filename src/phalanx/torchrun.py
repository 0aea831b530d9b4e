"""``python -m phalanx.torchrun ARGS``: torchrun itself, whose agent ends on a stop signal with the shell's status.

The same arguments as ``torchrun`` (this *is* ``torch.distributed.run``), for example::

    python -m phalanx.torchrun --standalone --nproc-per-node 2 -m phalanx train --steps 4000

torchrun's agent takes SIGTERM and SIGINT (Slurm's and Kubernetes' stop, a terminal's Ctrl-C) by
raising its ``SignalException`` in its monitoring loop: it passes SIGTERM on to the workers, waits
for them (up to 30 s; phalanx's workers stop at one step and save it, and print how to continue),
then lets the exception end the agent: exit 1 and the exception's traceback, whatever the workers
did. That is torchrun's code; under plain ``torchrun`` phalanx cannot change it. Here the exception
is taken where torchrun lets it out, after its workers have ended, and the agent exits 143 for
SIGTERM, 130 for SIGINT (128 + the signal, as ``phalanx train`` does), without a traceback. Any
other ending (success, a failed worker's report) is torchrun's, unchanged.

It also starts the agent with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set): each round of the
rendezvous then gets a store of its own, hosted by its rank 0. With torch's shared store, a restart of a
job on several nodes hangs (until the store's timeout, then again at each restart): an agent that was rank 0
of a round keeps that round's store address when a node joins and takes rank 0 (an elastic job whose
first node rendezvoused alone), and each agent counts only its own restarts, so the workers of one
attempt disagree on its number (``tests/test_torchrun_elastic.py``).
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

#: The signal that stopped the agent, kept to the interpreter's end. torch leaves the rendezvous open on a signal
#: (the job's other nodes go on), and its handler is freed with this exception's frames: freed while its keep-alive
#: timer beats, it is freed in the timer's thread, whose finalizer then joins itself ("Exception ignored ...
#: cannot join current thread" below the stop's line). Kept, it is freed after ``atexit``, when that finalizer
#: does nothing.
_STOPS: List[BaseException] = []


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        torchrun(list(argv) if argv is not None else None)
    except SignalException as e:  # (its workers were told and waited for: what they saved, they said)
        _STOPS.append(e)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
