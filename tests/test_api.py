"""``phalanx.compare(...)`` and ``phalanx.estimate(...)`` on a user's own model objects (issue 19, item 6),
and ``--tensorboard`` (item 8).

One small comparison (2 strategies x 1 scenario x 1 repeat, 20 steps) runs twice, shared by the
tests: through the API on objects, and through the command on the same file by import path
(``examples/mymodel.py``, docs/your-model.md's example). Both use deterministic strategies (sync and
local SGD on gloo), so with the same seed they must train the very same runs: the reports agree
on everything but timings and the data's name. The command's run also writes TensorBoard files,
read back and checked against its metrics files.
"""

import contextlib
import io
import json
import shutil
import sys

import numpy as np
import pytest
import torch

import phalanx
from helpers import REPO, run_main
from phalanx.errors import PhalanxError

SEED = 3
FLAGS = ["--strategies", "sync,local-sgd:4", "--scenarios", "none", "--repeats", "1", "--workers", "2",
         "--max-steps", "20", "--eval-every", "5", "--target", "0.5", "--seed", str(SEED)]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A folder holding the user's file, importable (as ``phalanx`` makes the current folder)."""
    root = tmp_path_factory.mktemp("project")
    shutil.copy(REPO / "examples" / "mymodel.py", root / "mymodel.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        mp.chdir(root)
        import mymodel

        yield root, mymodel
        sys.modules.pop("mymodel", None)


@pytest.fixture(scope="module")
def both(project):
    """The same comparison through the command (with --tensorboard) and through the API (saved)."""
    root, mymodel = project
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        from phalanx.cli import main

        code = main(["compare", "--model", "mymodel:Net", "--data", "mymodel:load", *FLAGS, "--tensorboard", "tb",
                     "--out", "cli"])
    assert code == 0, printed.getvalue()
    train, test = mymodel.load()
    torch.manual_seed(SEED)  # the weights the command's workers build: Net(...) right after seeding
    net = mymodel.Net(input_shape=(64,), num_classes=10)
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        result = phalanx.compare(model=net, train_data=train, test_data=test, strategies=["sync", "local-sgd:4"],
                                 scenarios="none", repeats=1, workers=2, max_steps=20, eval_every=5, target=0.5,
                                 seed=SEED)
    written = result.save(root / "api")
    return root, result, written, shown.getvalue()


def _report(path):
    return json.loads((path / "report.json").read_text())


def _learned(run):
    """What a run learned, without its timings: equal for equal seeds on deterministic strategies."""
    keep = ("strategy", "scenario", "repeat", "seed", "reached", "steps_to_target", "examples_to_target", "steps",
            "best_accuracy", "final_accuracy", "metric", "best", "final", "metrics")
    return {**{k: run[k] for k in keep}, "curve": [(p["step"], p["accuracy"]) for p in run["curve"]]}


@pytest.mark.slow
def test_the_api_on_objects_and_the_command_by_import_path_write_the_same_report(both):
    root, result, written, printed = both
    api, cli = _report(root / "api"), _report(root / "cli")
    assert [_learned(r) for r in api["runs"]] == [_learned(r) for r in cli["runs"]]
    assert [(r["strategy"], r["steps"]) for r in api["runs"]] == [("sync", api["runs"][0]["steps"]),
                                                                   ("local-sgd:4", api["runs"][1]["steps"])]
    assert api["runs"][0]["reached"]  # a target reached, so steps to target were compared too
    differs = {"command", "data"}
    assert {k: v for k, v in api["setup"].items() if k not in differs} == \
           {k: v for k, v in cli["setup"].items() if k not in differs}
    assert (api["setup"]["model"], api["setup"]["data"], cli["setup"]["data"]) == \
           ("mymodel:Net", "your data", "mymodel:load")
    # the same files: report, plots, every run's metrics file (the API's kept in memory, written by save)
    files = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert files(root / "api") == files(root / "cli")
    assert [p.name for p in written[:2]] == ["report.md", "report.json"] and all(p.is_file() for p in written)
    for run in api["runs"]:
        events = [json.loads(line) for line in (root / "api" / run["metrics"]).read_text().splitlines()]
        assert ([e["metrics"]["accuracy"] for e in events if e["event"] == "eval"]
                == [p["accuracy"] for p in run["curve"]])
    # the result holds what the call printed, as the command prints it
    assert result.answer == api["answer"].replace("**", "") and result.answer in printed
    assert result.tables.splitlines()[0] in printed
    assert [r.strategy for r in result.runs] == ["sync", "local-sgd:4"]


@pytest.mark.slow
def test_tensorboard_holds_each_runs_metrics_file_values(both):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = both[0]
    for run in _report(root / "cli")["runs"]:
        board = EventAccumulator(str(root / "tb" / "none" / f"{run['strategy'].replace(':', '-')}-r1"))
        board.Reload()
        events = [json.loads(line) for line in (root / "cli" / run["metrics"]).read_text().splitlines()]
        steps = [e for e in events if e["event"] == "step"]
        evals = [e for e in events if e["event"] == "eval"]
        expected = {"train/loss": [(e["step"], e["loss"]) for e in steps],
                    "train/lr": [(e["step"], e["lr"]) for e in steps],
                    "train/examples_per_sec": [(e["step"], e["examples_per_sec"]) for e in steps],
                    "test/accuracy": [(e["step"], e["metrics"]["accuracy"]) for e in evals],
                    "test/loss": [(e["step"], e["metrics"]["loss"]) for e in evals]}
        assert sorted(board.Tags()["scalars"]) == sorted(expected)
        for tag, pairs in expected.items():
            got = [(s.step, s.value) for s in board.Scalars(tag)]
            assert got == [(step, float(np.float32(v))) for step, v in pairs], tag  # stored as float32
        assert sorted({step for step, _ in expected["test/accuracy"]}) == list(range(5, run["steps"] + 1, 5))


def test_staleness_and_dropped_gradients_reach_tensorboard_as_recorded(tmp_path):
    """The parameter-server family's fields, through the Reporter that writes the metrics file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from phalanx.train.report import Reporter

    reporter = Reporter(True, "none", str(tmp_path / "m.jsonl"), 10, 0, tensorboard=str(tmp_path / "tb"))
    for step in (2, 4):
        reporter.record("step", step=step, loss=1.0 / step, lr=0.1, examples_per_sec=100.0 * step,
                        staleness_mean=0.5 * step, staleness_p95=step, staleness_max=step + 1,
                        gradients_applied_total=3 * step, gradients_dropped_total=step - 1)
    reporter.record("eval", step=4, metrics={"mse": 0.25, "loss": 0.5}, held_out="validation")
    reporter.close()
    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    got = {tag: [(s.step, s.value) for s in board.Scalars(tag)] for tag in board.Tags()["scalars"]}
    assert got["staleness/mean"] == [(2, 1.0), (4, 2.0)] and got["staleness/max"] == [(2, 3.0), (4, 5.0)]
    assert got["gradients/dropped"] == [(2, 1.0), (4, 3.0)] and got["gradients/applied"] == [(2, 6.0), (4, 12.0)]
    assert got["validation/mse"] == [(4, 0.25)] and got["validation/loss"] == [(4, 0.5)]


@pytest.mark.slow
def test_without_the_tensorboard_package_one_line_names_the_extra_and_nothing_starts(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    for command in (["train", "--steps", "2"], ["compare", "--strategies", "sync", "--scenarios", "none"]):
        code, out = run_main([*command, "--tensorboard", "tb"], capsys)
        assert code == 2, out
        assert out.err.strip().splitlines() == ["error: --tensorboard tb needs the tensorboard package: pip install "
                                                "'phalanx[tensorboard]' (or drop --tensorboard)"]
    assert not list(tmp_path.iterdir())  # no checkpoint folder, no metrics file, no event file


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 10}, "steps= is set for each run by the comparison; give max_steps= instead"),
    ({"checkpoint_dir": "c"}, "checkpoint_dir= is set for each run by the comparison"),
    ({"colour": "red"}, "compare() has no setting colour=;"),
    ({"model": object()}, "model must be a torch.nn.Module or a factory that returns one"),
    ({"target": "f1>=0.5"}, "--target f1>=0.5: no metric is named f1"),
    ({"simulate_workers": (8, 64)}, "simulate_workers= are the worker counts of a simulation: add simulate=True"),
    ({"simulate": True, "workers": 2}, "workers=2 is a real comparison's worker count"),
    ({"repeats": 0}, "--repeats must be at least 1"),
    ({"strategies": 5}, "strategies=5: give a comma-separated string or a list"),
])
def test_bad_api_input_is_one_phalanx_error_before_any_run(kwargs, message, capsys):
    with pytest.raises(PhalanxError) as raised:
        phalanx.compare(**{"strategies": "sync", "scenarios": "none", **kwargs})
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert "phalanx compare:" not in capsys.readouterr().out  # refused before the header: nothing ran


@pytest.mark.slow
def test_estimate_on_a_model_object_measures_that_model(project):
    _, mymodel = project
    train, test = mymodel.load()
    net = mymodel.Net(input_shape=(64,), num_classes=10, hidden=48)
    # one machine per worker: a single measurement (one worker alone) serves every row
    est = phalanx.estimate(model=net, train_data=train, test_data=test, workers=(1, 4), per_node=1, strategy="sync",
                           link_bandwidth="1GB/s", link_latency="50us", measure_link=False, measure_steps=3,
                           batch_size=16, quiet=True)
    facts = est.to_dict()
    assert facts["parameters"] == sum(p.numel() for p in net.parameters()) == 64 * 48 + 48 + 48 * 10 + 10
    assert (facts["model"], facts["data"], facts["input_shape"]) == ("mymodel:Net", "your data", [64])
    assert [(p["strategy"], p["workers"]) for p in facts["predictions"]] == [("sync", 1), ("sync", 4)]
    assert est.table.startswith("phalanx estimate: mymodel:Net on your data (64), batch 16 per worker")
    with pytest.raises(PhalanxError, match=r"estimate\(\) has no setting colour="):
        phalanx.estimate(model=net, train_data=train, colour="red")


@pytest.mark.slow
def test_simulate_true_trains_the_given_model_as_the_real_sync_run_did(both, project):
    """The API's simulation learns from the very objects given: its sync at 2 workers follows the real run's curve
    (the simulation computes the real gradients; parameters equal to float rounding, see test_simulate)."""
    root = both[0]
    _, mymodel = project
    train, test = mymodel.load()
    torch.manual_seed(SEED)
    net = mymodel.Net(input_shape=(64,), num_classes=10)
    with contextlib.redirect_stdout(io.StringIO()):
        sim = phalanx.compare(model=net, train_data=train, test_data=test, strategies="sync", scenarios="none",
                              repeats=1, max_steps=20, eval_every=5, target=0.5, seed=SEED, simulate=True,
                              simulate_workers=[2], step_time="10ms", link_bandwidth="1GB/s", link_latency="50us")
    real = next(r for r in _report(root / "cli")["runs"] if r["strategy"] == "sync")
    simulated = sim.runs[2][0]
    assert (simulated.strategy, simulated.steps_to_target) == ("sync", real["steps_to_target"])
    # (a real run that reaches its target evaluates once more at that step, as its final evaluation)
    theirs = {p["step"]: p["accuracy"] for p in real["curve"]}
    assert [p["step"] for p in simulated.curve] == list(theirs)
    for ours in simulated.curve:
        assert ours["accuracy"] == pytest.approx(theirs[ours["step"]], abs=1.5 / len(test[1]))  # one test example
    assert sim.answer.startswith("Simulated: Under none, sync reaches 0.5 first")
