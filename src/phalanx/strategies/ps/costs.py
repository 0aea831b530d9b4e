"""``ps``: W workers push gradients to one server and pull the parameters back. Pure.

Per global step (W gradients) the server's link carries W gradients in and W parameter copies
out, each a header message and the vector, received into a newly allocated buffer (whose first
touch, page faults, is measured). A worker's cycle: compute a gradient (forward, backward, flatten),
push it, wait while the
server applies it (scale, copy in, optimizer step, flatten) and sends the parameters back (a
blocking send: the server's main thread is busy until it is gone), copy them in, start again.
Pushes arrive on the server's receiving threads while its main thread works, one at a time on
its inbound link; the main thread serves them in arrival order. :func:`simulate` plays this out,
event by event, for the given durations; the step is the steady-state time per W updates.

Past :data:`SIMULATED_UP_TO` workers the event simulation (40 updates per worker, every one an
event) would cost time and memory in proportion to W, so the steady state is taken in closed form
instead (:func:`steady_state`): the workers' cycles, the server's inbound link and its main thread
are three resources, and the slowest one sets the rate; tests check it against the simulation.

The protocol's own work (a header each way, the server's receiving thread handing the push to its
main loop, the reply handed to a sender thread, each thread waiting for a core the workers keep
busy) grows with neither the model nor the compute: measured as a real round trip with a
2-parameter model while the other workers compute (:func:`round_trip_fixed`) and added to every
worker's cycle. It is waiting, not the server's work: a server kept busy by many workers does not
wake up for each push, so it is not charged to the server's time per update.

A CPU node also bounds the step from below: its cores must supply every process's CPU-seconds
(the workers' compute, the server's updates, and the copying of every byte through the loopback).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Optional

from ...costs.inputs import TINY_BYTES, Compute, ModelFacts, Network, cpu_bound
from ...costs.model import Alternative, CostModel
from ...costs.prediction import Prediction

if TYPE_CHECKING:
    from ..options import Options

SIMULATED_UPDATES = 40  #: updates per worker played out (the first quarter is the warm-up)
SIMULATED_UP_TO = 1024  #: workers played out event by event; more are taken in closed form


def simulate(workers: int, compute: list[float], push: list[float], reply: list[float], apply: float,
             unpack: float, server_loop: float = 0.0, updates: int = SIMULATED_UPDATES) -> float:
    """Seconds per global step (W applied gradients) in steady state.

    ``compute[i]``: worker i's seconds from having the parameters to having a gradient ready;
    ``push[i]`` / ``reply[i]``: moving a gradient in / the parameters out over worker i's link;
    ``apply``: the server's update; ``unpack``: the worker copying the parameters in;
    ``server_loop``: the server's own loop work once per global step.
    """
    ready = [(compute[i], i) for i in range(workers)]  # (time its push is ready to go, worker)
    heapq.heapify(ready)
    inbound = server = 0.0
    ends: list[float] = []
    total = updates * workers
    while len(ends) < total:
        t, i = heapq.heappop(ready)
        arrived = max(t, inbound) + push[i]  # pushes cross the server's inbound link one at a time
        inbound = arrived
        start = max(arrived, server)
        server = start + apply + reply[i]
        if (len(ends) + 1) % workers == 0:
            server += server_loop
        ends.append(server)
        heapq.heappush(ready, (server + unpack + compute[i], i))
    warm = total // 4
    steps = (total - warm) / workers
    return (ends[-1] - ends[warm - 1]) / steps if warm >= 1 else ends[-1] / (total / workers)


def steady_state(groups: list[tuple[int, float, float, float]], apply: float, unpack: float,
                 server_loop: float = 0.0) -> float:
    """Seconds per global step in steady state, in closed form: ``groups`` are (workers, compute, push,
    reply) for workers alike (those on the server's machine, those on others).

    Updates per second are bounded by the workers' cycles (each computes, pushes, waits for its update
    and reply, unpacks: sum of count / cycle), by the inbound link (one push at a time) and by the
    server's main thread (an update and a reply each, and its loop once per W updates); W updates
    make a global step.
    """
    workers = sum(n for n, _, _, _ in groups)
    cycles = sum(n / (c + p + apply + r + unpack) for n, c, p, r in groups)
    inbound = sum(n * p for n, _, p, _ in groups) / workers
    server = apply + sum(n * r for n, _, _, r in groups) / workers + server_loop / workers
    rate = min(cycles, 1.0 / max(inbound, 1e-30), 1.0 / max(server, 1e-30))
    return workers / rate


def round_trip_fixed(compute: Compute, net: Network) -> float:
    """The protocol's fixed seconds per update: the measured round trip of a 2-parameter model
    (``compute.round_trip_tiny``) less the four messages (a header and the vector each way) this model
    prices itself for it on the link within a machine."""
    if compute.round_trip_tiny <= 0:
        return 0.0
    priced = 2 * (net.intra.alpha + net.intra.message(TINY_BYTES))
    return max(0.0, compute.round_trip_tiny - priced)


def worker_work(compute: Compute) -> float:
    """A worker's seconds from having the parameters to having a gradient ready to push."""
    return compute.forward + compute.backward + compute.loop + compute.pack


def message_seconds(compute: Compute, facts: ModelFacts, net: Network, workers: int) -> list[float]:
    """Each worker's push (or reply): a header message and the vector, received into a newly allocated
    buffer; the first ``per_node`` workers share the server's machine, the others reach it over ``inter``."""
    near, far = (link.alpha + link.message(facts.param_bytes) + compute.fresh for link in (net.intra, net.inter))
    local = min(workers, net.per_node)
    return [near] * local + [far] * (workers - local)


def predict_ps(compute: Compute, facts: ModelFacts, net: Network, workers: int) -> Prediction:
    """W workers and one server on node 0 (the server shares node 0 with the first workers)."""
    nbytes = facts.param_bytes
    local = min(workers, net.per_node)  # workers on node 0, with the server; the rest reach it over inter
    work = worker_work(compute)
    messages = message_seconds(compute, facts, net, workers)
    near, far = messages[0], messages[-1]
    slowest = far if workers > local else near
    fixed = round_trip_fixed(compute, net)
    cycle = work + fixed  # what a worker spends from one reply to its next push, the protocol's waiting included
    if workers <= SIMULATED_UP_TO:
        timeline = simulate(workers, [cycle] * workers, messages, messages, compute.apply, compute.unpack,
                            compute.loop)
    else:
        timeline = steady_state([(local, cycle, near, near), (workers - local, cycle, far, far)], compute.apply,
                                compute.unpack, compute.loop)
    # CPU-seconds on node 0 per global step: its workers, the server's updates, and moving every
    # message (a header and a vector each way per update) at both of its ends on node 0.
    exchange = 2 * net.intra.cpu(2, nbytes)  # one update's messages, at one end
    worker_cpu = compute.cpu_share(without_optimizer=True) + compute.pack + compute.unpack
    node0 = local * (worker_cpu + exchange) + workers * (compute.apply + exchange)
    floor = cpu_bound(node0, compute.cores)
    step = max(timeline, floor)
    nodes = max(net.nodes(workers), 1)
    server_bound = workers * (compute.apply + slowest) >= cycle
    how = "event simulation" if workers <= SIMULATED_UP_TO else "steady state (closed form)"
    notes = [f"{how} of {workers} workers and one server: "
             f"{'the server is the bottleneck' if server_bound else 'workers compute most of the time'}"]
    if fixed > 0:
        notes.append(f"the protocol's fixed waiting: {fixed * 1e3:.3g} ms per update (measured: a 2-parameter model's "
                     "round trip through the server while another worker computes, less its four messages)")
    if floor > timeline:
        notes.append(f"CPU-bound: node 0 needs {node0 * 1e3:.1f} CPU-ms per step on {compute.cores} cores "
                     f"({local} workers + the server)")
    return Prediction("ps", workers, nodes, step, workers * facts.batch_size, work, work,
                      notes=tuple(notes),
                      parts={"worker_compute": work, "push_or_reply": slowest, "server_apply": compute.apply,
                             "fixed": fixed, "timeline": timeline, "cpu_floor": floor})


class ParameterServerCost(CostModel):
    """W workers and one server (:func:`predict_ps`); ``instead``: the synchronous strategy the advice
    compares it with (every gradient in one all-reduce, no server)."""

    title = "ps (parameter server; a step is W updates)"

    def __init__(self, instead: Optional[type[Options]] = None):
        self.instead = instead

    def predict(self, options, compute: Compute, facts: ModelFacts, net: Network, workers: int) -> Prediction:
        return predict_ps(compute, facts, net, workers)

    def alternatives(self, options, compute: Compute, net: Network, workers: int) -> list[Alternative]:
        if self.instead is None:
            return []
        return [Alternative(f"--strategy {self.instead.name} (every worker's gradient in one all-reduce, no server)",
                            strategy=self.instead, note="per update; asynchrony changes convergence too")]
