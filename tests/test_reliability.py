"""Faults with real files, real filesystems and real signals: nothing is lost or silently corrupted."""

import json
import os
import re
import signal

import pytest
import torch

from helpers import run_and_signal, run_cli, run_in_process, small_filesystem
from phalanx.errors import PhalanxError, StorageError
from phalanx.strategies.hogwild import reclaim_leftovers
from phalanx.checkpoint import (DirectoryLock, latest_checkpoint, list_checkpoints, load_checkpoint,
                                save_checkpoint)


def _state(step: int, w: torch.Tensor) -> dict:
    return {"format": "phalanx-checkpoint-1", "step": step, "model": {"w": w}, "meta": {"note": "x"}}


def _flip_a_byte_inside(path, needle: bytes) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at > 0, "the tensor's bytes are stored raw in the file"
    data[at + 5] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_byte_flipped_inside_a_checkpoint_is_detected(tmp_path):
    w = torch.arange(64, dtype=torch.float32)
    path = save_checkpoint(_state(10, w), tmp_path, 10, keep=3)
    assert torch.equal(load_checkpoint(path)["model"]["w"], w)  # a good one verifies
    _flip_a_byte_inside(path, w.numpy().tobytes()[:32])
    assert torch.load(path, weights_only=True)["step"] == 10  # torch alone loads it without a word
    with pytest.raises(PhalanxError, match="is corrupt \\(its checksum does not match"):
        load_checkpoint(path)


def test_resume_from_a_directory_takes_the_newest_checkpoint_that_verifies(tmp_path):
    w = torch.arange(64, dtype=torch.float32)
    save_checkpoint(_state(10, w), tmp_path, 10, keep=3)
    newest = save_checkpoint(_state(20, w + 1), tmp_path, 20, keep=3)
    _flip_a_byte_inside(newest, (w + 1).numpy().tobytes()[:32])
    state = load_checkpoint(tmp_path)
    assert state["step"] == 10 and state["skipped"][0][0] == str(newest)
    (tmp_path / "step-00000010.pt").write_bytes(b"truncated")
    with pytest.raises(PhalanxError, match=r"no checkpoint in .* verifies \(2 tried"):
        load_checkpoint(tmp_path)


def test_truncated_checkpoint_message_names_the_file_not_torchs_advice(tmp_path):
    path = save_checkpoint(_state(10, torch.ones(1000)), tmp_path, 10, keep=3)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PhalanxError) as info:
        load_checkpoint(path)
    assert "is corrupt or not a phalanx checkpoint" in str(info.value) and "weights_only" not in str(info.value)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One run: 30 steps, checkpoints at 10, 20, 30, progress logged every 10 steps."""
    root = tmp_path_factory.mktemp("trained")
    out = run_in_process("train", "--steps", "30", "--checkpoint-every", "10", "--log-every", "10", "--checkpoint-dir",
                         "checkpoints", cwd=root)
    assert out.returncode == 0, out.stderr
    return root


@pytest.mark.slow
def test_bare_resume_skips_a_corrupt_newest_checkpoint_naming_it(trained, tmp_path):
    import shutil

    shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
    newest = tmp_path / "checkpoints" / "step-00000030.pt"
    weight = load_checkpoint(newest)["model"]["0.0.weight"]
    _flip_a_byte_inside(newest, weight.numpy().tobytes()[:32])
    out = run_in_process("train", "--steps", "40", "--checkpoint-dir", "checkpoints", "--resume", "--log-every", "10",
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert re.search(r"warning: skipped checkpoints/step-00000030.pt, newer than step-00000020.pt: checkpoint .* is "
                     r"corrupt \(its checksum does not match", out.stderr), out.stderr
    assert "resuming at step 20" in out.stdout.splitlines()[0]


@pytest.mark.slow
def test_metrics_after_a_resume_carry_a_marker_and_repeat_no_step(trained, tmp_path):
    """The run went on to step 30 after its checkpoint at 20; resumed from 20, step 30 is not written twice."""
    import shutil

    shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "step-00000030.pt").unlink()  # as if the job died after step 30's log line
    out = run_in_process("train", "--steps", "40", "--checkpoint-dir", "checkpoints", "--resume", "--log-every", "10",
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in (tmp_path / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == [10, 20, 30, 40]
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 20 and resumes[0]["checkpoint"].endswith("step-00000020.pt")
    assert [e["event"] for e in events].count("summary") == 1  # the first run's summary (step 30) is gone too


@pytest.mark.slow
def test_a_kill_that_cut_the_metrics_line_and_the_run_record_leaves_an_explicit_resume_clean(trained, tmp_path):
    """A metrics line cut by a kill stayed in the file after --resume, and a cut .phalanx-run.json refused even
    an explicit --resume FILE of a checkpoint that verifies."""
    import shutil

    shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
    root = tmp_path / "checkpoints"
    (root / "step-00000030.pt").unlink()
    with open(root / "metrics.jsonl", "a") as f:
        f.write('{"event": "step", "step": 3')  # a kill mid-line
    record = (root / ".phalanx-run.json").read_text()
    (root / ".phalanx-run.json").write_text(record[: len(record) // 2])  # a record cut as well
    out = run_in_process("train", "--steps", "40", "--checkpoint-dir", "checkpoints", "--resume",
                         "checkpoints/step-00000020.pt", "--log-every", "10", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == ["warning: checkpoints/.phalanx-run.json is unreadable; --resume "
                                       "checkpoints/step-00000020.pt verifies, so the run continues it and the "
                                       "record is rewritten (its checkpoints in step order)"], out.stderr
    events = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]  # every line whole
    assert [e["step"] for e in events if e["event"] == "step"] == [10, 20, 30, 40]
    assert [p.name for p in list_checkpoints(root)] == ["step-00000010.pt", "step-00000020.pt", "step-00000040.pt"]
    assert json.loads((root / ".phalanx-run.json").read_text())["run_id"] == load_checkpoint(root)["run_id"]


@pytest.mark.slow
def test_a_second_job_on_the_same_checkpoint_directory_is_refused_naming_the_first(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with DirectoryLock(tmp_path / "checkpoints"):
        out = run_cli("train", "--steps", "5", "--checkpoint-dir", "checkpoints", cwd=tmp_path)
    assert out.returncode == 2
    assert re.search(rf"error: checkpoint directory checkpoints is in use by another phalanx job \(pid {os.getpid()} "
                     r"on .*\); wait for it to finish, or choose another --checkpoint-dir", out.stderr), out.stderr
    assert list_checkpoints(tmp_path / "checkpoints") == []
    DirectoryLock(tmp_path / "checkpoints").acquire().release()  # released with its holder: never stale


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB filesystem: room for one checkpoint of the default model, not two."""
    with small_filesystem(tmp_path, "2m") as mount:
        yield mount


@pytest.mark.slow
def test_disk_full_during_a_save_is_one_line_and_the_previous_checkpoint_stays(small_tmpfs, tmp_path):
    out = run_in_process("train", "--steps", "30", "--checkpoint-every", "10", "--keep-checkpoints", "1",
                         "--checkpoint-dir", str(small_tmpfs), cwd=tmp_path)
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert re.search(r"cannot write checkpoint .*step-00000020.pt: No space left on device \(ENOSPC\); nothing was "
                     r"lost: the previous checkpoint .*step-00000010.pt is intact; free some space", errors[0])
    assert [p.name for p in list_checkpoints(small_tmpfs)] == ["step-00000010.pt"]
    assert load_checkpoint(latest_checkpoint(small_tmpfs))["step"] == 10
    assert not list(small_tmpfs.glob("*.tmp"))


def test_a_storage_error_names_what_to_do(tmp_path, monkeypatch):
    save_checkpoint(_state(1, torch.ones(2)), tmp_path, 1, keep=3)

    def denied(obj, f):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(torch, "save", denied)
    with pytest.raises(StorageError, match=r"Permission denied \(EACCES\); nothing was lost: the previous checkpoint "
                                           r".*step-00000001.pt is intact; fix the directory's permissions"):
        save_checkpoint(_state(2, torch.ones(2)), tmp_path, 2, keep=3)


def _hogwild_files() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("phalanx-hogwild-")} if os.path.isdir("/dev/shm") \
        else set()


@pytest.mark.slow
def test_hogwild_leaves_no_shared_memory_when_a_worker_is_killed(tmp_path):
    before = _hogwild_files()
    code, out, err = run_and_signal(["train", "--strategy", "hogwild", "--steps", "4000", "--log-every", "20"],
                                    tmp_path, "step 40,", signal.SIGKILL, rank=1)
    assert code == 1 and "worker 1 failed" in err
    assert _hogwild_files() <= before


def test_leftover_shared_memory_of_a_dead_run_is_reclaimed(tmp_path):
    gone = tmp_path / "phalanx-hogwild-999999999-abc"
    gone.write_bytes(b"x")
    mine = tmp_path / f"phalanx-hogwild-{os.getpid()}-abc"
    mine.write_bytes(b"x")
    assert reclaim_leftovers(str(tmp_path)) == [gone.name]
    assert mine.exists() and not gone.exists()
