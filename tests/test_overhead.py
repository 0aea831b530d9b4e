"""What a step costs beyond its compute and its bytes: measured as training meets it, priced once.

- the measurement runs the real code on gloo workers: a DDP step of the model and its parameters'
  all-reduce on 2, and the parameter server's protocol and server with a worker pushing while another
  computes (the server beside them times no step); a long step means fewer rounds, the same on every
  rank, and every rank returns the same figure (each round reduced over the ranks);
- the summary takes the medians over the measuring processes, the server's missing figures left out;
- the cost models add exactly the measured figure less what they already price for it (the model's
  own DDP step at the measuring processes, the parameters' all-reduce, the round trip's four messages),
  once per step (sync), per update (ps) or per round (local SGD, DiLoCo), and say so in a note.
"""

import dataclasses

import pytest

from helpers import run_workers
from phalanx.costs import Compute, Link, ModelFacts, Network, allreduce
from phalanx.strategies.ps.costs import predict_ps
from phalanx.strategies.sync.costs import predict_sync
from phalanx.strategies.ps.costs import round_trip_fixed
from phalanx.costs.inputs import MEETING_AFTER
from phalanx.strategies.sync.costs import ddp_fixed
from phalanx.estimate.overhead import FIGURES, MIN_STEPS, STEPS, WARMUP, fixed_costs
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
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    w = torch.randn(64, 64)
    steps, ddp_steps = [], []
    model = nn.Linear(64, 4)

    def work():  # a worker's real step, while another pushes
        steps.append((w @ w).sum().item())

    def ddp_step():  # made once, by every worker at once (DDP's constructor is a collective)
        replica = DDP(nn.Linear(64, 4))

        def step():
            replica(w).sum().backward()
            ddp_steps.append(1)
        return step

    def params():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    last = ctx.rank == ctx.world_size - 1  # the last rank's step is the slowest: every rank takes its round count
    mine = {**fixed_costs(ctx, beside, work, step_s if last else 0.0, ddp_step, params), "work": len(steps),
            "ddp": len(ddp_steps)}
    every = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    return every


ROWS = {"rows": [(1, 1, 1, 1, 1)], "blocks": [1.0], "micro": {}, "pack": 0.0, "copy": 0.0, "unpack": 0.0,
        "apply": 0.0, "fresh": 0.0}


def _calls(rounds: int, meetings: int) -> tuple[int, int]:
    """Real steps and DDP steps one rank runs: bare and DDP steps in two halves each (warm-up each time), then
    MEETING_AFTER real steps before every timed all-reduce of the parameters (one before each warm-up)."""
    half = WARMUP + rounds // 2
    return 2 * half + WARMUP + meetings * MEETING_AFTER, 2 * half


@pytest.mark.slow
def test_the_models_ddp_step_and_its_parameters_all_reduce_are_measured_on_two_workers():
    every = run_workers(_every_rank, 2, 0)
    assert all(r["ddp_excess"] >= 0 and r["allreduce_params"] > 0 and r["round_trip_tiny"] is None for r in every)
    assert every[0]["allreduce_params"] == every[1]["allreduce_params"]  # each round's least over the ranks
    assert every[0]["meeting_wait"] == every[1]["meeting_wait"] >= 0  # each round's mean over the ranks, less that
    assert every[0]["ddp_excess"] == every[1]["ddp_excess"]  # each round's slowest rank
    # 1 ms steps: STEPS rounds of each (a meeting's 8 ms fit ROUNDS_BUDGET_S as often)
    assert [(r["work"], r["ddp"]) for r in every] == [_calls(STEPS, STEPS)] * 2
    slow = run_workers(_every_rank, 2, 0, 1.0)  # a 1-second step: the fewest rounds, on both ranks
    assert [(r["work"], r["ddp"]) for r in slow] == [_calls(MIN_STEPS, MIN_STEPS)] * 2
    every = [{k: v for k, v in r.items() if k not in ("work", "ddp")} for r in every]
    c = summarise([{**ROWS, **r} for r in every], Conditions(2, 1, "cpu"), cores=2)
    assert c.ddp_excess == every[0]["ddp_excess"] and c.round_trip_tiny == 0
    assert c.allreduce_params == every[0]["allreduce_params"]
    assert c.meeting_wait == every[0]["meeting_wait"]
    alone = summarise([{**ROWS, **dict.fromkeys(FIGURES, 0.0)}],
                      Conditions(1, 2, "cpu"), cores=2)
    assert [getattr(alone, k) for k in FIGURES] == [0.0] * len(FIGURES)


@pytest.mark.slow
def test_a_ps_round_trip_is_measured_through_the_real_server_while_another_worker_computes():
    server, pusher, computing = run_workers(_every_rank, 3, 1)  # rank 0 beside the two workers: the server
    assert pusher["round_trip_tiny"] > 0 and server["round_trip_tiny"] is computing["round_trip_tiny"] is None
    assert pusher["round_trip_spread"] > 0 and server["round_trip_spread"] is computing["round_trip_spread"] is None
    assert pusher["allreduce_params"] is None and pusher["ddp"] == 0
    assert pusher["work"] == WARMUP + STEPS and server["work"] == 0  # a real step before each push
    c = summarise([{"beside": True, **server}, {**ROWS, **pusher}, {**ROWS, **computing}],
                  Conditions(2, 1, "cpu", beside=1), cores=2)
    assert c.round_trip_tiny == pusher["round_trip_tiny"] and c.ddp_excess == 0
    assert c.round_trip_spread == pusher["round_trip_spread"]
    assert c.forward == 1 and c.processes == 2  # the server's result holds no step: left out


def test_sync_adds_the_measured_ddp_step_beyond_what_it_prices_for_it_once_per_step():
    plain = predict_sync(compute(), FACTS, NET, 2)
    priced = plain.parts["timeline"] - compute().slowest  # its buckets' all-reduces and copies, at the 2 measuring
    c = compute(ddp_excess=priced + 1.3 * MS)
    assert ddp_fixed(c, FACTS, NET) == pytest.approx(1.3 * MS)
    p = predict_sync(c, FACTS, NET, 2)  # the measuring processes' own count and link: the measured DDP step
    assert p.step == pytest.approx(c.slowest + c.ddp_excess) and p.parts["fixed"] == pytest.approx(1.3 * MS)
    assert any(note.startswith("DDP's fixed work: 1.3 ms per step") for note in p.notes)
    far = Network(LINK, Link(1 * MS, 1e-9, "slow"), per_node=2)  # 4 machines: the same fixed work on a slower link
    assert predict_sync(c, FACTS, far, 8).step == pytest.approx(predict_sync(compute(), FACTS, far, 8).step + 1.3 * MS)
    assert ddp_fixed(compute(ddp_excess=priced / 2), FACTS, NET) == 0.0  # less than it prices: nothing to add
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
    """local SGD's averaging and DiLoCo's outer round follow H steps of compute: each adds the parameters'
    all-reduce measured after a real step, less that all-reduce's price, once per round (so 1/H per step)."""
    from phalanx.strategies.diloco.costs import predict_diloco
    from phalanx.strategies.local_sgd.costs import predict_local_sgd
    from phalanx.costs.inputs import wake

    price = allreduce(NET, 2, FACTS.param_bytes)
    c = compute(allreduce_params=price + 2.0 * MS)
    assert wake(c, FACTS, NET) == pytest.approx(2.0 * MS)
    for predict in (lambda c: predict_local_sgd(c, FACTS, NET, 2, 8), lambda c: predict_diloco(c, FACTS, NET, 2, 8)):
        assert predict(c).step == pytest.approx(predict(compute()).step + 2.0 * MS / 8)
    assert wake(compute(allreduce_params=price / 2), FACTS, NET) == 0.0
    assert wake(compute(processes=1, allreduce_params=1.0), FACTS, NET) == 0.0
