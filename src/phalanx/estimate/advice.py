"""What would help most, at the largest worker count asked: each change tried in the model, kept if it pays.

For every strategy its own cost model is run again with one thing changed: a per-worker batch
twice as large (where the cost model can predict it from the measured compute: forward, backward
and the block times double, the optimizer does not), then each change the strategy's cost model
proposes (``CostModel.alternatives``: ``--compress bf16``, ``--reduce hierarchical``, ``--sync-every``
doubled, twice the micro-batches, or another strategy in its place, predicted under that strategy's
own conditions where they were measured). A change is reported only when it raises examples per
second by at least :data:`WORTH`; the best come first.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..costs import Alternative, Compute, Network, Prediction
from .setup import Row, Setup, conditions_for, plan_row, predict

WORTH = 0.05  #: a change must raise examples/s by at least 5% to be named
KEEP = 3  #: at most this many suggestions per strategy


def doubled_batch(compute: Compute) -> Compute:
    """The same worker with twice the examples per step: forward, backward and blocks take twice as long."""
    grown = compute.forward + compute.backward
    step = compute.step + grown
    scale = step / compute.step if compute.step > 0 else 2.0
    return dataclasses.replace(
        compute, forward=2 * compute.forward, backward=2 * compute.backward, slowest=compute.slowest * scale,
        cpu=compute.cpu * scale, block_seconds=tuple(2 * s for s in compute.block_seconds))


def advise(setup: Setup, row: Row, top: Prediction, computes: dict, net: Network) -> list[str]:
    """Lines naming the changes that help ``row`` (a strategy at its largest worker count), best first."""
    if top.workers == 1:
        return []
    compute = computes[conditions_for(setup, row)]
    tries: list[tuple[str, Prediction, str]] = []
    if row.cost.scales_with_batch:
        facts = dataclasses.replace(setup.facts, batch_size=2 * setup.facts.batch_size)
        tries.append((f"--batch-size {facts.batch_size} (twice the per-worker batch)",
                      predict(setup, row, doubled_batch(compute), net, facts=facts),
                      "compute assumed proportional to the batch"))
    for alternative in row.cost.alternatives(row.options, compute, net, row.workers):
        tried = _attempt(setup, row, alternative, compute, computes, net)
        if tried is not None:
            tries.append((alternative.label, tried, alternative.note))
    return [_line(label, top, alt, note) for label, alt, note in _best(top, tries)]


def _attempt(setup: Setup, row: Row, alternative: Alternative, compute: Compute, computes: dict,
             net: Network) -> Optional[Prediction]:
    """The row with the change made: new options, or another strategy (None where its layout refuses the
    workers or its conditions were not measured)."""
    if alternative.strategy is None:
        return predict(setup, row, compute, net, options=dataclasses.replace(row.options, **alternative.changes))
    other, _ = plan_row(setup, setup.strategies[alternative.strategy], row.workers)
    if other is None:
        return None
    measured = computes.get(conditions_for(setup, other))
    return predict(setup, other, measured, net) if measured is not None else None


def _best(top: Prediction, tries: list[tuple[str, Prediction, str]]) -> list[tuple[str, Prediction, str]]:
    gains = [(alt.examples_per_s / top.examples_per_s - 1, label, alt, note) for label, alt, note in tries
             if top.examples_per_s > 0]
    kept = sorted((g for g in gains if g[0] >= WORTH), key=lambda g: -g[0])[:KEEP]
    return [(label, alt, note) for _, label, alt, note in kept]


def _line(label: str, top: Prediction, alt: Prediction, note: Optional[str]) -> str:
    gain = alt.examples_per_s / top.examples_per_s - 1
    text = (f"{label}: {top.examples_per_s:,.0f} -> {alt.examples_per_s:,.0f} examples/s (+{gain:.0%}) on "
            f"{top.workers} workers, efficiency {top.efficiency:.2f} -> {alt.efficiency:.2f}")
    return text + (f" ({note})" if note else "")
