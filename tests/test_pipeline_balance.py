"""Stage balancing is pure logic: the exact partition, checked against brute force."""

import itertools
import random

import pytest

from phalanx.errors import PhalanxError
from phalanx.strategies.balance import (
    bounds, check_counts, ideal_bubble, parse_balance, partition, predicted_bubble, predicted_step, stage_costs,
)


def brute_force(costs, stages):
    """The smallest bottleneck over every way to cut ``costs`` into ``stages`` non-empty runs."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_partition_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    costs = [rng.choice([0, rng.random() * 10, rng.randint(1, 5)]) for _ in range(n)]
    counts = partition(costs, stages)
    assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
    assert max(stage_costs(costs, counts)) == pytest.approx(brute_force(costs, stages), rel=1e-12, abs=1e-12)


def test_partition_isolates_a_heavy_block():
    # One block five times heavier than the others: it gets a stage of its own.
    assert partition([1, 1, 5, 1, 1, 1], 2) == (3, 3)
    assert partition([1, 1, 1, 1, 1, 5], 2) == (5, 1)
    assert partition([5, 1, 1, 1, 1, 1], 3)[0] == 1


def test_partition_equal_costs_split_evenly_and_deterministically():
    assert partition([1.0] * 6, 3) == (2, 2, 2)
    assert partition([1.0] * 5, 2) == (2, 3)  # ties: the earliest cut
    assert partition([2.0, 3.0], 2) == (1, 1)


def test_more_stages_than_blocks_is_a_clear_error():
    with pytest.raises(PhalanxError, match="3 stages but the model has only 2 blocks.*--stages 2 or fewer"):
        partition([1, 2], 3)


def test_parse_balance():
    assert parse_balance("auto") == "auto"
    assert parse_balance("Time") == "time"
    assert parse_balance("3, 2,2") == (3, 2, 2)
    assert parse_balance([1, 4]) == (1, 4)
    with pytest.raises(PhalanxError, match="unknown --balance 'speed': choose auto, params, time"):
        parse_balance("speed")
    with pytest.raises(PhalanxError, match="every stage needs at least one block"):
        parse_balance("3,0")


def test_explicit_balance_is_validated():
    check_counts((3, 2), 5, 2)
    with pytest.raises(PhalanxError, match=r"--balance 3,3 sums to 6 \(3 \+ 3\) but the model has 5 blocks"):
        check_counts((3, 3), 5, 2)
    with pytest.raises(PhalanxError, match="names 3 stages but the pipeline has 2"):
        check_counts((1, 2, 2), 5, 2)


def test_bounds_and_stage_costs():
    assert bounds((2, 1, 3)) == [(0, 2), (2, 3), (3, 6)]
    assert stage_costs([1, 2, 3, 4, 5, 6], (2, 1, 3)) == [3.0, 3.0, 15.0]


def test_predicted_bubble():
    for p, m in [(2, 1), (2, 4), (3, 8), (4, 2)]:
        assert predicted_bubble([1.0] * p, m) == pytest.approx(ideal_bubble(p, m))
    assert ideal_bubble(2, 4) == pytest.approx(0.2)
    # An unequal pipeline idles more than the textbook figure: stage 0 waits on stage 1.
    assert predicted_bubble([1.0, 3.0], 4) > ideal_bubble(2, 4)
    assert predicted_bubble([1.0, 3.0], 4) == pytest.approx(1 - 4 * 4 / (2 * (4 + 3 * 3)))
    assert predicted_bubble([2.0], 4) == 0.0


def brute_force_with_edges(costs, stages, boundary):
    """The smallest bottleneck when a stage also pays boundary[k] for a cut after block k at either end."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) + (boundary[a - 1] if a > 0 else 0) + (boundary[b - 1] if b < n else 0)
                             for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_partition_with_boundary_costs_is_optimal_against_brute_force(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    costs = [rng.random() * 10 for _ in range(n)]
    boundary = [rng.random() * 4 for _ in range(n)]
    counts = partition(costs, stages, boundary)
    assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
    got = max(stage_costs(costs, counts, boundary))
    assert got == pytest.approx(brute_force_with_edges(costs, stages, boundary), rel=1e-12, abs=1e-12)


def test_boundary_costs_move_the_cut_to_a_small_message():
    # Without messages the even cut is after block 1; large activations after blocks 0 and 1 move it after block 2.
    costs = [1.0, 1.0, 1.0, 1.0]
    assert partition(costs, 2) == (2, 2)
    assert partition(costs, 2, boundary=[5.0, 5.0, 0.1, 0.0]) == (3, 1)
    # The last block's boundary is never a cut: it changes nothing.
    assert partition(costs, 2, boundary=[0.0, 0.0, 0.0, 99.0]) == (2, 2)
    assert stage_costs(costs, (3, 1), [5.0, 5.0, 0.1, 0.0]) == pytest.approx([3.1, 1.1])
    with pytest.raises(ValueError, match="3 given for 4 blocks"):
        partition(costs, 2, boundary=[0.0, 0.0, 0.0])


def test_predicted_step_is_fill_plus_bottleneck_plus_message_latency():
    # T = sum c + (M - 1) max c + 2 sum h
    assert predicted_step([1.0, 3.0], 4) == pytest.approx(4 + 3 * 3)
    assert predicted_step([1.0, 3.0], 4, latency=[0.5]) == pytest.approx(4 + 3 * 3 + 1.0)
    assert predicted_step([2.0], 8) == pytest.approx(16.0)  # one stage: no bubble
    assert predicted_step([], 4) == 0.0
    # The bubble counts the messages' latency as idle time.
    assert predicted_bubble([1.0, 1.0], 4, latency=[0.5]) == pytest.approx(1 - 4 * 2 / (2 * (2 + 3 + 1)))
