"""Hierarchical and compressed gradient reduction against a flat all-reduce (4 gloo workers)."""

import re

import pytest
import torch
from helpers import gather, run_workers
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from phalanx.errors import PhalanxError
from phalanx.comm.reduce import (
    HierarchicalState,
    apply_reduction,
    choose_reduction,
    validate_islands,
)
from phalanx.comm.wire import metering

ISLANDS = [[0, 1], [2, 3]]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))


def _grads_and_params(ctx, reduce, compress, steps):
    """Gradients after one backward, and parameters after ``steps`` SGD steps, under a reduction."""
    ddp = DDP(_model(), bucket_cap_mb=0.001)  # several buckets
    apply_reduction(ddp, reduce, compress, ISLANDS if reduce == "hierarchical" else None, ctx.world_size, ctx.rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + ctx.rank)  # different data on every rank
    grads = None
    for step in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if step == 0:
            grads = [p.grad.clone() for p in ddp.parameters()]
        opt.step()
    return grads, [p.detach().clone() for p in ddp.parameters()]


def _compare(ctx):
    out = {}
    for name, reduce, compress in [("flat", "flat", None), ("hier", "hierarchical", None),
                                   ("hier_bf16", "hierarchical", "bf16"), ("flat_fp16", "flat", "fp16")]:
        out[name] = _grads_and_params(ctx, reduce, compress, steps=4)
    return gather(ctx, out)


@pytest.fixture(scope="module")
def four_workers():
    return run_workers(_compare, 4)


@pytest.mark.slow
def test_hierarchical_equals_a_flat_all_reduce(four_workers):
    for rank_result in four_workers:
        for a, b in zip(rank_result["flat"][0], rank_result["hier"][0]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        for a, b in zip(rank_result["flat"][1], rank_result["hier"][1]):  # training matches sync
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # every rank ends with the same parameters
    for other in four_workers[1:]:
        for a, b in zip(four_workers[0]["hier"][1], other["hier"][1]):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name, tolerance", [("hier_bf16", 2e-2), ("flat_fp16", 2e-3)])
def test_compressed_reduction_is_within_half_precision(four_workers, name, tolerance):
    flat = four_workers[0]["flat"][0]
    compressed = four_workers[0][name][0]
    for a, b in zip(flat, compressed):
        scale = a.abs().max().item() or 1.0
        assert (a - b).abs().max().item() <= tolerance * scale
    assert any(not torch.equal(a, b) for a, b in zip(flat, compressed))  # it really went through half precision


def _bytes(ctx):
    sizes = {}
    for dtype in (None, torch.bfloat16, torch.float16):
        state = HierarchicalState.build(ISLANDS, ctx.rank, ctx.world_size, dtype)
        total = torch.arange(1000, dtype=torch.float32) * (ctx.rank + 1)
        with metering() as meter:
            meter.begin()
            state.reduce(total)
        sizes[str(dtype)] = (meter.sent, meter.received)
        expected = torch.arange(1000, dtype=torch.float32) * 10  # 1 + 2 + 3 + 4
        torch.testing.assert_close(total, expected, rtol=1e-2 if dtype else 0, atol=0)
    return gather(ctx, sizes)


@pytest.mark.slow
def test_compression_halves_the_bytes_sent():
    """The bytes on the wire (wire.py's pricing of gloo's algorithms) of one 4,000-byte bucket, islands of 2."""
    per_rank = run_workers(_bytes, 4)
    for sizes in per_rank:
        assert tuple(2 * b for b in sizes["torch.bfloat16"]) == sizes["None"] == \
            tuple(2 * b for b in sizes["torch.float16"])
    # a leader: the root of its island's reduce (sends half, receives both halves), the all-reduce among
    # the two leaders (sends and receives 4,000), the root of its island's broadcast (sends one copy)
    assert per_rank[0]["None"] == (2000 + 4000 + 4000, 4000 + 4000 + 0)
    # a member: sends its reduce-scatter half and its half of the sum to the leader, receives the broadcast
    assert per_rank[1]["None"] == (4000 + 0, 2000 + 4000)


def _degenerate_bytes(ctx):
    out = {}
    for islands in ([[0, 1, 2, 3]], [[0], [1], [2], [3]]):
        state = HierarchicalState.build(islands, ctx.rank, ctx.world_size)
        total = torch.ones(1000) * (ctx.rank + 1)
        with metering() as meter:
            meter.begin()
            state.reduce(total)
        out[str(islands)] = (meter.sent, total[0].item())
    return out


@pytest.mark.slow
def test_degenerate_islands_are_one_flat_all_reduce():
    out = run_workers(_degenerate_bytes, 4)
    # one ring all-reduce each: 2 (N - 1) / N x 4,000 bytes sent by every rank
    assert out == {"[[0, 1, 2, 3]]": (6000, 10.0), "[[0], [1], [2], [3]]": (6000, 10.0)}


def test_wire_buffers_are_kept_from_step_to_step():
    from phalanx.comm.reduce import WireBuffers

    wire = WireBuffers(torch.bfloat16)
    first = wire.cast(torch.ones(10))
    again = wire.cast(torch.full((10,), 2.0))
    assert again is first and again.dtype == torch.bfloat16 and again[0].item() == 2.0
    assert wire.cast(torch.ones(5)) is not first  # another bucket size: its own buffer


def _flat_counts(ctx):
    """What the meter counts over 3 steps of 2 micro-batches (the first under ``no_sync``) and an evaluation
    forward, for DDP's own reducer as sync builds it, and for torch's ``allreduce_hook`` (the reference: its
    ``dist.all_reduce`` of every bucket is what the meter's wrappers see). A frozen layer and a shared one
    (counted once), several buckets; and which communication hook DDP says it runs."""
    out = {}
    for name in ("reducer", "hook"):
        torch.manual_seed(0)
        shared = nn.Linear(32, 32)
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), shared, nn.Tanh(), shared, nn.Linear(32, 3))
        model[0].requires_grad_(False)
        ddp = DDP(model, bucket_cap_mb=0.001)
        if name == "reducer":
            apply_reduction(ddp, "flat", None, None, ctx.world_size, ctx.rank)
        else:
            ddp.register_comm_hook(None, allreduce_hook)
        with metering() as meter:
            meter.begin()
            for _ in range(3):
                with ddp.no_sync():
                    ddp(torch.randn(4, 6)).sum().backward()
                ddp(torch.randn(4, 6)).sum().backward()
                with torch.no_grad():
                    ddp(torch.randn(4, 6))
        out[name] = (meter.sent, meter.received, ddp._get_ddp_logging_data().get("comm_hook"))
    return out


@pytest.mark.slow
def test_a_flat_reduction_runs_ddps_own_reducer_and_counts_what_the_hook_counted():
    out = run_workers(_flat_counts, 2)
    gradient = 4 * (32 * 32 + 32 + 32 * 3 + 3)  # the shared layer once, the frozen one not at all
    # a ring all-reduce of 2 ranks sends and receives the gradient once, in each of the 3 synchronised steps
    assert out["hook"] == (3 * gradient, 3 * gradient, "allreduce_hook")
    assert out["reducer"] == (3 * gradient, 3 * gradient, None)  # no hook: DDP's C++ reducer


def test_a_compressed_buckets_failed_all_reduce_fails_the_step(monkeypatch):
    """A peer lost mid all-reduce: DDP must see the error, not take the bucket as reduced (seen: under torchrun
    the survivor then trained on, alone and on unreduced gradients, until some other collective failed)."""
    from phalanx.comm.reduce import CompressState, WireBuffers, compress_hook

    class Failed:
        def get_future(self):
            future = torch.futures.Future()
            future.set_exception(RuntimeError("Connection reset by peer"))
            return future

    class Bucket:
        def buffer(self):
            return torch.ones(4)

    monkeypatch.setattr("torch.distributed.all_reduce", lambda tensor, async_op=False: Failed())
    reduced = compress_hook(CompressState(WireBuffers(torch.bfloat16), 2), Bucket())
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        reduced.wait()


def test_island_validation_and_auto_choice():
    assert validate_islands([[3, 2], [1, 0]], 4) == [[0, 1], [2, 3]]
    with pytest.raises(PhalanxError, match=r"must list every rank 0..3 exactly once \(they cover \[0, 1, 1, 2\]\)"):
        validate_islands([[0, 1], [1, 2]], 4)
    assert choose_reduction("auto", [[0, 1], [2, 3]]) == "hierarchical"
    assert choose_reduction("auto", [[0, 1], [2, 3]], cpu=True) == "flat"  # CPU workers: nothing to win
    assert choose_reduction("auto", [[0, 1, 2, 3]]) == "flat"  # one island
    assert choose_reduction("auto", [[0], [1]]) == "flat"
    assert choose_reduction("auto", None) == "flat"
    with pytest.raises(PhalanxError, match="unknown --reduce 'ring'"):
        choose_reduction("ring", None)


@pytest.mark.slow
def test_training_with_hierarchical_bf16_through_the_cli(tmp_path):
    from helpers import run_cli, run_in_process

    out = run_cli("train", "--steps", "100", "--reduce", "hierarchical", "--islands", "0;1", "--compress", "bf16",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # one rank per island: the hierarchy has nothing to do, so it is the flat all-reduce (never a cost)
    assert ("flat all-reduce (islands [[0], [1]]: one rank per island, nothing to reduce hierarchically), bf16 on "
            "the wire") in out.stdout.splitlines()[0]
    assert float(re.search(r"test accuracy ([\d.]+)", out.stdout).group(1)) >= 0.95
    bad = run_in_process("train", "--reduce", "hierarchical", cwd=tmp_path)  # (refused before it starts)
    assert bad.returncode == 2 and "needs the islands spelled out" in bad.stderr
