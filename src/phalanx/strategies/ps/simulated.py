"""Simulated parameter-server family: ``ps``, ``ssp`` (K), ``backup`` (B), event by event.

The strategy's own pure rules decide: its aggregation rule (``strategies/ps/aggregate.py``: which
gradients make an update, weighed how; a late one dropped) and its SSP gate (``gate.py``: a worker
leading the slowest by more than K waits for its reply). The events are the cost model's
(``strategies/ps/costs.py``): a worker computes, pushes over the server's inbound link (one push at a time),
the server's main thread takes the pushes in arrival order, updates, and replies (a reply each,
in turn); the worker copies the parameters in and computes again. Every duration is the cost
model's, scaled by its CPU bound where the node's cores bound the step.

Learning is real: a worker's gradient is computed on the version it pulled (a shared,
reference-counted copy: :class:`~phalanx.simulate.versions.Versions`), on its own next batch, so
staleness is what the schedule makes it. Gradients are computed lazily and together: when the
server needs one, every gradient already begun is computed in one batched call (its parameters
and batch are fixed when its worker begins), and the versions they used are released.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Any

import torch

from .costs import message_seconds, predict_ps, round_trip_fixed, worker_work
from ...simulate.registry import SimulatedRule

if TYPE_CHECKING:
    from ...simulate.world import World


class Server(SimulatedRule):
    def run(self, options: Any, world: "World") -> None:
        from .gate import Gate
        from ...comm.staleness import StalenessStats

        W, problem = world.workers, world.problem
        compute = problem.compute
        predicted = predict_ps(compute, problem.facts, problem.network, W)
        pace = predicted.step / max(predicted.parts["timeline"], 1e-30)  # >1 where the node's cores bound it
        # as strategies/ps/costs.py's cycle
        work = (worker_work(compute) + round_trip_fixed(compute, problem.network)) * pace
        apply = compute.apply * pace
        unpack, loop = compute.unpack * pace, compute.loop * pace
        message = [m * pace for m in message_seconds(compute, problem.facts, problem.network, W)]
        # A cycle varies by its compute's spread and its round trip's (independent: their variances add).
        spread = math.hypot(compute.step_spread(), compute.round_trip_spread)
        rule, gate = options.aggregation(W), Gate(range(W), options.bound)
        world.outcome.drops = rule.drops_late
        world.staleness = StalenessStats(options.bound)
        params = world.stepped()
        optimizer = world.optimizer(params)
        scheduler = world.scheduler(optimizer)
        readers = [world.reader(w) for w in range(W)]
        state = _State(world, params)
        ready: list = []  # (time its gradient is ready to push, sequence, worker)

        def reply(worker: int, now: float) -> None:
            """``worker`` gets the parameters of now and begins its next step."""
            own = gate.clock[worker]
            state.begin(worker, next(readers[worker]))
            cycle = unpack + work
            done = now + cycle + world.jitter(worker, own, cycle, spread) + world.delay(worker, own, worker + 1)
            heapq.heappush(ready, (done, state.sequence, worker))

        for w in range(W):
            reply(w, 0.0)
        inbound = server = 0.0
        pending: dict[int, tuple[torch.Tensor, int]] = {}
        waiting: set[int] = set()
        updates = applied = dropped = step = 0
        dropped_by: dict[int, int] = {}
        while ready and not world.stopped:
            t, _, w = heapq.heappop(ready)
            inbound = max(t, inbound) + message[w]  # pushes cross the inbound link one at a time
            now = max(inbound, server)
            grad, version, loss = state.gradient(w)
            gate.tick(w)
            if rule.admits(version, updates):
                pending[w] = (grad, version)
            else:
                dropped += 1
                dropped_by[w + 1] = dropped_by.get(w + 1, 0) + 1  # by rank, as a real run's metrics say
            stepped = False
            if pending and len(pending) >= rule.quorum(W):
                taken = [pending[v] for v in sorted(pending)]
                pending.clear()
                for _, used in taken:
                    world.staleness.record(updates - used)
                total = taken[0][0] if len(taken) == 1 else torch.stack([g for g, _ in taken]).sum(0)
                params.set_grad(total * rule.weight(len(taken)))
                world.clip(params.tensors)  # the update's gradient, as the server clips it
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state.moved()
                updates += 1
                applied += len(taken)
                now += apply
                if updates % rule.per_step == 0:
                    step += 1
                    scheduler.step()
                    now += loop
                    stepped = True
            for v in ([w] if w not in waiting else []) + sorted(waiting):
                if v in pending or not gate.may_start(v):  # held: its round is open, or it leads by too much
                    waiting.add(v)
                    continue
                waiting.discard(v)
                now += message[v]
                reply(v, now)
            server = now
            if stepped or not math.isfinite(loss):
                values = world.evaluate(params.vector()) if stepped and world.due(step) else None
                world.outcome.applied, world.outcome.dropped = applied, dropped
                world.outcome.dropped_by = {str(rank): n for rank, n in sorted(dropped_by.items())}
                world.step_done(step, now, values, loss)
        state.close()
        world.final = params.snapshot()


class _State:
    """The gradients begun and not yet taken, and the versions they were begun on."""

    def __init__(self, world: "World", params) -> None:
        self.world, self.params = world, params
        self.version = 0  # the server's updates so far: the version a reply hands out
        self.sequence = 0
        self.begun: dict[int, tuple[int, Any]] = {}  # worker -> (version, batch): not computed yet
        self.done: dict[int, tuple[torch.Tensor, int, float]] = {}  # worker -> (gradient, version, loss)

    def begin(self, worker: int, batch) -> None:
        versions = self.world.versions
        if not versions.has(self.version):
            versions.add(self.params.snapshot(), self.version)
        else:
            versions.add(None, self.version)  # one more holder of the same copy
        self.begun[worker] = (self.version, batch)
        self.sequence += 1

    def moved(self) -> None:
        self.version += 1

    def gradient(self, worker: int) -> tuple[torch.Tensor, int, float]:
        if worker not in self.done:
            self._compute()
        return self.done.pop(worker)

    def _compute(self) -> None:
        """Every gradient begun, in one batched call; their versions released."""
        versions = self.world.versions
        workers = sorted(self.begun)
        flats = [versions.get(self.begun[w][0]) for w in workers]
        grads, losses = self.world.grads.each(flats, [self.begun[w][1] for w in workers])
        for w, g, loss in zip(workers, grads.unbind(0), losses):
            version = self.begun.pop(w)[0]
            self.done[w] = (g, version, loss)
            versions.release(version)

    def close(self) -> None:
        """The run ended: the gradients still being computed are never taken; their versions go."""
        for version, _ in self.begun.values():
            self.world.versions.release(version)
        self.begun.clear()


SERVER = Server()
