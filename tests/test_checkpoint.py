"""Atomic checkpoints: a kill during a save leaves the previous checkpoint loadable."""

import signal
import subprocess
import sys
import time
from collections import OrderedDict

import pytest
import torch

from phalanx.errors import PhalanxError, StorageError
from phalanx.checkpoint import (RUN_NAME, latest_checkpoint, list_checkpoints, load_checkpoint, read_run,
                                remove_stale_temporaries, save_checkpoint, step_of)

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


@pytest.mark.slow
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


def test_a_saved_state_loads_as_given_and_a_checkpoints_name_says_its_step(tmp_path):
    """The writer saves a copy with every tensor detached on the CPU (``data.batch.to_cpu``), the caller's state
    untouched; ``step_of`` reads the step from the name (what the trainer reads after a restart)."""
    w = torch.ones(3, requires_grad=True) * 2
    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]
    state = {"format": "phalanx-checkpoint-1", "step": 7, "model": OrderedDict(w=w),
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": groups},
             "rng": [torch.get_rng_state(), None]}
    path = save_checkpoint(state, tmp_path, 7, keep=1)
    assert "checksum" not in state and state["model"]["w"] is w
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["model"]["w"], w.detach()) and not loaded["model"]["w"].requires_grad
    assert loaded["optimizer"]["param_groups"] == groups and loaded["optimizer"]["state"][0]["step"] == 3
    assert torch.equal(loaded["rng"][0], state["rng"][0]) and loaded["rng"][1] is None
    assert step_of(path) == 7 and step_of(tmp_path / "step-00000000.dcp") == 0
    assert step_of(tmp_path / "best.pt") is None and step_of(".step-00000007.pt.x1.tmp") is None
