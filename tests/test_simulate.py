"""compare --simulate: the simulation learns what real runs learn, where its schedule is exact.

- simulated sync at W=2 ends with the parameters of a real single-process run on the global batch
  (same seed and steps), within 1e-5;
- a parameter server at W=2 on a deterministic schedule (equal step times, given link) has the
  staleness that schedule implies; a straggler makes the fast worker's gradients the fresh ones;
- parameter versions are freed as workers stop holding them;
- the CLI end to end on a tiny run: tables marked simulated, report, the worker-count plot; bad
  input (a real link scenario, a simulation flag without --simulate) is one line before anything runs.
All in-process: --step-time and --link-* given, so nothing is measured and no process starts.
"""

import json
import os

import pytest
import torch

from helpers import run_main
from phalanx import SSP, Backup, ParameterServer, Sync, TrainConfig, Trainer
from phalanx.costs import Link
from phalanx.simulate import simulated_rule
from phalanx.simulate.problem import build_problem
from phalanx.simulate.versions import Versions
from phalanx.simulate.world import World
from phalanx.train.checkpoint import load_checkpoint
from phalanx.train.straggle import Slowness

LINK = Link(1e-5, 1e-9, "given")


def problem(**train):
    config = TrainConfig(model="mlp", devices="cpu", batch_size=16, **train)
    return build_problem(config, (2,), None, 0.01, LINK, lambda line: None)


def simulate(options, workers=2, steps=10, slowness=None, target=1.01, **train):
    world = World(problem(**train), options, workers, slowness, 0, steps, steps, target)
    simulated_rule(options).run(options, world)
    world.finish()
    return world


def test_simulated_sync_ends_with_the_parameters_of_one_process_on_the_global_batch(tmp_path):
    world = simulate(Sync(), workers=2, steps=10)
    cfg = TrainConfig(model="mlp", devices="cpu", workers=1, batch_size=32, steps=10, checkpoint_dir=str(tmp_path),
                      progress="none")
    Trainer(cfg).fit()
    state = load_checkpoint(str(tmp_path))["model"]
    real = torch.cat([t.reshape(-1) for name, t in state.items()])
    assert world.final.shape == real.shape
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


def test_backup_averages_the_first_gradients_and_drops_the_stragglers():
    # Worker 2 (rank 3) is 3x as slow: every round takes the other two; each of its gradients arrives
    # after its round was applied and is dropped; nothing applied is stale.
    world = simulate(Backup(backup_workers=1), workers=3, steps=10, slowness=Slowness("slow", 3.0, rank=3))
    assert world.outcome.applied == 20 and set(world.staleness.counts) == {0}
    assert 2 <= world.outcome.dropped <= 4


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
    (["--step-time", "10ms"], "--step-time describes the simulated machines: add --simulate"),
    (["--workers", "2,4"], "--workers 2,4 lists several worker counts"),
    (["--simulate", "--strategies", "hogwild", *FAST], "hogwild has no simulated rule yet"),
    (["--simulate", "--workers", "2", "--strategies", "backup:2", *FAST], "backup:2 at 2 workers: --backup-workers 2"),
    (["--simulate", "--link-bandwidth", "1GB/s"], "--link-bandwidth needs --link-latency too"),
])
def test_bad_simulation_input_is_one_line_before_anything_runs(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["compare", *flags, "--out", "report"], capsys)
    assert code == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.err
    assert not os.listdir(tmp_path)


def test_compare_simulate_end_to_end(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["compare", "--simulate", "--workers", "4,8", "--strategies", "sync,ps", "--scenarios",
                          "none", "--repeats", "1", "--model", "mlp", "--batch-size", "8", "--max-steps", "30",
                          "--eval-every", "10", "--target", "0.5", *FAST, "--out", "report"], capsys)
    assert code == 0, out.err[-3000:]
    assert "=== 4 workers (simulated) ===" in out.out and "=== 8 workers (simulated) ===" in out.out
    assert "simulated: none (no straggler)" in out.out and "Simulated: Under none" in out.out
    report = tmp_path / "report"
    data = json.loads((report / "report.json").read_text())
    assert data["simulated"] and data["workers"] == [4, 8] and data["answer"]
    assert set(data["figures"]) == {"4", "8"}
    text = (report / "report.md").read_text()
    assert "compare --simulate" in text and "time-to-target-vs-workers.png" in text
    import matplotlib.image

    image = matplotlib.image.imread(report / "time-to-target-vs-workers.png")
    assert image.shape[1] == data["plot"]["width"] and image.shape[0] == data["plot"]["height"]
    per_count = (report / "workers-8" / "report.md").read_text()
    assert per_count.startswith("# phalanx compare --simulate") and "Every figure is simulated" in per_count


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
