"""Flags made from the options; every input checked in the parent, before any worker starts.

These run ``phalanx.cli.main`` in-process (the checks fail before anything is spawned, so no
worker is needed); one of each kind also runs the installed command in test_cli.py.
"""

import dataclasses
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from helpers import run_cli, run_main
from phalanx import TrainConfig, Trainer
from phalanx.cli import build_parser, strategy_fields
from phalanx.errors import PhalanxError
from phalanx.strategies import STRATEGIES

#: A valid value for every strategy option's flag (a new option must add one here).
SAMPLE = {"reduce": "flat", "compress": "bf16", "islands": "0,1", "bucket_mb": "10", "staleness": "1",
          "sync_every": "2", "stages": "2", "chunks": "2", "schedule": "gpipe", "balance": "params",
          "profile_repeats": "3", "reshard_after_forward": None, "blocks": "0,1",  # None: an on/off flag
          "backup_workers": "1", "outer_lr": "0.5", "outer_momentum": "0.8", "fragments": "2",
          "outer_precision": "int8", "split_points": "0", "init_device": "meta", "init_weights": "mymodel:init",
          "tensor_parallel": "2"}

FOREIGN = [(strategy, name) for strategy, cls in STRATEGIES.items() for name in strategy_fields()
           if name not in {f.name for f in dataclasses.fields(cls)}]


def test_every_strategy_option_has_a_sample_value_here():
    assert set(SAMPLE) == set(strategy_fields())


@pytest.mark.slow
@pytest.mark.parametrize("strategy, name", FOREIGN, ids=[f"{s}-{n}" for s, n in FOREIGN])
def test_a_flag_the_strategy_does_not_take_is_refused_naming_who_takes_it(strategy, name, capsys, tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    flag = "--" + name.replace("_", "-")
    code, out = run_main(["train", "--strategy", strategy, flag] + ([SAMPLE[name]] if SAMPLE[name] else []), capsys)
    owners = strategy_fields()[name][1]
    assert code == 2
    assert out.err.startswith(f"error: {flag} is an option of {' and '.join(owners)}; --strategy {strategy} "
                              "does not take it"), out.err
    assert out.err.count("\n") == 1 and not os.listdir(tmp_path)


@pytest.mark.slow
def test_help_shows_every_default_and_version_names_the_versions():
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    flags = [a for a in train._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 40
    missing = [a.option_strings[0] for a in flags if "(default: " not in (a.help or "")]
    assert not missing, missing
    out = run_cli("--version", cwd=".")
    assert out.returncode == 0 and re.fullmatch(r"phalanx \d+\.\d+\.\d+ \(torch [\w.+]+, Python 3\.\d+\.\d+\)\n",
                                                out.stdout), out.stdout


PARENT_CHECKS = [
    (["--straggler", "5:2"], "--straggler 5:2 names rank 5 but this run has ranks 0..1"),
    (["--strategy", "ps", "--straggler", "3:2"], "names rank 3 but this run has ranks 0..2"),
    (["--strategy", "ps", "--straggler", "0:2"], "--straggler 0:2 names the parameter server (rank 0), which computes "
                                                 "no gradients; slow one of the workers instead (ranks 1..2)"),
    (["--straggler", "pauses:2:4"], "--straggler 'pauses:2:4': the probability of a pause must be in (0, 1]"),
    (["--stop-at-accuracy", "0.9"], "--stop-at-accuracy needs evaluations during training: add --eval-every N"),
    (["--stop-at-accuracy", "2", "--eval-every", "5"], "--stop-at-accuracy must be in (0, 1]"),
    (["--strategy", "backup", "--backup-workers", "2"], "--backup-workers 2 leaves no gradient to average: each update "
                                                        "takes the first W - B = 2 - 2 = 0 of 2 workers' gradients"),
    (["--momentum", "5"], "--momentum must be in [0, 1)"),
    (["--lr", "inf"], "--lr must be positive and finite, got inf"),
    (["--lr", "nan"], "--lr must be positive and finite, got nan"),
    (["--weight-decay", "-1"], "--weight-decay must be 0 or a small positive number"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--master-addr", "999.1.1.1"], "--master-addr 999.1.1.1 does not resolve"),
    (["--master-addr", "192.0.2.1"], "--master-addr 192.0.2.1 is not an address of this machine"),
    (["--metrics", "nowhere/dir/m.jsonl"], "--metrics nowhere/dir/m.jsonl: directory nowhere/dir does not exist"),
    (["--metrics", "."], "--metrics . is a directory"),
    (["--batch-size", "1000"], "global batch 2000 (1000 per worker x 2 workers) is larger than the 1437 training"),
    (["--strategy", "pipeline", "--batch-size", "2000", "--chunks", "1"],
     "global batch 2000 (every worker reads the whole batch) is larger than the 1437"),
    (["--data", "synthetic", "--synthetic-shape", "3x0x4"], "--synthetic-shape (3, 0, 4): every dimension"),
    (["--data", "synthetic", "--synthetic-size", "5"], "--synthetic-size 5 is too small"),
    (["--model", "cnn", "--data", "synthetic", "--synthetic-shape", "5"], "model 'cnn' needs image data"),
    (["--model", "resnet"], "unknown model 'resnet': choose one of cnn, mlp, cifar10, lstm"),
    (["--lr-schedule", "exponential", "--lr-decay-factor", "2"], r"--lr-decay-factor must be in (0, 1]"),
    (["--lr-decay-every", "5"], "--lr-decay-every applies to --lr-schedule exponential"),
    (["--lr-base-batch", "0"], "--lr-base-batch must be a positive integer, got 0"),
    (["--optimizer", "adam", "--momentum", "0.5"], "--momentum applies to --optimizer sgd"),
    (["--model", "lstm", "--momentum", "0.5"], "--momentum applies to --optimizer sgd, and the lstm recipe uses adam"),
    (["--data-dir", "somewhere"], "--data-dir applies to --data cifar10"),
    (["--steps", "1.5"], "--steps takes a whole number, got '1.5'"),
    (["--islands", "0,1;x"], "islands '0,1;x' are not like '0,1;2,3'"),
    (["--strategy", "ssp", "--staleness", "-2"], "--staleness must be 0 or more steps"),
    (["--strategy", "pipeline", "--stages", "3"], "--stages 3 needs 3 workers (one per stage)"),
    # an empty name is not the default's name; a prefix of a flag is not the flag; a step count no run ends
    (["--strategy", ""], "unknown strategy '': choose one of sync, ps"),
    (["--metric", ""], "--metric is empty (''); name one, e.g. --metric accuracy, or drop --metric"),
    (["--metric", " , "], "--metric is empty (' , ')"),
    (["--loss", ""], "--loss is empty (''); name one"),
    (["--step", "3"], "unrecognized arguments: --step 3 (see 'phalanx train --help')"),
    (["--steps", "99999999999999999999999"], "--steps 99999999999999999999999 is more than a run can take (at most "
                                             "1,000,000,000); give fewer"),
]


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", PARENT_CHECKS, ids=[" ".join(f) for f, _ in PARENT_CHECKS])
def test_bad_input_is_refused_in_the_parent_with_one_line_and_nothing_written(flags, message, capsys, tmp_path,
                                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["train", *flags], capsys)
    assert code == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.err
    assert not os.listdir(tmp_path)  # no checkpoint directory, no metrics file


def test_a_metrics_path_through_a_file_names_the_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a directory")
    code, out = run_main(["train", "--metrics", "afile/m.jsonl"], capsys)
    assert code == 2 and out.err == "error: --metrics afile/m.jsonl: afile is a file, not a directory; choose " \
                                    "another path\n", out.err
    assert os.listdir(tmp_path) == ["afile"]


def test_an_unwritable_metrics_file_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["train", "--metrics", "/proc/m.jsonl"], capsys)
    assert code == 2 and "error: --metrics /proc/m.jsonl cannot be written" in out.err


# ---- the Python API checks what it is given, in the caller's process ----

class WithLambda(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer, self.act = nn.Linear(4, 2), lambda t: t

    def forward(self, x):
        return self.layer(self.act(x))


class WithLock(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer, self.lock = nn.Linear(4, 2), threading.Lock()

    def forward(self, x):
        with self.lock:
            return self.layer(x)


X, Y = torch.randn(64, 4), torch.randint(0, 2, (64,))
API_CASES = [
    (dict(model=nn.Linear(4, 2), train_data=(X, torch.rand(64))),  # float targets: a regression, one value each
     r"the model returns \(2, 2\) for targets of shape \(2,\): float targets make a regression"),
    (dict(model=nn.Linear(4, 3), train_data=(X, torch.randint(0, 10, (64,)))),
     "the model outputs 3 class scores but the labels go up to 9; make its last layer output 10"),
    (dict(model=nn.Linear(5, 2), train_data=(X, Y)), r"the model fails on an example batch of shape \(2, 4\)"),
    (dict(model=nn.Linear(4, 2), train_data=(X, Y - 1)),  # -100 is torch's ignore_index: allowed, -1 is not
     r"integer targets are class indices 0..C-1 \(or -100 for a position no loss counts\), and -1 is neither"),
    (dict(model=nn.Linear(4, 2), train_data=(X, Y[:, None])),  # a target per position, no score per position
     r"the model returns \(2, 2\) for targets of shape \(2, 1\): a class per position needs a score per class"),
    (dict(model=nn.Linear(4, 2), train_data=X), "train_data must be a pair"),
    (dict(model=nn.Linear(4, 2), train_data=(X, Y), test_data=(torch.randn(8, 5), Y[:8])),
     r"test_data examples have shape \(5,\) but train_data examples \(4,\)"),
    (dict(model=WithLambda(), train_data=(X, Y)), r"the model cannot be sent to the worker processes \(.*\): "
     r"WithLambda holds something pickle cannot send \(a lambda, a local function\); pass a factory that pickle can "
     r"send, which every worker calls: model=functools.partial\(GPT, config\) \(a lambda is not picklable either\)"),
    (dict(model=lambda: nn.Linear(4, 2), train_data=(X, Y)), r"the model factory cannot be sent to the worker "
     r"processes \(.*\); pass a factory that pickle can send"),
    (dict(model=nn.Linear(4, 2), train_data=(X, Y), loss_fn=lambda out, y: out.sum()),
     "loss_fn cannot be sent to the worker processes"),
    (dict(model="a string", train_data=(X, Y)), r"model must be a torch.nn.Module or a factory that returns one "
     r"\(e.g. functools.partial\(Net, config\)\), got str"),
    (dict(model=nn.Flatten(0), train_data=(X, Y)), r"integer targets make a classifier: return scores of shape"),
    (dict(model=WithLock(), train_data=(X, Y)), re.escape("the model cannot be copied for the workers (TypeError: "
                                                          "cannot pickle '_thread.lock' object in attribute 'lock'); "
                                                          "every worker trains its own copy")),
]


@pytest.mark.parametrize("kwargs, message", API_CASES, ids=[m[:30] for _, m in API_CASES])
def test_the_api_refuses_bad_models_and_data_before_any_worker(kwargs, message, tmp_path):
    config = TrainConfig(workers=2, devices="cpu", steps=2, batch_size=8, progress="none",
                         checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(PhalanxError, match=message):
        Trainer(config, **kwargs).fit()
    assert not (tmp_path / "c").exists()


def test_the_api_accepts_numpy_arrays(tmp_path):
    config = TrainConfig(workers=1, devices="cpu", steps=3, batch_size=8, progress="none",
                         checkpoint_dir=str(tmp_path / "c"))
    summary = Trainer(config, model=nn.Linear(4, 2), train_data=(X.numpy(), Y.numpy())).fit()
    assert summary["steps"] == 3


SCRIPT = """
import torch
from torch import nn
import phalanx

config = phalanx.TrainConfig(workers=2, devices="cpu", steps=2, batch_size=8, progress="none", checkpoint_dir="c")
phalanx.Trainer(config, model=nn.Linear(4, 2), train_data=(torch.randn(64, 4), torch.randint(0, 2, (64,)))).fit()
"""


@pytest.mark.slow
def test_a_script_without_the_main_guard_gets_that_advice_and_spawns_nothing(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].endswith(
        "train.py line 7 starts training at the top level of the script: phalanx spawns worker processes that "
        "import the script again, so put the call under 'if __name__ == \"__main__\":'")
    assert "bootstrapping phase" not in out.stderr and not (tmp_path / "c").exists()
    guarded = SCRIPT.replace("phalanx.Trainer(", "if __name__ == '__main__':\n    phalanx.Trainer(")
    (tmp_path / "train.py").write_text(guarded)
    out = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
