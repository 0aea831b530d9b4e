"""``diloco``: H local steps, then the averaged pseudo-gradient applied by an outer optimizer. Pure.

Per step a worker runs its own iteration; a fragment's round (every fragment once every H steps,
staggered, so a round moves 1/F of the model) costs: the pseudo-gradient (global − local: one pass
over the fragment), its reduction on the wire in the outer precision, the outer Nesterov step on
the global copy, and the copy back into the local weights (three more passes). The reduction is an
all-reduce for fp32 and bf16 (bf16 halves the bytes), and an all-gather of int8 values for int8
(a quarter of the bytes per rank, but W of them arrive: it pays up to about 8 workers; see
``strategies/diloco/``). As in local SGD, the workers meet only at a round, where the slowest
one's lead over the H steps is waited for.
"""

from __future__ import annotations

from ...costs.inputs import Compute, ModelFacts, Network, allreduce, allreduce_cpu, gather_or_scatter, wake
from ..local_sgd.costs import periodic
from ...costs.model import Alternative, CostModel
from ...costs.prediction import Prediction

#: Bytes on the wire per fp32 byte of pseudo-gradient, by outer precision.
WIRE_SHARE = {"fp32": 1.0, "bf16": 0.5, "int8": 0.25}


def round_seconds(net: Network, workers: int, nbytes: float, precision: str) -> float:
    """The link time of one round that reduces ``nbytes`` of fp32 pseudo-gradient."""
    wire = nbytes * WIRE_SHARE[precision]
    if precision == "int8":  # every rank's int8 values reach every rank
        return gather_or_scatter(net, workers, wire * workers)
    return allreduce(net, workers, wire)


def predict_diloco(compute: Compute, facts: ModelFacts, net: Network, workers: int, sync_every: int,
                   fragments: int = 1, precision: str = "fp32") -> Prediction:
    examples = workers * facts.batch_size
    if workers == 1:
        return Prediction("diloco", 1, 1, compute.step, examples, compute.step, compute.step)
    nbytes = facts.param_bytes / fragments  # one fragment's share
    passes = compute.copy * 4 / fragments  # pseudo-gradient, outer step, copy back: over 1/F of the model
    reduce = round_seconds(net, workers, nbytes, precision) + wake(compute, facts, net)  # a round follows compute
    rounds_per_step = fragments / sync_every
    cpu_per_step = rounds_per_step * (passes + allreduce_cpu(net, workers, nbytes * WIRE_SHARE[precision]))
    notes = [f"pseudo-gradient of {nbytes / 1e6:.3g} MB ({precision} on the wire) reduced {fragments} time(s) "
             f"every {sync_every} steps: {reduce * 1e3:.3g} ms each, {rounds_per_step * reduce * 1e3:.3g} ms per step"]
    return periodic("diloco", compute, net, workers, examples, sync_every, rounds_per_step * (passes + reduce),
                    cpu_per_step, notes,
                    {"round": passes + reduce, "per_step_rounds": rounds_per_step * (passes + reduce)}, fragments)


class DiLoCoCost(CostModel):
    """Local steps and staggered outer rounds (:func:`predict_diloco`)."""

    title = "diloco"
    fields = ("sync_every", "fragments", "outer_precision")

    def predict(self, options, compute: Compute, facts: ModelFacts, net: Network, workers: int) -> Prediction:
        return predict_diloco(compute, facts, net, workers, options.sync_every, options.fragments,
                              options.outer_precision)

    def alternatives(self, options, compute: Compute, net: Network, workers: int) -> list[Alternative]:
        every = 2 * options.sync_every
        found = [Alternative(f"--sync-every {every} (outer rounds half as often)", {"sync_every": every})]
        if options.outer_precision == "fp32":
            found.append(Alternative("--outer-precision bf16 (half the bytes per round)", {"outer_precision": "bf16"}))
        return found
