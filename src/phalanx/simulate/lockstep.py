"""Simulated ``sync`` (and every strategy that computes what sync computes each step: ``fsdp``).

Every step every worker computes its gradient on the one common set of parameters; the mean of
the W gradients is applied once (DDP's all-reduce, then the same optimizer step on every rank).
The W batches are computed together as one batch of W x B where their mean loss is its loss
(:meth:`Gradients.mean`), so the parameters are a real run's. Time: a step takes what the strategy's cost model predicts
at W workers, plus the slowest worker's straggler delay of that step (lockstep waits for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..data import batch as batches
from .registry import SimulatedRule

if TYPE_CHECKING:
    from .world import World


class Lockstep(SimulatedRule):
    def run(self, options: Any, world: "World") -> None:
        step_seconds = world.prediction(options).step
        params = world.stepped()
        optimizer = world.optimizer(params)
        scheduler = world.scheduler(optimizer)
        reader = world.global_reader()
        now = 0.0
        for step in range(1, world.max_steps + 1):
            whole = next(reader)
            shards = batches.split(whole, world.workers)  # worker w's batch: the real run's shard w
            grad, loss = world.grads.mean(params.vector(), shards, whole)
            params.set_grad(grad)
            world.clip(params.tensors)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            now += step_seconds + world.slowest_delay(step - 1)
            values = world.evaluate(params.vector()) if world.due(step) else None
            if world.step_done(step, now, values, loss):
                break
        world.final = params.snapshot()


LOCKSTEP = Lockstep()
