"""local SGD and DiLoCo resume exactly between averagings (issue 40): a run stopped by Ctrl-C (a real SIGINT to
the job's process group) at a step that is no sync boundary, and a run resumed from a periodic checkpoint
between two, end with the parameters (and buffers) of the run left alone; what the resumed run prints at its
end is what ``phalanx evaluate`` finds in its checkpoint; on another worker count the run starts from the
replicas' average and says so.

Per strategy one run left alone, one resumed from its checkpoint of step 30, one stopped and resumed: 2 workers,
a BatchNorm model (buffers of each replica's own), H = 40 (averaging after steps 1 and 41). The stop agreement
stops at a check step, a multiple of 4 (``train/stop.py``), never a step after which an averaging (or, with two
fragments, DiLoCo's round of fragment 1 after step 21) comes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest
import torch

from helpers import BATCHNORM_NET, phalanx_cmd, run_in_process
from phalanx.checkpoint import read_entries
from phalanx.checkpoint import latest_checkpoint, load_checkpoint, tensors


H = 40
STRATEGIES = {"local-sgd": ["--strategy", "local-sgd", "--sync-every", str(H)],
              "diloco": ["--strategy", "diloco", "--sync-every", str(H), "--fragments", "2", "--outer-momentum", "0.5"]}
COMMON = ["--model", "replicanet:Net", "--devices", "cpu", "--workers", "2", "--steps", "60", "--batch-size", "16",
          "--log-every", "10", "--checkpoint-every", "30"]
FINAL = re.compile(r"^test (?P<figures>.+) after 60 steps$", re.M)


def _train(cwd, strategy, directory, *more):
    out = run_in_process("train", *COMMON, *STRATEGIES[strategy], "--checkpoint-dir", directory, *more, cwd=cwd)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _ctrl_c(cwd, args, after_line):
    """``phalanx *args`` in a session of its own, SIGINT to the whole group after ``after_line`` (as Ctrl-C)."""
    proc = subprocess.Popen(phalanx_cmd() + args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stdout:
        if line.startswith(after_line):
            os.killpg(proc.pid, signal.SIGINT)
            break
    out, err = proc.communicate(timeout=300)
    return proc.returncode, err


def _model(directory):
    return tensors(load_checkpoint(latest_checkpoint(directory)))["model"]


@pytest.fixture(scope="module", params=list(STRATEGIES))
def runs(request, tmp_path_factory):
    strategy, cwd = request.param, tmp_path_factory.mktemp(request.param)
    (cwd / "replicanet.py").write_text(BATCHNORM_NET)
    _train(cwd, strategy, "straight")
    # (its checkpoints written in the background: each rank's replica is a shard like fsdp's)
    periodic = _train(cwd, strategy, "periodic", "--resume", "straight/step-00000030.dcp", "--async-checkpoint")
    code, err = _ctrl_c(cwd, ["train", *COMMON, *STRATEGIES[strategy], "--checkpoint-dir", "stopped"], "step 10,")
    assert code == 130, err
    stop = int(re.search(r"^stopped at step (\d+) by SIGINT; checkpoint stopped/step-\d+\.dcp", err, re.M).group(1))
    stopped = read_entries(str(cwd / "stopped" / f"step-{stop:08d}.dcp"))  # (before the resume adds to it)
    resumed = _train(cwd, strategy, "stopped", "--resume")
    return strategy, cwd, stop, stopped, periodic, resumed


def _same(a, b):
    assert sorted(a) == sorted(b)
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= 1e-6, worst


@pytest.mark.slow
def test_a_resume_from_a_periodic_checkpoint_between_averagings_is_exact(runs):
    strategy, cwd, _, _, periodic, _ = runs
    assert "resuming at step 30" in periodic.stdout
    _same(_model(cwd / "straight"), _model(cwd / "periodic"))


@pytest.mark.slow
def test_ctrl_c_between_averagings_saves_every_replica_and_the_resume_is_exact(runs):
    strategy, cwd, stop, saved, _, _ = runs
    assert stop >= 10 and (stop - 1) % H and (strategy != "diloco" or (stop - 1 - H // 2) % H), stop
    replicas = saved["replicas"]
    assert sorted(replicas) == ["0", "1"]
    weight = "body.1.weight"
    assert not torch.equal(replicas["0"]["model"][weight], replicas["1"]["model"][weight])  # as they stopped
    if strategy == "local-sgd":  # the checkpoint's model, the one evaluated: the replicas' average
        torch.testing.assert_close(saved["model"][weight], (replicas["0"]["model"][weight] +
                                                            replicas["1"]["model"][weight]) / 2)
    else:  # the end's outer round was not taken: both fragments still owe theirs
        assert saved["diloco"]["unsynced"] == [0, 1]
    _same(_model(cwd / "straight"), _model(cwd / "stopped"))


@pytest.mark.slow
def test_the_resumed_run_prints_what_evaluate_finds_in_its_checkpoint(runs):
    _, cwd, _, _, _, resumed = runs
    printed = dict(pair.split(" ") for pair in FINAL.search(resumed.stdout).group("figures").split(", "))
    out = run_in_process("evaluate", "--checkpoint", str(latest_checkpoint(cwd / "stopped")), "--json", cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    evaluated = json.loads(out.stdout.strip().splitlines()[-1])["metrics"]
    assert sorted(evaluated) == sorted(printed)
    for name, value in evaluated.items():
        assert any(f"{value + d:.4f}" == printed[name] for d in (0.0, -1e-6, 1e-6)), (name, value, printed)


@pytest.mark.slow
def test_a_resume_on_another_worker_count_starts_from_the_average_and_says_so(runs):
    strategy, cwd, stop, saved, _, _ = runs
    if strategy != "local-sgd":
        pytest.skip("one strategy is enough: the rule is replica_state.read's")
    out = run_in_process("train", *COMMON, *STRATEGIES[strategy], "--workers", "1", "--steps", str(stop + 1),
                         "--checkpoint-dir", "one", "--resume", f"stopped/step-{stop:08d}.dcp", cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("local-sgd: the checkpoint holds 2 replicas of their own and this run has 1 worker: every worker starts "
            "from their average (the replicas continue exactly only on 2 workers)") in out.stdout
