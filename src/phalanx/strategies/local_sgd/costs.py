"""``local-sgd``: every worker steps on its own; every H steps the parameters are averaged. Pure.

An averaging is torch's ``PeriodicModelAverager``: flatten the parameters into one new vector,
divide it by N, all-reduce it, and point the parameters at their slices of it (no copy back);
between averagings nothing crosses the link and the loop needs no collective. The workers meet
only at an averaging, where the slowest one's lead over the H steps is waited for
(``inputs.meeting_wait``, measured), so per step the cost is the worker's own iteration plus
(averaging + that wait) / H. An averaging follows H steps of compute, so gloo's threads must be woken
for it (``inputs.wake``, measured).
"""

from __future__ import annotations

from ...costs.inputs import Compute, ModelFacts, Network, allreduce, allreduce_cpu, cpu_bound, meeting_wait, wake
from ...costs.model import Alternative, CostModel
from ...costs.prediction import Prediction


def predict_local_sgd(compute: Compute, facts: ModelFacts, net: Network, workers: int,
                      sync_every: int) -> Prediction:
    examples = workers * facts.batch_size
    if workers == 1:
        return Prediction("local-sgd", 1, 1, compute.step, examples, compute.step, compute.step)
    nbytes = facts.param_bytes
    reduce = allreduce(net, workers, nbytes) + wake(compute, facts, net)
    average = compute.pack + compute.copy + reduce  # flatten into a new vector, divide it, all-reduce
    copied = (compute.pack + compute.copy + allreduce_cpu(net, workers, nbytes)) / sync_every
    notes = [f"parameters ({nbytes / 1e6:.3g} MB) averaged every {sync_every} steps: "
             f"{average * 1e3:.3g} ms each, {average / sync_every * 1e3:.3g} ms per step"]
    return periodic("local-sgd", compute, net, workers, examples, sync_every, average / sync_every, copied, notes,
                    {"averaging": average, "per_step_averaging": average / sync_every})


def periodic(name: str, compute: Compute, net: Network, workers: int, examples: int, sync_every: int,
             rounds: float, rounds_cpu: float, notes: list[str], parts: dict, meetings: int = 1) -> Prediction:
    """A step of local work plus ``rounds`` seconds of periodic rounds per step (``rounds_cpu`` of them
    CPU-seconds), where the workers meet ``meetings`` times every ``sync_every`` steps and wait there for
    the slowest one's lead (``parts["meeting_wait"]``: seconds a meeting): local SGD's averaging, DiLoCo's
    outer rounds. Bound below by the cores they share."""
    wait = meeting_wait(compute, sync_every / meetings)
    waiting = wait * meetings / sync_every
    timeline = compute.step + rounds + waiting
    if wait > 0:
        notes = notes + [f"waiting for the slowest worker's lead at each meeting: {wait * 1e3:.3g} ms, "
                         f"{waiting * 1e3:.3g} ms per step"]
    local = min(workers, net.per_node)
    floor = cpu_bound(local * (compute.cpu + rounds_cpu), compute.cores)
    if floor > timeline:
        notes = notes + [f"CPU-bound: {local} processes on {compute.cores} cores"]
    return Prediction(name, workers, net.nodes(workers), max(timeline, floor), examples,
                      compute.step + waiting, compute.step, notes=tuple(notes),
                      parts={"compute": compute.step, **parts, "meeting_wait": wait, "timeline": timeline,
                             "cpu_floor": floor})


class LocalSGDCost(CostModel):
    """Local steps and an averaging every H steps (:func:`predict_local_sgd`)."""

    title = "local-sgd"
    fields = ("sync_every",)

    def predict(self, options, compute: Compute, facts: ModelFacts, net: Network, workers: int) -> Prediction:
        return predict_local_sgd(compute, facts, net, workers, options.sync_every)

    def alternatives(self, options, compute: Compute, net: Network, workers: int) -> list[Alternative]:
        every = 2 * options.sync_every
        return [Alternative(f"--sync-every {every} (average half as often)", {"sync_every": every})]
