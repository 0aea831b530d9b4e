"""What a step costs beyond its compute and its bytes: measured with a 2-parameter model, priced once.

- the measurement runs the real code on gloo workers: DDP on 2, and the parameter server's protocol
  and server with a worker pushing while another computes (the server beside them times no step);
  every timed round comes after one real step (gloo's threads idle, as in training), and a long
  step means fewer rounds, the same on every rank;
- the summary takes the medians over the measuring processes, the server's missing figures left out;
- the cost models add exactly the measured figure less what they already price for that model (its
  all-reduce, its four messages), once per step (sync) or per update (ps), and say so in a note.
"""

import dataclasses

import pytest

from helpers import run_workers
from phalanx.costs import Compute, Link, ModelFacts, Network, allreduce, predict_ps, predict_sync
from phalanx.costs.ps import round_trip_fixed
from phalanx.costs.sync import ddp_fixed
from phalanx.estimate.overhead import MIN_STEPS, STEPS, WARMUP, fixed_costs
from phalanx.estimate.profile import Conditions, summarise

MS = 1e-3
LINK = Link(0.1 * MS, 1e-10, "test")
NET = Network(LINK, LINK, per_node=2)
FACTS = ModelFacts(("0", "1"), (1_000_000, 1_000_000), (4000, 40), ((4_000_000, 1), (4_000_000, 0)), 32)


def compute(**changes) -> Compute:
    values = dict(forward=10 * MS, backward=20 * MS, optimizer=2 * MS, loop=1 * MS, slowest=33 * MS, cpu=33 * MS,
                  processes=2, threads=1, cores=None, block_seconds=(1.0, 1.0), pack=0.5 * MS, copy=0.5 * MS,
                  unpack=0.5 * MS, apply=3 * MS)
    values.update(changes)
    return Compute(**values)


def _every_rank(ctx, beside, step_s=1e-3):
    import torch
    import torch.distributed as dist

    w = torch.randn(64, 64)
    steps = []

    def work():  # a worker's real step, while another pushes
        steps.append((w @ w).sum().item())

    mine = {**fixed_costs(ctx, beside, work, step_s if ctx.rank == ctx.world_size - 1 else 0.0),
            "work": len(steps)}  # the last rank's step is the slowest: every rank takes its round count
    every = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    return every


ROWS = {"rows": [(1, 1, 1, 1, 1)], "blocks": [1.0], "micro": {}, "pack": 0.0, "copy": 0.0, "unpack": 0.0,
        "apply": 0.0, "fresh": 0.0}


def test_a_tiny_models_ddp_step_is_measured_on_two_workers():
    every = run_workers(_every_rank, 2, 0)
    assert all(r["ddp_tiny"] >= 0 and r["allreduce_tiny"] > 0 and r["round_trip_tiny"] is None for r in every)
    assert every[0]["allreduce_tiny"] == every[1]["allreduce_tiny"]  # each round's least over the ranks
    assert [r["work"] for r in every] == [3 * (WARMUP + STEPS)] * 2  # a real step before each bare, DDP, all-reduce
    slow = run_workers(_every_rank, 2, 0, 1.0)  # a 1-second step: the fewest rounds, on both ranks
    assert [r["work"] for r in slow] == [3 * (WARMUP + MIN_STEPS)] * 2
    every = [{k: v for k, v in r.items() if k != "work"} for r in every]
    c = summarise([{**ROWS, **r} for r in every], Conditions(2, 1, "cpu"), cores=2)
    assert c.ddp_tiny == pytest.approx((every[0]["ddp_tiny"] + every[1]["ddp_tiny"]) / 2) and c.round_trip_tiny == 0
    assert c.allreduce_tiny == every[0]["allreduce_tiny"]
    alone = summarise([{**ROWS, "ddp_tiny": 0.0, "allreduce_tiny": 0.0, "round_trip_tiny": 0.0}],
                      Conditions(1, 2, "cpu"), cores=2)
    assert (alone.ddp_tiny, alone.allreduce_tiny, alone.round_trip_tiny) == (0.0, 0.0, 0.0)


def test_a_ps_round_trip_is_measured_through_the_real_server_while_another_worker_computes():
    server, pusher, computing = run_workers(_every_rank, 3, 1)  # rank 0 beside the two workers: the server
    assert pusher["round_trip_tiny"] > 0 and server["round_trip_tiny"] is computing["round_trip_tiny"] is None
    assert pusher["allreduce_tiny"] is None
    assert pusher["work"] == WARMUP + STEPS and server["work"] == 0  # a real step before each push
    c = summarise([{"beside": True, **server}, {**ROWS, **pusher}, {**ROWS, **computing}],
                  Conditions(2, 1, "cpu", beside=1), cores=2)
    assert c.round_trip_tiny == pusher["round_trip_tiny"] and c.ddp_tiny == 0
    assert c.forward == 1 and c.processes == 2  # the server's result holds no step: left out


def test_sync_adds_ddps_fixed_work_once_per_step_less_the_all_reduce_it_prices():
    plain = predict_sync(compute(), FACTS, NET, 2)
    c = compute(ddp_tiny=1.5 * MS)
    fixed = 1.5 * MS - allreduce(NET, 2, 8)  # the tiny model's 8-byte all-reduce: 2 messages of 0.1 ms
    assert ddp_fixed(c, NET) == pytest.approx(1.3 * MS, rel=1e-3) == pytest.approx(fixed)
    p = predict_sync(c, FACTS, NET, 2)
    assert p.step == pytest.approx(plain.step + fixed) and p.parts["fixed"] == pytest.approx(fixed)
    assert any(note.startswith("DDP's fixed work: 1.3 ms per step") for note in p.notes)
    assert ddp_fixed(compute(ddp_tiny=0.1 * MS), NET) == 0.0  # less than its all-reduce: nothing left to add
    assert predict_sync(c, FACTS, NET, 1).step == c.step  # one process: no DDP


def test_ps_adds_the_protocols_fixed_waiting_to_every_workers_cycle_less_its_four_messages():
    one = compute(forward=1 * MS, backward=2 * MS, loop=0.0, pack=0.0, unpack=0.0, apply=0.5 * MS)
    c = dataclasses.replace(one, round_trip_tiny=2 * MS)
    fixed = 2 * MS - 2 * (LINK.alpha + LINK.message(8))  # a header and the vector, each way
    assert round_trip_fixed(c, NET) == pytest.approx(fixed) == pytest.approx(1.6 * MS, rel=1e-3)
    # One worker cycles through compute, push, the update, the reply: longer by the fixed waiting.
    p = predict_ps(c, FACTS, NET, 1)
    assert p.step == pytest.approx(predict_ps(one, FACTS, NET, 1).step + fixed)
    assert p.parts["fixed"] == pytest.approx(fixed)
    assert any("the protocol's fixed waiting: 1.6 ms per update" in note for note in p.notes)
    # Many workers keep the server busy: it is the bottleneck either way, and the waiting, which is not its
    # work, leaves its pace alone.
    assert predict_ps(c, FACTS, NET, 64).step == pytest.approx(predict_ps(one, FACTS, NET, 64).step, rel=1e-3)


def test_a_periodic_round_pays_the_measured_wake_once_less_the_all_reduce_it_prices():
    """local SGD's averaging and DiLoCo's outer round follow H steps of compute: each adds the tiny all-reduce
    measured after a real step, less that all-reduce's price, once per round (so 1/H per step)."""
    from phalanx.costs import predict_diloco, predict_local_sgd
    from phalanx.costs.inputs import wake

    c = compute(allreduce_tiny=2.2 * MS)
    extra = 2.2 * MS - allreduce(NET, 2, 8)
    assert wake(c, NET) == pytest.approx(extra) == pytest.approx(2.0 * MS, rel=1e-3)
    for predict in (lambda c: predict_local_sgd(c, FACTS, NET, 2, 8), lambda c: predict_diloco(c, FACTS, NET, 2, 8)):
        assert predict(c).step == pytest.approx(predict(compute()).step + extra / 8)
    assert wake(compute(allreduce_tiny=0.1 * MS), NET) == 0.0 and wake(compute(processes=1, allreduce_tiny=1.0), NET) == 0.0
