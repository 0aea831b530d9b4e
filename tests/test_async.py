"""Asynchronous strategies: accuracy, SSP(0) == Backup(0) == sync (buffers included), staleness bound,
exactly-once, faults."""

import json
import re
import signal

import pytest
import torch

from helpers import only_run, run_and_signal, run_in_process, run_main, run_workers
from phalanx import TrainConfig, Trainer
from phalanx.errors import PhalanxError, TrainingDiverged, WorkerFailed
from phalanx.data import load_data
from phalanx.strategies import SSP, Backup, Hogwild, Job, LocalSGD, ParameterServer, runtime_for
from phalanx.checkpoint import latest_checkpoint, load_checkpoint, tensors


def _summary(directory):
    events = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return events[-1]


@pytest.mark.parametrize("flags", [["--strategy", "ps"], ["--strategy", "ssp", "--staleness", "2"],
                                   ["--strategy", "hogwild"], ["--strategy", "local-sgd", "--sync-every", "4"]],
                         ids=["ps", "ssp", "hogwild", "local-sgd"])
def test_each_strategy_trains_digits(tmp_path, flags):
    out = run_in_process("train", *flags, "--steps", "150", cwd=tmp_path)  # (0.975 to 0.981 measured)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", out.stdout).group(1))
    assert accuracy >= 0.93, out.stdout[-3000:]  # (its staleness line: how far behind the workers ran)
    if flags[1] in ("ps", "ssp", "hogwild"):
        assert re.search(r"^staleness: mean \d+\.\d, p95 \d+, max \d+ updates behind"
                         r".*\((bound \d+ steps?|unbounded)\)$", out.stdout, re.M)
        assert "staleness_histogram" in _summary(only_run(tmp_path))
    state = load_checkpoint(latest_checkpoint(only_run(tmp_path)))
    assert state["step"] == 150


def _params(tmp_path, name, strategy, model=None, **kw):
    cfg = TrainConfig(strategy=strategy, workers=2, devices="cpu", steps=6, batch_size=8, lr=0.05,
                      progress="none", checkpoint_dir=str(tmp_path / name), checkpoint_every=0, **kw)
    Trainer(cfg, **_with(model)).fit()
    return tensors(load_checkpoint(latest_checkpoint(tmp_path / name)))["model"]  # (local-sgd's: sharded)


class BatchNormNet(torch.nn.Module):
    """A model with buffers: BatchNorm's running statistics and its step count."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64),
                                        torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


def _with(model):
    if model is None:
        return {}
    digits = load_data("digits")
    return {"model": model, "train_data": (digits.train.x, digits.train.y), "test_data": (digits.test.x, digits.test.y)}


@pytest.mark.slow
def test_ssp_with_staleness_zero_equals_sync(tmp_path):
    sync = _params(tmp_path, "sync", "sync")
    ssp0 = _params(tmp_path, "ssp0", SSP(staleness=0))
    for k in sync:
        torch.testing.assert_close(sync[k], ssp0[k], atol=1e-5, rtol=1e-5, msg=k)


@pytest.fixture(scope="module")
def batchnorm_sync(tmp_path_factory):
    torch.manual_seed(0)
    return _params(tmp_path_factory.mktemp("bn"), "sync", "sync", BatchNormNet())


@pytest.mark.parametrize("strategy", [SSP(staleness=0), Backup(backup_workers=0)], ids=["ssp0", "backup0"])
def test_ssp0_and_backup0_equal_sync_buffers_included(tmp_path, batchnorm_sync, strategy):
    """Parameters and buffers: the server keeps the buffers of the lowest-numbered worker in each update, DDP's
    rule (rank 0's). (ssp:0 on the cnn, without buffers: the test above.)"""
    torch.manual_seed(0)
    other = _params(tmp_path, strategy.name, strategy, BatchNormNet())
    assert sorted(other) == sorted(batchnorm_sync)
    assert {"body.2.running_mean", "body.2.running_var", "body.2.num_batches_tracked"} <= set(other)
    for k in batchnorm_sync:
        torch.testing.assert_close(batchnorm_sync[k], other[k], atol=1e-5, rtol=1e-5, msg=k)
    assert int(other["body.2.num_batches_tracked"]) == 6  # the buffers moved with every step


@pytest.mark.slow
def test_ps_trains_a_batchnorm_model_to_the_accuracy_sync_reaches(tmp_path):
    accuracy = {}
    for strategy in ("sync", "ps"):
        torch.manual_seed(0)
        cfg = TrainConfig(strategy=strategy, workers=2, devices="cpu", steps=120, batch_size=32, lr=0.05,
                          progress="none", checkpoint_dir=str(tmp_path / strategy), checkpoint_every=0)
        accuracy[strategy] = Trainer(cfg, **_with(BatchNormNet())).fit()["test_accuracy"]
    assert accuracy["sync"] >= 0.9
    assert accuracy["ps"] >= accuracy["sync"] - 0.03, accuracy  # evaluated with the server's running statistics
    state = torch.load(latest_checkpoint(tmp_path / "ps"), weights_only=True)["model"]
    assert int(state["body.2.num_batches_tracked"]) > 0 and not torch.equal(state["body.2.running_var"],
                                                                              torch.ones(64))


def test_local_sgd_averaging_every_step_equals_sync_with_plain_sgd(tmp_path):
    sync = _params(tmp_path, "sync", "sync", momentum=0.0)
    local = _params(tmp_path, "local", LocalSGD(sync_every=1), momentum=0.0)
    for k in sync:
        torch.testing.assert_close(sync[k], local[k], atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.slow
def test_ssp_bound_holds_with_a_straggler_and_every_gradient_is_applied_once(tmp_path):
    out = run_in_process("train", "--strategy", "ssp", "--staleness", "1", "--straggler", "1:3", "--steps", "80",
                         "--log-every", "40", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    s = _summary(only_run(tmp_path))
    assert s["max_clock_gap"] <= 1  # no worker ever began a step more than 1 ahead of the slowest
    assert sum(s["gradients_pushed"].values()) == s["gradients_applied_total"] == s["gradients_applied"]
    assert sum(s["staleness_histogram"].values()) == s["gradients_applied"]
    assert s["replies"] > 0 and s["reply_versions_out_of_order"] == 0  # versions never go back
    assert s["staleness_max"] == max(int(k) for k in s["staleness_histogram"])
    assert f"max {s['staleness_max']} updates behind; lead over the slowest worker at most 1 step (bound 1 step)" \
        in out.stdout


@pytest.mark.slow
def test_ps_staleness_is_unbounded_and_consistent(tmp_path):
    out = run_in_process("train", "--strategy", "ps", "--straggler", "1:3", "--steps", "60", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    s = _summary(only_run(tmp_path))
    assert s["staleness_bound"] is None and s["max_clock_gap"] >= 2  # the fast worker ran ahead freely
    assert sum(s["gradients_pushed"].values()) == s["gradients_applied_total"]
    # 60 steps of 2 gradients each; what was in flight at the last step is applied too, and said so
    in_flight = s["gradients_applied_in_flight"]
    assert s["gradients_applied_total"] == 60 * 2 + in_flight and 0 <= in_flight <= 1
    if in_flight:
        assert f"applied {120 + in_flight} gradients: 120 in the 60 steps, and {in_flight} in flight" in out.stdout


def _join_after_the_end(ctx):
    """steps=0: the server is done before any worker says HELLO (as when a worker starts late)."""
    model = torch.nn.Linear(4, 2)
    example = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
    runtime = runtime_for(ParameterServer(), ctx, model, lambda p: torch.optim.SGD(p, lr=0.1), steps=0,
                          example=example if ctx.rank else None)
    if ctx.rank:
        runtime.train_step(*example)
        assert runtime.next_step(0) is None
    runtime.finish()
    report = runtime.report(final=True).fields
    runtime.close()
    return report


@pytest.mark.slow
def test_a_worker_that_joins_after_the_end_computes_nothing_and_leaves():
    report = run_workers(_join_after_the_end, 3)  # a push nobody receives would block until the 60 s timeout
    assert report["gradients_pushed"] == {"1": 0, "2": 0} and report["gradients_applied_total"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["ps"], ["backup", "--backup-workers", "0"]], ids=["ps", "backup0"])
def test_ps_survives_a_killed_worker(tmp_path, strategy):
    """backup:0 is the hard case: the survivor's round waits for the dead worker's gradient."""
    code, out, err = run_and_signal(
        ["train", "--strategy", *strategy, "--workers", "2", "--model", "mlp", "--steps", "300", "--log-every", "20",
         "--checkpoint-every", "50", "--straggler", "1:2"], tmp_path, "step 60,", signal.SIGKILL, rank=2)
    assert code == 0, err[-3000:]
    assert re.search(r"worker 2 lost at step \d+; continuing with 1 workers", out)
    state = load_checkpoint(latest_checkpoint(only_run(tmp_path)))
    assert state["step"] == 300
    assert float(re.search(r"test accuracy (\d\.\d+)", out).group(1)) >= 0.9
    assert _summary(only_run(tmp_path))["lost_workers"][0]["worker"] == 2


@pytest.mark.slow
def test_sync_fails_fast_naming_the_killed_rank_then_resumes(tmp_path):
    code, out, err = run_and_signal(
        ["train", "--steps", "4000", "--log-every", "20", "--checkpoint-every", "20"], tmp_path, "step 60,",
        signal.SIGKILL, rank=1)
    assert code == 1
    assert re.search(r"error: worker 1 failed:\s+process \d+ was killed by SIGKILL", err)
    assert re.search(r"last checkpoint: runs/sync-1/step-\d+\.pt; continue with --resume runs/sync-1/step-", err)
    last = load_checkpoint(latest_checkpoint(only_run(tmp_path)))["step"]
    assert last >= 40  # the newest checkpoint before the kill is intact
    resumed = run_in_process("train", "--steps", str(last + 20), "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming at step {last}" in resumed.stdout


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "ssp", "--staleness", "-1"], "--staleness must be 0 or more steps"),
    (["--strategy", "local-sgd", "--sync-every", "0"], "--sync-every must be at least 1 step"),
    (["--strategy", "ps", "--workers", "1"], "--strategy ps needs at least 2 workers"),
    (["--straggler", "slow"], "--straggler 'slow' is not RANK:FACTOR"),
])
def test_bad_input(tmp_path, flags, message, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (the command's main() in this process: refused before anything starts)
    code, out = run_main(["train", *flags], capsys)
    assert code == 2 and message in out.err, out.err
    assert not (tmp_path / "runs").exists()


def test_hogwild_refuses_cuda():
    with pytest.raises(PhalanxError, match="hogwild .* refuses CUDA: use --devices cpu"):
        Hogwild().layout(Job((torch.device("cuda", 0), torch.device("cuda", 1))))


@pytest.mark.slow
def test_a_dead_server_ends_the_job_and_the_last_checkpoint_loads(tmp_path):
    code, out, err = run_and_signal(
        ["train", "--strategy", "ps", "--steps", "4000", "--log-every", "20", "--checkpoint-every", "20"], tmp_path,
        "step 60,", signal.SIGKILL, rank=0)
    assert code == 1
    assert re.search(r"error: the parameter server \(rank 0\) failed:\s+process \d+ was killed by SIGKILL", err)
    state = load_checkpoint(latest_checkpoint(only_run(tmp_path)))
    assert state["step"] >= 40 and state["meta"]["strategy"] == "ps"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["ps"], ["ssp", "--staleness", "1"]], ids=["ps", "ssp"])
def test_ps_divergence_stops_at_once_naming_its_step_and_a_checkpoint_that_exists(tmp_path, strategy):
    """lr 1e6: step 1 is finite and checkpointed, a later loss is NaN. The server stops at the first NaN
    push (no 60 s wait for workers it never told to stop, so --hang-timeout does not call it a hang)."""
    out = run_in_process("train", "--strategy", *strategy, "--lr", "1e6", "--steps", "40", "--checkpoint-every", "1",
                         "--hang-timeout", "10", cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    found = re.search(r"error: model diverged with loss = nan at step (\d+); last good checkpoint: (\S+) ", out.stderr)
    assert found, out.stderr[-3000:]
    events = [json.loads(line) for line in (only_run(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "diverged"] == [int(found.group(1))]
    assert (tmp_path / found.group(2)).is_file()  # the checkpoint it names was written
    assert load_checkpoint(tmp_path / found.group(2))["step"] < int(found.group(1))
    assert "made no progress" not in out.stderr


def _digits_with_nan_inputs():
    digits = load_data("digits")
    x = digits.train.x.clone().float()
    x[::10] = float("nan")  # one example in ten: a batch of 8 holds one within a few steps
    return {"train_data": (x, digits.train.y), "test_data": (digits.test.x, digits.test.y)}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ps", "sync"])
def test_nan_in_the_inputs_is_named_as_the_inputs_not_the_learning_rate(tmp_path, strategy):
    cfg = TrainConfig(strategy=strategy, workers=2, devices="cpu", steps=30, batch_size=8, log_every=30,
                      progress="none", checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0)
    with pytest.raises(TrainingDiverged, match=r"^the inputs of step \d+ contain NaN \((worker \d|data shard \d)"
                                               r"[^)]*\), so its loss is nan: the data, not the learning rate"):
        Trainer(cfg, model=torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)),
                **_digits_with_nan_inputs()).fit()


class RaisesOnRank1(torch.nn.Module):
    """User code with a bug that shows on one worker only: its fourth forward pass on rank 1 raises."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1 and self.calls >= 4:
            raise RuntimeError("a bug in the user's forward")
        return self.body(x)


@pytest.mark.slow
def test_a_ps_worker_that_raises_ends_the_job_with_its_traceback(tmp_path):
    """A killed worker is a lost machine (the job goes on: test_ps_survives_a_killed_worker); one that
    raises is a bug, and hiding it behind 'continuing with 1 workers' and exit 0 would lose it."""
    cfg = TrainConfig(strategy="ps", workers=2, devices="cpu", steps=40, batch_size=8, progress="none",
                      checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0)
    with pytest.raises(WorkerFailed) as failed:
        Trainer(cfg, **_with(RaisesOnRank1())).fit()
    assert failed.value.rank == 1
    assert "Traceback" in failed.value.detail and "RuntimeError: a bug in the user's forward" in failed.value.detail


RAISES_EVERYWHERE = """
import torch
import torch.distributed as dist
from torch import nn


class Net(nn.Module):
    \"\"\"User code with a bug that every worker hits alike: from its fourth forward pass on, any worker raises
    (the server, rank 0, only evaluates).\"\"\"

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
        self.calls = 0

    def forward(self, x):
        self.calls += self.training
        if self.training and dist.is_initialized() and dist.get_rank() > 0 and self.calls >= 4:
            raise RuntimeError(f"a bug in the user's forward, on rank {dist.get_rank()}")
        return self.body(x)
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["ps"], ["backup", "--backup-workers", "1"]], ids=["ps", "backup"])
def test_a_bug_in_every_ps_worker_ends_the_job_with_one_traceback_not_lost_workers(strategy, tmp_path):
    """Before: "worker 1 lost at step 3; continuing with 1 workers", "worker 2 lost ...", then "the parameter
    server (rank 0) failed: every worker was lost", and no traceback. A worker that raised says so in the job's
    store before its connection drops: the server stops with it, and the first traceback is the job's error."""
    (tmp_path / "raising.py").write_text(RAISES_EVERYWHERE)
    run = run_in_process("train", "--model", "raising:Net", "--strategy", *strategy, "--workers", "3", "--steps",
                         "40", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    found = re.match(r"error: worker (\d) failed:\nTraceback \(most recent call last\):\n", run.stderr)
    assert found, run.stderr
    # Once, the named worker's own: not one per worker, not the server's.
    assert run.stderr.count("Traceback") == 1 and run.stderr.count("RuntimeError: a bug") == 1, run.stderr
    assert f"RuntimeError: a bug in the user's forward, on rank {found.group(1)}" in run.stderr
    assert "lost" not in run.stdout + run.stderr and "every worker" not in run.stderr


def test_sgd_momentum_on_stale_gradients_is_said_once_in_the_header_and_left_as_set():
    from phalanx.strategies.ps import momentum_note

    params = [torch.nn.Parameter(torch.zeros(2))]
    line, = momentum_note(torch.optim.SGD(params, lr=0.1, momentum=0.9), 4)
    assert line.startswith("sgd momentum 0.9 on stale gradients: asynchrony with 4 workers adds a momentum of about "
                           "1 - 1/4 of its own")
    assert momentum_note(torch.optim.SGD(params, lr=0.1, momentum=0.3), 4) == []
    assert momentum_note(torch.optim.Adam(params), 4) == []  # no momentum key: Adam's betas are another matter
