"""``phalanx estimate`` from top to bottom: check, read the model, measure, predict, advise.

:func:`~phalanx.estimate.setup.prepare` checks the inputs and reads the model's sizes; :func:`run`
then measures a worker's step on this machine once per distinct condition (``profile.py``),
settles the links (``link.py``), asks each row's strategy for its cost model (``phalanx/costs/``),
and tries what could help (``advice.py``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import torch

from ..costs import Compute, Network, Prediction, modelled_cost
from ..errors import Stopped
from ..launcher.stop_signals import stop_if_asked, taken_between_steps
from .advice import advise
from .link import Link, describe_link, measure_link, ring_of_gpus
from .overhead import FIGURES
from .plausible import doubts, warning
from .profile import Conditions, ProbeSpec, describe_conditions, measure
from .setup import Setup, alone, conditions_for, predict, unknown_gpu_link

Say = Callable[[str], None]


@dataclasses.dataclass
class Estimate:
    setup: Setup
    baseline: Compute  #: one worker alone on this machine
    computes: dict  #: Conditions -> Compute
    network: Network
    link_notes: list[str]
    predictions: list[Prediction]
    advice: dict  #: strategy name -> lines
    #: what is implausible in the figures even measured twice (``plausible.py``): the report's warning line
    warnings: list = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        return {
            "model": s.task.model_name, "data": s.task.data_name, "input_shape": list(s.input_shape),
            "batch_size": s.config.batch_size, "optimizer": s.config.optimizer, "device": str(s.device),
            "cores": s.cores, "per_node": s.per_node, "parameters": s.facts.params,
            "gradient_bytes": s.facts.param_bytes, "ddp_buckets_bytes": [b for b, _ in s.facts.buckets],
            "compute": [{"processes": c.processes, "threads": c.threads, "device": c.device, "beside": c.beside,
                         **{k: getattr(m, k) for k in ("forward", "backward", "optimizer", "loop", "slowest", "cpu",
                                                       "step_stdev", "pack", "copy", "unpack", "apply", "fresh",
                                                       *FIGURES)},
                         "block_seconds": list(m.block_seconds),
                         "micro_batch_block_seconds": {str(k): list(v) for k, v in m.micro_seconds.items()},
                         "engine_per_micro_batch": {str(k): v for k, v in m.engine.items()}}
                        for c, m in self.computes.items()],
            "links": {"within_machine": self.network.intra.to_dict(), "between_machines": self.network.inter.to_dict(),
                      "notes": self.link_notes},
            "predictions": [dict(p.to_dict(), speedup=self.speedup(p)) for p in self.predictions],
            "skipped": s.skipped, "advice": self.advice, "warnings": self.warnings,
        }

    def speedup(self, p: Prediction) -> float:
        """Examples per second over those of one worker training alone on this machine."""
        alone = self.setup.facts.batch_size / self.baseline.step
        return p.examples_per_s / alone


# --------------------------------------------------------------------------- measuring and predicting

def run(setup: Setup, say: Say) -> Estimate:
    try:
        with taken_between_steps():  # (a stop is taken after each measurement: its workers do not stop for one)
            return _run(setup, say)
    except Stopped as e:  # (the launcher words it for training: "before the first step; nothing was saved")
        raise Stopped(f"estimate stopped by {e.signame} while measuring; nothing was printed or written",
                      e.signame) from None


def _run(setup: Setup, say: Say) -> Estimate:
    spec = _probe_spec(setup)
    baseline_at = alone(setup)
    wanted = list(dict.fromkeys([baseline_at] + [conditions_for(setup, row) for row in setup.rows]))
    computes = _measure(spec, wanted, say)
    network, notes = settle_links(setup, say)
    stop_if_asked()
    est = _predict(setup, baseline_at, computes, network, notes)
    found = doubts(est.baseline, est.computes, est.predictions, est.speedup)
    if found:
        say(f"implausible: {found[0]}; measuring again")
        again = _measure(spec, wanted, say)
        # Other work only ever slows a measurement down: of the two, the faster is the less disturbed.
        computes = {cond: min(computes[cond], again[cond], key=lambda m: m.step) for cond in wanted}
        est = _predict(setup, baseline_at, computes, network, notes)
        found = doubts(est.baseline, est.computes, est.predictions, est.speedup)
        est.warnings = [warning(found)] if found else []
    advice = {}
    for cls in setup.predicted:
        mine = [(row, p) for row, p in zip(setup.rows, est.predictions) if type(row.options) is cls]
        if mine:
            advice[cls.name] = advise(setup, *mine[-1], est.computes, network)
    est.advice = {name: lines for name, lines in advice.items() if lines}
    return est


def _measure(spec: ProbeSpec, wanted: list[Conditions], say: Say) -> dict[Conditions, Compute]:
    computes: dict[Conditions, Compute] = {}
    for cond in wanted:
        started = time.perf_counter()
        say(f"measuring compute: {describe_conditions(cond)} ...")
        computes[cond] = measure(spec, cond)
        stop_if_asked()
        say(f"  done in {time.perf_counter() - started:.1f} s")
    return computes


def _predict(setup: Setup, baseline_at: Conditions, computes: dict, network: Network, notes: list[str]) -> Estimate:
    predictions = [predict(setup, row, computes[conditions_for(setup, row)], network) for row in setup.rows]
    return Estimate(setup, computes[baseline_at], computes, network, notes, predictions, {})


def _probe_spec(setup: Setup) -> ProbeSpec:
    """What to measure: the step, and every block at the micro-batch counts any predicted row needs."""
    batch = setup.config.batch_size
    rowed = {type(row.options) for row in setup.rows}  # (a strategy refused on this task measures nothing)
    micro = {m for cls in setup.predicted if cls in rowed for m in
             modelled_cost(cls).micro_batches(setup.strategies[cls], batch)}
    return ProbeSpec(setup.config, setup.options.measure_steps, tuple(sorted(micro)), task=setup.task,
                     bucket_mb=setup.bucket_mb)


# --------------------------------------------------------------------------- the links

def settle_links(setup: Setup, say: Say) -> tuple[Network, list[str]]:
    """The link within a machine and between machines, and a line saying where each comes from."""
    opts = setup.options
    given = Link(opts.link_latency, 1.0 / opts.link_bandwidth, "given by --link-bandwidth and --link-latency") \
        if opts.link_bandwidth is not None and opts.link_latency is not None else None
    spans = max(opts.workers) > setup.per_node
    intra = _intra_link(setup, given, say)
    notes = [f"within a machine: {describe_link(intra)}"]
    if given is not None:
        inter = given
    elif not spans:
        inter = intra
    else:  # (CPU workers: on GPUs, setup.prepare refused a span without --link-*)
        inter = dataclasses.replace(intra, shared_copy=False,
                                    source="assumed equal to the link within a machine: give --link-bandwidth and "
                                           "--link-latency for your network")
    if spans:
        notes.append(f"between machines: {describe_link(inter)}")
    return Network(intra, inter, setup.per_node), notes


def _intra_link(setup: Setup, given: Optional[Link], say: Say) -> Link:
    opts = setup.options
    if setup.device.type == "cpu":
        # Nothing else tells the link between local CPU processes: measured unless --link-* is given
        # (setup refuses --no-measure-link without --link-*).
        if opts.measure_link or (opts.measure_link is None and given is None):
            say("measuring the link: all-reduces between 2 local gloo ranks ...")
            return measure_link("cpu")[0]
        assert given is not None, "setup refuses --no-measure-link without --link-*"
        return dataclasses.replace(given, source=given.source + " (--measure-link measures this machine's own)")
    if opts.measure_link:
        say("measuring the link: NCCL all-reduces between cuda:0 and cuda:1 ...")
        return measure_link("cuda")[0]
    gpus = torch.cuda.device_count()
    if setup.per_node >= 2 and gpus >= 2:
        from ..topology import detect_topology

        topo = detect_topology(peer=False)
        link = ring_of_gpus(topo.links, min(setup.per_node, len(topo.gpus))) if len(topo.gpus) >= 2 else None
        if link is not None:
            return link
    if given is not None:
        return given
    if setup.per_node >= 2:
        raise unknown_gpu_link(setup.per_node, gpus)
    return Link(0.0, 1e-18, "not used: one GPU per machine and every job on one machine")
