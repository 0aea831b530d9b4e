"""What a checkpoint is for besides a resume (issue 19): ``phalanx evaluate`` prints its metrics, ``--init-from``
fine-tunes from its weights with a fresh optimizer. One real run (one process, a user model by import path) is
shared by every test; each compares against a reference computed here, by hand."""

import json
import sys

import pytest
import torch
import torch.nn.functional as F

import phalanx
from helpers import run_main
from phalanx import TrainConfig, Trainer
from phalanx.data import ShardedBatches
from phalanx.errors import PhalanxError
from phalanx import checkpoint as ckpt

MODULE = '''
import torch
from torch import nn
from sklearn.datasets import load_digits


class Net(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def wide():
    return Net(32)


def load():
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target)
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])
'''

RUN = dict(model="ckuse_mod:Net", data="ckuse_mod:load", workers=1, devices="cpu", batch_size=32, lr=0.1,
           optimizer="sgd", momentum=0.9, log_every=100, progress="none")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckuse")
    (root / "ckuse_mod.py").write_text(MODULE)
    sys.path.insert(0, str(root))
    Trainer(TrainConfig(steps=8, checkpoint_every=4, checkpoint_dir=str(root / "run"), **RUN)).fit()
    import ckuse_mod
    yield root, ckuse_mod
    sys.path.remove(str(root))


def _reference(mod, path):
    """Accuracy and mean cross-entropy of the checkpoint's weights on the whole test set, by hand."""
    model = mod.Net()
    model.load_state_dict(ckpt.load_checkpoint(path)["model"])
    (_, _), (x, y) = mod.load()
    with torch.no_grad():
        out = model(x)
    return {"accuracy": (out.argmax(1) == y).double().mean().item(), "loss": F.cross_entropy(out, y).item()}


def test_evaluate_a_directory_gives_its_newest_checkpoints_metrics_on_the_test_set(trained):
    root, mod = trained
    got = phalanx.evaluate(str(root / "run"))  # model and data: what the checkpoint recorded
    want = _reference(mod, root / "run" / "step-00000008.pt")
    assert got.keys() == want.keys()
    assert got == pytest.approx(want, rel=1e-6)


def test_the_command_prints_one_json_line_and_the_sentence(trained, capsys, monkeypatch):
    root, mod = trained
    monkeypatch.chdir(root)
    code, out = run_main(["evaluate", "--checkpoint", "run/step-00000004.pt", "--json"], capsys)
    assert code == 0, out.err
    result = json.loads(out.out.strip())
    assert result["step"] == 4 and result["held_out"] == "test" and result["examples"] == 297
    assert result["metrics"] == pytest.approx(_reference(mod, root / "run" / "step-00000004.pt"), rel=1e-6)
    code, out = run_main(["evaluate", "--checkpoint", "run", "--metric", "accuracy"], capsys)
    assert code == 0 and "(step 8, ckuse_mod:Net on ckuse_mod:load): test accuracy " in out.out


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint", "nowhere"], "checkpoint nowhere does not exist; pass an existing file or directory to "
                                  "--checkpoint"),
    (["--checkpoint", "garbage.pt"], "checkpoint garbage.pt is corrupt or not a phalanx checkpoint"),
    (["--checkpoint", "run", "--model", "ckuse_mod:wide"], "holds another model (fc1.weight is (16, 64) there and "
                                                           "(32, 64) here); evaluate it with the model and data"),
    (["--checkpoint", ""], "--checkpoint is empty (''); give a step-*.pt written by phalanx train, or its "
                           "directory"),  # not the current directory
])
def test_a_missing_corrupt_or_foreign_checkpoint_is_one_line_exit_2(trained, capsys, monkeypatch, flags, message):
    root, _ = trained
    monkeypatch.chdir(root)
    (root / "garbage.pt").write_bytes(b"not a checkpoint")
    code, out = run_main(["evaluate", *flags], capsys)
    assert code == 2 and out.out == ""
    assert len(out.err.strip().splitlines()) == 1 and message in out.err, out.err


@pytest.mark.slow
def test_evaluate_names_a_newer_checkpoint_it_skipped_as_corrupt(trained, tmp_path):
    import shutil

    from helpers import run_cli

    root, mod = trained
    shutil.copytree(root / "run", tmp_path / "run")
    (tmp_path / "ckuse_mod.py").write_text(MODULE)
    newest = tmp_path / "run" / "step-00000008.pt"
    newest.write_bytes(newest.read_bytes()[:-200])  # torn: the newest no longer verifies
    out = run_cli("evaluate", "--checkpoint", "run", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["step"] == 4 and result["skipped"] == ["run/step-00000008.pt"]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: skipped run/step-00000008.pt, newer than "
                                                   "step-00000004.pt: checkpoint run/step-00000008.pt is corrupt"), \
        out.stderr


def test_init_from_starts_at_the_checkpoints_weights_with_a_fresh_optimizer(trained, tmp_path):
    root, mod = trained
    start = root / "run" / "step-00000004.pt"  # mid-run: its momentum buffers are not zero
    cfg = TrainConfig(steps=1, init_from=str(root / "run"), checkpoint_dir=str(tmp_path / "tuned"), **RUN)
    plan = Trainer(cfg).plan()
    assert plan.config.init_from == str(root / "run" / "step-00000008.pt")  # a directory: its newest
    cfg = TrainConfig(steps=1, init_from=str(start), checkpoint_dir=str(tmp_path / "tuned"), **RUN)
    x, y = ShardedBatches(Trainer(cfg).plan().data.train, 32, seed=0).one(0)  # the run's first batch
    summary = Trainer(cfg).fit()
    tuned = ckpt.load_checkpoint(summary["checkpoint"])
    assert tuned["step"] == 1
    # By hand: the checkpoint's weights, a new SGD (no momentum yet), one step on the first batch at step 0.
    model = mod.Net()
    model.load_state_dict(ckpt.load_checkpoint(start)["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tuned["model"][name], tensor, rtol=1e-5, atol=1e-6)


def test_init_from_a_foreign_checkpoint_or_with_resume_is_one_line_and_nothing_starts(trained, tmp_path):
    root, _ = trained
    with pytest.raises(PhalanxError, match=r"--init-from starts a new run .* and --resume continues"):
        TrainConfig(init_from=str(root / "run"), resume=str(root / "run"))
    cfg = TrainConfig(**{**RUN, "model": "ckuse_mod:wide"}, init_from=str(root / "run"),
                      checkpoint_dir=str(tmp_path / "never"))
    with pytest.raises(PhalanxError, match=r"holds another model \(fc1.weight is \(16, 64\) there and \(32, 64\) "
                                           r"here\); start from it with the model and data it was trained with"):
        Trainer(cfg).fit()
    assert not (tmp_path / "never").exists()
