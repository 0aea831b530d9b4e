"""Balancing by time, the pure parts: profiling under stage conditions, agreeing, pricing messages, predicting.

The distributed side (every rank measures, all agree on one plan, the early-receive schedule
equals the unsplit model) is in tests/test_pipeline_equivalence.py.
"""

import math

import pytest
import torch
from torch import nn

from phalanx.strategies.pipeline import messages
from phalanx.strategies.pipeline.plan import StagePlan
from phalanx.strategies.pipeline.profile import agree, describe, profile_order, time_blocks


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_time_blocks_runs_the_schedules_micro_batches_and_touches_nothing(schedule):
    model = small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    micro = list(torch.randn(12, 6).split(3))  # 4 micro-batches of 3
    rng = torch.get_rng_state()
    calls = []
    times = time_blocks(list(model), micro, torch.device("cpu"), repeats=3, schedule=schedule, warmup=2,
                        barrier=lambda: calls.append(1))
    assert len(times.seconds) == 4 and all(math.isfinite(s) and s >= 0 for s in times.seconds)
    # bytes of each block's output for one micro-batch of 3 examples (float32)
    assert times.output_bytes == [3 * 8 * 4, 3 * 8 * 4, 3 * 8 * 4, 3 * 3 * 4]
    assert len(calls) == 2 + 3  # every pass, warm-up included, starts at the barrier
    # private copies, forked random state: the model's weights, BatchNorm statistics, gradients and
    # the training run's random stream are as they were
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_time_blocks_runs_blocks_that_work_in_place():
    """torchvision's ReLU(inplace=True), alone as a block and first in a block."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Sequential(nn.ReLU(inplace=True), nn.Tanh()),
                          nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    times = time_blocks(list(model), list(torch.randn(12, 6).split(3)), torch.device("cpu"), repeats=2)
    assert len(times.seconds) == 4 and all(math.isfinite(s) and s >= 0 for s in times.seconds)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_agree_takes_the_median_per_block_over_ranks():
    assert agree([[1.0, 2.0], [3.0, 2.0], [2.0, 8.0]]) == [2.0, 2.0]
    assert agree([[1.0, 4.0], [3.0, 2.0]]) == [2.0, 3.0]  # two ranks: their mean
    assert agree([[5.0]]) == [5.0]
    with pytest.raises(ValueError, match="different numbers of blocks"):
        agree([[1.0], [1.0, 2.0]])


def test_probe_sizes_keeps_every_size_or_a_log_spread_with_the_ends():
    assert messages.probe_sizes([64, 16, 64, 0]) == [1, 16, 64]
    sizes = [2 ** k for k in range(4, 24)]
    probe = messages.probe_sizes(sizes, most=6)
    assert len(probe) <= 6 and probe[0] == 16 and probe[-1] == 2 ** 23 and set(probe) <= set(sizes)


def test_interpolate_is_piecewise_linear_in_bytes():
    sizes, seconds = [100, 1000, 10000], [1.0, 2.0, 11.0]
    assert messages.interpolate(sizes, seconds, 100) == 1.0
    assert messages.interpolate(sizes, seconds, 50) == 1.0  # below the smallest: its time
    assert messages.interpolate(sizes, seconds, 550) == pytest.approx(1.5)
    assert messages.interpolate(sizes, seconds, 5500) == pytest.approx(6.5)
    assert messages.interpolate(sizes, seconds, 20000) == pytest.approx(21.0)  # the last slope, onwards
    assert messages.interpolate([100], [2.0], 300) == pytest.approx(6.0)  # one size: proportional above it
    assert messages.interpolate([100], [2.0], 10) == 2.0
    assert messages.interpolate([], [], 10) == 0.0


def test_message_pairs_never_put_a_rank_in_two_pairs_at_once():
    for stages in range(1, 7):
        rounds = [messages.pairs(stages, r) for r in (0, 1)]
        assert sorted(p for r in rounds for p in r) == [(b, b + 1) for b in range(stages - 1)]
        for r in rounds:
            ranks = [s for pair in r for s in pair]
            assert len(ranks) == len(set(ranks))


def test_messages_agree_over_the_boundaries_that_measured():
    assert messages.agree([[1.0, 4.0], None, [3.0, 2.0], None]) == [2.0, 3.0]
    assert messages.agree([None, None]) == []


def plan(counts=(2, 2), message=None, conditions="") -> StagePlan:
    return StagePlan(counts, ["a", "b", "c", "d"], [10, 20, 30, 40], [1e-3, 1e-3, 1e-3, 5e-3], "time", 4, "gpipe",
                     message=message, output_bytes=[4096] * 4 if message else None, conditions=conditions)


def test_plan_prices_its_own_partition_and_any_other_from_the_same_measurements():
    p = plan((3, 1), message=[1e-4] * 4)
    # stages: 3 ms and 5 ms of blocks, each + 2 x 0.1 ms for the activations out and the gradients back
    assert p.stage_seconds() == pytest.approx([3e-3, 5e-3])
    assert p.stage_seconds(messages=True) == pytest.approx([3.2e-3, 5.2e-3])
    assert p.step_seconds() == pytest.approx(3.2e-3 + 5.2e-3 + 3 * 5.2e-3 + 2 * 1e-4)
    equal = 2.2e-3 + 6.2e-3 + 3 * 6.2e-3 + 2 * 1e-4  # (2, 2): 2 ms and 6 ms
    assert p.step_seconds((2, 2)) == pytest.approx(equal)
    assert p.speedup_over((2, 2)) == pytest.approx(equal / p.step_seconds())
    # without messages measured, the step is the blocks alone
    assert plan((3, 1)).step_seconds() == pytest.approx(3e-3 + 5e-3 + 3 * 5e-3)
    unmeasured = StagePlan((2, 2), ["a", "b", "c", "d"], [1] * 4, None, "params", 4, "gpipe")
    assert unmeasured.step_seconds() is None and unmeasured.speedup_over((3, 1)) is None


def test_a_traced_plan_says_the_users_step_runs_once_when_traced():
    """Under pipeline a user's step is traced once: a step that raised at its 31st call trained to exit 0, where
    sync, ps and fsdp fail at step 31. The plan says so, for the user's step alone (phalanx's own has no Python
    of the user's to run)."""
    said = "  your training step runs once, when traced (and once per evaluation batch shape): every step runs "
    for users_step in (True, False):
        p = StagePlan((1, 1), ["(start)", "h.1"], [10, 20], None, "params", 4, "gpipe", traced=("h.1",),
                      users_step=users_step)
        assert any(line.startswith(said) for line in p.lines()) == users_step


def test_plan_lines_show_boundaries_prediction_and_conditions():
    lines = plan((3, 1), message=[1e-4] * 4, conditions="in every worker at once").lines()
    assert lines[0] == ("pipeline plan: 4 blocks in 2 stages, balanced by measured time; 4 micro-batches per step, "
                        "gpipe schedule")
    assert lines[1] == "  stage 0 (rank 0): blocks a..c (3), 60 parameters, 3.00 ms per micro-batch (fwd+bwd)"
    assert lines[2] == "  stage 1 (rank 1): blocks d (1), 40 parameters, 5.00 ms per micro-batch (fwd+bwd)"
    assert lines[3] == ("  stage 0 -> 1: 4 KiB of activations per micro-batch (and their gradients back), "
                        "0.10 ms per message")
    assert lines[4].startswith("  slowest stage 5.20 ms per micro-batch with its messages; predicted step 24.2 ms, "
                               "predicted bubble ")
    assert lines[5] == "  measured in every worker at once"


def test_profile_order_and_description():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert profile_order("gpipe", cpu) == "gpipe" and profile_order("1f1b", cpu) == "1f1b"
    assert profile_order("gpipe", gpu) == "1f1b"  # one micro-batch's activations at a time on a device
    micro = list(torch.zeros(8, 2).split(2))
    threads = torch.get_num_threads()
    text = describe(cpu, micro, "gpipe", 5, 2, True)
    assert text.startswith(f"in every worker at once: {threads} torch thread")
    assert text.endswith("4 micro-batches of 2 per pass in gpipe order, median of 5 passes after a warm-up; "
                         "median over 2 ranks")
    assert describe(gpu, micro, "gpipe", 3, 1, False) == ("in this process: cuda:0, 4 micro-batches of 2 per pass "
                                                          "in 1f1b order, median of 3 passes after a warm-up")
