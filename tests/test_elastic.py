"""Elastic resume: another worker count, another strategy, flags that win over the checkpoint's.

Real runs of the ``phalanx`` command (real gloo workers), by its ``main()`` in this process (no interpreter
start-up per run; the workers fork from a warm fork server); one uninterrupted run is shared by every
test that resumes from its step-20 checkpoint. The data position is pure logic, tested without processes.
"""

import json
import re

import pytest
import torch
from torch import nn

from helpers import only_run, run_in_process
from phalanx import TrainConfig, Trainer
from phalanx.data import ArrayDataset, ShardedBatches
from phalanx.data.loader import Position, advance, epoch_generator
from phalanx.errors import PhalanxError
from phalanx.checkpoint import latest_checkpoint, load_checkpoint
from phalanx.train.resume import data_position, resume_config

QUIET = ["--log-every", "4"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Sync on 2 workers x 48 for 40 steps, a checkpoint at step 20 and at step 40."""
    root = tmp_path_factory.mktemp("straight")
    out = run_in_process("train", "--steps", "40", "--batch-size", "48", "--checkpoint-every", "20", *QUIET, cwd=root)
    assert out.returncode == 0, out.stderr
    return only_run(root)


def _same_parameters(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def _steps(metrics) -> list[dict]:
    return [e for e in map(json.loads, open(metrics)) if e["event"] == "step"]


# ---- another worker count ----

@pytest.mark.slow
def test_three_workers_keeping_the_global_batch_end_where_two_uninterrupted_workers_end(straight, tmp_path):
    out = run_in_process("train", "--steps", "40", "--workers", "3", "--keep-global-batch", "--resume",
                         str(straight / "step-00000020.pt"), "--checkpoint-dir", "resumed", *QUIET, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert ", resuming at step 20" in lines[0] and "global batch 96 (32 per worker x 3)" in lines[0]
    assert lines[1] == ("resuming at step 20 with global batch 96 as before (--keep-global-batch): 32 per worker x 3 "
                        "(was 48 per worker)")
    resumed, uninterrupted = load_checkpoint(tmp_path / "resumed"), load_checkpoint(straight / "step-00000040.pt")
    _same_parameters(uninterrupted["model"], resumed["model"])
    assert resumed["data_position"] == uninterrupted["data_position"]


def test_a_global_batch_that_does_not_split_is_refused_with_the_arithmetic(straight, tmp_path):
    out = run_in_process("train", "--steps", "40", "--workers", "5", "--keep-global-batch", "--resume",
                         str(straight / "step-00000020.pt"), "--checkpoint-dir", "resumed", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "error: global batch 96 cannot be kept on 5 workers: 96 / 5 is not whole" in out.stderr
    assert "resume on another worker count (it splits over 4 or 6), or without --keep-global-batch (global batch " \
           "160)" in out.stderr and "Traceback" not in out.stderr


# ---- flags on resume ----

@pytest.mark.slow
def test_flags_given_at_resume_win_and_the_global_batch_follows_the_workers(straight, tmp_path):
    """Per-worker batch 48 kept on 3 workers: global batch 144; --lr and --lr-base-batch replace the checkpoint's."""
    out = run_in_process("train", "--steps", "24", "--workers", "3", "--batch-size", "48", "--lr", "0.01",
                         "--lr-base-batch", "96", "--resume", str(straight / "step-00000020.pt"), "--checkpoint-dir",
                         "resumed", *QUIET, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == ("resuming at step 20 with global batch 144 (was 96): the per-worker batch stays 48; lr 0.01 x "
                        "144 / 96 = 0.015 (--lr-base-batch; was 0.01); --keep-global-batch keeps 96")
    assert "--lr 0.01 replaces the checkpoint's 0.05" in lines
    assert "--lr-base-batch 96 replaces the checkpoint's none" in lines
    assert [round(e["lr"], 9) for e in _steps(tmp_path / "resumed" / "metrics.jsonl")] == [0.015]
    state = load_checkpoint(tmp_path / "resumed")
    assert state["meta"]["settings"]["lr"] == 0.01 and state["meta"]["global_batch"] == 144
    assert state["data_position"] == {"epoch": 1, "examples_in_epoch": 6 * 96 + 4 * 144}  # 14 steps of 96 an epoch


@pytest.mark.slow
def test_another_optimizer_starts_fresh_with_one_line(straight, tmp_path):
    out = run_in_process("train", "--steps", "24", "--optimizer", "adam", "--lr", "0.001", "--batch-size", "48",
                         "--resume", str(straight / "step-00000020.pt"), "--checkpoint-dir", "resumed", *QUIET,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    said = [ln for ln in out.stdout.splitlines() if ln.startswith("--optimizer")]
    assert said == ["--optimizer adam replaces the checkpoint's sgd: adam starts from a fresh state (sgd's does not "
                    "translate); the parameters, step, schedule and data position carry over"]
    state = load_checkpoint(tmp_path / "resumed")
    assert state["step"] == 24 and all("exp_avg" in s for s in state["optimizer"]["state"].values())
    assert int(state["optimizer"]["state"][0]["step"]) == 4  # Adam's own count began at the resume


# ---- another strategy ----

CHAIN = [  # each resumes from the one before, 3 steps further, from the shared run's step 20
    ("fsdp", 3, []), ("pipeline", 2, ["--stages", "2"]), ("sync", 3, []),
    # ps without momentum: stale gradients under SGD's momentum 0.9 were seen to diverge in 3 steps at lr 0.05
    # (staleness adds momentum of its own: Mitliagkas et al., 2016, "Asynchrony begets momentum").
    ("ps", 2, ["--momentum", "0"]), ("sync", 2, []),
]


@pytest.mark.slow
@pytest.mark.long
def test_every_strategy_resumes_another_strategys_checkpoint_on_another_worker_count(straight, tmp_path):
    """sync(2) -> fsdp(3) -> pipeline(2 stages) -> sync(3) -> ps(2) -> sync(2), global batch 96 throughout:
    each strategy's save and load path at least once."""
    checkpoint, step = straight / "step-00000020.pt", 20
    for strategy, workers, flags in CHAIN:
        where = tmp_path / f"{step + 3}-{strategy}"
        out = run_in_process("train", "--strategy", strategy, "--workers", str(workers), *flags, "--steps",
                             str(step + 3), "--log-every", "1", "--keep-global-batch", "--resume", str(checkpoint),
                             "--checkpoint-dir", str(where), cwd=tmp_path)
        assert out.returncode == 0, f"{strategy} on {workers}: {out.stderr}"
        assert f", resuming at step {step}" in out.stdout.splitlines()[0], out.stdout
        first, loss = re.search(r"step (\d+), loss = ([\d.]+)", out.stdout).groups()
        # The step after the resume starts from the checkpoint's model, not a fresh one (ln 10 = 2.3 on
        # ten digits): the load path worked.
        assert int(first) == step + 1 and float(loss) < 1.2, f"{strategy} on {workers}: {out.stdout}"
        accuracy = float(re.search(r"test accuracy (\d\.\d+)[^\n]* after", out.stdout).group(1))
        assert accuracy > 0.5, f"{strategy} on {workers}: {out.stdout}"
        checkpoint, step = latest_checkpoint(where), step + 3  # (fsdp's: a sharded directory)
        assert load_checkpoint(checkpoint)["step"] == step


# ---- refusals that need the model ----

def test_a_checkpoint_of_another_model_is_refused_naming_the_first_parameter_that_differs(straight, tmp_path):
    other = nn.Sequential(nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU()), nn.Flatten(),
                          nn.Linear(16 * 64, 10))
    cfg = TrainConfig(workers=1, devices="cpu", steps=30, progress="none", resume=str(straight / "step-00000020.pt"),
                      checkpoint_dir=str(tmp_path / "other"))
    with pytest.raises(PhalanxError, match=r"holds another model \(0\.0\.weight is \(32, 1, 3, 3\) there and "
                                           r"\(16, 1, 3, 3\) here\); resume with the model and data it was trained"):
        Trainer(cfg, model=other).fit()


# ---- pure logic: the data position, the settings ----

def _indices(batches: ShardedBatches, start, steps: int) -> list[int]:
    stream = batches(start)
    return [int(i) for _ in range(steps) for i in next(stream)[0].flatten()]


def test_a_new_global_batch_continues_with_the_next_example_of_the_epoch():
    """2 x 4 for 5 steps, then 3 x 4 to the end of the epoch: every example once, only a tail short of a batch left."""
    data = ArrayDataset(torch.arange(100).float().unsqueeze(1), torch.zeros(100, dtype=torch.long))
    before = [_indices(ShardedBatches(data, 4, r, 2, seed=3), 0, 5) for r in range(2)]
    at = advance(Position(0, 0), 5, len(data), 8)
    assert at == Position(0, 40)
    steps_left = (100 - 40) // 12
    after = [_indices(ShardedBatches(data, 4, r, 3, seed=3), at, steps_left) for r in range(3)]
    seen = [i for part in before + after for i in part]
    assert len(seen) == len(set(seen)) == 40 + 12 * steps_left  # nothing twice
    epoch = torch.randperm(100, generator=epoch_generator(3, 0, 0))
    assert set(seen) == set(epoch[:len(seen)].tolist())  # nothing skipped: a prefix of the epoch's shuffle
    # the next step opens epoch 1, as the position says
    assert advance(at, steps_left, 100, 12) == Position(1, 0)
    first = _indices(ShardedBatches(data, 4, 0, 3, seed=3), advance(at, steps_left, 100, 12), 1)
    assert first == _indices(ShardedBatches(data, 4, 0, 3, seed=3), Position(1, 0), 1)


def test_an_older_checkpoint_counted_batches_and_the_position_is_the_same():
    old = {"step": 20, "data_position": {"epoch": 1, "batch_in_epoch": 6}, "meta": {"batch_size": 48, "workers": 2}}
    assert data_position(old, 1437) == Position(1, 6 * 96) == advance(Position(0, 0), 20, 1437, 96)


def _checkpoint(**settings) -> dict:
    recorded = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0, "lr_schedule": "constant",
                "lr_decay_every": 100, "lr_decay_factor": 0.5, "staircase": False, "warmup_steps": 0,
                "lr_base_batch": None, **settings}
    return {"step": 20, "meta": {"batch_size": 32, "workers": 2, "global_batch": 64, "settings": recorded}}


def test_the_checkpoints_settings_continue_where_no_flag_is_given():
    ckpt = _checkpoint(lr=0.01, lr_schedule="cosine", warmup_steps=5, weight_decay=5e-4)
    run = resume_config(TrainConfig(steps=100).resolved(), ckpt, shards=2)
    assert (run.config.lr, run.config.lr_schedule, run.config.warmup_steps, run.config.weight_decay) == \
        (0.01, "cosine", 5, 5e-4)
    assert run.lines == [] and not run.fresh_optimizer
    given = resume_config(TrainConfig(steps=100, weight_decay=0.0, lr_schedule="constant").resolved(), ckpt, 2)
    assert (given.config.weight_decay, given.config.lr_schedule, given.config.lr) == (0.0, "constant", 0.01)
    assert given.lines == ["--weight-decay 0 replaces the checkpoint's 0.0005",
                           "--lr-schedule constant replaces the checkpoint's cosine"]
