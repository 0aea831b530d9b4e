"""phalanx compare: tokens and scenarios parsed with clear errors; the report's figures are the runs' own
(read back from each run's metrics file); the plots decode at their stated size; a run that cannot reach
its target is reported as such. Small runs only: 2 strategies, 1 scenario, 1 repeat, a few dozen steps."""

import json
import math
import os
import re
import signal
import subprocess

import pytest

from helpers import phalanx_cmd, run_in_process, run_main
from phalanx import SSP, Backup, LocalSGD, PhalanxError, TrainConfig
from phalanx.compare.options import CompareOptions
from phalanx.compare.setup import setup_from
from phalanx.compare.results import RunResult, figures, from_events
from phalanx.compare.runner import schedule
from phalanx.compare.tokens import parse_scenarios, parse_strategies


# ---- parsing (pure) ----

def test_strategy_tokens_carry_each_strategys_main_option():
    tokens = parse_strategies("sync,ps,ssp:2,local-sgd:8,hogwild,backup:1")
    assert [t.token for t in tokens] == ["sync", "ps", "ssp:2", "local-sgd:8", "hogwild", "backup:1"]
    assert tokens[2].options == SSP(staleness=2) and tokens[3].options == LocalSGD(sync_every=8)
    assert tokens[5].options == Backup(backup_workers=1)


@pytest.mark.parametrize("text, message", [
    ("sync,foo", "unknown strategy 'foo' in 'foo': choose one of sync, ps, ssp, backup"),
    ("ssp:-1", "strategy 'ssp:-1': --staleness must be 0 or more steps"),
    ("ssp:two", "strategy 'ssp:two': --staleness takes a whole number, got 'two'"),
    ("hogwild:2", "strategy 'hogwild:2': hogwild takes no option; write hogwild"),
    ("ssp:", "strategy 'ssp:': give --staleness after the colon"),
    ("sync,,ps", "has an empty entry"),
    ("ps,ps", "--strategies names ps twice"),
])
def test_bad_strategy_tokens_name_the_fix(text, message):
    with pytest.raises(PhalanxError, match=re.escape(message)):
        parse_strategies(text)


def test_scenarios():
    none, slow, pauses = parse_scenarios("none,slow:1:2,pauses:0.1:4")
    assert none.slowness is None and none.describe() == "no straggler"
    assert (slow.slowness.kind, slow.slowness.rank, slow.slowness.factor) == ("slow", 1, 2.0)
    assert (pauses.slowness.kind, pauses.slowness.probability, pauses.slowness.factor) == ("pauses", 0.1, 4.0)


@pytest.mark.parametrize("text, message", [
    ("slow:1", "'slow:1' is not none, slow:RANK:FACTOR or pauses:P:FACTOR"),
    ("fast:1:2", "'fast:1:2' is not none, slow:RANK:FACTOR or pauses:P:FACTOR"),
    ("pauses:1.5:4", "pauses:1.5:4: the probability of a pause must be in (0, 1]"),
    ("slow:1:0.5", "slow:1:0.5: the factor must be a number of at least 1"),
    ("none,none", "--scenarios names none twice"),
])
def test_bad_scenarios_name_the_fix(text, message):
    with pytest.raises(PhalanxError, match=re.escape(message)):
        parse_scenarios(text)


def test_runs_are_interleaved_and_each_repeat_has_its_own_seed():
    setup = setup_from(CompareOptions(strategies="sync,ps,hogwild", scenarios="none,slow:1:2", repeats=3),
                       TrainConfig(seed=10))
    runs = schedule(setup)
    assert len(runs) == 3 * 2 * 3
    first = [r.strategy.token for r in runs[:3]]
    second = [r.strategy.token for r in runs[6:9]]
    assert first == ["sync", "ps", "hogwild"] and second == ["ps", "hogwild", "sync"]  # the order rotates
    assert {r.seed for r in runs if r.repeat == 2} == {12}  # every strategy of a repeat: the same seed
    assert setup.max_steps == 600 and setup.eval_every == 30  # 2 x the cnn recipe's 300 steps; 20 evaluations


def test_a_strategy_that_missed_the_target_in_most_repeats_has_no_median_time():
    def run(reached, seconds=None, best=0.9):
        return RunResult("ps", "none", 0, 0, reached, False, 10 if reached else None, seconds,
                         320 if reached else None, best, best, 10, 1.0, 0.1, 3.0, 1.9, 100.0, None, None, {}, [], "m")
    assert figures([run(True, 2.0), run(False), run(True, 4.0)], 50).median_seconds == 4.0
    missed = figures([run(True, 2.0), run(False), run(False, best=0.93)], 50)
    assert math.isinf(missed.median_seconds) and missed.reached == 1 and missed.best_accuracy == 0.93


def test_an_evaluation_without_the_targets_metric_has_not_reached_it():
    """The first evaluation reports accuracy only: it is not compared with a loss target, and not a reach."""
    events = [{"event": "eval", "step": 5, "train_seconds": 1.0, "eval_seconds": 0.1, "metrics": {"accuracy": 0.5}},
              {"event": "eval", "step": 10, "train_seconds": 2.0, "eval_seconds": 0.1, "metrics": {"loss": 0.4}},
              {"event": "summary", "steps": 10, "train_seconds": 2.0, "eval_seconds": 0.2, "examples_per_sec": 50.0,
               "metrics": {"loss": 0.4}}]
    r = from_events(events, strategy="sync", scenario="none", repeat=0, seed=0, target="loss<=0.5", batch_size=8,
                    global_batch=16, wall_seconds=3.0, metrics="m")
    assert (r.steps_to_target, r.seconds_to_target, r.best, r.best_accuracy) == (10, 2.0, 0.4, None)


@pytest.mark.parametrize("flags, message", [
    (["--strategies", "ssp:-1"], "strategy 'ssp:-1': --staleness must be 0 or more steps"),
    (["--scenarios", "slow:5:2", "--workers", "2"],
     "sync under scenario slow:5:2: --straggler 5:2 names rank 5 but this run has ranks 0..1"),
    (["--strategies", "ps", "--scenarios", "slow:0:2"],
     "ps under scenario slow:0:2: --straggler 0:2 names the parameter server (rank 0), which computes no gradients"),
    (["--strategies", "backup:2", "--workers", "2"], "backup:2: --backup-workers 2 leaves no gradient to average"),
    (["--target", "1.5"], "--target 1.5: an accuracy is in (0, 1]"),
    (["--max-steps", "10", "--eval-every", "20"], "--eval-every 20 is more than --max-steps 10"),
    (["--momentum", "0.5", "--optimizer", "adam"], "--momentum applies to --optimizer sgd"),
    (["--strategies", ""], "--strategies '' has an empty entry"),  # not "the default strategies"
    (["--strategies", "sync,,ps"], "--strategies 'sync,,ps' has an empty entry"),
    (["--scenarios", ""], "--scenarios '' has an empty entry"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--max-steps", "-5"], "--max-steps must be at least 1"),
])
@pytest.mark.slow
def test_bad_input_is_one_line_before_any_run(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["compare", *flags, "--out", "report"], capsys)
    assert code == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.err
    assert not os.listdir(tmp_path)  # no report directory, nothing trained


def test_an_empty_out_folder_is_refused_not_ignored(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["compare", "--out", ""], capsys)
    assert code == 2 and out.err.strip().splitlines() == [out.err.strip()] and "--out '' names no folder" in out.err
    assert not os.listdir(tmp_path)


# ---- one small comparison (the command's main(): the installed command runs in the interrupted comparison below) ----

TARGET = 0.5


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    out = run_in_process("compare", "--strategies", "sync,ps", "--scenarios", "slow:1:2", "--repeats", "1",
                  "--workers", "2", "--max-steps", "60", "--eval-every", "5", "--target", str(TARGET),
                  "--out", "report", cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "report", out.stdout, json.loads((root / "report" / "report.json").read_text())


def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_the_reports_figures_are_the_ones_in_each_runs_metrics_file(comparison):
    out, _, report = comparison
    assert [(r["strategy"], r["scenario"]) for r in report["runs"]] == [("sync", "slow:1:2"), ("ps", "slow:1:2")]
    for run in report["runs"]:
        events = _events(out / run["metrics"])
        evals = [e for e in events if e["event"] == "eval"]
        summary = events[-1]
        first = next(e for e in evals if e["accuracy"] >= TARGET)
        assert run["reached"] and run["steps_to_target"] == first["step"]
        assert run["seconds_to_target"] == first["train_seconds"]
        assert run["curve"] == [{"step": e["step"], "seconds": e["train_seconds"], "accuracy": e["accuracy"]}
                                for e in evals]
        assert run["final_accuracy"] == summary["test_accuracy"] and run["steps"] == summary["steps"]
        assert (run["train_seconds"], run["eval_seconds"]) == (summary["train_seconds"], summary["eval_seconds"])
        # the run stopped at the first evaluation that reached the target
        assert summary["stopped_at_accuracy"] and summary["steps"] == first["step"] < 60
        assert 0 < run["startup_seconds"] < run["wall_seconds"]
        straggle = next(e for e in events if e["event"] == "straggle")
        assert run["calibrated_compute_s"] == straggle["calibrated_compute_s"]
        assert list(straggle["calibrated_compute_s"]) == ["1"]  # slow:1:2 calibrates rank 1 alone
    sync, ps = report["runs"]
    assert sync["examples_to_target"] == sync["steps_to_target"] * 64  # global batch 32 x 2
    assert sync["examples_per_sec"] == _events(out / sync["metrics"])[-1]["examples_per_sec"]
    ps_events = _events(out / ps["metrics"])
    ps_first = next(e for e in ps_events if e["event"] == "eval" and e["accuracy"] >= TARGET)
    assert ps["examples_to_target"] == ps_first["gradients_applied_total"] * 32 == ps["steps_to_target"] * 64
    assert ps["staleness"]["histogram"] == ps_events[-1]["staleness_histogram"]
    assert sync["staleness"] is None and ps["dropped"] is None  # ps drops nothing: no dropped column


@pytest.mark.slow
def test_the_tables_medians_and_ratios_come_from_the_runs(comparison):
    _, stdout, report = comparison
    rows = {f["strategy"]: f for f in report["figures"]["slow:1:2"]}
    runs = {r["strategy"]: r for r in report["runs"]}
    for name in ("sync", "ps"):
        assert rows[name]["median_seconds"] == runs[name]["seconds_to_target"]
        assert rows[name]["median_steps"] == runs[name]["steps_to_target"]
    assert rows["ps"]["ratio"] == pytest.approx(runs["ps"]["seconds_to_target"] / runs["sync"]["seconds_to_target"])
    winner = min(rows.values(), key=lambda f: f["median_seconds"])
    assert winner["winner"] and sum(f["winner"] for f in rows.values()) == 1
    assert re.search(rf"^\* {winner['strategy']} +\d+\.\d\d s +{winner['median_steps']} ", stdout, re.M), stdout
    assert f"**{winner['strategy']}** reached 0.5 first" in report["answer"]
    md = (comparison[0] / "report.md").read_text()
    assert report["answer"] in md and "| strategy | time to target (median, min-max) |" in md
    assert "## Machine and versions" in md and report["machine"]["torch"] in md


@pytest.mark.slow
def test_every_plot_decodes_as_an_image_of_the_stated_size(comparison):
    import matplotlib.image

    out, _, report = comparison
    files = {p["file"] for p in report["plots"]}
    assert files == {"accuracy-vs-time.png", "accuracy-vs-steps.png", "time-to-target.png", "staleness.png"}
    for plot in report["plots"]:
        image = matplotlib.image.imread(out / plot["file"])
        assert image.shape[:2] == (plot["height"], plot["width"]) and image.shape[2] in (3, 4), plot
        assert image.std() > 0  # something was drawn
        assert f"]({plot['file']})" in (out / "report.md").read_text()


@pytest.mark.slow
def test_a_run_that_cannot_reach_its_target_is_reported_as_not_reached(tmp_path):
    out = run_in_process("compare", "--strategies", "sync", "--scenarios", "none", "--repeats", "1", "--workers", "2",
                         "--max-steps", "10", "--eval-every", "5", "--target", "1.0", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    best = re.search(r"^  sync +not reached in 10 steps \(best (0\.\d\d)\)", out.stdout, re.M)
    assert best, out.stdout
    assert "no strategy reached 1 in 10 steps" in out.stdout
    assert re.search(r"run 1/1: sync under none, repeat 1: not reached \(best 0\.\d{3}\)", out.stderr)
    assert not os.listdir(tmp_path)  # without --out nothing is left behind


@pytest.mark.slow
def test_an_interrupted_comparison_writes_a_partial_report_marked_incomplete(tmp_path):
    """Ctrl-C reaches the compare process once run 1 of 2 has finished (while run 2 starts or trains).
    SIGTERM takes the same handler here and in the launcher; test_exit sends it to a job."""
    sig = signal.SIGINT
    proc = subprocess.Popen(phalanx_cmd() + ["compare", "--strategies", "sync,ps", "--scenarios", "none", "--repeats",
                                             "1", "--workers", "2", "--max-steps", "20", "--eval-every", "5",
                                             "--target", "0.999", "--out", "report"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stderr:  # the progress lines go to stderr when it is not a terminal
        if line.startswith("run 1/2: sync under none"):
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=300)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, err[-3000:]
    last = err.strip().splitlines()[-1]
    # A stop is not an error: its line is plain, as train's "stopped at step N by SIGINT" is.
    assert last.startswith(f"compare stopped by {name} during run 2/2 (ps under none, repeat 1); the partial "
                           "report of the 1 finished run(s), marked incomplete: report/report.md"), err[-3000:]
    assert "before the first step" not in err
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["incomplete"] == {"stopped_by": name, "interrupted_run": 2,
                                  "interrupted_label": "ps under none, repeat 1", "runs_finished": 1, "runs_planned": 2}
    assert [r["strategy"] for r in data["runs"]] == ["sync"]
    assert "**Incomplete**: stopped by" in (tmp_path / "report" / "report.md").read_text()
