"""Buffers and in-place layers inside pipeline stages (test tier 3 of docs/architecture.md, then the CLI end to end).

BatchNorm normalises each micro-batch by its own statistics and takes each into its running
statistics, so a pipeline of M micro-batches is compared with one process that runs the same M
micro-batches through the unsplit model in the same order (each loss divided by M, as the
engine scales): the loss of every step and, after K steps, every parameter AND every buffer
(running mean, running variance, ``num_batches_tracked``). The model's middle block starts with
``ReLU(inplace=True)``, so a cut before it makes a stage's first layer work in place on what it
received. Then a torchvision-style ResNet cut into blocks trains through the CLI, time profiler
and all, as far as sync takes it.
"""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import REPO, gather, run_cli, run_in_process, run_workers
from phalanx.launcher import WorkerContext
from phalanx.strategies import Pipeline, runtime_for
from phalanx.checkpoint import load_checkpoint, tensors

K = 3  # SGD steps compared
BATCH = 16
TOL = dict(rtol=1e-4, atol=1e-5)  # BatchNorm divides by a micro-batch's spread: a little more rounding


def make_model() -> nn.Sequential:
    """Three blocks, BatchNorm in the middle one, which begins with an in-place ReLU."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 4, 3, padding=1)),
        nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=True)),
        nn.Sequential(nn.Flatten(), nn.Linear(6 * 8 * 8, 10)),
    )


def batches(n: int = K) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 1, 8, 8, generator=g) * 3 + 1, torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(n)]


def held_out() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(n, 1, 8, 8, generator=g) * 3 + 1, torch.randint(0, 10, (n,), generator=g)) for n in (8, 6)]


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def micro_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, parts: int, scale: int) -> list[float]:
    """Forward and backward of each of ``parts`` micro-batches in order, each loss divided by ``scale``."""
    losses = []
    for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
        loss = F.cross_entropy(model(xs), ys)
        (loss / scale).backward()
        losses.append(loss.item())
    return losses


def reference(chunks: int, replicas: int = 1) -> dict:
    """One process, the unsplit model, the pipeline's micro-batches in the pipeline's order.

    With ``replicas``: every replica's part of the batch runs from the step's starting buffers, the
    gradients add up (each loss divided by all R x M micro-batches) and the floating-point buffers
    the replicas end the step with are averaged, as the replicas of a stage average theirs."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    losses = []
    for x, y in batches():
        start = {k: v.clone() for k, v in model.named_buffers()}
        ends, mine = [], []
        for xs, ys in zip(x.chunk(replicas), y.chunk(replicas)):
            model.load_state_dict(start, strict=False)
            mine += micro_steps(model, xs, ys, chunks, replicas * chunks)
            ends.append({k: v.clone() for k, v in model.named_buffers()})
        model.load_state_dict({k: torch.stack([e[k] for e in ends]).mean(0) if v.is_floating_point() else v
                               for k, v in ends[0].items()}, strict=False)
        losses.append(sum(mine) / len(mine))
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in held_out())
    return {"losses": losses, "state": model.state_dict(), "correct": correct}


def run_pipeline(ctx: WorkerContext, strategy: Pipeline) -> dict:
    runtime = runtime_for(strategy, ctx, make_model(), make_optimizer, F.cross_entropy, example=batches()[0])
    losses = [float(runtime.global_losses(runtime.train_step(x, y))) for x, y in batches()]
    counted = runtime.evaluate(held_out())
    return {"losses": losses, "state": runtime.state_dict(), "eval": gather(ctx, counted),
            "counts": runtime.plan.counts}


def assert_state_equal(got: dict, want: dict, label: str) -> None:
    assert list(got) == list(want), label  # the unsplit model's keys, buffers included, in order
    for name, value in want.items():
        if value.is_floating_point():
            assert torch.allclose(got[name], value, **TOL), f"{label}: {name}"
        else:
            assert torch.equal(got[name], value), f"{label}: {name} is {got[name]}, want {value}"


# (schedule, micro-batches, balance): the in-place ReLU first in stage 1, then BatchNorm in stage 0 (whose
# shape inference runs on micro-batch 0 itself), then cut where the time profiler says
CONFIGS = [("gpipe", 4, (1, 2)), ("1f1b", 4, (2, 1)), ("gpipe", 2, "time")]


def _two_stage_worker(ctx: WorkerContext) -> dict:
    return {config: run_pipeline(ctx, Pipeline(schedule=config[0], chunks=config[1], balance=config[2]))
            for config in CONFIGS}


@pytest.mark.slow
def test_batchnorm_in_a_stage_equals_the_unsplit_model_on_the_same_micro_batches_parameters_and_buffers():
    results = run_workers(_two_stage_worker, 2)
    for (schedule, chunks, balance), got in results.items():
        label = f"{schedule} M={chunks} balance {balance}"
        want = reference(chunks)
        assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOL), label
        assert_state_equal(got["state"]["model"], want["state"], label)
        assert int(got["state"]["model"]["1.2.num_batches_tracked"]) == K * chunks, label  # no extra pass counted
        assert got["eval"] == [(want["correct"], 14)] * 2, label  # evaluated in eval mode, running statistics
    assert results[CONFIGS[0]]["counts"] == (1, 2) and results[CONFIGS[1]]["counts"] == (2, 1)


# ---- a torchvision-style ResNet cut into blocks, through the CLI ----

def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, as written there: in-place ReLUs and ``out += identity``."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = conv3x3(inplanes, planes, stride), nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = conv3x3(planes, planes), nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def resnet(input_shape: tuple, num_classes: int, widths: tuple = (16, 32, 64)) -> nn.Sequential:
    """torchvision's ResNet re-cut into blocks (its stem with a 3x3 convolution for 8x8 digits): conv1, bn1, relu,
    one layer of two BasicBlocks per width, avgpool, flatten, fc."""
    parts: list[nn.Module] = [conv3x3(input_shape[0], widths[0]), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True)]
    inplanes = widths[0]
    for i, planes in enumerate(widths):
        parts.append(nn.Sequential(BasicBlock(inplanes, planes, 1 if i == 0 else 2), BasicBlock(planes, planes)))
        inplanes = planes
    return nn.Sequential(*parts, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, num_classes))


def summary(run_dir) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"summary"' in line][-1]


@pytest.mark.slow
def test_resnet_with_inplace_relus_cut_into_blocks_trains_under_pipeline_as_under_sync(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests"))  # the workers import --model test_pipeline_bn:resnet
    common = ["--model", "test_pipeline_bn:resnet", "--workers", "2", "--steps", "60", "--log-every", "30",
              "--progress", "lines"]
    pipe = run_cli("train", "--strategy", "pipeline", "--stages", "2", *common, "--checkpoint-dir", "pipe",
                   cwd=tmp_path)
    assert pipe.returncode == 0, pipe.stderr
    assert re.search(r"pipeline plan: 9 blocks in 2 stages, balanced by measured time", pipe.stdout), pipe.stdout
    sync = run_in_process("train", "--strategy", "sync", *common, "--checkpoint-dir", "sync", cwd=tmp_path)
    assert sync.returncode == 0, sync.stderr
    got, want = summary(tmp_path / "pipe")["test_accuracy"], summary(tmp_path / "sync")["test_accuracy"]
    assert got > 0.8 and got > want - 0.1, (got, want)
    # Its checkpoint is the unsplit ResNet's, running statistics counted once per micro-batch; it scores the same.
    state = tensors(load_checkpoint(tmp_path / "pipe" / "step-00000060.dcp"))["model"]  # (the stages' shards, whole)
    assert all(torch.isfinite(v).all() for v in state.values())
    assert {int(v) for k, v in state.items() if k.endswith("num_batches_tracked")} == {60 * 4}
    model = resnet((1, 8, 8), 10)
    model.load_state_dict(state)
    from phalanx.data import load_data

    test = load_data("digits", seed=0).test
    model.eval()
    with torch.no_grad():
        plain = (model(test.transform(test.x, None)).argmax(1) == test.y).float().mean().item()
    assert plain == pytest.approx(got, abs=1 / 360 + 1e-9)
