"""A stage's example input and output, worked out ahead (pipeline/stage.py): torch's static mode.

First without processes: the examples of every stage equal what the real stages compute on one
micro-batch (shape, stride, dtype, ``requires_grad``), on meta tensors where the blocks run there and for
real where a block reads a value on the host, and neither way changes a buffer of the model or
the random stream. Then on 2 gloo workers: a BatchNorm model with such a block, fed batches of
two shapes, equals the unsplit model run on the same micro-batches (test tier 3 of docs/architecture.md).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import gather, run_workers
from phalanx.launcher import WorkerContext
from phalanx.strategies.pipeline.split import StageModule
from phalanx.strategies.pipeline.stage import stage_examples
from phalanx.strategies import Pipeline, runtime_for
from test_pipeline_bn import TOL, assert_state_equal, make_optimizer, micro_steps

CPU = torch.device("cpu")
SIZES = (16, 8, 16)  # the batches of the run: a second shape, then the first again
CHUNKS = 4


class HostRead(nn.Module):
    """Scales by a value read on the host (``.item()``), as some models do: no meta tensor can run it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / max(1.0, x.detach().abs().max().item())


def make_model(host_read: bool = True, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    first = [HostRead()] if host_read else []
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Dropout(dropout)),
        nn.Sequential(*first, nn.ReLU(inplace=True), nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6),
                      nn.ReLU(inplace=True)),
        nn.Sequential(nn.Flatten(), nn.Linear(6 * 8 * 8, 10)),
    )


def as_stages(model: nn.Sequential) -> list[StageModule]:
    return [StageModule([(str(i), block)]) for i, block in enumerate(model)]


@pytest.mark.parametrize("host_read", [False, True], ids=["meta", "real"])
@pytest.mark.parametrize("backward", [True, False], ids=["train", "eval"])
def test_examples_are_what_the_stages_compute_and_change_nothing(host_read, backward):
    model = make_model(host_read, dropout=0.5)
    model.train(backward)
    x = torch.randn(4, 1, 8, 8)
    want, h = [], x  # what a copy of the stages computes, each stage's input a leaf as the engine hands it
    with torch.set_grad_enabled(backward):
        for stage in as_stages(copy.deepcopy(model)):
            h = h.detach().requires_grad_(h.requires_grad) if want else h
            want.append((h, stage(h)))
            h = want[-1][1]
    before, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    real_calls = []
    model[2].register_forward_hook(lambda module, args, out: real_calls.append(args[0].device.type != "meta"))
    stages = as_stages(model)
    for index, (inp, out) in enumerate(want):
        got = stage_examples(stages[: index + 1], x, CPU, backward)
        for example, real in zip(got, (inp, out)):
            assert example.device.type == "meta", index
            assert (example.shape, example.stride(), example.dtype, example.requires_grad) == \
                (real.shape, real.stride(), real.dtype, real.requires_grad), index
    assert any(real_calls) == host_read  # meta tensors where the blocks run on them; a real pass where not
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # no statistic counted
    assert torch.equal(torch.get_rng_state(), rng)  # Dropout drew nothing from the run's stream
    assert all(m.training == backward for m in model.modules())  # every block back in its own mode


def run_pipeline(ctx: WorkerContext, strategy: Pipeline) -> dict:
    runtime = runtime_for(strategy, ctx, make_model(), make_optimizer, F.cross_entropy)
    losses = [float(runtime.global_losses(runtime.train_step(x, y))) for x, y in batches()]
    return {"losses": losses, "state": runtime.state_dict(), "schedules": gather(ctx, len(runtime._schedules))}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 1, 8, 8, generator=g) * 3 + 1, torch.randint(0, 10, (n,), generator=g)) for n in SIZES]


def reference() -> dict:
    """One process, the unsplit model, the pipeline's micro-batches in the pipeline's order."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    losses = []
    for x, y in batches():
        losses.append(sum(micro_steps(model, x, y, CHUNKS, CHUNKS)) / CHUNKS)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "state": model.state_dict()}


def _worker(ctx: WorkerContext) -> dict:
    return {schedule: run_pipeline(ctx, Pipeline(chunks=CHUNKS, schedule=schedule, balance=(1, 2)))
            for schedule in ("gpipe", "1f1b")}


@pytest.mark.slow
def test_a_block_meta_tensors_cannot_run_and_batches_of_two_shapes_train_as_the_unsplit_model():
    results = run_workers(_worker, 2)
    want = reference()
    for schedule, got in results.items():
        assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOL), schedule
        assert_state_equal(got["state"]["model"], want["state"], schedule)
        assert int(got["state"]["model"]["1.3.num_batches_tracked"]) == len(SIZES) * CHUNKS, schedule
        assert got["schedules"] == [2, 2], schedule  # one per batch shape, on both stages
