"""What someone else can do to a phalanx user: run code through a checkpoint, reach a job's sockets, change its files.

- a sharded checkpoint (fsdp, pipeline: torch's distributed checkpoint) whose ``.metadata``, ``phalanx.pt`` or
  non-tensor entry is a pickle that would run code (a real payload: it makes a directory) runs nothing under
  ``evaluate`` (the ``.dcp`` or the run directory), ``--resume`` (fsdp, and into sync) and ``--init-from``:
  each refuses it in one line naming the file; the same checkpoint, untouched, still loads;
- a one-machine job listens on loopback only: the launcher's store and every worker's sockets;
- a run directory is private (0700, files 0600) even under umask 000: the folders phalanx made, its record,
  metrics, lock, and every file of a sharded checkpoint (torch writes those).
"""

import json
import os
import pickle
import shutil
import stat
import subprocess

import pytest
import torch

from helpers import phalanx_cmd, run_in_process, run_workers
from phalanx import evaluate
from phalanx.errors import PhalanxError
from phalanx.checkpoint import STATE, load_checkpoint, read_entries, tensors
from phalanx.checkpoint.integrity import file_digest, payload_digest
from phalanx.checkpoint.pt import write_file


class Payload:
    """Unpickled, it makes the directory ``marker``: what a crafted checkpoint's ``__reduce__`` would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One fsdp run on 2 workers under umask 000 (its one checkpoint, step 2, sharded), shared by every test
    here: ``phalanx train`` as a user runs it, in a process of its own (its workers take its umask)."""
    root = tmp_path_factory.mktemp("secure")
    argv = ["train", "--strategy", "fsdp", "--workers", "2", "--model", "mlp", "--steps", "2", "--batch-size", "8",
            "--optimizer", "adam", "--progress", "none"]
    out = subprocess.run(phalanx_cmd() + argv, cwd=root, capture_output=True, text=True, timeout=300, umask=0,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    directory = root / "runs" / "fsdp-1"
    summary = json.loads((directory / "metrics.jsonl").read_text().splitlines()[-1])
    return {"root": root, "dir": directory, "dcp": directory / "step-00000002.dcp", "summary": summary}


def _reseal(dcp):
    """The checksums in phalanx.pt made to match the files again, as whoever crafted them would: a checksum is
    no signature, so nothing may rest on it."""
    state = torch.load(dcp / STATE, weights_only=True)
    state["files"] = {p.name: file_digest(p) for p in sorted(dcp.iterdir()) if p.is_file() and p.name != STATE}
    state.pop("checksum")
    state["checksum"] = payload_digest(state)
    write_file(state, dcp / STATE)


def _crafted(run, tmp_path, what):
    """A copy of the run directory whose checkpoint's ``what`` ('.metadata' or 'phalanx.pt') is the payload."""
    copy = tmp_path / f"crafted{what}"
    shutil.copytree(run["dir"], copy)
    dcp = copy / run["dcp"].name
    marker = tmp_path / f"ran{what}"
    if what == STATE:  # a torch.save of the payload, in the state's own form
        state = torch.load(dcp / STATE, weights_only=True)
        state["meta"] = Payload(marker)
        torch.save(state, dcp / STATE)
    else:
        (dcp / what).write_bytes(pickle.dumps(Payload(marker)))
        _reseal(dcp)
    return copy, dcp, marker


@pytest.mark.slow
def test_a_crafted_metadata_runs_nothing_anywhere_it_is_read_and_is_refused_in_one_line(run, tmp_path):
    copy, dcp, marker = _crafted(run, tmp_path, ".metadata")
    line = (f"error: {dcp / '.metadata'} is refused: it names posix.mkdir, which a checkpoint never holds (a file "
            "made to run code when read); nothing in it was run; use a checkpoint from a source you trust")
    train = ["train", "--workers", "2", "--model", "mlp", "--steps", "4", "--batch-size", "8", "--progress", "none"]
    commands = {
        "evaluate .dcp": ["evaluate", "--checkpoint", str(dcp)],
        "evaluate run dir": ["evaluate", "--checkpoint", str(copy)],
        "--resume": [*train, "--strategy", "fsdp", "--resume", str(dcp), "--checkpoint-dir", str(copy)],
        "--resume into sync": [*train, "--strategy", "sync", "--resume", str(copy), "--checkpoint-dir", str(copy)],
        "--init-from": [*train, "--workers", "1", "--init-from", str(dcp), "--checkpoint-dir", str(tmp_path / "n")],
    }
    for label, argv in commands.items():
        out = run_in_process(*argv, cwd=tmp_path)
        assert not marker.exists(), f"{label}: the payload ran"
        assert out.returncode == 2, (label, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and line[len("error: "):] in lines[0], (label, out.stderr)
    # The API, and a reader given no parent's check (a worker's): refused alike.
    with pytest.raises(PhalanxError, match="is refused: it names posix.mkdir"):
        evaluate(str(dcp))
    with pytest.raises(PhalanxError, match="is refused: it names posix.mkdir"):
        read_entries(str(dcp), ["model"])
    assert not marker.exists()
    pickle.loads((dcp / ".metadata").read_bytes())  # what torch's own reader does with it:
    assert marker.is_dir()  # the payload was a real one


@pytest.mark.slow
def test_a_crafted_phalanx_pt_or_entry_in_a_sharded_checkpoint_runs_nothing(run, tmp_path):
    copy, dcp, marker = _crafted(run, tmp_path, STATE)
    out = run_in_process("evaluate", "--checkpoint", str(dcp), cwd=tmp_path)
    assert out.returncode == 2 and not marker.exists(), out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: checkpoint {dcp} is corrupt: its phalanx.pt is unreadable (it holds objects a checkpoint never "
        "holds; nothing in it was run); give --checkpoint an earlier checkpoint of the same directory"]
    # A non-tensor entry of the shards (torch's planner reads them with weights_only=False) holding the payload.
    import torch.distributed.checkpoint as dcp_api

    entry = tmp_path / "entry.dcp"
    with pytest.warns(UserWarning, match="single process"):
        dcp_api.save({"model": {"w": torch.ones(2)}, "aliases": {"x": Payload(marker)}}, checkpoint_id=str(entry),
                     no_dist=True)
    with pytest.raises(PhalanxError, match="checkpoint entry aliases.x is refused"):
        read_entries(str(entry))
    assert not marker.exists()


@pytest.mark.slow
def test_the_genuine_checkpoint_still_loads_whole_and_by_entry(run):
    assert evaluate(str(run["dcp"])) == pytest.approx(run["summary"]["test_metrics"])
    state = tensors(load_checkpoint(run["dir"]))
    assert state["step"] == 2 and state["model"] and state["optimizer"]["param_groups"][0]["lr"] > 0
    assert set(read_entries(str(run["dcp"]), ["model"])["model"]) == set(state["model"])


def _listening(pid):
    """(address, port) of every TCP socket process ``pid`` listens on."""
    import ipaddress

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                hexaddr, port = fields[1].split(":")
                raw = bytes.fromhex(hexaddr)  # the kernel's words, each in host (little-endian) order
                address = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                found.append((address, int(port, 16)))
    return found


def _sockets_of_the_job(ctx, launcher_pid):
    from helpers import gather

    pids = gather(ctx, os.getpid())
    torch.distributed.barrier()  # every rank's group is up: everything the job listens on is open
    found = {pid: _listening(pid) for pid in [launcher_pid, *pids]} if ctx.rank == 0 else None
    torch.distributed.barrier()
    return {pid: [(str(a), port) for a, port in sockets] for pid, sockets in found.items()} if found else None


def _loopback(address):
    import ipaddress

    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.slow
def test_a_one_machine_job_listens_on_loopback_only():
    sockets = run_workers(_sockets_of_the_job, 2, os.getpid())
    assert len(sockets[os.getpid()]) >= 1 and all(sockets.values()), sockets  # the store; each rank's group
    outside = {pid: [s for s in found if not _loopback(s[0])] for pid, found in sockets.items()}
    assert not any(outside.values()), f"listening outside loopback: {outside}"


@pytest.mark.slow
def test_a_run_directory_is_private_under_umask_000(run):
    """The shared run was made under umask 000: every folder phalanx made 0700, every file 0600."""
    made = [run["root"] / "runs", *sorted((run["root"] / "runs").rglob("*"))]
    modes = {str(p.relative_to(run["root"])): stat.S_IMODE(p.stat().st_mode) for p in made}
    assert {name for name in modes} >= {"runs/fsdp-1/.phalanx-run.json", "runs/fsdp-1/metrics.jsonl",
                                        "runs/fsdp-1/.phalanx.lock", "runs/fsdp-1/step-00000002.dcp/.metadata"}
    assert {name: mode for name, mode in modes.items()
            if mode != (0o700 if (run["root"] / name).is_dir() else 0o600)} == {}
