"""The job's end: clean exits under every launcher, and a stop signal reaching any process (real processes, real signals)."""

import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import phalanx_cmd, run_and_signal, spawned_children
from phalanx.train.checkpoint import latest_checkpoint, load_checkpoint

#: What a C++ abort at exit leaves on stderr (std::terminate, torchrun's report, a c10 error).
CPP_TRACES = ("terminate called", "SIGABRT", "Exception raised from")
TINY = ["train", "--steps", "3", "--model", "mlp", "--progress", "none", "--checkpoint-dir", "ck"]
LONG = ["--steps", "1500", "--log-every", "20", "--checkpoint-every", "100"]


def _torchrun(cwd, *args, nproc=2, timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "phalanx", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.slow
def test_a_torchrun_job_exits_0_every_time_with_nothing_from_cpp(tmp_path):
    # The abort at exit came in 1 run of 5 to 15 (a gloo thread retiring the last collective during
    # interpreter teardown): 20 runs, two at a time (two 2-rank jobs fit the machine's cores).
    def one(i):
        cwd = tmp_path / f"run{i}"
        cwd.mkdir()
        return _torchrun(cwd, *TINY)

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(one, range(20)))
    bad = [(i, r.returncode, r.stderr[-1500:]) for i, r in enumerate(runs)
           if r.returncode != 0 or any(t in r.stderr for t in CPP_TRACES)]
    assert not bad, bad
    # Only rank 0 reports: one wall-time line per job, not one per rank.
    assert all(r.stdout.count("wall time") == 1 for r in runs), [r.stdout for r in runs]


@pytest.mark.slow
def test_a_torchrun_input_error_is_printed_once(tmp_path):
    run = _torchrun(tmp_path, "train", "--steps", "3", "--model", "mlp", "--batch-size", "0")
    assert run.returncode != 0
    assert run.stderr.count("error: ") == 1, run.stderr


def _ctrl_c(cwd, args, after_line, timeout=300):
    """Run ``phalanx *args`` in a session of its own (as a terminal does) and, after ``after_line``,
    send SIGINT to its whole process group: the parent and every worker get it, as from Ctrl-C."""
    proc = subprocess.Popen(phalanx_cmd() + args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(after_line):
            os.killpg(proc.pid, signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=timeout)
    return proc.returncode, "".join(lines) + rest, err


def _stopped_with_checkpoint(code, err, cwd, signame, after):
    """The job stopped together at one step, saved that step, and said so once; returns the step."""
    assert code == 128 + getattr(signal, signame), err
    found = re.search(rf"^stopped at step (\d+) by {signame}; checkpoint (checkpoints/step-(\d+)\.pt); continue with: ",
                      err, re.M)  # (a progress bar draws on stderr before it)
    assert found and found.group(1).lstrip("0") == found.group(3).lstrip("0"), err
    assert err.count("stopped at step") == 1
    step = int(found.group(1))
    assert step > after and load_checkpoint(latest_checkpoint(cwd / "checkpoints"))["step"] == step
    assert not any(t in err for t in CPP_TRACES + ("Traceback", "leaked semaphore")), err
    return step


@pytest.mark.parametrize("strategy", ["sync", "fsdp"])
def test_ctrl_c_to_the_process_group_stops_at_one_step_and_saves_it(strategy, tmp_path):
    # --progress bar with output not on a terminal: no leaked-semaphore warning either.
    code, out, err = _ctrl_c(tmp_path, ["train", "--strategy", strategy, *LONG, "--progress", "bar"], "step 240,")
    _stopped_with_checkpoint(code, err, tmp_path, "SIGINT", 240)


@pytest.mark.parametrize("strategy, signal_", [("sync", signal.SIGTERM), ("pipeline", signal.SIGINT)])
def test_a_signal_to_one_worker_stops_the_whole_job_at_one_step(strategy, signal_, tmp_path):
    code, out, err = run_and_signal(["train", "--strategy", strategy, *LONG], tmp_path, "step 240,", signal_, rank=1)
    _stopped_with_checkpoint(code, err, tmp_path, signal_.name, 240)


# ---- torchrun elastic: a node lost, then a node back ----

def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(cwd, port, host, log):
    """One torchrun agent of an elastic job on loopback (one worker), in a session of its own (a "node")."""
    # read_timeout: the rendezvous store's (60 s by default), which a loaded machine can exceed while
    # a joining agent starts; the job would then end inside torchrun, not inside phalanx.
    conf = f"is_host={int(host)},last_call_timeout=1,join_timeout=120,read_timeout=300"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", conf, "--max-restarts",
           "3", "--monitor-interval", "0.5", "-m", "phalanx", "train", "--model", "mlp", "--steps", "6000",
           "--checkpoint-every", "50", "--log-every", "50", "--progress", "lines"]
    return subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _wait_for(predicate, survivor, log, timeout=180):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline and survivor.poll() is None, log()[-3000:]
        time.sleep(0.1)


@pytest.mark.slow
def test_torchrun_elastic_shrinks_when_a_node_dies_and_grows_back_when_one_joins(tmp_path):
    port = _free_port()
    logs = [open(tmp_path / f"agent{i}.log", "w+") for i in range(3)]
    text = lambda i: (tmp_path / f"agent{i}.log").read_text()  # noqa: E731
    survivor = _agent(tmp_path, port, True, logs[0])
    lost = _agent(tmp_path, port, False, logs[1])
    joining = None
    try:
        _wait_for(lambda: re.search(r"^step 100,", text(0) + text(1), re.M), survivor, lambda: text(0))
        # The node dies: its agent and its worker at once (torchrun starts each worker in a session of its own).
        for pid in [lost.pid] + spawned_children(lost.pid, "phalanx"):
            os.kill(pid, signal.SIGKILL)
        lost.wait()
        # The survivor's agent restarts its worker on the smaller world; phalanx resumes from its newest checkpoint.
        _wait_for(lambda: re.search(r"world size 1, .*resuming at step \d+", text(0)), survivor, lambda: text(0))
        joining = _agent(tmp_path, port, False, logs[2])  # a node comes back: the job grows at the next restart
        _wait_for(lambda: re.search(r"world size 2, .*resuming at step \d+", text(0) + text(2)), survivor,
                  lambda: text(0))
        assert survivor.wait(timeout=300) == 0, text(0)[-3000:]
        assert joining.wait(timeout=300) == 0, text(2)[-3000:]
    finally:
        for proc in (survivor, lost, joining):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))["step"] == 6000
    # (torch logs the lost node's broken connections itself; what must not happen is an abort)
    assert "terminate called" not in text(0) + text(2), text(0)[-3000:]
