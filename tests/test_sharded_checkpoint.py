"""fsdp's sharded checkpoints: each rank writes its own shard, and they keep the single-file guarantees.

- the directory holds one shard file per rank, DCP's index and phalanx's small state; no file holds
  the whole model; retention removes whole directories;
- a run resumed from one on 2 workers, on 3 (DCP reshards) and in sync (read whole) ends where the
  uninterrupted fsdp run ends (the checkpoints of both compared, read whole: parameters, Adam's state and
  the decayed learning rate);
- ``phalanx evaluate`` and ``--init-from`` read it, in one process, without a process group;
- a kill while the shards are being written leaves the previous checkpoint loadable; a corrupted
  shard is refused in one line;
- ``--async-checkpoint`` ends with the same parameters as the run without it, and every checkpoint
  it wrote verifies; both runs say in the metrics how long each save held the step up.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import REPO, run_in_process
from phalanx import TrainConfig, Trainer, evaluate
from phalanx.errors import PhalanxError
from phalanx.task.models import cnn
from phalanx.checkpoint import (latest_checkpoint, list_checkpoints, load_checkpoint, read_run,
                                remove_stale_temporaries, tensors)

TOL = dict(rtol=1e-5, atol=1e-6)  # float32


def _train(root, name: str, **overrides) -> dict:
    """An fsdp run on 2 workers (Adam and a decaying rate: state and a schedule to carry over)."""
    cfg = dict(strategy="fsdp", steps=8, batch_size=12, workers=2, devices="cpu", optimizer="adam", lr=0.01,
               lr_schedule="exponential", lr_decay_every=2, lr_decay_factor=0.5, log_every=100, progress="none",
               checkpoint_dir=str(root / name), checkpoint_every=4, metrics=str(root / name / "metrics.jsonl"))
    cfg.update(overrides)
    summary = Trainer(TrainConfig(**cfg)).fit()
    return {"summary": summary, "state": whole(latest_checkpoint(root / name))}


def whole(path) -> dict:
    return tensors(load_checkpoint(path))


def assert_same(got: dict, want: dict, label: str) -> None:
    assert got["step"] == want["step"], label
    assert list(got["model"]) == list(want["model"]), label
    for key, value in want["model"].items():
        torch.testing.assert_close(got["model"][key], value, **TOL, msg=lambda m: f"{label}: {key}: {m}")
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys(), label
    for i, state in want["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["optimizer"]["state"][i][key], value, **TOL,
                                       msg=lambda m: f"{label}: optimizer state {i} {key}: {m}")
    assert got["optimizer"]["param_groups"][0]["lr"] == want["optimizer"]["param_groups"][0]["lr"], label


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run, and its first half (4 steps) in another directory."""
    root = tmp_path_factory.mktemp("sharded")
    return {"root": root, "straight": _train(root, "straight"), "half": _train(root, "half", steps=4)}


@pytest.mark.slow
def test_each_rank_writes_its_own_shard_and_no_file_holds_the_whole_model(runs):
    root = runs["root"] / "straight"
    saved = list_checkpoints(root)
    assert [p.name for p in saved] == ["step-00000004.dcp", "step-00000008.dcp"]
    assert not list(root.glob("*.pt")) and not list(root.glob(".*tmp"))  # no single file, nothing half-written
    files = sorted(p.name for p in saved[-1].iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "phalanx.pt"]
    # The model and Adam's two moments: 3 x the parameters' bytes, of which each rank wrote about half.
    whole_bytes = 3 * sum(p.numel() * 4 for p in cnn((1, 8, 8), 10).parameters())
    for rank in (0, 1):
        size = (saved[-1] / f"__{rank}_0.distcp").stat().st_size
        assert 0.4 * whole_bytes < size < 0.6 * whole_bytes, (rank, size, whole_bytes)
    small = torch.load(saved[-1] / "phalanx.pt", weights_only=True)
    assert "model" not in small and "optimizer" not in small and small["step"] == 8
    assert sorted(small["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each one's SHA-256
    assert small["run_id"] == read_run(root).run_id  # the run the directory belongs to


@pytest.mark.slow
def test_retention_removes_whole_directories(tmp_path):
    _train(tmp_path, "kept", steps=6, checkpoint_every=2, keep_checkpoints=2)
    assert [p.name for p in list_checkpoints(tmp_path / "kept")] == ["step-00000004.dcp", "step-00000006.dcp"]
    assert not (tmp_path / "kept" / "step-00000002.dcp").exists()


@pytest.mark.slow
@pytest.mark.parametrize("strategy,workers", [("fsdp", 2), ("fsdp", 3), ("sync", 2)])
def test_a_resumed_run_ends_where_the_uninterrupted_one_ends(runs, tmp_path, strategy, workers):
    import shutil

    # A copy of the first half for each resume (a resume writes into its directory); --keep-global-batch:
    # 3 workers read the same global batches (24 examples) as 2 did.
    shutil.copytree(runs["root"] / "half", tmp_path / "half")
    resumed = _train(tmp_path, "half", resume=str(tmp_path / "half"), strategy=strategy, workers=workers,
                     keep_global_batch=True)
    assert runs["straight"]["state"]["optimizer"]["param_groups"][0]["lr"] == 0.01 / 16  # (halved every 2 steps)
    assert_same(resumed["state"], runs["straight"]["state"], f"fsdp(2) -> {strategy}({workers})")
    kind = ".dcp" if strategy == "fsdp" else ".pt"
    assert latest_checkpoint(tmp_path / "half").name == f"step-00000008{kind}"


def test_evaluate_and_init_from_read_it_in_one_process(runs, tmp_path):
    checkpoint = runs["root"] / "straight" / "step-00000008.dcp"
    reported = runs["straight"]["summary"]["test_metrics"]
    assert evaluate(str(checkpoint)) == pytest.approx(reported)
    out = run_in_process("evaluate", "--checkpoint", str(runs["root"] / "straight"), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["checkpoint"] == str(checkpoint)
    # --init-from: a one-process run that starts from its weights; at a learning rate of 1e-12 its one step
    # leaves them where they were.
    started = _train(tmp_path, "tuned", init_from=str(checkpoint), workers=1, steps=1, optimizer="sgd", lr=1e-12)
    for key, value in runs["straight"]["state"]["model"].items():
        torch.testing.assert_close(started["state"]["model"][key], value, **TOL)


def test_a_corrupted_shard_is_refused_in_one_line(runs, tmp_path):
    import shutil

    shutil.copytree(runs["root"] / "straight", tmp_path / "c")
    shard = tmp_path / "c" / "step-00000008.dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = run_in_process("evaluate", "--checkpoint", str(shard.parent), cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: checkpoint {shard.parent} is corrupt: its shard __1_0.distcp does not match its checksum (the file "
        "changed after it was written); give --checkpoint an earlier checkpoint of the same directory"]
    # From the directory, a resume skips it (naming it) and takes the newest that verifies.
    assert load_checkpoint(tmp_path / "c")["step"] == 4


def test_init_from_a_directory_says_which_newer_checkpoint_it_skipped_and_a_lost_state_file_is_incomplete(
        runs, tmp_path):
    """``--init-from DIR`` took the older checkpoint without the warning ``--resume`` and ``evaluate`` print; a
    ``.dcp`` whose phalanx.pt was lost was "a directory, not a checkpoint" (a resume in its directory refused)."""
    import shutil
    import warnings

    for damage in ("flipped", "lost"):
        root = tmp_path / damage
        shutil.copytree(runs["root"] / "straight", root)
        newest = root / "step-00000008.dcp"
        if damage == "flipped":
            shard = newest / "__1_0.distcp"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
            why = (f"checkpoint {newest} is corrupt: its shard __1_0.distcp does not match its checksum (the file "
                   "changed after it was written)")
        else:
            (newest / "phalanx.pt").unlink()
            why = f"checkpoint {newest} is incomplete: its phalanx.pt is missing"
        given = dict(strategy="fsdp", workers=2, devices="cpu", batch_size=12, progress="none")
        plans = {"--init-from": TrainConfig(init_from=str(root), checkpoint_dir=str(tmp_path / f"new-{damage}"),
                                            steps=1, **given),
                 "--resume": TrainConfig(resume=str(root), checkpoint_dir=str(root), steps=12, **given)}
        for flag, cfg in plans.items():
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                Trainer(cfg).plan()
            assert [str(w.message) for w in said] == [f"skipped {newest}, newer than step-00000004.dcp: {why}"], flag
    with pytest.raises(PhalanxError, match=rf"^checkpoint {newest} is incomplete: its phalanx.pt is missing; give "
                                           r"--checkpoint an earlier checkpoint of the same directory$"):
        evaluate(str(newest))


WRITER = """
import os, sys, torch, torch.nn.functional as F
from phalanx import FSDP
from phalanx.launcher import launch
from phalanx.strategies import runtime_for
from phalanx.checkpoint import ShardWriter

def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)

def work(ctx, root):
    os.makedirs(root, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # 16 MB, 8 MB a rank
    x = torch.randn(4, 1024)
    runtime = runtime_for(FSDP(), ctx, model, sgd, F.mse_loss, example=(x, x))
    runtime.train_step(x, x)
    writer = ShardWriter(ctx, asynchronous=False)
    small = {"format": "phalanx-checkpoint-1", "step": 1, "run_id": "r1",
             "meta": {"parameter_shapes": {}}}
    writer.save(runtime.shard_state_dict(), small, root, 1, keep=5)
    if ctx.rank == 0:
        print("first saved", flush=True)
    while True:  # the step-2 checkpoint, again and again, until the test kills the job mid-write
        writer.save(runtime.shard_state_dict(), {**small, "step": 2}, root, 2, keep=5)

if __name__ == "__main__":
    launch(work, [torch.device("cpu")] * 2, (sys.argv[1],), timeout_s=300)
"""


@pytest.mark.slow
def test_a_kill_while_the_shards_are_written_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, start_new_session=True)  # its own process group: the workers with it
    try:
        assert proc.stdout.readline().strip() == "first saved"
        for _ in range(1200):  # until a shard of a step-2 save is being written, then kill every process
            if list(root.glob(".step-00000002.dcp*.tmp/__*.distcp")):
                break
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    first = whole(root / "step-00000001.dcp")  # verified: every shard's checksum
    assert first["step"] == 1 and len(first["model"]) == 8
    assert load_checkpoint(latest_checkpoint(root))["step"] in (1, 2)  # the first, or a complete second
    removed = remove_stale_temporaries(root)
    assert removed and all(p.name.endswith(".tmp") for p in removed)
    assert not list(root.glob(".*.tmp")) and list_checkpoints(root)


@pytest.mark.slow
def test_async_checkpoint_ends_with_the_same_parameters_and_every_save_verifies(runs, tmp_path):
    background = _train(tmp_path, "async", async_checkpoint=True, checkpoint_every=2, keep_checkpoints=3)
    # Exactly the same run: a save in the background changes nothing in the steps.
    for key, value in runs["straight"]["state"]["model"].items():
        assert torch.equal(background["state"]["model"][key], value), key
    assert_same(background["state"], runs["straight"]["state"], "--async-checkpoint")
    assert [p.name for p in list_checkpoints(tmp_path / "async")] == [
        "step-00000004.dcp", "step-00000006.dcp", "step-00000008.dcp"]
    for path in list_checkpoints(tmp_path / "async"):
        load_checkpoint(path)  # every shard verifies
    for name, root in (("async", tmp_path / "async"), ("sync", runs["root"] / "straight")):
        events = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
        saves = [e for e in events if e["event"] == "checkpoint"]
        assert saves and all(e["checkpoint_blocked_s"] > 0 for e in saves), name
        summary = events[-1]
        # Each figure is rounded to the microsecond, so the sum of the saves' may pass the total's by that much each.
        slack = 1e-6 * (len(saves) + 1)
        assert summary["checkpoint_blocked_s"] >= sum(e["checkpoint_blocked_s"] for e in saves) - slack, name


def test_async_checkpoint_is_refused_where_nothing_is_sharded(tmp_path):
    for strategy, workers, why in (("sync", 2, "sync saves one file from rank 0"),
                                   ("fsdp", 1, "fsdp on one worker shards nothing")):
        with pytest.raises(PhalanxError, match=why):
            Trainer(TrainConfig(strategy=strategy, workers=workers, devices="cpu", async_checkpoint=True,
                                checkpoint_dir=str(tmp_path / strategy))).plan()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["pipeline", "fsdp"])
def test_a_full_disk_under_async_checkpoint_is_enospc_exit_1(tmp_path, strategy):
    """A real 2 MiB tmpfs: room for one checkpoint, not two. Was (pipeline; fsdp where the zip writer met the full
    disk first): `[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`, exit 2: DCP pickles
    each rank's error to rank 0, and the pickle dropped the OSError behind torch's zip writer's RuntimeError."""
    import re

    from helpers import run_cli, run_in_process, small_filesystem

    run = run_cli if strategy == "fsdp" else run_in_process  # (one through the installed command)
    with small_filesystem(tmp_path, "2m") as small:
        out = run("train", "--strategy", strategy, "--workers", "2", "--async-checkpoint", "--steps", "20",
                  "--checkpoint-every", "10", "--keep-checkpoints", "1", "--checkpoint-dir", str(small / "a"),
                  "--progress", "none", cwd=tmp_path)
        errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
        assert out.returncode == 1 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        assert re.search(r"cannot write checkpoint .*step-00000020.dcp: No space left on device \(ENOSPC\); nothing "
                         r"was lost: the previous checkpoint .*step-00000010.dcp is intact; free some space",
                         errors[0]), errors[0]
        assert load_checkpoint(latest_checkpoint(small / "a"))["step"] == 10
