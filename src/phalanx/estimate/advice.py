"""What would help most, at the largest worker count asked: each change tried in the model, kept if it pays.

For every strategy the same cost model is run again with one thing changed: a per-worker batch
twice as large (compute assumed proportional to the batch: forward, backward and the block times
double, the optimizer does not), ``--compress bf16`` (half the bytes on the wire),
``--reduce hierarchical`` (where workers span machines with several per machine), ``--sync-every``
doubled, twice the micro-batches (measured at that size), or ``sync`` in place of ``ps``. A change is
reported only when it raises examples per second by at least :data:`WORTH`; the best come first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..costs import Compute, Network, Prediction
from .setup import Setup, conditions_for, predict

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


def advise(setup: Setup, strategy: str, rows: list[Prediction], computes: dict, net: Network) -> list[str]:
    """Lines naming the changes that help ``strategy`` at its largest worker count, best first."""
    if not rows or rows[-1].workers == 1:
        return []
    top = rows[-1]
    n = top.workers
    compute = computes[conditions_for(setup, strategy, n)]
    tries: list[tuple[str, Prediction, str]] = []

    def attempt(label: str, note: str = "", **changes: Any) -> None:
        tries.append((label, predict(setup, strategy, n, compute, net, **changes), note))

    if strategy != "pipeline":
        facts = dataclasses.replace(setup.facts, batch_size=2 * setup.facts.batch_size)
        tries.append((f"--batch-size {facts.batch_size} (twice the per-worker batch)",
                      predict(setup, strategy, n, doubled_batch(compute), net, facts=facts),
                      "compute assumed proportional to the batch"))
    if strategy == "sync":
        if setup.sync.compress is None:
            attempt("--compress bf16 (half the bytes on the wire)", compress="bf16")
        if net.nodes(n) > 1 and net.per_node > 1 and setup.sync.reduce == "flat":
            attempt("--reduce hierarchical (within each machine first, then one leader per machine)",
                    hierarchical=True)
    if strategy == "local-sgd":
        every = 2 * setup.local_sgd.sync_every
        attempt(f"--sync-every {every} (average half as often)", sync_every=every)
    if strategy == "pipeline":
        m = 2 * setup.pipeline.chunks
        if m in compute.micro_seconds:
            attempt(f"--chunks {m} (more micro-batches: a smaller bubble)", chunks=m)
    if strategy == "ps":
        sync = computes.get(conditions_for(setup, "sync", n))
        if sync is not None:
            tries.append(("--strategy sync (every worker's gradient in one all-reduce, no server)",
                          predict(setup, "sync", n, sync, net), "per update; asynchrony changes convergence too"))
    return [_line(label, top, alt, note) for label, alt, note in _best(top, tries)]


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
