"""The hot path: an ordinary step runs no collective and reads nothing on the host beyond the
strategy's own; bf16 and compiled training (real gloo workers, counted by torch's flight recorder)."""

import math
import json

import pytest
import torch

from helpers import run_workers
from phalanx import Hogwild, Sync, TrainConfig, Trainer
from phalanx.errors import PhalanxError
from phalanx.train.loop import WorkerRun
from phalanx.train.losses import LossWindow


def _collectives_in_a_run(ctx, plan):
    """Train; return how many collectives this rank ran (the flight recorder's sequence number)
    and how many buckets DDP reduces each step (0 where there is no DDP)."""
    import torch._C._distributed_c10d as c10d

    run = WorkerRun(ctx, plan)
    try:
        run.train()
    finally:
        run.close()
    entries = json.loads(c10d._dump_fr_trace_json(True, True))["entries"]
    model = run.runtime.model
    buckets = len(model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")) \
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) else 0
    return max(e["collective_seq_id"] for e in entries if not e["is_p2p"]), buckets


def _count(tmp_path, strategy, steps):
    cfg = TrainConfig(strategy=strategy, workers=2, devices="cpu", steps=steps, log_every=steps, batch_size=16,
                      progress="none", checkpoint_dir=str(tmp_path / f"{strategy.name}-{steps}"))
    return run_workers(_collectives_in_a_run, 2, Trainer(cfg).plan())


@pytest.mark.slow
@pytest.mark.parametrize("strategy, per_step", [(Sync(bucket_mb=0.2), "buckets"), (Hogwild(), 0)],
                         ids=["sync", "hogwild"])
def test_ordinary_steps_run_no_collective_but_the_strategys_own(tmp_path, strategy, per_step):
    # Two runs that differ only by 10 ordinary steps (each logs once, at its end): the difference in
    # collectives is what those steps cost. For sync, DDP's bucket all-reduces and nothing else.
    short, buckets = _count(tmp_path, strategy, 10)
    long, _ = _count(tmp_path, strategy, 20)
    expected = buckets if per_step == "buckets" else per_step
    assert per_step != "buckets" or buckets >= 2  # the small buckets make several per step
    assert long - short == 10 * expected


def test_the_loss_window_names_the_first_non_finite_step_and_empties():
    window = LossWindow(torch.device("cpu"), capacity=4)
    for step, loss in [(7, 1.0), (8, float("nan")), (9, float("inf"))]:
        window.add(step, torch.tensor(loss))
    assert not window.full and len(window) == 3
    steps, losses = window.drain(lambda values: values * 1.0)
    assert steps == [7, 8, 9] and losses[0] == 1.0 and math.isnan(losses[1]) and math.isinf(losses[2])
    assert len(window) == 0
    window.add(10, torch.tensor(2.0))
    assert window.drain(lambda values: values)[1] == [2.0]
    # losses as a step may leave them: bf16 (autocast), a 1-element vector beside a scalar; read as fp32 floats
    window.add(11, torch.tensor(1.5, dtype=torch.bfloat16))
    window.add(12, torch.tensor([0.25]))
    assert window.drain(lambda values: values) == ([11, 12], [1.5, 0.25])
    for step in (13, 14):
        window.add(step, torch.tensor(0.5, dtype=torch.bfloat16))
    taken = []
    assert window.drain(lambda values: taken.append(values.dtype) or values)[1] == [0.5, 0.5]
    assert taken == [torch.float32]


# ---- precision and compilation ----

def _fit(tmp_path, name, workers=2, **overrides):
    cfg = TrainConfig(workers=workers, devices="cpu", progress="none", log_every=1000, checkpoint_every=0,
                      checkpoint_dir=str(tmp_path / name), **overrides)
    return Trainer(cfg).fit()


@pytest.mark.slow
def test_bf16_trains_the_default_model_and_keeps_fp32_weights(tmp_path):
    # (100 steps reach 0.98 to 0.99 on seeds 0, 1 and 2)
    summary = _fit(tmp_path, "bf16", precision="bf16", steps=100)
    assert summary["test_accuracy"] >= 0.95
    state = torch.load(summary["checkpoint"], weights_only=True)
    assert all(t.dtype == torch.float32 for t in state["model"].values())


@pytest.mark.slow
@pytest.mark.parametrize("workers, compiled_as", [(2, "4 blocks, each"), (1, "the whole model")],
                         ids=["ddp-by-block", "one-worker-whole"])
def test_compiled_training_equals_eager(tmp_path, workers, compiled_as):
    # The same 8 steps of sync, eager and compiled: by block on 2 workers (DDP reduces during backward), whole
    # on one. Inductor may order a reduction differently, so equal to 1e-5 (a step's update is about 1e-2).
    eager = _fit(tmp_path, "eager", steps=8, batch_size=16, workers=workers)
    compiled = _fit(tmp_path, "compiled", steps=8, batch_size=16, workers=workers, compile=True)
    a = torch.load(eager["checkpoint"], weights_only=True)["model"]
    b = torch.load(compiled["checkpoint"], weights_only=True)["model"]
    assert compiled["compiled"] == compiled_as and eager["compiled"] is None
    assert a.keys() == b.keys()  # compiled in place: the same names, loadable into an eager model
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("overrides, message", [
    (dict(precision="fp16"), r"--precision fp16 runs on CUDA devices only .* use --precision bf16 on the CPU"),
    (dict(precision="fp8"), r"unknown --precision 'fp8': choose one of fp32, bf16, fp16"),
])
def test_precision_that_cannot_run_is_refused_before_anything_starts(tmp_path, overrides, message):
    with pytest.raises(PhalanxError, match=message):
        Trainer(TrainConfig(devices="cpu", checkpoint_dir=str(tmp_path / "x"), **overrides)).plan()
    assert not (tmp_path / "x").exists()


@pytest.mark.gpu
def test_ordinary_steps_never_synchronise_the_gpu(tmp_path):
    """torch's sync debug mode raises on any host-device synchronisation: on from the third step
    (after warm-up) until the loop first looks at the losses, which here is after the last step."""
    from phalanx.launcher import launch

    def run(ctx, plan):
        worker = WorkerRun(ctx, plan)
        calls = {"steps": 0}
        train_step, look = worker.runtime.train_step, worker._check_losses

        def step(batch):
            calls["steps"] += 1
            if calls["steps"] == 3:
                torch.cuda.set_sync_debug_mode("error")
            return train_step(batch)

        def looked(window):
            torch.cuda.set_sync_debug_mode("default")
            return look(window)

        worker.runtime.train_step, worker._check_losses = step, looked
        try:
            return worker.train(), calls["steps"]
        finally:
            torch.cuda.set_sync_debug_mode("default")
            worker.close()

    for precision in ("fp32", "bf16"):
        cfg = TrainConfig(devices="cuda", steps=30, log_every=30, checkpoint_every=0, progress="none",
                          precision=precision, checkpoint_dir=str(tmp_path / precision))
        summary, steps = launch(run, [torch.device("cuda", 0)], (Trainer(cfg).plan(),))
        assert steps == 30 and summary["steps"] == 30
