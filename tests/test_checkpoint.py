"""Atomic checkpoints: a kill during a save leaves the previous checkpoint loadable."""

import signal
import subprocess
import sys
import time

import pytest
import torch

from phalanx.errors import PhalanxError, StorageError
from phalanx.checkpoint import (RUN_NAME, latest_checkpoint, list_checkpoints, load_checkpoint, read_run,
                                remove_stale_temporaries, save_checkpoint)

WRITER = """
import sys, torch
from phalanx.checkpoint import save_checkpoint
root = sys.argv[1]
save_checkpoint({"format": "phalanx-checkpoint-1", "step": 1, "w": torch.ones(4)}, root, 1, keep=5)
print("first saved", flush=True)
big = torch.randn(64 * 1024 * 1024)  # 256 MB: a save that takes a while
while True:
    save_checkpoint({"format": "phalanx-checkpoint-1", "step": 2, "w": big}, root, 2, keep=5)
"""


def test_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "first saved"
    for _ in range(600):  # wait until a temporary file of the big save exists, then kill mid-write
        if list(tmp_path.glob(".step-00000002.pt.*.tmp")):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = load_checkpoint(tmp_path / "step-00000001.pt")
    assert torch.equal(first["w"], torch.ones(4))
    newest = latest_checkpoint(tmp_path)  # either the untouched first, or a complete second
    assert load_checkpoint(newest)["step"] in (1, 2)
    removed = remove_stale_temporaries(tmp_path)
    assert not list(tmp_path.glob("*.tmp")) and all(p.suffix == ".tmp" for p in removed)
    assert list_checkpoints(tmp_path)  # finished checkpoints are never removed


def test_failed_save_removes_its_temporary(tmp_path, monkeypatch):
    save_checkpoint({"format": "phalanx-checkpoint-1", "step": 1}, tmp_path, 1, keep=3)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(StorageError, match="No space left on device"):
        save_checkpoint({"format": "phalanx-checkpoint-1", "step": 2}, tmp_path, 2, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_NAME, "step-00000001.pt"]
    assert read_run(tmp_path).checkpoints == ("step-00000001.pt",)  # the failed step is not the newest


def _saved(root, step):
    return save_checkpoint({"format": "phalanx-checkpoint-1", "step": step, "run_id": "r1"}, root, step, keep=3)


def test_the_newest_checkpoint_is_the_last_written_and_retention_keeps_the_last_written(tmp_path):
    for step in (10, 20, 30, 15):  # 15: a run resumed from step 10 writes it after 30
        _saved(tmp_path, step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000020.pt", "step-00000030.pt",
                                                            "step-00000015.pt"]
    assert latest_checkpoint(tmp_path).name == "step-00000015.pt"
    assert load_checkpoint(tmp_path)["step"] == 15  # a bare --resume takes it, not step 30
    _saved(tmp_path, 20)  # written again: now the newest, and 30 the oldest
    _saved(tmp_path, 25)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000015.pt", "step-00000020.pt",
                                                            "step-00000025.pt"]
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-00000015.pt", "step-00000020.pt",
                                                                   "step-00000025.pt"]
    assert read_run(tmp_path).run_id == "r1"


def test_a_directory_named_like_a_checkpoint_is_named_as_such(tmp_path):
    _saved(tmp_path, 10)
    (tmp_path / "step-00000020.pt").mkdir()
    with pytest.raises(StorageError, match=r"cannot write checkpoint .*step-00000020.pt: a directory of that name "
                                           r"is in the way \(not a checkpoint\); nothing was lost: the previous "
                                           r"checkpoint .*step-00000010.pt is intact; move it out of --checkpoint-dir"):
        _saved(tmp_path, 20)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000010.pt"]


def test_loading_rejects_what_is_not_a_phalanx_checkpoint(tmp_path):
    torch.save({"weights": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(PhalanxError, match="is not a phalanx checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(PhalanxError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(PhalanxError, match=r"no checkpoint \(step-\*.pt\) in"):
        load_checkpoint(tmp_path)
