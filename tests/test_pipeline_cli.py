"""The pipeline end to end: the stacked LSTM through the CLI and the example; bad input, plainly."""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from helpers import REPO, only_run, run_in_process
from phalanx import Pipeline, TrainConfig, Trainer
from phalanx.errors import PhalanxError
from phalanx.strategies import Job
from phalanx.task.models import lstm
from phalanx.strategies.pipeline.split import model_blocks
from phalanx.checkpoint import load_checkpoint, tensors


def run(*args: str, cwd) -> subprocess.CompletedProcess:
    """This checkout's code (PYTHONPATH=src), as a user runs it: ``python -m phalanx`` or a script."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)


def accuracy(stdout: str) -> float:
    return float(re.search(r"test accuracy (\d\.\d+)[^\n]* after", stdout).group(1))


@pytest.mark.slow
def test_stacked_lstm_through_the_cli_reaches_090_and_its_checkpoint_is_the_unsplit_model(tmp_path):
    """With its recipe (adam, lr 0.01, 300 steps) and no other flag: also test_recipes.py's lstm-pipeline case."""
    out = run("-m", "phalanx", "train", "--strategy", "pipeline", "--model", "lstm", "--workers", "2",
              "--log-every", "100", "--progress", "lines", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("phalanx train: strategy pipeline (2 stages, 4 micro-batches, gpipe), world size 2")
    assert "recipe: adam, lr 0.01, 300 steps (lstm default; any flag overrides)" in lines
    assert "global batch 32 (every worker reads the whole batch)" in lines[0]
    assert lines[1].startswith("pipeline plan: 5 blocks in 2 stages, balanced by measured time")
    # (the partition follows measured times, which depend on the machine's load: one block or several)
    assert re.fullmatch(r"  stage 0 \(rank 0\): blocks 0(\.\.\d)? \(\d\), [\d,]+ parameters, \d+\.\d\d ms per "
                        r"micro-batch \(fwd\+bwd\)", lines[2])
    assert re.fullmatch(r"  stage 0 -> 1: \d+ KiB of activations per micro-batch \(and their gradients back\), "
                        r"\d+\.\d\d ms per message", lines[4])
    assert re.search(r"predicted step \d+\.\d ms, predicted bubble \d+\.\d%", lines[5])
    assert lines[6].startswith("  measured in every worker at once: 1 torch thread each on cpu, 4 micro-batches of 8 ")
    assert accuracy(out.stdout) >= 0.90
    # The stages' sharded checkpoint, read whole, is the unsplit model's: it loads into the plain LSTM (and its
    # optimizer state into a plain Adam), which scores the same.
    state = tensors(load_checkpoint(only_run(tmp_path) / "step-00000300.dcp"))
    model = lstm((1, 8, 8), 10)
    model.load_state_dict(state["model"])
    torch.optim.Adam(model.parameters()).load_state_dict(state["optimizer"])
    from phalanx.data import load_data

    test = load_data("digits", None, (1, 8, 8), 0, 0).test
    with torch.no_grad():
        plain = (model(test.transform(test.x, None)).argmax(1) == test.y).float().mean().item()
    assert plain == pytest.approx(accuracy(out.stdout), abs=1e-4)


@pytest.mark.slow
def test_lstm_pipeline_example_runs_and_learns(tmp_path):
    out = run(str(REPO / "examples" / "lstm_pipeline.py"), "--balance", "params", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "pipeline plan: 5 blocks in 2 stages, balanced by parameter count" in out.stdout
    found = re.search(r"lstm pipeline: 4 LSTM layers over 2 stages, balance \[\d, \d\], test accuracy (\d\.\d+)",
                      out.stdout)
    assert found and float(found.group(1)) >= 0.90, out.stdout


BAD_CLI = [
    (["--stages", "3"], "--stages 3 needs 3 workers (one per stage) but this run has 2; add --workers 3"),
    (["--balance", "3,3"], "--balance 3,3 sums to 6 (3 + 3) but the model has 5 blocks"),
    (["--balance", "1,2,2"], "--balance 1,2,2 names 3 stages but the pipeline has 2"),
    (["--batch-size", "30"], "batch 30 does not split into 4 equal micro-batches (--chunks 4): 30 / 4 = 7.5"),
    (["--schedule", "1f1b", "--chunks", "1", "--batch-size", "30"],
     "--schedule 1f1b needs at least one micro-batch per stage: --chunks 1 < 2 stages"),
    (["--schedule", "zigzag"], "unknown --schedule 'zigzag': choose gpipe or 1f1b"),
    (["--balance", "fast"], "unknown --balance 'fast': choose auto, params, time"),
]


@pytest.mark.parametrize("flags,message", BAD_CLI, ids=[" ".join(f) for f, _ in BAD_CLI])
def test_bad_pipeline_input_is_one_clear_line(tmp_path, flags, message):
    # (the command's main() in this process: refused before anything starts, no interpreter start-up per case)
    out = run_in_process("train", "--strategy", "pipeline", "--model", "lstm", "--steps", "5", *flags, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("error: ") and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


class NotSequential(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.b(self.a(x.flatten(1)))


class Blocks(NotSequential):
    def pipeline_blocks(self):
        return [nn.Sequential(nn.Flatten(), self.a), self.b]


def _setup(model, **options):
    """The layout of a 2-stage pipeline over this model: every model error is found there, in the parent."""
    Pipeline(**options).layout(Job((torch.device("cpu"),) * 2, model=model))


def test_model_errors_name_the_fix():
    # A model with no blocks of its own is traced; with no repeated blocks either, it is told where to split.
    with pytest.raises(PhalanxError, match=r"2 stages but NotSequential has no repeated blocks \(a ModuleList or "
                                           r"Sequential of one class\) to begin a stage at: name the submodules where "
                                           r"stages begin with --split-points a,b"):
        _setup(NotSequential())
    _setup(NotSequential(), split_points=("b",))
    with pytest.raises(PhalanxError, match="2 stages but the model has only 1 blocks.*--stages 1 or fewer"):
        _setup(nn.Sequential(nn.Linear(4, 2)))
    with pytest.raises(PhalanxError, match="returned modules that are not submodules"):
        _setup(Blocks())  # its first block is a new Sequential, not one of the model's submodules
    with pytest.raises(PhalanxError, match=r"parameters outside its blocks \(extra\.weight"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model.pipeline_blocks = lambda: [model[0], model[1]]
        model.extra = nn.Linear(2, 2)
        _setup(model)
    a = nn.Linear(4, 4)
    with pytest.raises(PhalanxError, match="lists one block twice"):
        _setup(nn.Sequential(a, nn.ReLU(), a))
    with pytest.raises(PhalanxError, match="shares parameters between blocks.*give --split-points to split it by "
                                           "tracing, which keeps tied weights tied"):
        model_blocks(nn.Sequential(a, nn.Sequential(nn.ReLU(), a)))
    _setup(nn.Sequential(a, nn.Sequential(nn.ReLU(), a)), split_points=("1",))  # traced: the tie is kept


def test_model_with_no_sequential_structure_fails_before_the_workers_start_with_one_line(tmp_path):
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    config = TrainConfig(strategy=Pipeline(), devices="cpu", workers=2, steps=2, checkpoint_dir=str(tmp_path / "c"),
                         progress="none")
    with pytest.raises(PhalanxError, match="NotSequential has no repeated blocks"):
        Trainer(config, model=NotSequential(), train_data=(x, y)).fit()


def test_pipeline_blocks_protocol_splits_a_plain_module():
    from phalanx.strategies.pipeline.split import model_blocks

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.head = nn.Linear(4, 2)

        def pipeline_blocks(self):
            return [*self.body, self.head]

    assert [name for name, _ in model_blocks(Net())] == ["body.0", "body.1", "head"]
