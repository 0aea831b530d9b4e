"""Whole training runs against single-process references (real spawned gloo workers)."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import run_workers
from phalanx import Sync, TrainConfig, Trainer
from phalanx.errors import PhalanxError, TrainingDiverged
from phalanx.strategies import runtime_for
from phalanx.checkpoint import latest_checkpoint, list_checkpoints


def _train(tmp: Path, name: str, **overrides) -> dict:
    cfg = dict(steps=6, batch_size=8, workers=2, devices="cpu", lr=0.05, log_every=100, progress="none",
               checkpoint_dir=str(tmp / name), checkpoint_every=0)
    cfg.update(overrides)
    summary = Trainer(TrainConfig(**cfg)).fit()
    state = torch.load(latest_checkpoint(tmp / name), weights_only=True)
    return {"summary": summary, "state": state}


def _assert_same_params(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def test_sync_two_workers_equals_one_process_with_twice_the_batch(tmp_path):
    two = _train(tmp_path, "two", workers=2, batch_size=8, steps=6)
    one = _train(tmp_path, "one", workers=1, batch_size=16, steps=6)
    _assert_same_params(two["state"]["model"], one["state"]["model"], atol=1e-5)
    # the parameters really moved: the comparison is not between two untouched initialisations
    init = _train(tmp_path, "init", workers=1, batch_size=16, steps=1, lr=1e-12)
    moved = max((two["state"]["model"][k] - init["state"]["model"][k]).abs().max() for k in init["state"]["model"])
    assert moved > 1e-3


@pytest.mark.slow
def test_gradient_accumulation_equals_the_full_batch(tmp_path):
    whole = _train(tmp_path, "whole", workers=2, batch_size=8, steps=4)
    accumulated = _train(tmp_path, "acc", workers=2, batch_size=8, steps=4, accumulate=4)
    _assert_same_params(whole["state"]["model"], accumulated["state"]["model"], atol=1e-5)


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    straight = _train(tmp_path, "straight", steps=20, checkpoint_every=10, lr_schedule="exponential",
                      lr_decay_every=5, optimizer="sgd")
    _train(tmp_path, "split", steps=10, checkpoint_every=10, lr_schedule="exponential", lr_decay_every=5)
    resumed = _train(tmp_path, "split", steps=20, checkpoint_every=10, lr_schedule="exponential",
                     lr_decay_every=5, resume=str(tmp_path / "split"))
    assert resumed["state"]["step"] == 20
    _assert_same_params(straight["state"]["model"], resumed["state"]["model"], atol=1e-6)
    assert straight["state"]["scheduler"]["last_epoch"] == resumed["state"]["scheduler"]["last_epoch"] == 20
    for a, b in zip(straight["state"]["optimizer"]["state"].values(), resumed["state"]["optimizer"]["state"].values()):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_checkpoints_keep_the_newest_k_and_hold_everything(tmp_path):
    out = _train(tmp_path, "k", workers=2, steps=10, checkpoint_every=2, keep_checkpoints=3)
    names = [p.name for p in list_checkpoints(tmp_path / "k")]
    assert names == ["step-00000006.pt", "step-00000008.pt", "step-00000010.pt"]
    state = out["state"]
    assert {"model", "optimizer", "scheduler", "step", "rng", "meta", "data_position"} <= set(state)
    assert len(state["rng"]) == 2  # one RNG state per worker
    assert state["meta"]["world_size"] == 2 and state["meta"]["batch_size"] == 8
    assert not list((tmp_path / "k").glob("*.tmp"))
    lines = (tmp_path / "k" / "metrics.jsonl").read_text().splitlines()
    assert '"event": "summary"' in lines[-1]


@pytest.mark.slow
def test_divergence_stops_and_names_the_last_good_checkpoint(tmp_path):
    with pytest.raises(TrainingDiverged,
                       match=r"model diverged with loss = (nan|inf) at step \d+; last good checkpoint"):
        _train(tmp_path, "nan", lr=1e12, steps=40, checkpoint_every=1, optimizer="sgd", momentum=0.0)
    for path in list_checkpoints(tmp_path / "nan"):  # every checkpoint left behind is finite
        state = torch.load(path, weights_only=True)
        assert all(torch.isfinite(t).all() for t in state["model"].values())


@pytest.mark.slow
@pytest.mark.parametrize("strategy, workers", [("sync", 2), ("ps", 3)])
def test_a_step_whose_batch_has_no_target_is_no_divergence(strategy, workers, tmp_path):
    """Labels of -100 (torch's and Hugging Face's ignore index) on a third of the examples, a batch of one per
    worker: many steps have a shard with no target, whose loss is a mean over nothing (NaN) and whose gradient is
    zero. They were taken for a divergence and the run was stopped ("model diverged with loss = nan"); the run
    trains and what it saves is finite. Lockstep ranks read the step's batches again, say so once and record each
    such step; a parameter server's worker says so in its push, and the server leaves that loss out."""
    import json

    torch.manual_seed(0)
    x = torch.randn(300, 4)
    y = (x[:, 0] > 0).long()
    y[torch.arange(0, 240, 3)] = -100
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    cfg = TrainConfig(strategy=strategy, steps=60, batch_size=1, workers=workers, devices="cpu", lr=0.05,
                      momentum=0.0, progress="none", log_every=10, checkpoint_dir=str(tmp_path / "ck"))
    summary = Trainer(cfg, model=model, train_data=(x[:240], y[:240]), test_data=(x[240:], y[240:])).fit()
    assert summary["steps"] == 60
    events = [json.loads(line) for line in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    skipped = [e["step"] for e in events if e["event"] == "no_targets"]
    assert not [e for e in events if e["event"] == "diverged"]
    if strategy == "sync":  # (the server reads no data: its workers' pushes said it)
        assert len(skipped) >= 5
    assert all(math.isfinite(e["loss"]) for e in events if e["event"] == "step")
    state = torch.load(list_checkpoints(tmp_path / "ck")[-1], weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_user_model_and_data_through_the_api(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    cfg = TrainConfig(steps=60, batch_size=16, workers=2, devices="cpu", lr=0.1, progress="none",
                      checkpoint_dir=str(tmp_path / "user"), log_every=1000)
    summary = Trainer(cfg, model=model, train_data=(x[:200], y[:200]), test_data=(x[200:], y[200:])).fit()
    assert summary["test_accuracy"] >= 0.9
    assert summary["world_size"] == 2


def _perturbed_setup(ctx):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    if ctx.rank == 1:
        with torch.no_grad():
            model.weight[0, 0] += 1e-3
    runtime_for(Sync(), ctx, model, lambda p: torch.optim.SGD(p, lr=0.1))


@pytest.mark.slow
def test_replicas_that_start_different_are_a_loud_error():
    with pytest.raises(PhalanxError, match="replicas differ at start .* build the model identically"):
        run_workers(_perturbed_setup, 2)
