"""One run per checkpoint directory: refused, overwritten, continued, restarted, complete (real phalanx runs).

Runs go through the command's own ``main()`` in this process (the same flags, checks, messages and exit
status, without an interpreter's start-up each). The attempt that trains in torchrun's worker environment, whose
process is the worker itself, goes through the installed command; the restarts after it, which end before
training (complete, or another job's), run here too.
"""

import json
import os
import re
import shutil
import socket

import pytest

from helpers import only_run, python_script, run_cli, run_in_process, run_main, small_filesystem
from phalanx.checkpoint import RUN_NAME, list_checkpoints, load_checkpoint, read_run

# --checkpoint-dir given: these are the rules of a directory that runs share (the default is a new one per run)
QUICK = ["--model", "mlp", "--workers", "2", "--log-every", "10", "--progress", "lines",
         "--checkpoint-dir", "checkpoints"]


def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _snapshot(root):
    """Every file's name and bytes: what a refused run must leave exactly as it was."""
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file() and p.name != ".phalanx.lock"}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A finished 40-step run: checkpoints at 20, 30, 40 (the newest 3), its metrics beside them."""
    root = tmp_path_factory.mktemp("first")
    out = run_in_process("train", *QUICK, "--steps", "40", "--checkpoint-every", "10", cwd=root)
    assert out.returncode == 0, out.stderr
    return root


def _copy(first_run, tmp_path):
    shutil.copytree(first_run / "checkpoints", tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


@pytest.mark.slow
def test_a_new_run_is_refused_in_another_runs_directory_and_overwrite_starts_over(first_run, tmp_path, capsys,
                                                                                   monkeypatch):
    ck = _copy(first_run, tmp_path)
    before = _snapshot(ck)
    old = read_run(ck).run_id
    monkeypatch.chdir(tmp_path)
    # A restarting job would have resumed the old run's step 40 at its first restart: it never starts.
    code, out = run_main(["train", *QUICK, "--steps", "20", "--max-restarts", "1"], capsys)
    assert code == 2 and out.out == "", out.err
    assert out.err == ("error: --checkpoint-dir checkpoints holds the checkpoints of another run (newest "
                       "checkpoints/step-00000040.pt); continue that run with --resume, start over with "
                       "--overwrite (removes them), or choose another --checkpoint-dir\n")
    assert _snapshot(ck) == before  # nothing touched: checkpoints, record, metrics
    # Its metrics file is the other run's too, wherever the new run's checkpoints go.
    code, out = run_main(["train", *QUICK, "--steps", "20", "--checkpoint-dir", "new", "--metrics",
                          "checkpoints/metrics.jsonl"], capsys)
    assert code == 2 and out.err == ("error: --metrics checkpoints/metrics.jsonl holds another run's "
                                     "metrics; start over with --overwrite (replaces it), or choose "
                                     "another --metrics\n")
    assert not (tmp_path / "new").exists() and _snapshot(ck) == before

    out = run_in_process("train", *QUICK, "--steps", "20", "--checkpoint-every", "10", "--overwrite", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "checkpoint checkpoints/step-00000020.pt" in out.stdout
    assert [p.name for p in list_checkpoints(ck)] == ["step-00000010.pt", "step-00000020.pt"]
    assert sorted(p.name for p in ck.glob("step-*.pt")) == ["step-00000010.pt", "step-00000020.pt"]
    new = read_run(ck).run_id
    assert new != old and load_checkpoint(ck / "step-00000020.pt")["run_id"] == new
    events = _events(ck / "metrics.jsonl")
    assert events[0] == {"event": "run", "time": events[0]["time"], "run_id": new}
    assert [e["step"] for e in events if e["event"] == "step"] == [10, 20]  # the old run's lines are gone


@pytest.mark.slow
def test_retention_keeps_the_last_written_and_a_continued_run_appends_its_metrics(first_run, tmp_path):
    ck = _copy(first_run, tmp_path)
    run_id = read_run(ck).run_id
    # Back to step 20, on to 35: 25, 30 and 35 are written after 40. Kept by step number, 40 (the
    # abandoned timeline) would stay and 25 go, and a bare --resume would take 40.
    out = run_in_process("train", *QUICK, "--steps", "35", "--checkpoint-every", "5", "--resume",
                         "checkpoints/step-00000020.pt", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in ck.glob("step-*.pt")) == ["step-00000025.pt", "step-00000030.pt",
                                                             "step-00000035.pt"]
    assert "checkpoint checkpoints/step-00000035.pt" in out.stdout
    events = _events(ck / "metrics.jsonl")
    assert events[0]["event"] == "run" and events[0]["run_id"] == run_id  # appended to, not replaced
    resume = [e for e in events if e["event"] == "resume"]
    assert [(e["step"], e["run_id"]) for e in resume] == [(20, run_id)]
    assert [e["step"] for e in events if e["event"] == "step"] == [10, 20, 30, 35]

    out = run_in_process("train", *QUICK, "--steps", "40", "--resume", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "resuming at step 35" in out.stdout.splitlines()[0]
    assert read_run(ck).run_id == run_id and load_checkpoint(ck)["run_id"] == run_id


DIES_AFTER_ITS_LAST_CHECKPOINT = '''
import os, signal, sys
import torch.distributed as dist
from torch import nn
import phalanx
from phalanx.data import load_digits


class DiesInTheFinalEvaluation(nn.Module):
    """A small MLP whose rank 1 is killed in the evaluation after training, once step 60 is saved."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        if not self.training and dist.is_initialized() and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


if __name__ == "__main__":
    data = load_digits()
    config = phalanx.TrainConfig(workers=2, devices="cpu", steps=60, checkpoint_every=20, log_every=20,
                                 max_restarts=1, progress="lines", checkpoint_dir=sys.argv[1])
    summary = phalanx.Trainer(config, model=DiesInTheFinalEvaluation(),
                              train_data=(data.train.x, data.train.y)).fit()
    print("result", type(summary).__name__, summary.already_complete, summary.steps, summary["checkpoint"])
'''


@pytest.mark.slow
def test_a_restart_that_finds_its_run_complete_exits_0(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(DIES_AFTER_ITS_LAST_CHECKPOINT)
    out = python_script(script, "ck", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # (the step a dead rank is named with is the last it published: a quarter second old at most)
    assert re.search(r"^worker 1 died at step \d+ \(SIGKILL\); already complete at step 60: checkpoint "
                     r"ck/step-00000060.pt$", out.stdout, re.M), out.stdout + out.stderr
    assert "restart 1 of 1" not in out.stderr
    assert "result TrainResult True 60 ck/step-00000060.pt" in out.stdout  # the same type as a run's


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.slow
def test_under_torchrun_a_restarted_attempt_continues_only_its_own_run(tmp_path, monkeypatch):
    """torchrun's worker environment, one process: attempt 0 trains, attempt 1 finds the run complete
    (its --overwrite, repeated by torchrun, wipes nothing), another job's attempt 1 is refused."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port(), "TORCHELASTIC_RUN_ID": "job-a",
                        "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    again = ["train", "--model", "mlp", "--steps", "20", "--checkpoint-every", "10", "--overwrite"]
    out = run_cli(*again, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    ck = tmp_path / "checkpoints"
    before = _snapshot(ck)
    assert read_run(ck).launcher == "torchrun job job-a"

    # A restart counted by this agent (1), and one it did not count (0: a node joined the elastic job, or another
    # node's worker failed; each agent counts only its own failures).
    for attempt in ("1", "0"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        out = run_in_process(*again, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[0] == "already complete at step 20: checkpoint checkpoints/step-00000020.pt"
        assert out.stderr == "" and _snapshot(ck) == before

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")  # another job whose first attempt never claimed the directory
    out = run_in_process("train", "--model", "mlp", "--steps", "20", cwd=tmp_path)
    assert out.returncode == 2 and "holds the checkpoints of another run" in out.stderr, out.stderr
    assert _snapshot(ck) == before

    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name)
    out = run_in_process("train", "--model", "mlp", "--workers", "1", "--steps", "20", "--checkpoint-dir",
                         "checkpoints", "--resume", cwd=tmp_path)  # explicit
    assert out.returncode == 2
    assert out.stderr == ("error: checkpoint checkpoints/step-00000020.pt is already at step 20 and --steps is 20; "
                          "raise --steps to train further\n")


def test_empty_paths_are_refused_when_the_flags_are_read(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for flag in ("--checkpoint-dir", "--metrics"):
        code, out = run_main(["train", flag, " "], capsys)
        assert code == 2 and out.err.startswith(f"error: {flag} is empty (' '); give a path"), out.err
    code, out = run_main(["train", "--overwrite", "--resume"], capsys)
    assert code == 2 and out.err == ("error: --overwrite starts a new run and --resume continues one: "
                                     "give one of them\n")
    assert os.listdir(tmp_path) == []


def test_a_directory_named_like_a_checkpoint_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    (tmp_path / "checkpoints" / "step-00000100.pt").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["train", "--model", "mlp", "--steps", "5", "--checkpoint-dir", "checkpoints"], capsys)
    assert code == 2 and out.err == (
        "error: checkpoints/step-00000100.pt is a directory, not a checkpoint, but phalanx names its checkpoints "
        "so; move it out of --checkpoint-dir, or choose another --checkpoint-dir\n")


@pytest.fixture
def tiny_full_tmpfs(tmp_path):
    """A 64 KiB filesystem with one page left: a metrics file fills it within a few dozen lines."""
    with small_filesystem(tmp_path, "64k") as mount:
        (mount / "filler").write_bytes(b"\0" * 60 * 1024)
        yield mount


@pytest.mark.slow
def test_a_full_disk_under_the_metrics_file_is_one_line(tiny_full_tmpfs, tmp_path):
    out = run_in_process("train", "--model", "mlp", "--workers", "2", "--steps", "100", "--log-every", "1",
                         "--checkpoint-every", "5", "--metrics", "small/m.jsonl", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert out.stderr == ("error: cannot write metrics file small/m.jsonl: No space left on device (ENOSPC); free "
                          "some space or choose another --metrics, then continue with --resume (the checkpoints are "
                          "not affected)\n")
    assert list_checkpoints(only_run(tmp_path))  # the checkpoints before it are there to continue from
    assert RUN_NAME in os.listdir(only_run(tmp_path))


@pytest.mark.slow
def test_without_a_checkpoint_dir_each_run_has_its_own_and_a_bare_resume_finds_the_newest(tmp_path, capsys,
                                                                                           monkeypatch):
    """The README in order, in one folder: phalanx train, then phalanx train --strategy ps (once refused as
    another run's directory), then --resume alone, which continues the run that wrote a checkpoint last."""
    quick = ["--model", "mlp", "--workers", "2", "--log-every", "10", "--progress", "lines", "--checkpoint-every", "5"]
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["train", *quick, "--resume"], capsys)  # nothing to continue yet
    assert code == 2 and out.err == ("error: --resume: no run in runs/ holds a checkpoint yet; start one with "
                                     "phalanx train, or give the checkpoint to continue (--resume PATH) or its "
                                     "--checkpoint-dir\n"), out.err
    assert os.listdir(tmp_path) == []
    for strategy, name in (("sync", "sync-1"), ("ps", "ps-2")):
        out = run_in_process("train", *quick, "--strategy", strategy, "--steps", "10", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert f"checkpoint runs/{name}/step-00000010.pt" in out.stdout
    sync, ps = tmp_path / "runs" / "sync-1", tmp_path / "runs" / "ps-2"
    assert read_run(sync).run_id != read_run(ps).run_id
    assert _events(ps / "metrics.jsonl")[0]["run_id"] == read_run(ps).run_id  # each run's metrics beside it

    out = run_in_process("train", *quick, "--strategy", "ps", "--steps", "15", "--resume", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "resuming at step 10" in out.stdout and "checkpoint runs/ps-2/step-00000015.pt" in out.stdout
    # A checkpoint named by path continues in its own run's directory; then that run is the newest.
    out = run_in_process("train", *quick, "--steps", "15", "--resume", "runs/sync-1/step-00000010.pt", cwd=tmp_path)
    assert out.returncode == 0 and "checkpoint runs/sync-1/step-00000015.pt" in out.stdout, out.stderr
    out = run_in_process("train", *quick, "--steps", "20", "--resume", "last", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "resuming at step 15" in out.stdout and "checkpoint runs/sync-1/step-00000020.pt" in out.stdout
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["ps-2", "sync-1"]  # no run dir made on resume
    assert [e["step"] for e in _events(sync / "metrics.jsonl") if e["event"] == "step"] == [10, 15, 20]


def test_a_new_run_is_numbered_after_every_run_in_runs_whatever_its_strategy(tmp_path):
    from phalanx.train.rundir import next_number

    assert next_number(tmp_path / "runs") == 1  # no runs/ yet
    for name in ("sync-1", "local-sgd-3", "notes", "ps-x"):  # a folder of the user's own is not a run
        (tmp_path / "runs" / name).mkdir(parents=True)
    (tmp_path / "runs" / "fsdp-9").touch()  # a file, not a run's directory
    assert next_number(tmp_path / "runs") == 4
