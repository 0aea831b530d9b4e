"""``phalanx estimate``: the cost model on hand-computed cases, the α–β fit, DDP's buckets, the command.

The formulas are pure functions of made-up inputs (tier 1); DDP's bucketing is checked against a
real DDP on 2 gloo workers; the command runs end to end on the digits cnn with a tiny measurement,
and every bad input is one line and exit status 2 before anything is measured.
"""

import dataclasses
import json
import math
import os
import resource
import signal
import subprocess

import pytest
import torch

from helpers import phalanx_cmd, run_cli, run_in_process, run_workers
from phalanx.cli import main
from phalanx.errors import PhalanxError
from phalanx.estimate import Compute, Link, ModelFacts, Network, fit_ring
from phalanx.costs import Op, allreduce, gather_or_scatter, schedule
from phalanx.strategies.fsdp.costs import predict_fsdp
from phalanx.strategies.local_sgd.costs import predict_local_sgd
from phalanx.strategies.pipeline.costs import predict_pipeline
from phalanx.strategies.ps.costs import predict_ps, simulate, steady_state
from phalanx.strategies.sync.costs import predict_sync
from phalanx.estimate.facts import ddp_buckets, model_facts
from phalanx.estimate.link import gpu_link, ring_terms
from phalanx.estimate.profile import Conditions, summarise
from phalanx.units import (fmt_bandwidth, fmt_bytes, fmt_seconds, parse_bandwidth, parse_duration,
                                   parse_workers)

MS = 1e-3
GB = 1e9


def link(gbps=10.0, alpha=5e-6, shared=False) -> Link:
    return Link(alpha, 1 / (gbps * GB), "test", shared)


def compute(**changes) -> Compute:
    values = dict(forward=10 * MS, backward=20 * MS, optimizer=2 * MS, loop=1 * MS, slowest=33 * MS, cpu=33 * MS,
                  processes=1, threads=1, cores=None, block_seconds=(1.0, 1.0), micro_seconds={},
                  pack=0.5 * MS, copy=0.5 * MS, unpack=0.5 * MS, apply=3 * MS)
    values.update(changes)
    return Compute(**values)


def facts(**changes) -> ModelFacts:
    values = dict(block_names=("0", "1"), block_params=(1_000_000, 1_000_000), activation_bytes=(4000, 40),
                  buckets=((4_000_000, 1), (4_000_000, 0)), batch_size=32)
    values.update(changes)
    return ModelFacts(**values)


# ---------------------------------------------------------------- units

def test_units_parse_as_people_write_them():
    assert parse_bandwidth("25GB/s") == 25e9
    assert parse_bandwidth("200Gb/s") == 25e9  # bits
    assert parse_bandwidth("900 MB/s") == 900e6
    assert parse_bandwidth("1GiB/s") == 2 ** 30
    assert parse_duration("10us") == pytest.approx(1e-5)
    assert parse_duration("2.5µs") == pytest.approx(2.5e-6)
    assert parse_duration("0.1ms") == pytest.approx(1e-4)
    assert parse_workers("8,1,2,2") == (1, 2, 8)
    assert fmt_bandwidth(1 / (1 / 1e9)) == "1 GB/s" and fmt_bytes(605224) == "605 kB"
    assert fmt_seconds(118e-6) == "118 µs" and fmt_seconds(0.99999e-3) == "1 ms" and fmt_seconds(1.2) == "1.2 s"


@pytest.mark.parametrize("parse, text", [(parse_bandwidth, "25GB"), (parse_bandwidth, "fast"),
                                         (parse_bandwidth, "-1GB/s"), (parse_duration, "10"),
                                         (parse_duration, "0us"), (parse_workers, "1,a"), (parse_workers, "0,2")])
def test_units_refuse_what_they_cannot_read(parse, text):
    with pytest.raises(PhalanxError):
        parse(text)


# ---------------------------------------------------------------- the α–β formulas, by hand

def test_ring_allreduce_is_2_n_minus_1_alpha_plus_2_n_minus_1_over_n_s_beta():
    assert ring_terms(2, 1000) == (2.0, 1000.0)
    assert ring_terms(4, 1000) == (6.0, 1500.0)
    net = Network(link(10, 5e-6), link(1, 20e-6), per_node=4)
    # 4 ranks on one machine: 6 x 5 µs + 1.5 x 1 MB / 10 GB/s = 30 µs + 150 µs
    assert allreduce(net, 4, 1e6) == pytest.approx(180e-6)
    # 8 ranks on 2 machines: the ring crosses the slow link: 14 x 20 µs + 1.75 x 1 MB / 1 GB/s
    assert allreduce(net, 8, 1e6) == pytest.approx(280e-6 + 1750e-6)
    assert allreduce(net, 1, 1e6) == 0.0


def test_hierarchical_allreduce_reduces_within_machines_then_across_leaders():
    net = Network(link(100, 2e-6), link(1, 20e-6), per_node=4)
    within = 2 * (3 * 2e-6 + 1e6 / 100e9)  # reduce to the leader, broadcast back
    across = 2 * 20e-6 + 1e6 / 1e9  # ring of 2 leaders: 2 x α + (2/2) x S x β
    assert allreduce(net, 8, 1e6, hierarchical=True) == pytest.approx(within + across)
    assert allreduce(net, 8, 1e6, hierarchical=True) < allreduce(net, 8, 1e6)


def test_gather_and_scatter_move_n_minus_1_over_n_of_the_bytes():
    net = Network(link(10, 5e-6), link(10, 5e-6), per_node=8)
    assert gather_or_scatter(net, 4, 1e6) == pytest.approx(3 * 5e-6 + 0.75 * 1e6 / 10e9)


def test_a_message_costs_alpha_plus_s_beta_and_half_the_bytes_where_one_cpu_copies_both_ways():
    assert link(10, 5e-6).message(1e6) == pytest.approx(5e-6 + 1e-4)
    assert link(10, 5e-6, shared=True).message(1e6) == pytest.approx(5e-6 + 0.5e-4)


def test_cpu_spent_on_messages_counts_their_alpha_only_where_cpus_are_the_link():
    # one end of 2 messages carrying 1 MB: every byte copied; on a loopback link α is software too
    assert link(10, 5e-6).cpu(2, 1e6) == pytest.approx(1e6 / 10e9)
    assert link(10, 5e-6, shared=True).cpu(2, 1e6) == pytest.approx(1e6 / 20e9 + 2 * 5e-6)


def test_gpu_link_defaults_follow_the_datasheets():
    assert gpu_link("NV12").bandwidth == pytest.approx(300e9)  # 12 links x 25 GB/s
    assert gpu_link("NV18").alpha == pytest.approx(3.4e-6)
    assert gpu_link("PIX").bandwidth == pytest.approx(31.5e9)
    assert "NCCL" in gpu_link("SYS").source and "PCI-SIG" in gpu_link("SYS").source


# ---------------------------------------------------------------- --measure-link's fit

def test_fit_recovers_alpha_and_beta_from_exact_ring_timings():
    alpha, beta = 40e-6, 1 / 3e9
    sizes = [4096 * 4 ** k for k in range(7)]
    for ranks in (2, 4):
        seconds = [2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * s * beta for s in sizes]
        fitted = fit_ring(sizes, seconds, ranks)
        assert fitted.alpha == pytest.approx(alpha, rel=1e-9)
        assert fitted.beta == pytest.approx(beta, rel=1e-9)


def test_fit_recovers_alpha_and_beta_from_noisy_timings():
    alpha, beta = 120e-6, 1 / 1.2e9
    sizes = [4096 * 4 ** k for k in range(7)]
    noise = [1.04, 0.97, 1.03, 0.96, 1.02, 0.98, 1.01]  # ±4%, made up
    seconds = [(2 * alpha + s * beta) * e for s, e in zip(sizes, noise)]
    fitted = fit_ring(sizes, seconds, 2)
    assert fitted.alpha == pytest.approx(alpha, rel=0.15)
    assert fitted.beta == pytest.approx(beta, rel=0.05)


def test_fit_clamps_a_negative_latency_and_refuses_timings_that_do_not_grow():
    sizes = [1e3, 1e6, 1e7]
    fitted = fit_ring(sizes, [s / 1e9 * 0.5 for s in sizes], 2)  # no latency at all, slightly noisy below
    assert fitted.alpha >= 0 and fitted.beta > 0
    with pytest.raises(PhalanxError, match="do not grow"):
        fit_ring(sizes, [1e-3, 1e-3 * 0.9, 1e-3 * 0.8], 2)
    with pytest.raises(PhalanxError):
        fit_ring([1e3], [1e-3], 2)


# ---------------------------------------------------------------- two streams

def test_schedule_overlaps_streams_and_respects_waits():
    ops = [Op("a", "compute", 2.0), Op("x", "comm", 5.0, ("a",)), Op("b", "compute", 1.0, ("a",)),
           Op("c", "compute", 1.0, ("b", "x"))]
    times = schedule(ops)
    assert times == {"a": (0.0, 2.0), "x": (2.0, 7.0), "b": (2.0, 3.0), "c": (7.0, 8.0)}


# ---------------------------------------------------------------- the strategies, by hand

def test_sync_overlaps_the_first_bucket_with_the_rest_of_backward_on_gpus():
    net = Network(link(10, 0.0), link(10, 0.0), per_node=8)
    c = compute(copy=0.0)  # forward 10, backward 20 (two equal blocks), optimizer 2, loop 1: 33 ms; slowest 33
    # bucket 0 (block 1's 4 MB) is ready halfway through backward (20 ms), bucket 1 at its end (30 ms);
    # each all-reduce over 2 ranks moves 4 MB at 10 GB/s: 0.4 ms, so bucket 0's hides behind backward.
    p = predict_sync(c, facts(), net, 2)
    assert p.step == pytest.approx(30 * MS + 0.4 * MS + 2 * MS + 1 * MS)
    assert p.comm == pytest.approx(0.4 * MS)
    assert p.examples == 64 and p.efficiency == pytest.approx(33 / 33.4)
    # DDP's three passes over the gradients (into the buckets, divide, back): with 0.5 ms a pass, half of
    # the first two hide nothing (they are compute), the copy back waits for the last all-reduce.
    with_copies = predict_sync(compute(copy=0.5 * MS), facts(), net, 2)
    assert with_copies.step == pytest.approx(p.step + 1.5 * MS)


def test_sync_serialises_communication_where_the_workers_fill_every_core():
    net = Network(link(10, 0.0), link(10, 0.0), per_node=2)
    c = compute(processes=2, threads=1, cores=2, cpu=20 * MS)
    p = predict_sync(c, facts(), net, 2)
    assert p.step == pytest.approx(33 * MS + 2 * 0.4 * MS + 3 * 0.5 * MS)  # compute, 2 all-reduces, DDP's passes


def test_sync_is_bounded_by_the_cpu_seconds_its_processes_need():
    net = Network(link(10, 0.0), link(10, 0.0), per_node=4)
    c = compute(processes=4, threads=1, cores=2, cpu=30 * MS)  # 4 processes on 2 cores
    p = predict_sync(c, facts(), net, 4)
    copied = 2 * 1.5 * 4e6 / 10e9  # every rank copies 1.5 x 4 MB per bucket
    assert p.step == pytest.approx(4 * (30 * MS + copied + 3 * 0.5 * MS) / 2)
    assert any("CPU-bound" in note for note in p.notes)


def test_one_sync_worker_is_a_plain_step():
    p = predict_sync(compute(), facts(), Network(link(), link(), 2), 1)
    assert p.step == pytest.approx(33 * MS) and p.comm == 0 and p.efficiency == 1.0


def test_ps_simulation_one_worker_cycles_through_compute_push_update_reply():
    assert simulate(1, [10.0], [1.0], [1.0], 3.0, 0.5) == pytest.approx(10 + 1 + 3 + 1 + 0.5)


def test_ps_simulation_two_workers_interleave_without_queueing():
    # worker cycle 10 + 1 + 3 + 1 = 15; the server is busy 4 of every 15 per worker: one step per cycle
    assert simulate(2, [10.0, 10.0], [1.0, 1.0], [1.0, 1.0], 3.0, 0.0) == pytest.approx(15.0)


def test_ps_simulation_is_server_bound_when_updates_outlast_compute():
    # 4 workers, each update holds the server 3 + 1: 16 per step of 4 updates
    assert simulate(4, [1.0] * 4, [1.0] * 4, [1.0] * 4, 3.0, 0.0) == pytest.approx(16.0)


@pytest.mark.parametrize("compute_s", [1.0, 0.05, 1e-3], ids=["compute-bound", "between", "server-bound"])
@pytest.mark.parametrize("workers", [64, 1024])
def test_ps_steady_state_in_closed_form_matches_the_event_simulation(workers, compute_s):
    """Past 1,024 workers predict_ps takes the closed form (the simulation grows with W: 10^8 workers
    would need tens of GB); here both can run, and they agree."""
    near, far, local = 1e-4, 3e-4, 4
    pushes = [near] * local + [far] * (workers - local)
    simulated = simulate(workers, [compute_s] * workers, pushes, pushes, 2e-5, 1e-5, 1e-4)
    closed = steady_state([(local, compute_s, near, near), (workers - local, compute_s, far, far)], 2e-5, 1e-5, 1e-4)
    assert closed == pytest.approx(simulated, rel=0.01)


def test_ps_prediction_for_a_million_workers_is_closed_form():
    c = compute(forward=1 * MS, backward=2 * MS, loop=0.0, pack=0.0, unpack=0.0, apply=0.1 * MS)
    p = predict_ps(c, facts(), Network(link(10, 5e-6), link(1, 1e-5), per_node=8), 1_000_000)
    assert p.step > 0 and "steady state (closed form) of 1000000 workers" in p.notes[0]


def test_ps_server_link_carries_w_gradients_in_and_w_copies_out():
    net = Network(link(1, 0.0), link(1, 0.0), per_node=64)
    c = compute(forward=0.0, backward=0.0, loop=0.0, pack=0.0, unpack=0.0, apply=0.0)
    p = predict_ps(c, facts(), net, 8)  # 8 MB of parameters at 1 GB/s: 8 ms a message
    assert p.step == pytest.approx(8 * 8 * MS)  # the server sends 8 copies one after another
    # a header before every vector, and fresh receive buffers: each message costs α + fresh more
    slow = predict_ps(dataclasses.replace(c, fresh=1 * MS), facts(),
                      Network(link(1, 1e-4), link(1, 1e-4), per_node=64), 8)
    assert slow.step == pytest.approx(8 * (8 * MS + 2 * 1e-4 + 1 * MS))


def test_local_sgd_amortises_one_averaging_over_h_steps():
    net = Network(link(10, 0.0), link(10, 0.0), per_node=8)
    c = compute(slowest=35 * MS)
    p = predict_local_sgd(c, facts(), net, 2, sync_every=8)
    average = 0.5 * MS + 0.5 * MS + 8e6 / 10e9  # flatten (new vector), divide, all-reduce 8 MB over 2 ranks
    # the slowest one's lead after 8 steps apart: one step's spread (2 ms) grown with the root of the steps
    assert p.step == pytest.approx(33 * MS + (average + 2 * MS * math.sqrt(8)) / 8)
    assert p.parts["meeting_wait"] == pytest.approx(2 * MS * math.sqrt(8))


def test_a_meetings_wait_is_measured_after_meeting_after_steps_and_grows_with_their_root():
    from phalanx.costs.inputs import MEETING_AFTER, meeting_wait

    c = compute(slowest=35 * MS, meeting_wait=1 * MS)  # measured: the spread is not used
    assert meeting_wait(c, MEETING_AFTER) == pytest.approx(1 * MS)
    assert meeting_wait(c, 4 * MEETING_AFTER) == pytest.approx(2 * MS)
    assert meeting_wait(c, 0.5) == meeting_wait(c, 1)  # a meeting every step at most
    net = Network(link(10, 0.0), link(10, 0.0), per_node=8)
    p = predict_local_sgd(c, facts(), net, 2, sync_every=32)
    assert p.parts["meeting_wait"] == pytest.approx(2 * MS)
    even = predict_local_sgd(dataclasses.replace(c, slowest=c.step), facts(), net, 2, sync_every=32)
    assert even.step == pytest.approx(p.step)  # the measured wait, not the probe's spread



def test_diloco_amortises_a_fragments_round_over_its_turn_and_int8_sends_a_quarter():
    from phalanx.strategies.diloco.costs import predict_diloco

    net = Network(link(10, 0.0), link(10, 0.0), per_node=8)
    c = compute(slowest=35 * MS)
    one = predict_diloco(c, facts(), net, 2, sync_every=8)
    # a round: pseudo-gradient, outer step, copy back (4 passes of 0.5 ms) and an 8 MB all-reduce over 2 ranks
    assert one.step == pytest.approx(33 * MS + (4 * 0.5 * MS + 8e6 / 10e9) / 8 + 2 * MS * math.sqrt(8) / 8)
    # F fragments: F rounds of 1/F of the model every H steps, the same bytes per step; the workers meet F times,
    # each after H/F steps apart
    four = predict_diloco(c, facts(), net, 2, sync_every=8, fragments=4)
    assert four.parts["per_step_rounds"] == pytest.approx(one.parts["per_step_rounds"])
    assert four.step - one.step == pytest.approx((4 * 2 * MS * math.sqrt(2) - 2 * MS * math.sqrt(8)) / 8)
    int8 = predict_diloco(c, facts(), net, 2, sync_every=8, precision="int8")
    assert int8.parts["round"] == pytest.approx(4 * 0.5 * MS + 0.5 * 2 * 2e6 / 10e9)  # an all-gather of 2 x 2 MB
    assert predict_diloco(c, facts(), net, 1, sync_every=8).step == c.step

def pipeline_compute(**changes) -> Compute:
    """Two blocks of 4 ms each at the batch (forward + backward 8 ms, as the step measured), 1 ms per
    micro-batch of 4."""
    values = dict(forward=3 * MS, backward=5 * MS, block_seconds=(4 * MS, 4 * MS), micro_seconds={4: (1 * MS, 1 * MS)},
                  optimizer=0.0, loop=0.0, copy=0.0)
    return compute(**{**values, **changes})


def test_pipeline_of_equal_stages_has_the_textbook_bubble():
    net = Network(link(10, 0.0), link(10, 0.0), per_node=8)
    c = pipeline_compute()
    p = predict_pipeline(c, facts(), net, 2, stages=2, micro_batches=4)
    hop = 4000 * 8 / 10e9  # block 0's output, 8 examples per micro-batch
    assert p.step == pytest.approx((1 + 1 + 3 * 1) * MS + 2 * hop)
    assert p.bubble / (5 * MS) == pytest.approx(1 / 5)  # (P-1)/(M+P-1) with P = 2, M = 4
    assert "bubble 20.0%" in p.notes[0]
    # the engine's own work per micro-batch lands on every stage: (P + M - 1) times on the critical path
    slower = predict_pipeline(dataclasses.replace(c, engine={4: 0.1 * MS}), facts(), net, 2, stages=2, micro_batches=4)
    assert slower.step - p.step == pytest.approx(5 * 0.1 * MS)


def test_a_cpu_stage_copies_its_boundary_bytes_each_micro_batch_but_waits_for_alpha_only_on_the_first():
    """The engine's messages are posted asynchronously: a stage's CPU copies their bytes on every
    micro-batch, but a message's α is waiting, paid where a stage waits (the first micro-batch's path).
    Seen: α charged as CPU work on every micro-batch put the digits cnn's 2-stage pipeline +18% over."""
    shared = Network(link(10, 200e-6, shared=True), link(10, 200e-6, shared=True), per_node=2)
    c = pipeline_compute(cores=2)
    p = predict_pipeline(c, facts(), shared, 2, stages=2, micro_batches=4)
    hop = 200e-6 + 4000 * 8 / 10e9 / 2  # α and the bytes one way, copied by one CPU (half a ring step's time)
    copying = 2 * 4000 * 8 / 10e9 / 2  # per micro-batch on each stage: the bytes each way, no α
    assert p.parts["schedule"] == pytest.approx(2 * MS + 2 * hop + 3 * (1 * MS + copying))


def test_pipeline_replicas_add_an_all_reduce_of_each_stage():
    net = Network(link(10, 0.0), link(10, 0.0), per_node=8)
    c = pipeline_compute()
    one = predict_pipeline(c, facts(), net, 2, stages=2, micro_batches=4)
    two = predict_pipeline(c, facts(), net, 4, stages=2, micro_batches=4)
    assert two.step - one.step == pytest.approx(4e6 / 10e9)  # 4 MB per stage over 2 replicas
    assert two.examples == 2 * one.examples


def test_a_one_stage_pipeline_is_never_faster_than_the_step_it_runs():
    """Seen: a 1-worker pipeline of the cifar10 network 1.82x faster than one worker, because its micro-batch block
    times (timed one by one) summed to about half the forward + backward the training loop measured."""
    net = Network(link(10, 0.0), link(10, 0.0), per_node=2)
    seen = compute(block_seconds=(15 * MS, 15 * MS), micro_seconds={4: (2 * MS, 2 * MS)})  # 4 x 4 ms < 30 ms
    p = predict_pipeline(seen, facts(), net, 1, stages=1, micro_batches=4)
    assert p.step == pytest.approx(seen.step)  # M micro-batches cost at least one batch: no speedup
    # the block times give the shares and the price of cutting the batch; the loop's step gives the scale
    other_scale = compute(block_seconds=(1.0, 1.0), micro_seconds={4: (0.3, 0.3)})  # micro-batching costs 1.2x
    p = predict_pipeline(other_scale, facts(), net, 1, stages=1, micro_batches=4)
    assert p.step == pytest.approx(1.2 * 30 * MS + 2 * MS + 1 * MS)


def test_pipeline_chooses_the_most_stages_that_divide_the_workers():
    """Seen: 8 workers on a 5-block model refused ('8 workers do not make whole 5-stage pipelines')."""
    from phalanx.strategies.pipeline.costs import PipelineCost
    from phalanx.strategies import Job, Pipeline

    cost = PipelineCost()
    assert [p.stages for p in cost.plans(Pipeline(), 8, 5, 2)] == [4, 2, 1]
    assert [p.stages for p in cost.plans(Pipeline(), 3, 5, 2)] == [3, 1]
    assert [p.stages for p in cost.plans(Pipeline(schedule="1f1b", chunks=2), 8, 5, 2)] == [2, 1]
    assert [p.stages for p in cost.plans(Pipeline(stages=2), 8, 5, 2)] == [2]  # given: kept
    with pytest.raises(PhalanxError, match="only 5 blocks"):
        cost.plans(Pipeline(stages=6), 12, 5, 2)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)])
    layout = cost.plans(Pipeline(), 8, 5, 2)[0].layout(Job((torch.device("cpu"),) * 8, 32, model=model))
    assert (layout.world_size, layout.shards) == (8, 2)  # 4 stages x 2 replicas


def test_estimate_plans_rows_through_each_strategys_layout(tmp_path, monkeypatch):
    """No measurement: which rows exist, and why not, comes from the strategies' layouts."""
    from phalanx.estimate.setup import conditions_for, prepare
    from phalanx.estimate import EstimateOptions

    monkeypatch.chdir(tmp_path)
    setup = prepare(EstimateOptions(workers=(1, 8)), {"model": "cifar10"}, {})
    rows = {(r.strategy, r.workers): r for r in setup.rows}
    assert set(rows) == ({(s, n) for s in ("sync", "local-sgd", "diloco", "pipeline", "fsdp") for n in (1, 8)}
                         | {("ps", 8)})
    assert rows[("pipeline", 8)].options.stages == 4 and rows[("pipeline", 1)].options.stages == 1
    assert rows[("ps", 8)].processes == 9  # the server: one more process on node 0, sharing its cores
    assert conditions_for(setup, rows[("ps", 8)]).threads == 1 and conditions_for(setup, rows[("sync", 1)]).threads >= 1
    assert [line.split(":")[0] for line in setup.skipped] == ["ps on 1 worker"]
    assert "at least 2 workers" in setup.skipped[0]  # the layout's own reason
    with pytest.raises(PhalanxError, match="needs at least 2 workers"):  # asked for by name: nothing to show
        prepare(EstimateOptions(workers=(1,), strategy="ps"), {"model": "cifar10"}, {})
    # sync's layout wants a hierarchical reduction's islands spelled out on CPU: the machines are the islands
    hierarchical = prepare(EstimateOptions(workers=(4,), strategy="sync"), {"model": "cnn"}, {"reduce": "hierarchical"})
    assert hierarchical.rows[0].options.islands == ((0, 1), (2, 3))


def test_every_estimated_strategy_owns_a_cost_model_registered_by_its_options_class():
    from phalanx.costs import COSTS, cost_model
    from phalanx.strategies.ps.costs import ParameterServerCost
    from phalanx.strategies.sync.costs import SyncCost
    from phalanx.estimate.options import ESTIMATED
    from phalanx.strategies import SSP, STRATEGIES, Backup, Hogwild, LocalSGD, ParameterServer, Pipeline, Sync

    assert ESTIMATED == ("sync", "ps", "local-sgd", "diloco", "pipeline", "fsdp")
    assert isinstance(cost_model(Sync()), SyncCost) and isinstance(cost_model(ParameterServer), ParameterServerCost)
    assert cost_model(SSP) is None and cost_model(Backup) is None and cost_model(Hogwild) is None  # not inherited
    for cls, cost in COSTS.items():
        assert STRATEGIES[cls.name] is cls and cost.title
        assert set(cost.fields) <= {f.name for f in dataclasses.fields(cls)}  # flags come from the options
    net = Network(link(10, 5e-6), link(1, 20e-6), per_node=2)
    c = compute(micro_seconds={4: (1 * MS, 1 * MS), 8: (0.6 * MS, 0.6 * MS)})
    # each wraps its strategy's pure formula with the options' values
    assert cost_model(Sync).predict(Sync(compress="bf16", reduce="auto"), c, facts(), net, 8) == \
        predict_sync(c, facts(), net, 8, "bf16", hierarchical=True)
    assert cost_model(LocalSGD).predict(LocalSGD(sync_every=3), c, facts(), net, 4) == \
        predict_local_sgd(c, facts(), net, 4, 3)
    # and proposes the changes the advice tries, by option
    assert [a.changes for a in cost_model(Sync).alternatives(Sync(), c, net, 8)] == \
        [{"compress": "bf16"}, {"reduce": "hierarchical"}]
    assert [a.changes for a in cost_model(LocalSGD).alternatives(LocalSGD(sync_every=3), c, net, 4)] == \
        [{"sync_every": 6}]
    assert [a.changes for a in cost_model(Pipeline).alternatives(Pipeline(stages=2), c, net, 2)] == [{"chunks": 8}]
    assert [a.strategy for a in cost_model(ParameterServer).alternatives(ParameterServer(), c, net, 4)] == [Sync]


def test_measure_link_help_says_what_it_does():
    """Seen: 'done anyway on CPU when no --link-* is given (default: off)'."""
    from phalanx.estimate import EstimateOptions
    from phalanx.options import help_text

    field = next(f for f in dataclasses.fields(EstimateOptions) if f.name == "measure_link")
    text = help_text(field)
    assert "default: off)" not in text and "(default: on for CPU workers unless --link-* is given; off on GPUs)" in text


def test_a_gpu_link_that_is_neither_given_nor_measurable_is_refused_before_measuring():
    """Seen on an H200: --workers 64 on one GPU measured for 6 s, then said the link between machines was
    missing. The links are checked with the other inputs, before any measurement."""
    from phalanx.estimate import EstimateOptions
    from phalanx.estimate.setup import _check_links

    gpu = torch.device("cuda", 0)
    with pytest.raises(PhalanxError, match="--workers 64 spans several machines of 1 GPUs: give the network"):
        _check_links(EstimateOptions(workers=(1, 8, 64)), gpu, per_node=1, gpus=1)
    with pytest.raises(PhalanxError, match="--per-node 4 but this machine has 1 GPU"):
        _check_links(EstimateOptions(workers=(1, 4)), gpu, per_node=4, gpus=1)
    with pytest.raises(PhalanxError, match="--measure-link on GPUs needs 2 GPUs here"):
        _check_links(EstimateOptions(workers=(1,), measure_link=True), gpu, per_node=1, gpus=1)
    given = EstimateOptions(workers=(1, 8, 64), link_bandwidth=25e9, link_latency=1e-5)
    _check_links(given, gpu, per_node=1, gpus=1)  # the network given: every row has its link
    _check_links(EstimateOptions(workers=(1,)), gpu, per_node=1, gpus=1)  # one GPU, one machine: no link used
    _check_links(EstimateOptions(workers=(1, 8)), gpu, per_node=8, gpus=8)  # the topology's links
    with pytest.raises(PhalanxError, match="--no-measure-link on CPU workers"):
        _check_links(EstimateOptions(workers=(2,), measure_link=False), torch.device("cpu"), per_node=2, gpus=0)


def test_fsdp_without_overlap_adds_every_gather_and_scatter():
    net = Network(link(10, 0.0), link(10, 0.0), per_node=2)
    c = compute(processes=2, threads=1, cores=2, cpu=0.0)
    p = predict_fsdp(c, facts(), net, 2)
    unit = gather_or_scatter(net, 2, 4e6)  # one block's 4 MB over 2 ranks
    assert p.step == pytest.approx(10 * MS + 20 * MS + 1 * MS + 1 * MS + 6 * unit)  # optimizer halved


@pytest.mark.parametrize("workers", [2, 4, 64])
def test_every_strategy_keeps_step_at_least_its_ideal(workers):
    net = Network(link(10, 5e-6), link(1, 20e-6), per_node=2)
    c = compute(micro_seconds={4: (1 * MS, 2 * MS)})
    rows = [predict_sync(c, facts(), net, workers), predict_ps(c, facts(), net, workers),
            predict_local_sgd(c, facts(), net, workers, 8), predict_fsdp(c, facts(), net, workers),
            predict_pipeline(c, facts(), net, workers, 2, 4)]
    for p in rows:
        assert p.step >= p.compute - 1e-12 and 0 < p.efficiency <= 1 and 0 <= p.comm_share < 1, p


# ---------------------------------------------------------------- measuring and the model's sizes

def test_summary_takes_means_and_the_slowest_worker_of_each_step():
    ops = {"pack": 0.1, "copy": 0.05, "unpack": 0.2, "fresh": 0.0}
    rank0 = {"rows": [(1, 2, 0.5, 0.1, 3.6), (1, 2, 0.5, 0.1, 3.6), (1, 6, 0.5, 0.1, 7.6)],
             "blocks": [1.0, 2.0], "micro": {2: [0.5, 1.0]}, "engine": {2: 0.3}, "apply": 0.3, **ops}
    rank1 = {"rows": [(2, 2, 0.5, 0.1, 4.6), (1, 2, 0.5, 0.1, 3.6), (1, 2, 0.5, 0.1, 3.6)],
             "blocks": [3.0, 2.0], "micro": {2: [1.5, 1.0]}, "engine": {2: 0.5}, "apply": 0.5, **ops}
    c = summarise([rank0, rank1], Conditions(2, 1, "cpu"), cores=2)
    # means over every worker's steps (a run's time is their sum: the medians 1 and 2 would miss the slow steps)
    assert (c.forward, c.backward, c.optimizer, c.loop) == pytest.approx((7 / 6, 16 / 6, 0.5, 0.1))
    assert c.slowest == pytest.approx(15.8 / 3)  # per step max: 4.6, 3.6, 7.6 -> their mean (the median: 4.6)
    assert c.block_seconds == (2.0, 2.0) and c.micro_seconds == {2: (1.0, 1.0)}
    assert c.apply == pytest.approx(0.4) and c.engine == {2: pytest.approx(0.4)} and c.cores == 2
    assert (c.pack, c.copy) == (0.1, 0.05)


def test_a_super_linear_speedup_or_a_spread_that_swamps_the_mean_is_doubted():
    """The figures of issue 30's loaded machine (one worker alone 129 ms a step, each of two 2.2 ms: "59x")
    are doubted, in one phrase each; plausible ones are not."""
    from phalanx.costs import Prediction
    from phalanx.estimate.plausible import doubts, warning

    alone, pair = Conditions(1, 2, "cpu"), Conditions(2, 1, "cpu")
    slowed = compute(forward=40 * MS, backward=60 * MS, optimizer=28 * MS, loop=1 * MS, step_stdev=20 * MS)
    shared = compute(forward=0.7 * MS, backward=1 * MS, optimizer=0.4 * MS, loop=0.1 * MS, processes=2)
    row = Prediction("sync", 2, 1, step=2.4 * MS, examples=64, compute=2.2 * MS, ideal=2.2 * MS)

    def speedup(p):
        return p.examples_per_s / (32 / slowed.step)

    found = doubts(slowed, {alone: slowed, pair: shared}, [row], speedup)
    assert found == ["sync on 2 workers is 107.5x one worker alone, more than 2 workers can give (one worker alone "
                     "measured 129 ms a step)"]
    noisy = dataclasses.replace(shared, step_stdev=3 * MS)  # a standard deviation above the 2.2 ms mean
    assert doubts(slowed, {alone: slowed, pair: noisy}, [], speedup) == [
        "the steps of 2 process(es) x 1 thread(s) spread 3 ms around a mean of 2.2 ms"]
    calm = compute(forward=0.6 * MS, backward=1 * MS, optimizer=0.3 * MS, loop=0.1 * MS)  # 2 ms alone: 1.67x
    assert doubts(calm, {alone: calm, pair: shared}, [row], lambda p: p.examples_per_s / (32 / calm.step)) == []
    assert warning(found).startswith("warning: measured twice and still implausible: sync on 2 workers is 107.5x")


def test_stage_block_timer_leaves_the_model_alone_and_times_every_block():
    from phalanx.estimate.timings import time_block_sizes, time_stage_blocks

    torch.manual_seed(0)
    blocks = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
    before = [p.detach().clone() for b in blocks for p in b.parameters()]
    seconds = time_stage_blocks(blocks, torch.randn(12, 8), 3, torch.device("cpu"), repeats=2)
    assert len(seconds) == 3 and all(s >= 0 for s in seconds)
    assert all(p.grad is None for b in blocks for p in b.parameters())  # private copies were timed
    assert all(torch.equal(a, p) for a, p in zip(before, (p for b in blocks for p in b.parameters())))
    both = time_block_sizes(blocks, torch.randn(12, 8), (1, 3), torch.device("cpu"), repeats=2)  # interleaved
    assert set(both) == {1, 3} and all(len(s) == 3 and min(s) >= 0 for s in both.values())


def _real_ddp_buckets(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 200),
                                torch.nn.Linear(200, 10))
    ddp = DDP(model, bucket_cap_mb=0.5)
    for _ in range(3):  # DDP rebuilds its buckets in backward order after the first steps
        ddp(torch.randn(4, 300)).sum().backward()
    data = ddp._get_ddp_logging_data()
    return [int(b) for b in data["rebuilt_bucket_sizes"].split(",")]


@pytest.mark.slow
def test_bucket_model_equals_ddps_own_rebuilt_buckets():
    real = run_workers(_real_ddp_buckets, 2)
    model = torch.nn.Sequential(torch.nn.Linear(300, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 200),
                                torch.nn.Linear(200, 10))
    sizes = model_facts(model, torch.zeros(1, 300), 4, bucket_mb=0.5)
    assert [b for b, _ in sizes.buckets] == real
    assert len(real) > 1
    assert sizes.params == sum(p.numel() for p in model.parameters())
    assert sizes.activation_bytes == (4000, 4000, 800, 40)
    backward = list(reversed(list(model.parameters())))
    assert sum(len(b) for b in ddp_buckets(backward, 0.5)) == len(backward)


# ---------------------------------------------------------------- the command

@pytest.fixture(scope="module")
def estimate_json(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("estimate")
    out = run_in_process("estimate", "--model", "cnn", "--workers", "1,2", "--link-bandwidth", "10GB/s",
                         "--link-latency", "5us", "--json", "--measure-steps", "3", "--plot", "scaling.png", cwd=cwd)
    return cwd, out


@pytest.mark.slow
def test_estimate_json_numbers_are_consistent(estimate_json):
    cwd, out = estimate_json
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert data["model"] == "cnn" and data["parameters"] == 151_306 and data["gradient_bytes"] == 4 * 151_306
    assert data["links"]["within_machine"]["bandwidth_bytes_per_s"] == pytest.approx(10e9)
    assert data["links"]["within_machine"]["alpha_s"] == pytest.approx(5e-6)
    rows = {(p["strategy"], p["workers"]): p for p in data["predictions"]}
    assert set(rows) == ({(s, n) for s in ("sync", "local-sgd", "diloco", "pipeline", "fsdp") for n in (1, 2)}
                         | {("ps", 2)})
    assert any("ps on 1 worker" in line for line in data["skipped"])
    for p in rows.values():
        assert p["step_s"] > 0 and 0 < p["efficiency"] <= 1 and 0 <= p["comm_share"] <= 1
        assert p["examples_per_s"] == pytest.approx(p["examples_per_step"] / p["step_s"])
        assert p["step_s"] >= p["compute_s"] - 1e-12
    assert rows[("sync", 2)]["examples_per_step"] == 64 and rows[("pipeline", 2)]["examples_per_step"] == 32
    single = rows[("sync", 1)]
    assert single["comm_share"] == 0 and single["efficiency"] == 1 and single["speedup"] == pytest.approx(1)
    measured = {(c["processes"], c["threads"]) for c in data["compute"]}
    assert measured == {(1, 2), (2, 1)}  # one worker alone with both cores; two sharing them
    assert (cwd / "scaling.png").stat().st_size > 0


@pytest.mark.slow
def test_estimate_table_of_one_sync_worker(tmp_path, monkeypatch):
    """The printed table, through ``phalanx.estimate`` in this process (its ``table`` is what the command prints;
    the command itself runs above and below)."""
    import phalanx

    monkeypatch.chdir(tmp_path)
    table = phalanx.estimate(model="cnn", strategy="sync", workers=(1,), link_bandwidth="10GB/s", link_latency="5us",
                             measure_steps=3, quiet=True).table
    assert "sync (DDP)" in table and "examples/s" in table
    row = next(line for line in table.splitlines() if line.split()[:2] == ["1", "1"])
    assert float(row.split()[-3]) == pytest.approx(1.0)  # one worker: speedup 1


@pytest.mark.slow
def test_a_million_ps_workers_is_answered_in_closed_form_with_little_memory_on_a_measured_link(tmp_path):
    """It took 123 s (and 10^8 workers 23 GB) while the event simulation played out every update. The link
    is measured here (--measure-link), not given."""
    out = run_cli("estimate", "--strategy", "ps", "--workers", "1000000", "--measure-link", "--measure-steps", "3",
                  "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    rows = data["predictions"]
    assert [r["workers"] for r in rows] == [1_000_000] and rows[0]["step_s"] > 0
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < 4 * 2 ** 20  # KiB: every process so far
    within = data["links"]["within_machine"]
    assert within["source"].startswith("measured here: gloo all-reduces of 8 sizes"), within
    assert within["bandwidth_bytes_per_s"] > 0 and within["alpha_s"] >= 0
    assert any("measured here: gloo all-reduces of 8 sizes" in line for line in data["links"]["notes"])


@pytest.mark.slow
def test_a_pipeline_estimate_of_the_cifar10_network(tmp_path, monkeypatch):
    """The rows once seen wrong: 1 worker faster than one worker alone (speedup 1.82), 8 workers on 5 blocks refused.
    (``phalanx.estimate`` in this process: ``to_dict()`` is what ``--json`` prints.)"""
    import phalanx

    monkeypatch.chdir(tmp_path)
    data = phalanx.estimate(model="cifar10", strategy="pipeline", workers=(1, 8), per_node=1, batch_size=16,
                            link_bandwidth="10GB/s", link_latency="5us", measure_steps=3,
                            quiet=True).to_dict()  # one worker per machine: one measurement serves both rows
    rows = {p["workers"]: p for p in data["predictions"]}
    assert set(rows) == {1, 8} and data["skipped"] == []
    assert rows[1]["speedup"] <= 1 + 1e-9  # the same measured worker, micro-batched: never faster
    assert rows[8]["notes"][0].startswith("4 stages x 4 micro-batches") and rows[8]["examples_per_step"] == 2 * 16


@pytest.mark.parametrize("args, message", [
    (["--link-bandwidth", "25GB"], "not a bandwidth like 25GB/s"),
    (["--link-latency", "10"], "not a duration with a unit"),
    (["--link-bandwidth", "25GB/s"], "--link-bandwidth needs --link-latency too"),
    (["--workers", "0,2"], "every worker count must be 1 or more"),
    (["--workers", "two"], "not a list of worker counts"),
    (["--workers", "2,,4"], "--workers '2,,4' has an empty entry"),
    (["--workers", ""], "has an empty entry"),
    (["--workers", "2,"], "has an empty entry"),
    (["--workers", "-4"], "every worker count must be 1 or more"),
    (["--workers", "100000000"], "--workers 100000000 is more than phalanx estimate predicts (1,000,000)"),
    (["--strategy", "hogwild"], "unknown --strategy 'hogwild'"),
    (["--strategy", "sync", "--sync-every", "4"], "--sync-every is an option of local-sgd and diloco"),
    # the layout's words
    (["--strategy", "pipeline", "--chunks", "5"], "does not split into 5 equal micro-batches (--chunks 5)"),
    (["--strategy", "pipeline", "--stages", "9"], "the model has only 4 blocks"),
    (["--plot", "out.txt"], "name a .png, .pdf or .svg file"),
    (["--plot", "missing/out.png"], "does not exist"),
    (["--per-node", "0"], "--per-node must be at least 1"),
    (["--measure-steps", "1"], "--measure-steps must be at least 3"),
    (["--synthetic-shape", "3x8x8"], "--synthetic-shape applies to --data synthetic"),
    (["--batch-size", "5000"], "larger than the 1437 training examples"),
    (["--compress", "int8"], "unknown --compress"),
    (["--no-measure-link"], "--no-measure-link on CPU workers leaves the link between them unknown"),
    (["--strategy", "ps", "--workers", "1"], "ps on 1 worker: --strategy ps needs at least 2 workers"),
])
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["estimate", *args])
    except SystemExit as e:  # argparse's own usage errors exit directly
        code = e.code
    out = capsys.readouterr()
    assert code == 2, (out.out, out.err)
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], out.err


@pytest.mark.slow
def test_bad_input_through_the_installed_command(tmp_path):
    out = run_cli("estimate", "--link-latency", "10", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "not a duration" in out.stderr



@pytest.mark.slow
def test_ctrl_c_while_measuring_stops_the_estimate_in_its_own_words(tmp_path):
    # A stop that reached the measuring workers was ignored by them (they take no steps to stop at), and the
    # command went on measuring and printed its table, exit 0; else the launcher said it in a training job's
    # words: "stopped by SIGINT before the first step; nothing was saved".
    proc = subprocess.Popen(phalanx_cmd() + ["estimate", "--model", "mlp", "--workers", "1,2", "--measure-steps", "3",
                                             "--plot", "scaling.png"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stderr:
        if line.startswith("measuring compute: 1 worker"):
            os.killpg(proc.pid, signal.SIGINT)  # (Ctrl-C: the whole process group)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "estimate stopped by SIGINT while measuring; nothing was printed or written"
    assert out == "" and list(tmp_path.iterdir()) == []
