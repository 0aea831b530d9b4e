"""The one helper every multi-process test uses: spawn gloo workers on 127.0.0.1.

It is phalanx's own launcher (a TCPStore on a kernel-chosen loopback port, spawned processes,
the first failing worker's traceback raised in the test), so the tests exercise the real path.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from phalanx.launcher import WorkerContext, launch

REPO = Path(__file__).resolve().parents[1]

#: a user's model file (``--model NAME:Net``) with buffers: BatchNorm's running statistics and its step count
BATCHNORM_NET = '''
import numpy as np
from torch import nn


class Net(nn.Module):
    """BatchNorm between two layers: running statistics and a step count as buffers."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 32), nn.BatchNorm1d(32),
                                  nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.body(x)
'''


def run_workers(fn: Callable[..., Any], n: int, *args: Any) -> Any:
    """Run ``fn(ctx, *args)`` on ``n`` CPU workers; return rank 0's result."""
    return launch(fn, [torch.device("cpu")] * n, args, timeout_s=60)


def run_main(argv: list[str], capsys) -> tuple[Any, Any]:
    """``phalanx *argv`` in this process: (exit status, pytest's captured output)."""
    from phalanx.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage errors exit directly
        code = e.code
    return code, capsys.readouterr()


def gather(ctx: WorkerContext, value: Any) -> list:
    """Every rank's ``value``, in rank order (on every rank)."""
    if not ctx.distributed:
        return [value]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def phalanx_cmd() -> list[str]:
    """The installed ``phalanx`` console script (the tests run what users run)."""
    exe = shutil.which("phalanx")
    assert exe, "the phalanx command is not installed: run the README's setup command"
    return [exe]


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(phalanx_cmd() + list(args), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def only_run(cwd: Path) -> Path:
    """The run directory that a run without --checkpoint-dir made in ``cwd`` (``runs/<strategy>-<n>``): the one
    there, so that a test also checks that a run wrote nowhere else."""
    runs = sorted(p for p in (cwd / "runs").iterdir() if p.is_dir()) if (cwd / "runs").is_dir() else []
    assert len(runs) == 1, f"expected one run directory in {cwd / 'runs'}, found {[p.name for p in runs]}"
    return runs[0]


def run_in_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``phalanx *args`` in ``cwd``, run by the command's own ``main()`` in this process: the same flags,
    checks, messages and exit status as :func:`run_cli`, without a fresh interpreter importing torch
    (seconds), and its workers fork from this process's fork server, already warm after the first run.

    ``stdout`` and ``stderr`` are what the command printed, its workers' lines included: fds 1 and 2
    point at files of this call while it runs, and the launcher hands a worker the parent's fds as they
    are at launch. Not for what only a process of its own shows: its exit at interpreter teardown, a
    signal, the console script, a cold start (those tests use :func:`run_cli`)."""
    from phalanx.cli import main

    here = os.getcwd()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        os.chdir(cwd)
        try:
            with _fd_to(1, out), _fd_to(2, err):
                try:
                    code = main(list(args))
                except SystemExit as e:  # argparse's own usage errors exit directly
                    code = e.code
        finally:
            os.chdir(here)  # (what resolving its import paths left: undone after the test, conftest.py)
        printed = []
        for f in (out, err):
            f.seek(0)
            printed.append(f.read())
    return subprocess.CompletedProcess(["phalanx", *args], code, *printed)


@contextlib.contextmanager
def _fd_to(fd: int, target):
    """File descriptor ``fd`` and its Python stream (``sys.stdout`` for 1) write to ``target`` meanwhile,
    line by line, in the order they were printed."""
    name = {1: "stdout", 2: "stderr"}[fd]
    getattr(sys, name).flush()
    saved = os.dup(fd)
    os.dup2(target.fileno(), fd)
    stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True)
    old = getattr(sys, name)
    setattr(sys, name, stream)
    try:
        yield
    finally:
        stream.flush()
        setattr(sys, name, old)
        os.dup2(saved, fd)
        os.close(saved)


def python_script(path: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(path), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _children(pid: int) -> list[tuple[int, int, str]]:
    """(start time, pid, command line) of each child of ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{entry}/cmdline").read()
        except OSError:
            continue
        if int(stat[1]) == pid:
            found.append((int(stat[19]), int(entry), cmdline))
    return found


def spawned_children(pid: int, marker: str = "spawn_main") -> list[int]:
    """The worker processes a phalanx command started, oldest first (rank order).

    phalanx's own workers are forks of its fork server (a child of the command: their parent; a fork of
    the command, or a new interpreter where a script's fit() started it), or, with PHALANX_START_METHOD=spawn,
    its own spawned children (``spawn_main``); ``marker`` ``"phalanx"``: the workers of a torchrun agent."""
    found = []
    command = open(f"/proc/{pid}/cmdline").read()
    for start, child, cmdline in _children(pid):
        if marker == "spawn_main" and (cmdline == command or "multiprocessing.forkserver" in cmdline):
            found += [(s, p) for s, p, _ in _children(child)]
        elif marker in cmdline:
            found.append((start, child))
    return [p for _, p in sorted(found)]


def run_and_signal(args: list[str], cwd: Path, after_line: str, signal_: int, rank: int | None = None,
                   timeout: float = 300) -> tuple[int, str, str]:
    """Run ``phalanx *args``; when a stdout line starts with ``after_line`` send ``signal_`` to worker
    ``rank`` (None: to the phalanx command itself). Returns (exit status, stdout, stderr)."""
    proc = subprocess.Popen(phalanx_cmd() + args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(after_line):
            os.kill(proc.pid if rank is None else spawned_children(proc.pid)[rank], signal_)
            break
    rest, err = proc.communicate(timeout=timeout)  # a hang fails here instead of stalling the suite
    return proc.returncode, "".join(lines) + rest, err


@contextlib.contextmanager
def small_filesystem(tmp_path: Path, size: str):
    """A tmpfs of ``size`` (``64k``, ``2m``) mounted at ``tmp_path/small`` for a full-disk test; the test is
    skipped, with the reason, where mounting is not permitted."""
    import pytest

    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or 'not permitted'})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)

