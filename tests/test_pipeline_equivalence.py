"""A pipeline computes what the unsplit model computes (test tier 3 of docs/architecture.md).

Every configuration runs inside one launch per stage count (worker start-up dominates), each
from the same seed, against a single-process reference on the whole batch: the loss of every
step, the gradients of the last step and the parameters after K steps. Also: the checkpoint is
the unsplit model's (and its optimizer's), it resumes under another partition, evaluation
agrees with the plain model on every rank, and one stage runs in-process with no engine.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import gather, run_workers
from phalanx.launcher import WorkerContext
from phalanx.task.models import lstm
from phalanx.strategies import Pipeline, runtime_for

K = 3  # SGD steps compared
BATCH = 16
TOL = dict(rtol=1e-5, atol=1e-6)


def make_model() -> nn.Sequential:
    """A stacked LSTM (its batch-first gradients are not contiguous: the engine must cope) and a head."""
    torch.manual_seed(0)
    return lstm((1, 8, 8), 10, hidden=12, layers=3)  # 4 blocks: 3 RowLSTM + (LastStep, Linear)


def batches(n: int = K + 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(n)]


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the gradients it was last asked to apply."""

    def step(self, closure=None):
        self.seen = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def make_optimizer(params):
    return RecordingSGD(params, lr=0.1, momentum=0.9)


def reference(steps: int = K) -> dict:
    model = make_model()
    opt = make_optimizer(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    losses = []
    for x, y in batches()[:steps]:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "grads": dict(zip(names, opt.seen)), "params": model.state_dict(),
            "optimizer": opt.state_dict()}


def run_pipeline(ctx: WorkerContext, strategy: Pipeline, steps: int = K, resume: dict = None) -> dict:
    """``steps`` pipelined steps; rank 0 gets losses, every stage's gradients and the checkpoint."""
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    runtime = runtime_for(strategy, ctx, model, make_optimizer, F.cross_entropy, example=batches()[0])
    if resume is not None:
        runtime.load_state_dict(resume["state"])
    losses = []
    for x, y in batches()[resume["step"] if resume else 0:steps]:
        loss = runtime.train_step(x, y)
        losses.append(float(runtime.global_losses(loss)))
    grads = {names[g]: t for g, t in zip(runtime.local_to_global, runtime.optimizer.seen)}
    merged = {}
    for part in gather(ctx, grads):
        merged.update(part)
    state = runtime.state_dict()
    plan = runtime.plan
    plans = gather(ctx, (plan.counts, plan.seconds, plan.message, plan.output_bytes, plan.lines()))
    return {"losses": losses, "grads": merged, "state": state, "counts": plan.counts, "plans": plans}


def assert_same(got: dict, want: dict, label: str) -> None:
    assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOL), label
    assert set(got["grads"]) == set(want["grads"]), label
    for name, g in want["grads"].items():
        assert torch.allclose(got["grads"][name], g, **TOL), f"{label}: gradient of {name}"
    assert list(got["state"]["model"]) == list(want["params"]), label  # the unsplit model's keys, in order
    for name, p in want["params"].items():
        assert torch.allclose(got["state"]["model"][name], p, **TOL), f"{label}: parameter {name}"


CONFIGS_2 = [("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)]


def _two_stage_worker(ctx: WorkerContext) -> dict:
    out = {}
    for schedule, chunks in CONFIGS_2:
        out[(schedule, chunks)] = run_pipeline(ctx, Pipeline(chunks=chunks, schedule=schedule, balance="params"))
    return out


def test_two_stages_equal_the_unsplit_model_gpipe_and_1f1b_for_1_2_4_micro_batches():
    want = reference()
    results = run_workers(_two_stage_worker, 2)
    for (schedule, chunks), got in results.items():
        assert_same(got, want, f"{schedule} M={chunks}")
        assert len(got["counts"]) == 2


def _three_stage_worker(ctx: WorkerContext) -> dict:
    return {
        ("gpipe", 4): run_pipeline(ctx, Pipeline(chunks=4, schedule="gpipe", balance=(1, 2, 1))),
        ("1f1b", 4): run_pipeline(ctx, Pipeline(chunks=4, schedule="1f1b", balance=(2, 1, 1))),
        ("gpipe", 2, "time"): run_pipeline(ctx, Pipeline(chunks=2, schedule="gpipe", balance="time")),
    }


@pytest.fixture(scope="module")
def three_stages() -> dict:
    return run_workers(_three_stage_worker, 3)


@pytest.mark.slow
def test_three_stages_equal_the_unsplit_model(three_stages):
    want = reference()
    for config, got in three_stages.items():
        assert_same(got, want, f"3 stages {config}")


def test_every_rank_measures_and_all_hold_one_plan(three_stages):
    """Balanced by time on 3 ranks: each timed every block and the two cuts' messages; they agreed."""
    got = three_stages[("gpipe", 2, "time")]
    assert len(got["plans"]) == 3 and all(p == got["plans"][0] for p in got["plans"])
    counts, seconds, message, output_bytes, lines = got["plans"][0]
    assert counts == got["counts"] and len(counts) == 3 and sum(counts) == 4
    assert len(seconds) == 4 and len(message) == 4
    # one micro-batch is 8 of the 16 examples: 3 RowLSTMs of 8 rows x 12 hidden, then 10 logits (float32)
    assert output_bytes == [8 * 8 * 12 * 4] * 3 + [8 * 10 * 4]
    assert lines[0].startswith("pipeline plan: 4 blocks in 3 stages, balanced by measured time; 2 micro-batches")
    assert sum(line.startswith("  stage 0 -> 1: 3 KiB of activations") for line in lines) == 1
    assert lines[-1].startswith("  measured in every worker at once: ")


def from_rank0(value):
    """Rank 0's checkpoint on every rank (the trainer reads it from the file instead)."""
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _checkpoint_worker(ctx: WorkerContext) -> dict:
    first = run_pipeline(ctx, Pipeline(chunks=2, balance=(1, 3)), steps=2)
    # Resume under another partition: every stage takes its part of the whole-model checkpoint.
    resume = {"state": from_rank0(first["state"]), "step": 2}
    resumed = run_pipeline(ctx, Pipeline(chunks=4, balance=(3, 1)), steps=K, resume=resume)
    strategy = runtime_for(Pipeline(chunks=2, balance=(2, 2)), ctx, make_model(), make_optimizer)
    strategy.load_state_dict(from_rank0(resumed["state"]))
    g = torch.Generator().manual_seed(5)
    odd = [(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in (7, 7, 3)]
    return {"first": first, "resumed": resumed, "eval": gather(ctx, strategy.evaluate(odd)), "odd": odd}


@pytest.mark.slow
def test_checkpoint_is_the_unsplit_model_resumes_under_another_partition_and_evaluates_alike():
    want2, want = reference(steps=2), reference()
    out = run_workers(_checkpoint_worker, 2)
    # The pipeline checkpoint is the plain model's state_dict and its optimizer's, exactly.
    saved = out["first"]["state"]
    plain = make_model()
    plain.load_state_dict(saved["model"])
    opt = make_optimizer(plain.parameters())
    opt.load_state_dict(saved["optimizer"])
    assert saved["optimizer"]["param_groups"][0]["params"] == list(range(len(list(plain.parameters()))))
    for i, s in want2["optimizer"]["state"].items():
        assert torch.allclose(saved["optimizer"]["state"][i]["momentum_buffer"], s["momentum_buffer"], **TOL)
    # Resumed at step 2 with a different partition and micro-batch count: the same final step.
    resumed = out["resumed"]
    assert torch.allclose(torch.tensor(resumed["losses"]), torch.tensor(want["losses"][2:]), **TOL)
    for name, p in want["params"].items():
        assert torch.allclose(resumed["state"]["model"][name], p, **TOL), name
    # Evaluation through the pipeline (batches of 7, 7 and 3): every rank gets the plain model's count.
    plain.load_state_dict(resumed["state"]["model"])
    with torch.no_grad():
        correct = sum(int((plain(x).argmax(1) == y).sum()) for x, y in out["odd"])
    assert out["eval"] == [(correct, 17), (correct, 17)]


def test_one_stage_runs_in_process_and_equals_the_unsplit_model():
    ctx = WorkerContext(0, 1, 0, torch.device("cpu"), None)
    got = run_pipeline(ctx, Pipeline(chunks=4))
    assert_same(got, reference(), "one stage")
