"""GPipe with its receives posted ahead: torch's ``ScheduleGPipe``, less a round trip per micro-batch.

Who talks to whom: stage s receives micro-batch i's activations from stage s−1 and, in the
backward half, its gradients from stage s+1 (point-to-point, in the stages' pipeline group);
this changes only *when* those receives are posted, never what is sent or computed.

Why: torch's single-stage schedules post each receive just before the micro-batch needs it. On
gloo (and any rendezvous transport) the bytes move only once the receiver has posted, so every
micro-batch a stage receives costs it a round trip (its "ready", the sender's reply with the
data, the wake-ups on both sides) on top of the copy. A stage that waits on its neighbour anyway
does not notice; in a balanced pipeline every stage is the bottleneck and pays it on every
micro-batch. On the real-compute MLP of ``benchmarks/pipeline.py`` that was most of the gap
between the speed-up the block times predict and the one measured (the figures:
benchmarks/README.md, "Figures behind the code").

Here every forward receive of the step is posted when the step begins and every backward
receive when the backward half begins. The engine already gives each micro-batch its own
receive buffer (``PipelineStage`` allocates one per chunk), so posting early costs no memory
and no copy, and messages between one pair of stages are matched in the order they are sent.
The rest (loss, waits on the sends, gradient scaling) is ``ScheduleGPipe``'s own, step by step,
less its ``record_function`` labels per micro-batch (about 1% of a stage's time on the CPU; a
profiler trace still shows each stage's operators).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import ScheduleGPipe
from torch.distributed.pipelining.schedules import _sorted_batch_p2p, _wait_batch_p2p


class GPipeAhead(ScheduleGPipe):
    """``ScheduleGPipe`` whose receives are posted at the start of each half of the step."""

    def _step_microbatches(self, arg_mbs: Any = None, kwarg_mbs: Any = None, target_mbs: Any = None,
                           losses: Any = None, return_outputs: bool = True, loss_kwargs: Any = None) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        stage, m = self._stage, self._n_microbatches
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        receives = [_sorted_batch_p2p(stage.get_fwd_recv_ops(i), desc="fwd_recv") for i in range(m)]
        sends = []
        for i in range(m):
            _wait_all(receives[i])
            output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
            sends.append(_sorted_batch_p2p(stage.get_fwd_send_ops(i), desc="fwd_send"))
            self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
        for works in sends:  # all sent before the backward half reuses the pair (as ScheduleGPipe does)
            _wait_all(works)
        receives = [_sorted_batch_p2p(stage.get_bwd_recv_ops(i), desc="bwd_recv") for i in range(m)]
        sends = []
        for i in range(m):
            _wait_all(receives[i])
            stage.backward_one_chunk(i, loss=self._maybe_get_loss(stage, i), last_backward=i == m - 1)
            sends.append(_sorted_batch_p2p(stage.get_bwd_send_ops(i), desc="bwd_send"))
        for works in sends:
            _wait_all(works)
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(m if self.scale_grads else 1)


def _wait_all(works_by_peer: dict) -> None:
    for works in works_by_peer.values():
        _wait_batch_p2p(works)
