"""Simulated periodic averaging: ``local-sgd`` (H) and ``diloco`` (H, outer optimizer, fragments).

Every worker steps its own copy of the parameters with its own optimizer state on its own shard;
the copies meet every H steps. The W copies are one stacked tensor per parameter (W, ...), so one
optimizer over the stacks is W independent optimizers for element-wise optimizers (SGD, Adam,
AdamW: each element's update reads only its own state), and the W gradients, each on its own copy,
are one batched call (:meth:`Gradients.each`). At a meeting:

- local SGD: the copies are replaced by their mean (torch's ``PeriodicModelAverager``, after steps
  1, H+1, 2H+1, ...); optimizer states stay local; the run's last step averages them too (a real
  run's ``finish``, where H does not divide the steps);
- DiLoCo: the pseudo-gradients (global - local) are averaged (in the outer precision on the wire),
  the outer Nesterov SGD steps the global copy, every local copy restarts from it; fragments meet at
  their own staggered steps, and the run's last step syncs them all (``strategies/diloco/``).

Time: each worker's own steps (the measured step plus its straggler delays) until a meeting, where
all wait for the slowest, plus the round's cost from the strategy's cost model. The measured step is
a mean: real workers' steps jitter, and at a meeting the slowest one's lead is waited for, so the
meeting starts at least the cost model's wait (``costs/inputs.meeting_wait``) after the workers'
mean clock. An evaluation is a collective in a real run: the workers meet there too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...simulate.registry import SimulatedRule

if TYPE_CHECKING:
    from ...simulate.world import World


class Periodic(SimulatedRule):
    steps_a_module = False  # the W copies are stacks: no module of one worker's for a factory that takes the model

    def run(self, options: Any, world: "World") -> None:
        W = world.workers
        model = world.fresh_model()
        stacks = [p.detach().unsqueeze(0).repeat(W, *([1] * p.dim())).requires_grad_(True) for p in model.parameters()]
        optimizer = world.optimizer(stacks)
        scheduler = world.scheduler(optimizer)
        readers = [world.reader(w) for w in range(W)]
        meeting = self.meeting(options, world, stacks)
        predicted = world.prediction(options)
        rounds = meeting.rounds_per_cycle
        round_seconds = max(predicted.step - predicted.compute, 0.0) * options.sync_every / rounds
        wait = predicted.parts.get("meeting_wait", 0.0)  # for the slowest one's lead beyond the modelled delays
        base = world.problem.compute.step
        clocks = [0.0] * W
        for step in range(1, world.max_steps + 1):
            batches = [next(r) for r in readers]
            grads, losses = world.grads.each(_matrix(stacks), batches)
            _set_stacked_grads(stacks, grads)
            world.clip(stacks, rows=True)  # each worker's own inner step
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            clocks = [c + base + world.delay(w, step - 1, w) for w, c in enumerate(clocks)]
            if meeting.after(step - 1, last=step == world.max_steps):
                clocks = [max(max(clocks), sum(clocks) / W + wait) + round_seconds] * W
            evaluating = world.due(step)
            if evaluating:
                clocks = [max(clocks)] * W
            values = meeting.evaluate(world) if evaluating else None
            if world.step_done(step, clocks[0], values, sum(losses) / W):
                break
        world.final = meeting.model_flat()

    def meeting(self, options: Any, world: "World", stacks: list[torch.Tensor]) -> "Averaging":
        raise NotImplementedError


def _matrix(stacks: list[torch.Tensor]) -> torch.Tensor:
    """Every worker's parameters as one (W, P) matrix, a row each (a copy)."""
    W = stacks[0].shape[0]
    return torch.cat([s.detach().reshape(W, -1) for s in stacks], dim=1)


def _set_stacked_grads(stacks: list[torch.Tensor], grads: torch.Tensor) -> None:
    offset = 0
    for s in stacks:
        n = s[0].numel()
        s.grad = grads[:, offset:offset + n].reshape(s.shape)  # a view of this step's gradient matrix
        offset += n


class Averaging:
    """Local SGD's meeting: the copies replaced by their mean every H steps."""

    rounds_per_cycle = 1

    def __init__(self, options: Any, stacks: list[torch.Tensor]):
        self.every, self.stacks = options.sync_every, stacks

    def after(self, index: int, last: bool) -> bool:
        if index % self.every and not last:
            return False
        with torch.no_grad():
            for s in self.stacks:
                s.copy_(s.mean(0, keepdim=True).expand_as(s))
        return True

    def evaluate(self, world: "World") -> dict[str, float]:
        # each replica on its part, as a real run does
        return world.evaluate_parts(list(_matrix(self.stacks).unbind(0)))

    def model_flat(self) -> torch.Tensor:
        return torch.cat([s.detach()[0].reshape(-1) for s in self.stacks])


class LocalSGDRule(Periodic):
    def meeting(self, options, world, stacks):
        return Averaging(options, stacks)


LOCAL_SGD = LocalSGDRule()
