"""The user's problem, read once for a whole simulated comparison: the task, the data, the clock's inputs.

The clock's inputs are the estimate's: a worker's step measured on this machine under the
conditions it would run in (``estimate/profile.py``: the same probe ``phalanx estimate`` runs),
or ``--step-time`` for a device that is not here; the model's sizes (``estimate/facts.py``); the
link within a machine (measured here, as the estimate measures it) and between machines
(``--link-bandwidth``/``--link-latency``). Every strategy's cost model prices its steps from these.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from ..costs import Compute, Link, Network
from ..task import Task, task_from
from ..simulate.problem import Problem
from ..train import TrainConfig


def compute_from_step_time(seconds: float, block_count: int) -> Compute:
    """A worker's step given as one figure (``--step-time``, for a device that is not here): a third
    forward, two thirds backward (the usual ratio), the optimizer and loop inside it, nothing CPU-bound."""
    return Compute(forward=seconds / 3, backward=2 * seconds / 3, optimizer=0.0, loop=0.0, slowest=seconds,
                   cpu=seconds, processes=1, threads=1, cores=None,
                   block_seconds=tuple([seconds / max(block_count, 1)] * block_count))


def build_problem(train: TrainConfig, workers: tuple[int, ...], per_node: Optional[int], step_time: Optional[float],
                  link: Optional[Link], say: Callable[[str], None], task: Optional[Task] = None,
                  beside: int = 0) -> Problem:
    """Read the task (``task``: the comparison's, else the config's names) and the model; measure (or
    take) the step and the links. ``beside``: processes some strategy runs beside its workers (a
    parameter server), whose round trip is measured with them, as the estimate measures it
    (``estimate/overhead.py``)."""
    from ..estimate.facts import model_facts
    from ..estimate.link import describe_link, measure_link
    from ..launcher import available_cores
    from ..devices import resolve_devices
    from ..train.checks import data_facts
    from ..train.step_checks import check_model

    task = task or task_from(train)
    cfg = train.resolved(task.model_name)
    problem = Problem(cfg, task, None, None, None)  # type: ignore[arg-type]
    data = problem.data(cfg.seed)
    model = problem.model(cfg.seed)  # on the CPU: the checks and the facts look at it as train's do
    shapes = data_facts(cfg, data)
    check_model(model, shapes, task.loss_fn, task.metrics, task.step)  # as train checks it: one line, not a traceback
    facts = model_facts(model, shapes.example, cfg.batch_size, step=task.step)
    device = resolve_devices(cfg.devices, cfg.strict_devices)[0]
    per_node = per_node or (torch.cuda.device_count() if device.type == "cuda" else 2)
    notes = []
    if step_time is not None:
        compute = compute_from_step_time(step_time, len(facts.block_names))
        notes.append(f"compute: --step-time {step_time * 1e3:.3g} ms per worker step")
    else:
        local = min(max(workers), per_node)
        compute = _measured(cfg, task, device, local, available_cores(), say)
        notes.append(f"compute: measured here, {compute.processes} worker process(es) at once, {compute.threads} "
                     f"thread(s) each: {compute.step * 1e3:.3g} ms per step")
        if beside and device.type == "cpu":
            server = _measured(cfg, task, device, local, available_cores(), say, beside)
            trip = server.round_trip_tiny
            compute = dataclasses.replace(compute, round_trip_tiny=trip, round_trip_spread=server.round_trip_spread)
            notes.append(f"a parameter server's round trip of a 2-parameter model, another worker computing: "
                         f"{trip * 1e3:.3g} ms, measured here (beyond its four messages, every ps update waits it)")
    if link is not None:
        intra = inter = link
    else:
        say("measuring the link: all-reduces between 2 local gloo ranks ...")
        intra = measure_link("cpu")[0] if device.type == "cpu" else Link(0.0, 1e-18, "not modelled")
        inter = dataclasses.replace(intra, shared_copy=False,
                                    source="assumed equal to the link within a machine: give --link-bandwidth and "
                                           "--link-latency for your network")
    notes.append(f"link: {describe_link(inter)}; {per_node} workers per machine")
    problem.compute, problem.facts, problem.network = compute, facts, Network(intra, inter, per_node)
    problem.clock_notes = tuple(notes)
    problem.device = device  # the simulated workers' tensors from here on (every World's)
    return problem


def _measured(cfg: TrainConfig, task: Task, device: torch.device, local: int, cores: int, say,
              beside: int = 0) -> Compute:
    """The probe under these conditions. A probe with a server beside the workers runs for the server's
    round trip alone: its compute is not used, so it times the fewest steps the probe takes."""
    from ..estimate.profile import Conditions, ProbeSpec, describe_conditions, measure

    if device.type == "cuda":
        conditions = Conditions(1, cfg.threads or max(1, cores // local), "cuda:0")
    else:
        conditions = Conditions(local, cfg.threads or max(1, cores // (local + beside)), "cpu", beside)
    say(f"measuring compute: {describe_conditions(conditions)} ...")
    spec = ProbeSpec(cfg, 3, task=task, seconds=0.0) if beside else ProbeSpec(cfg, 20, task=task)
    return measure(spec, conditions)
