"""Fast starts: workers forked by the fork server, the parent's imports, the start-up profile.

Real processes: the fork server is multiprocessing's own, the workers real gloo ranks.
"""

import json
import os
import subprocess
import sys

import torch

from helpers import run_cli, run_in_process, run_workers
from phalanx.checkpoint import load_checkpoint


def _environment_and_output(ctx, name):
    print(f"rank {ctx.rank} says hello", flush=True)
    return os.environ.get(name)


def test_a_worker_has_the_parents_environment_and_output_of_now_not_the_servers(capfd, monkeypatch):
    run_workers(_environment_and_output, 2, "PHALANX_TEST_LATE")  # the server is running after this
    monkeypatch.setenv("PHALANX_TEST_LATE", "set after the fork server started")
    assert run_workers(_environment_and_output, 2, "PHALANX_TEST_LATE") == "set after the fork server started"
    out = capfd.readouterr().out  # fds 1 and 2 as pytest holds them now: the workers wrote there
    assert out.count("rank 0 says hello") == 2 and out.count("rank 1 says hello") == 2, out


def test_the_cli_imports_no_torch_before_it_starts_the_worker_server():
    code = ("import sys; import phalanx, phalanx.cli, phalanx.launcher.forkserver, phalanx.launcher.env; "
            "print(sorted(m for m in ('torch', 'sklearn', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


def test_forked_and_spawned_workers_train_to_the_same_parameters_and_the_start_up_is_profiled(tmp_path):
    flags = ["train", "--steps", "6", "--model", "mlp", "--log-every", "3", "--profile-startup"]
    forked = run_cli(*flags, "--checkpoint-dir", "forked", cwd=tmp_path)
    spawned = subprocess.run([sys.executable, "-m", "phalanx", *flags, "--checkpoint-dir", "spawned"], cwd=tmp_path,
                             capture_output=True, text=True, env=dict(os.environ, PHALANX_START_METHOD="spawn"))
    assert forked.returncode == 0 and spawned.returncode == 0, forked.stderr + spawned.stderr
    a, b = load_checkpoint(tmp_path / "forked")["model"], load_checkpoint(tmp_path / "spawned")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    line = next(x for x in forked.stdout.splitlines() if x.startswith("start-up "))
    assert "to the first step: imports and the parent's checks" in line and "first training step +" in line, line
    summary = [json.loads(x) for x in open(tmp_path / "forked" / "metrics.jsonl")][-1]
    phases = summary["startup_seconds"]
    assert list(phases) == ["plan", "joined", "data", "model", "calibration", "strategy", "first_step"]
    assert all(b >= a for a, b in zip(phases.values(), list(phases.values())[1:])), phases  # in order, in time


def test_an_unknown_start_method_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_START_METHOD", "fork")
    out = run_in_process("train", "--steps", "1", "--model", "mlp", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: PHALANX_START_METHOD=fork is not a way to start workers: use one of "
                                  "forkserver, spawn, or unset it"), out.stderr
