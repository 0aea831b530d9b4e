"""compare --simulate: the simulation learns what real runs learn, where its schedule is exact.

- simulated sync at W=2 ends with the parameters of a real single-process run on the global batch
  (same seed and steps), within 1e-5, and so do sync at W=3 and DiLoCo at W=2 with real gloo workers;
- a parameter server at W=2 on a deterministic schedule (equal step times, given link) has the
  staleness that schedule implies; a straggler makes the fast worker's gradients the fresh ones;
- parameter versions are freed as workers stop holding them;
- an evaluation is a real one: a simulated regression's metrics (mae, a user's own, the loss) at every
  evaluation equal a real one-process run's, and a ``loss<=`` target stops it at the same evaluation;
- the race (a run stops once it cannot be first) finds the winner and its time that running every
  strategy to the end finds, and stops the others past that time;
- the CLI end to end on a tiny run (to a perplexity target): tables marked simulated, report, the
  worker-count plot; bad input (a real link scenario, a simulation flag without --simulate, a target
  no metric reaches) is one line before anything runs.
--step-time and --link-* given, so nothing is measured; only the real multi-process runs start processes.
"""

import dataclasses
import json
import math
import os

import pytest
import torch

from helpers import run_main
from phalanx import SSP, Backup, DiLoCo, ParameterServer, Sync, TrainConfig, Trainer
from phalanx.costs import Link
from phalanx.simulate import simulated_rule
from phalanx.compare.simulated import deadline
from phalanx.compare.simulated_problem import build_problem
from phalanx.simulate.versions import Versions
from phalanx.simulate.world import World
from phalanx.checkpoint import load_checkpoint, tensors
from phalanx.task.models import mlp
from phalanx.scenarios.straggle import Slowness

LINK = Link(1e-5, 1e-9, "given")


def problem(**train):
    config = TrainConfig(model="mlp", devices="cpu", batch_size=16, **train)
    return build_problem(config, (2,), None, 0.01, LINK, lambda line: None)


def simulate(options, workers=2, steps=10, slowness=None, target=None, seed=0, **train):
    world = World(problem(**train), options, workers, slowness, seed, steps, steps, target)
    simulated_rule(options).run(options, world)
    world.finish()
    return world


def test_simulated_sync_ends_with_the_parameters_of_one_process_on_the_global_batch(tmp_path):
    """At a repeat's seed (compare's repeat r runs seed + r), not only the comparison's: the model, the split
    and the order of the batches are all the run's own."""
    world = simulate(Sync(), workers=2, steps=10, seed=3)
    cfg = TrainConfig(model="mlp", devices="cpu", workers=1, batch_size=32, steps=10, checkpoint_dir=str(tmp_path),
                      progress="none", seed=3)
    Trainer(cfg).fit()
    state = load_checkpoint(str(tmp_path))["model"]
    real = torch.cat([t.reshape(-1) for name, t in state.items()])
    assert world.final.shape == real.shape
    assert torch.allclose(world.final, real, atol=1e-5, rtol=0), (world.final - real).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("options, workers, steps", [(Sync(), 3, 10), (DiLoCo(sync_every=8), 2, 16)],
                         ids=["sync-3-workers", "diloco-2-workers"])
def test_the_simulation_ends_with_the_parameters_of_a_real_multi_process_run(options, workers, steps, tmp_path):
    """Against real gloo workers: 3 shards of the 1,437 digits (which do not split evenly), and DiLoCo's
    outer rounds (after steps 1 and 9, and the last)."""
    world = simulate(options, workers=workers, steps=steps)
    cfg = TrainConfig(model="mlp", devices="cpu", workers=workers, batch_size=16, steps=steps, strategy=options,
                      checkpoint_dir=str(tmp_path), progress="none")
    Trainer(cfg).fit()
    # (diloco's checkpoint on 2 workers is sharded, each replica's own state beside the global model, and read
    # back by name: in the model's own order here, as the simulation flattens it)
    saved = tensors(load_checkpoint(str(tmp_path)))["model"]
    real = torch.cat([saved[name].reshape(-1) for name in mlp((8, 8), 10).state_dict()])
    assert torch.allclose(world.final, real, atol=1e-5, rtol=0), (world.final - real).abs().max()


def test_ps_at_two_workers_has_the_staleness_its_schedule_implies():
    # Equal step times: worker 0's push lands first (version 0, nothing applied yet: 0 behind); from
    # then on each worker's gradient was computed before the other's last update: 1 behind, always.
    world = simulate(ParameterServer(), workers=2, steps=10)
    assert dict(world.staleness.counts) == {0: 1, 1: 19}
    assert world.outcome.applied == 20 and world.outcome.dropped == 0


def test_a_straggler_makes_the_other_workers_gradients_stale_and_bounded_by_ssp():
    slow = Slowness("slow", 4.0, rank=1)  # rank 1 is worker 0 (rank 0 is the server)
    ps = simulate(ParameterServer(), workers=2, steps=20, slowness=slow)
    ssp = simulate(SSP(staleness=1), workers=2, steps=20, slowness=slow)
    assert max(ps.staleness.counts) >= 3  # the slow worker's gradients: several of the fast one's updates behind
    assert max(ssp.staleness.counts) < max(ps.staleness.counts)  # the gate holds the fast worker back
    assert ssp.outcome.seconds > ps.outcome.seconds  # ...which costs time


def test_local_sgd_waits_at_each_averaging_for_the_lead_real_workers_jitter_into():
    # The measured step is a mean; the measured wait at a meeting (after MEETING_AFTER = 8 steps apart)
    # is charged at each averaging, so 16 steps take what the cost model's 16 steps take (its 2
    # averagings, after steps 1 and 9), plus the run's last averaging (of steps 10-16), a third...
    from phalanx import LocalSGD
    from phalanx.costs.inputs import meeting_wait

    jitter = problem()
    jitter.compute = dataclasses.replace(jitter.compute, meeting_wait=2e-3)
    world = World(jitter, LocalSGD(sync_every=8), 2, None, 0, 16, 16, None)
    simulated_rule(world.options).run(world.options, world)
    predicted = world.prediction()
    assert predicted.parts["meeting_wait"] == meeting_wait(jitter.compute, 8) == 2e-3
    one_meeting = 8 * (predicted.step - jitter.compute.step)  # what the cost model spreads over 8 steps
    assert world.outcome.seconds == pytest.approx(16 * predicted.step + one_meeting)
    # ...and a straggler's lead beyond it is waited for instead, not on top of it: at each of the 3
    # meetings its lead (1, 8 and 7 steps of sleep) instead of the wait
    slow = Slowness("slow", 2.0, rank=0)
    late = World(jitter, LocalSGD(sync_every=8), 2, slow, 0, 16, 16, None)
    simulated_rule(late.options).run(late.options, late)
    sleep = late.compute_seconds  # the straggler's sleep per step
    assert late.outcome.seconds == pytest.approx(world.outcome.seconds + 16 * sleep - 3 * 2e-3)


def test_backup_averages_the_first_gradients_and_drops_the_stragglers():
    # Worker 2 (rank 3) is 3x as slow: every round takes the other two; each of its gradients arrives
    # after its round was applied and is dropped; nothing applied is stale.
    world = simulate(Backup(backup_workers=1), workers=3, steps=10, slowness=Slowness("slow", 3.0, rank=3))
    assert world.outcome.applied == 20 and set(world.staleness.counts) == {0}
    assert 2 <= world.outcome.dropped <= 4


def test_workers_steps_jitter_by_the_measured_spread_so_who_arrives_first_varies():
    """Seen: simulated backup:1 at 2 equal workers always took worker 0's gradient and dropped worker 1's (a
    tie, broken the same way every round), so it learnt from one shard and needed 75 steps where real runs,
    whose arrivals vary, needed 55. A worker's step now varies by the spread measured with it."""
    from statistics import fmean, pstdev

    even = simulate(Backup(backup_workers=1), workers=2, steps=20)
    assert even.outcome.dropped_by == {"2": even.outcome.dropped}  # no spread measured: always the same loser
    jitter = problem()
    step = jitter.compute.step
    # the slowest of 2 workers 1 ms over the mean step on average: a spread of 1 ms / E[max of 2 normals]
    jitter.compute = dataclasses.replace(jitter.compute, processes=2, slowest=step + 1e-3)
    spread = 1e-3 / (1 / math.sqrt(math.pi))
    assert jitter.compute.step_spread() == pytest.approx(spread)
    world = World(jitter, Backup(backup_workers=1), 2, None, 0, 20, 20, None)
    for cycle in (step, 10 * spread):  # a spread larger than the step, as a ps round trip's can be: still mean 0
        draws = [world.jitter(w, k, cycle, spread) for w in range(2) for k in range(4000)]
        assert abs(fmean(draws)) < 0.05 * spread and pstdev(draws) == pytest.approx(spread, rel=0.15)
        assert min(draws) > -cycle  # a step never takes negative time
    again = World(jitter, Sync(), 2, None, 0, 20, 20, None)
    assert world.jitter(1, 7, step, spread) == again.jitter(1, 7, step, spread)  # pure
    simulated_rule(world.options).run(world.options, world)
    assert set(world.outcome.dropped_by) == {"1", "2"}  # both workers lose some rounds


def test_versions_are_shared_counted_and_freed():
    versions = Versions()
    flat = torch.zeros(3)
    versions.add(flat, 0)
    versions.add(None, 0)  # a second holder shares the copy
    versions.add(torch.ones(3), 1)
    assert len(versions) == 2 and versions.get(0) is flat
    versions.release(0)
    assert versions.has(0)
    versions.release(0)
    versions.release(1)
    assert len(versions) == 0 and versions.peak == 2
    world = simulate(ParameterServer(), workers=8, steps=5)
    assert len(world.versions) == 0 and 1 <= world.versions.peak <= 8


FAST = ["--step-time", "10ms", "--link-bandwidth", "1GB/s", "--link-latency", "10us"]


@pytest.mark.parametrize("flags, message", [
    (["--simulate", "--scenarios", "link:50mbit", *FAST],
     "--scenarios link:50mbit is a real shaped link and --simulate runs no process: give the simulated link with "
     "--link-bandwidth"),
    (["--step-time", "10ms"], "--step-time is a flag of the simulation: add --simulate"),
    (["--workers", "2,4"], "--workers 2,4 lists several worker counts"),
    (["--simulate", "--strategies", "hogwild", *FAST], "hogwild has no simulated rule yet"),
    (["--simulate", "--workers", "2", "--strategies", "backup:2", *FAST], "backup:2 at 2 workers: --backup-workers 2"),
    (["--simulate", "--link-bandwidth", "1GB/s"], "--link-bandwidth needs --link-latency too"),
    (["--simulate", "--target", "f1>=0.8", *FAST], "--target f1>=0.8: no metric is named f1"),
    (["--simulate", "--target", "loss>=0.3", *FAST], "a lower loss is better"),
])
def test_bad_simulation_input_is_one_line_before_anything_runs(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["compare", *flags, "--out", "report"], capsys)
    assert code == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.err
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_compare_simulate_end_to_end(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["compare", "--simulate", "--workers", "4,8", "--strategies", "sync,ps", "--scenarios",
                          "none", "--repeats", "1", "--model", "mlp", "--batch-size", "8", "--max-steps", "30",
                          "--eval-every", "10", "--target", "perplexity<=3", *FAST, "--out", "report"], capsys)
    assert code == 0, out.err[-3000:]
    assert "=== 4 workers (simulated) ===" in out.out and "=== 8 workers (simulated) ===" in out.out
    assert "simulated: none (no straggler): time to test perplexity<=3" in out.out, out.out
    assert "Simulated: Under none" in out.out and "reaches perplexity<=3 first" in out.out
    report = tmp_path / "report"
    data = json.loads((report / "report.json").read_text())
    assert data["simulated"] and data["workers"] == [4, 8] and data["answer"]
    assert set(data["figures"]) == {"4", "8"}
    text = (report / "report.md").read_text()
    assert "compare --simulate" in text and "time-to-target-vs-workers.png" in text
    assert "How it was validated: phalanx's benchmarks/simulate.py" in text and data["validated"] in text
    import matplotlib.image

    image = matplotlib.image.imread(report / "time-to-target-vs-workers.png")
    assert image.shape[1] == data["plot"]["width"] and image.shape[0] == data["plot"]["height"]
    per_count = (report / "workers-8" / "report.md").read_text()
    assert per_count.startswith("# phalanx compare --simulate") and "Every figure is simulated" in per_count


@pytest.mark.slow
def test_a_stopped_simulation_reports_the_worker_counts_and_runs_that_finished(capsys, tmp_path, monkeypatch):
    """SIGINT or SIGTERM (here: the Stopped its handler raises, in the last run) ends the simulation with the
    report of what finished: the worker count done in full at the top, the runs of the next in its own report,
    both marked incomplete; exit 130 with one line saying where."""
    from phalanx.compare import simulated
    from phalanx.errors import Stopped

    real, calls = simulated.run_one, []

    def stopped_in_the_last(*args, **kwargs):
        calls.append(args[2].label)
        if len(calls) == 4:
            raise Stopped("stopped by SIGINT", "SIGINT")
        return real(*args, **kwargs)

    monkeypatch.setattr(simulated, "run_one", stopped_in_the_last)
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["compare", "--simulate", "--workers", "2,4", "--strategies", "sync,ps", "--scenarios",
                          "none", "--repeats", "1", "--model", "mlp", "--batch-size", "8", "--max-steps", "20",
                          "--eval-every", "10", "--target", "0.999", *FAST, "--out", "report"], capsys)
    assert code == 130, out.err[-3000:]
    assert out.err.strip().splitlines()[-1] == (
        "compare --simulate stopped by SIGINT during run 4/4 (ps under none at 4 workers, repeat 1); the partial "
        "report of the 3 finished run(s), marked incomplete: report/report.md")
    assert "=== 2 workers (simulated) ===" in out.out and "=== 4 workers" not in out.out
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["incomplete"]["runs_finished"] == 3 and data["workers"] == [2] and set(data["figures"]) == {"2"}
    assert "**Incomplete**: stopped by SIGINT during run 4 of 4" in (tmp_path / "report" / "report.md").read_text()
    whole = json.loads((tmp_path / "report" / "workers-2" / "report.json").read_text())
    assert "incomplete" not in whole and len(whole["runs"]) == 2
    part = json.loads((tmp_path / "report" / "workers-4" / "report.json").read_text())
    assert part["incomplete"]["runs_finished"] == 1 and [r["strategy"] for r in part["runs"]] == ["sync"]


@pytest.mark.slow
@pytest.mark.parametrize("signal_name, at_run, finished", [("SIGTERM", 1, 0), ("SIGINT", 2, 1), ("SIGHUP", 3, 2)])
def test_a_real_signal_stops_the_simulation_at_any_run_with_what_finished(signal_name, at_run, finished, capsys,
                                                                           tmp_path, monkeypatch):
    """The signal itself (os.kill of this process), sent from inside a gradient of run ``at_run`` (inside the
    vmap that an ``except Exception`` fallback guards, which swallowed the raising handler's Stopped: the runs
    went on, exit 0, a report not marked incomplete): the simulation stops at that run's next step, writes
    what finished marked incomplete, and exits 128 + the signal. Run 2 is the first of a scenario, so its
    worker count's report holds a scenario with no finished run (an IndexError once)."""
    import signal

    from phalanx.compare import simulated
    from phalanx.simulate.gradients import Gradients

    real_run, real_loss, runs, sent = simulated.run_one, Gradients._loss, [], []

    def counted(*args, **kwargs):
        runs.append(args[2].label)
        return real_run(*args, **kwargs)

    def loss(self, flat, batch):
        if len(runs) == at_run and not sent:
            sent.append(os.kill(os.getpid(), getattr(signal, signal_name)))
        return real_loss(self, flat, batch)

    monkeypatch.setattr(simulated, "run_one", counted)
    monkeypatch.setattr(Gradients, "_loss", loss)
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["compare", "--simulate", "--workers", "2", "--strategies", "ps", "--scenarios",
                          "none,slow:1:2", "--repeats", "2", "--model", "mlp", "--batch-size", "8", "--max-steps",
                          "10", "--eval-every", "5", "--target", "0.999", *FAST, "--out", "report"], capsys)
    assert code == 128 + getattr(signal, signal_name), out.err[-3000:]
    assert len(runs) == at_run and "Traceback" not in out.err
    last = out.err.strip().splitlines()[-1]
    assert last.startswith(f"compare --simulate stopped by {signal_name} during run {at_run}/4 "), last
    if not finished:
        assert last.endswith("no report was written (no --out, or no run finished); the tables above hold the "
                             "worker counts that finished") and not (tmp_path / "report" / "report.md").exists()
        return
    assert last.endswith(f"the partial report of the {finished} finished run(s), marked incomplete: report/report.md")
    part = json.loads((tmp_path / "report" / "workers-2" / "report.json").read_text())
    assert part["incomplete"]["runs_finished"] == finished and part["incomplete"]["stopped_by"] == signal_name
    assert [r["scenario"] for r in part["runs"]] == ["none"] * finished
    assert "no run finished" in (tmp_path / "report" / "workers-2" / "report.md").read_text()


USER_MODULE = '''
import torch
from torch import nn


class Net(nn.Module):  # a forward of its own: no sequential structure
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.hidden, self.out = nn.Linear(input_shape[-1], 32), nn.Linear(32, num_classes)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x.flatten(1))))


def load():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return (x[:500], y[:500]), (x[500:], y[500:])
'''


def test_a_users_own_model_without_sequential_structure_is_simulated(capsys, tmp_path, monkeypatch):
    (tmp_path / "usermodel.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["compare", "--simulate", "--workers", "4", "--strategies", "sync,local-sgd:4", "--scenarios",
                          "none", "--repeats", "1", "--model", "usermodel:Net", "--data", "usermodel:load",
                          "--batch-size", "16", "--max-steps", "60", "--eval-every", "10", "--target", "0.8", *FAST],
                         capsys)
    assert code == 0, out.err[-3000:]
    assert "usermodel:Net on usermodel:load" in out.out and "reaches 0.8 first" in out.out, out.out


# --------------------------------------------------------------------------- any metric, as a real run evaluates it

REGRESSION_MODULE = '''
import torch
from torch import nn


def load():  # float targets: a regression, MSE its loss
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 5, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.1 * torch.randn(400, generator=g)
    return (x[:300], y[:300]), (x[300:], y[300:])


def net(input_shape, num_classes):
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def worst(outputs, targets):  # a user's metric: the mean cubed absolute error
    error = (outputs.reshape(targets.shape) - targets).abs()
    return (error ** 3).sum(), targets.numel()
'''
PROBLEM = dict(model="simreg:net", data="simreg:load", devices="cpu", optimizer="sgd", lr=0.05, momentum=0.0,
               metric="mae,simreg:worst")
EVERY, STEPS = 4, 12


@pytest.fixture(scope="module")
def regression(tmp_path_factory):
    """The regression module importable, and a real one-process run on the global batch (2 x 16), evaluated
    every EVERY steps: the reference every simulated evaluation is held to."""
    folder = tmp_path_factory.mktemp("simreg")
    (folder / "simreg.py").write_text(REGRESSION_MODULE)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        cfg = TrainConfig(workers=1, batch_size=32, steps=STEPS, eval_every=EVERY, checkpoint_dir=str(folder / "ck"),
                          progress="none", **PROBLEM)
        Trainer(cfg).fit()
        events = [json.loads(line) for line in open(cfg.metrics)]
        yield {e["step"]: e["metrics"] for e in events if e["event"] == "eval"}


def test_a_simulated_evaluation_is_a_real_evaluation_of_the_same_parameters(regression):
    config = TrainConfig(batch_size=16, **PROBLEM)
    world = World(build_problem(config, (2,), None, 0.01, LINK, lambda line: None), Sync(), 2, None, 0, STEPS, EVERY,
                  None)
    simulated_rule(Sync()).run(Sync(), world)
    out = world.finish()
    assert [p["step"] for p in out.curve] == sorted(regression) == [4, 8, 12]
    for point, values in zip(out.curve, out.values):
        real = regression[point["step"]]
        assert list(values) == list(real) == ["mae", "worst", "loss"]  # the run's metrics, the loss after them
        assert values == pytest.approx(real, rel=1e-5), point["step"]
    assert out.values[-1]["loss"] < 0.5 * out.values[0]["loss"]  # it learns: the values are not all alike


def test_a_loss_target_stops_the_simulation_where_the_real_evaluation_reaches_it(regression):
    from phalanx.compare.options import CompareOptions
    from phalanx.compare.setup import setup_from
    from phalanx.compare.simulated import simulate_compare
    from phalanx.simulate.options import SimulateOptions

    # Between the real loss at step 4 and at step 8: reached at the evaluation of step 8, not before.
    goal = (regression[4]["loss"] + regression[8]["loss"]) / 2
    options = CompareOptions(strategies="sync", target=f"loss<={goal:.6f}", scenarios="none", repeats=1,
                             max_steps=STEPS, eval_every=EVERY)
    setup = setup_from(options, TrainConfig(batch_size=16, **PROBLEM))
    sim = SimulateOptions(simulate=True, step_time=0.01, link_bandwidth=1e9, link_latency=1e-5)
    _, results = simulate_compare(setup, (2,), sim, lambda line: None)
    (run,) = results[2]
    assert run.reached and run.steps_to_target == 8 and run.metric == "loss" and not run.higher
    assert [p["step"] for p in run.curve] == [4, 8]  # it stopped there, as a real run stops
    assert run.best == run.final == pytest.approx(regression[8]["loss"], rel=1e-5)
    assert run.best_accuracy is None  # a regression reports no accuracy


@pytest.mark.slow
def test_the_race_stops_the_slower_strategies_and_finds_the_same_winner_in_the_same_time():
    from phalanx.compare import report
    from phalanx.compare.options import CompareOptions
    from phalanx.compare.setup import setup_from
    from phalanx.compare.simulated import simulate_compare
    from phalanx.compare.simulated_report import tables
    from phalanx.simulate.options import SimulateOptions

    options = CompareOptions(strategies="sync,local-sgd:4,ps", target="0.9", scenarios="slow:1:2", repeats=1,
                             max_steps=150, eval_every=10)
    setup = setup_from(options, TrainConfig(model="mlp", devices="cpu", batch_size=8))
    found = {}
    for race in (True, False):
        sim = SimulateOptions(simulate=True, step_time=0.01, link_bandwidth=1e9, link_latency=1e-5, race=race)
        order = []
        _, results = simulate_compare(setup, (4, 8), sim, lambda line: None,
                                      lambda i, total, run, result: order.append((run.workers, run.strategy.token)))
        rows = {n: {f.strategy: f for f in t["slow:1:2"]} for n, t in tables(setup, results).items()}
        found[race] = (order, results, rows)
    (order, raced, table), (_, full, every) = found[True], found[False]
    assert order[:3] == [(4, "sync"), (4, "local-sgd:4"), (4, "ps")]  # as given at the first count
    assert order[3][1] == next(s for s, f in table[4].items() if f.winner)  # then the last count's winner first
    for n in (4, 8):
        (winner,) = [s for s, f in every[n].items() if f.winner]
        assert table[n][winner].winner and table[n][winner].median_seconds == every[n][winner].median_seconds
        for strategy, f in table[n].items():
            if f.behind is None:  # run to the end: the very same figures
                assert f.median_seconds == every[n][strategy].median_seconds
            else:  # stopped past the fastest time found before it, which it would not have beaten
                assert every[n][winner].median_seconds <= f.behind < every[n][strategy].median_seconds
                assert report.time_cell(f) == f"> {report.seconds(f.behind)} (stopped; best {report.best(f)})"
    stopped = [(r, s) for r in raced[8] for s in full[8] if r.stopped_behind and r.strategy == s.strategy]
    assert stopped and all(r.steps < s.steps for r, s in stopped)  # the race computed fewer steps
    assert deadline(1.5, 3) == 1.5 and deadline(1.5, 2) == 3.0  # an even median: the mean of the middle two


def test_a_server_beside_the_workers_is_read_from_the_layouts():
    # compare --simulate then measures a parameter server's round trip with it, as the estimate does
    from phalanx.compare.options import CompareOptions
    from phalanx.compare.setup import setup_from
    from phalanx.compare.simulated import beside

    train = TrainConfig(model="mlp", devices="cpu", batch_size=16)
    for strategies, expected in (("sync,local-sgd:4,diloco:4", 0), ("sync,ps,backup:1", 1)):
        assert beside(setup_from(CompareOptions(strategies=strategies), train), (2, 8)) == expected
