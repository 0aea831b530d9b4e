"""What a step costs beyond its compute and its bytes: measured with a 2-parameter model, priced once.

- the measurement runs the real code (DDP, the parameter server's protocol and server) on 2 gloo
  workers and hands back a DDP step's excess and a worker's round trip (the server times none);
- the summary takes the medians over the measuring processes, the server's missing round trip left out;
- the cost models add exactly the measured figure less what they already price for that model (its
  all-reduce, its four messages), once per step (sync) or per update (ps), and say so in a note.
"""

import dataclasses

import pytest

from helpers import run_workers
from phalanx.costs import Compute, Link, ModelFacts, Network, allreduce, predict_ps, predict_sync
from phalanx.costs.ps import round_trip_fixed
from phalanx.costs.sync import ddp_fixed
from phalanx.estimate.overhead import fixed_costs
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


def _both_ranks(ctx):
    import torch.distributed as dist

    mine = fixed_costs(ctx)
    every = [None, None]
    dist.all_gather_object(every, mine)
    return every


def test_the_real_ddp_step_and_ps_round_trip_of_a_tiny_model_are_measured_on_two_workers():
    server, worker = run_workers(_both_ranks, 2)
    assert server["ddp_tiny"] >= 0 and worker["ddp_tiny"] >= 0
    assert server["round_trip_tiny"] is None and worker["round_trip_tiny"] > 0  # only a worker times replies
    ops = {"pack": 0.0, "copy": 0.0, "unpack": 0.0, "apply": 0.0, "fresh": 0.0}
    rows = {"rows": [(1, 1, 1, 1, 1)], "blocks": [1.0], "micro": {}}
    c = summarise([{**rows, **ops, **server}, {**rows, **ops, **worker}], Conditions(2, 1, "cpu"), cores=2)
    assert c.round_trip_tiny == worker["round_trip_tiny"]
    assert c.ddp_tiny == pytest.approx((server["ddp_tiny"] + worker["ddp_tiny"]) / 2)
    alone = summarise([{**rows, **ops, "ddp_tiny": 0.0, "round_trip_tiny": 0.0}], Conditions(1, 2, "cpu"), cores=2)
    assert (alone.ddp_tiny, alone.round_trip_tiny) == (0.0, 0.0)


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


def test_ps_charges_the_protocols_fixed_work_to_every_update_less_its_four_messages():
    one = compute(forward=1 * MS, backward=2 * MS, loop=0.0, pack=0.0, unpack=0.0, apply=0.5 * MS)
    c = dataclasses.replace(one, round_trip_tiny=2 * MS)
    fixed = 2 * MS - 2 * (LINK.alpha + LINK.message(8))  # a header and the vector, each way
    assert round_trip_fixed(c, NET) == pytest.approx(fixed) == pytest.approx(1.6 * MS, rel=1e-3)
    # One worker cycles through compute, push, the update, the reply: the update is longer by the fixed work.
    assert predict_ps(c, FACTS, NET, 1).step == pytest.approx(predict_ps(one, FACTS, NET, 1).step + fixed)
    # Four workers whose updates outlast their compute: the server is the bottleneck, each update costs it more.
    many = predict_ps(c, FACTS, NET, 4)
    assert many.step >= 4 * (0.5 * MS + fixed) and many.parts["fixed"] == pytest.approx(fixed)
    assert any("the protocol's fixed work: 1.6 ms per update" in note for note in many.notes)
