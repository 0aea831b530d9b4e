"""Which run a checkpoint directory belongs to: decided in the parent, before anything is written.

A *run* is one training job's life, continued by ``--resume`` and by restarts. Its id is written
in every checkpoint (``run_id``), in the directory's record (``.phalanx-run.json``, see
``checkpoint/format.py``) and in the first line of its metrics file. The rules:

- **A new run** (no ``--resume``) is refused in a directory that holds another run's checkpoints,
  or next to another run's metrics file; ``--overwrite`` removes them first (phalanx's own files
  only: ``step-*.pt``, sharded ``step-*.dcp/``, the record, a metrics file phalanx wrote).
- **--resume** continues the run of the checkpoint it names; the directory must hold that run, or
  no checkpoints at all.
- **A restarted attempt** continues the current run only. phalanx's own ``--max-restarts`` knows
  its run (the parent holds it). Under ``torchrun`` every attempt is a new process with the same
  command line: an attempt continues the run the record says *this torchrun job* wrote
  (``TORCHELASTIC_RUN_ID``, or the agent process when the id is torchrun's default ``none``),
  whatever its flags say, ``--overwrite`` included. Not its attempt number: each agent counts only
  its own failures (``TORCHELASTIC_RESTART_COUNT``), and a node joining an elastic job restarts every
  worker without counting, so the ranks of one attempt may read different numbers. An earlier
  attempt that never claimed the directory left nothing to continue: the attempt is then judged as
  a new run, so it can never take another run's checkpoints.

Only the process that writes checkpoints (launcher rank 0) refuses or removes anything; under
torchrun the other ranks read the same directory and follow.

Without ``--checkpoint-dir`` each new run gets a directory of its own, ``runs/<strategy>-<n>`` (as
Lightning's ``lightning_logs/version_N``), so that runs one after another in one folder never meet the
rules above; see :func:`placed`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import uuid
import warnings
from pathlib import Path
from typing import Mapping, Optional

from ..errors import PhalanxError
from ..launcher import in_torchrun, launcher_rank
from .. import checkpoint as ckpt
from .config import TrainConfig


class RunComplete(PhalanxError):
    """A restarted attempt found its run already at --steps: nothing to do, and that is success."""

    exit_code = 0

    def __init__(self, step: int, path: str):
        super().__init__(f"already complete at step {step}: checkpoint {path}")
        self.step, self.path = step, path


@dataclasses.dataclass(frozen=True)
class Claim:
    """What the parent decided about the checkpoint directory."""

    run_id: str  #: a new run's id (a continued run takes its checkpoint's: see :func:`resumed_run`)
    resume: Optional[str]  #: what to resume from: the user's --resume, or the directory a restart continues
    restarted: bool  #: a torchrun attempt continuing its own run (finding it complete is success)
    remove: tuple[Path, ...] = ()  #: --overwrite: another run's files, removed once the directory is locked


#: where runs go without --checkpoint-dir, each in runs/<strategy>-<n>
RUNS = "runs"
#: --resume alone, or --resume last (Lightning's word): the newest checkpoint of the newest run
NEWEST = "last"
#: a joined job's default: every rank on every node, and every restarted attempt, must name the same
#: directory without asking each other, which a count of what runs/ holds cannot promise
JOINED_DEFAULT = "checkpoints"
_RUN_NAME = re.compile(r"^[\w.-]+-(\d+)$")  # local-sgd-3 too


def placed(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its checkpoint directory and metrics file named; ``--resume`` alone made a path.

    ``--checkpoint-dir X`` is kept as given. Without it: a new run takes the next ``runs/<strategy>-<n>``
    (n counts every run in ``runs/``, so the numbers say which started last, and a name says what ran;
    a timestamp would say neither at a glance, and two runs in one second would share it); a resume
    continues in the directory that holds its checkpoint (a run never writes into another's); under
    torchrun or srun the directory is ``checkpoints`` (see ``JOINED_DEFAULT``). The paths named here rather than
    by the user are recorded (``_placed``): the run's saved ``config.toml`` leaves them out.
    """
    directory, resume = cfg.checkpoint_dir, cfg.resume
    if directory is None:
        if in_torchrun():
            directory = JOINED_DEFAULT
        elif resume == NEWEST:
            directory = resume = str(newest_run(Path(RUNS)))
        elif resume is not None:
            directory = resume if Path(resume).is_dir() else str(Path(resume).parent)
        else:
            directory = str(Path(RUNS) / f"{cfg.options.name}-{next_number(Path(RUNS))}")
    if resume == NEWEST:
        resume = directory
    chosen = ("checkpoint_dir",) if cfg.checkpoint_dir is None else ()  # (the metrics beside it: __post_init__)
    return dataclasses.replace(cfg, checkpoint_dir=directory, resume=resume, _placed=cfg._placed + chosen)


def next_number(runs: Path) -> int:
    """One more than the highest n of any ``<name>-<n>`` in ``runs`` (1 in a folder without runs)."""
    numbers = [int(m.group(1)) for p in _entries(runs) if (m := _RUN_NAME.match(p.name))]
    return max(numbers, default=0) + 1


def newest_run(runs: Path) -> Path:
    """The run directory under ``runs`` whose newest checkpoint was written last (``--resume`` alone)."""
    held = [(ckpt.list_checkpoints(p)[-1].stat().st_mtime, int(m.group(1)), p)
            for p in _entries(runs) if (m := _RUN_NAME.match(p.name)) and ckpt.list_checkpoints(p)]
    if not held:
        raise PhalanxError(f"--resume: no run in {runs}/ holds a checkpoint yet; start one with phalanx train, or "
                           "give the checkpoint to continue (--resume PATH) or its --checkpoint-dir")
    return max(held)[2]


def _entries(runs: Path) -> list[Path]:
    return [p for p in runs.iterdir() if p.is_dir()] if runs.is_dir() else []


def launcher_identity(env: Optional[Mapping[str, str]] = None) -> str:
    """The torchrun job this process belongs to, the same in each of its attempts ('' outside torchrun)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RESTART_COUNT" not in env:
        return ""
    job = env.get("TORCHELASTIC_RUN_ID", "")
    if job and job != "none":  # --standalone makes a fresh uuid per torchrun; multi-node jobs pass --rdzv-id
        return f"torchrun job {job}"
    agent = os.getppid()  # the agent starts every attempt's workers itself
    return f"torchrun agent pid {agent} on {socket.gethostname()} started {_start_time(agent)}"


def _start_time(pid: int) -> str:
    """A process's start time in clock ticks since boot: with the pid, unique even when pids are reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def new_run_id(launcher: str) -> str:
    """Under torchrun every rank derives the same id from the job; otherwise a random one."""
    return uuid.uuid5(uuid.NAMESPACE_URL, launcher).hex[:16] if launcher else uuid.uuid4().hex[:16]


def claim(cfg: TrainConfig) -> Claim:
    """The run this job is: a torchrun attempt continuing its own, a --resume, or a new run."""
    root = Path(cfg.run_dir)
    record = _record(root, cfg)
    launcher = launcher_identity()
    if launcher and record is not None and record.launcher == launcher:
        resume = str(root) if ckpt.list_checkpoints(root) else cfg.resume
        return Claim(record.run_id, resume, restarted=True)
    if cfg.resume is not None:
        return Claim(new_run_id(launcher), cfg.resume, restarted=False)
    return Claim(new_run_id(launcher), None, restarted=False, remove=_new_run(cfg, root, record))


def _new_run(cfg: TrainConfig, root: Path, record: Optional[ckpt.RunRecord]) -> tuple[Path, ...]:
    """A new run needs a directory without checkpoints; --overwrite names the ones to remove."""
    found = [p for p in ckpt.step_entries(root) if ckpt.is_checkpoint(p)]
    if not found:
        return ()
    if not cfg.overwrite:
        if launcher_rank() == 0:
            newest = (ckpt.list_checkpoints(root) or found)[-1]
            raise PhalanxError(f"--checkpoint-dir {root} holds the checkpoints of another run (newest {newest}); "
                               f"continue that run with --resume, start over with --overwrite (removes them), or "
                               f"choose another --checkpoint-dir")
        return ()
    return tuple(found) + ((root / ckpt.RUN_NAME,) if record is not None else ())


def resumed_run(cfg: TrainConfig, state: dict) -> str:
    """The run a resume continues (its checkpoint's); refused when the directory holds another run."""
    root = Path(cfg.run_dir)
    record = _record(root, cfg)
    here = Path(state["path"]).resolve().parent == root.resolve()
    theirs = record.run_id if record is not None and record.run_id else None
    run_id = state.get("run_id") or (theirs if here else None) or new_run_id(launcher_identity())
    held = [p for p in ckpt.step_entries(root) if ckpt.is_checkpoint(p)]
    other = theirs != run_id if theirs is not None else not here
    if held and other and launcher_rank() == 0:
        newest = (ckpt.list_checkpoints(root) or held)[-1]
        raise PhalanxError(f"--resume {state['path']} continues another run than the one whose checkpoints "
                           f"--checkpoint-dir {root} holds (newest {newest}); write this run to another "
                           f"--checkpoint-dir, or continue that one with --resume {root}")
    return run_id


def _record(root: Path, cfg: TrainConfig) -> Optional[ckpt.RunRecord]:
    """The directory's run record. An unreadable one (cut) is none where ``--resume`` names a checkpoint itself:
    that checkpoint, which must verify, says which run this is (see :func:`cut_record`)."""
    if not root.is_dir():
        return None
    try:
        return ckpt.read_run(root)
    except PhalanxError:
        if not names_a_checkpoint(cfg.resume):
            raise
        return None


def names_a_checkpoint(path: Optional[str]) -> bool:
    """``--resume`` names one checkpoint (a file, or a sharded one's directory), not a directory of them."""
    return path is not None and (Path(path).is_file() or ckpt.is_checkpoint(Path(path)))


def cut_record(cfg: TrainConfig, resumed: Optional[str]) -> tuple[Path, ...]:
    """Where ``--resume`` named a checkpoint that verified (``resumed``) and the directory's run record is
    unreadable: one warning, and the record to remove (then rewritten from the checkpoints, in step order, by
    :func:`record_run` once the directory is locked)."""
    root = Path(cfg.run_dir)
    if resumed is None or not names_a_checkpoint(cfg.resume) or not (root / ckpt.RUN_NAME).exists():
        return ()
    try:
        ckpt.read_run(root)
        return ()
    except PhalanxError:
        pass
    warnings.warn(f"{root / ckpt.RUN_NAME} is unreadable; --resume {resumed} verifies, so the run continues it "
                  "and the record is rewritten (its checkpoints in step order)")
    return (root / ckpt.RUN_NAME,)


# --------------------------------------------------------------------------- the metrics file


def metrics_owner(path: Path) -> tuple[bool, Optional[str]]:
    """(whether phalanx wrote the file, the run it belongs to where it says): from its first line."""
    try:
        with open(path) as f:
            first = json.loads(f.readline())
    except (OSError, ValueError, UnicodeDecodeError):
        return False, None
    if not isinstance(first, dict) or "event" not in first:
        return False, None
    return True, first.get("run_id")


def check_metrics(cfg: TrainConfig, run_id: str, new: bool) -> tuple[Path, ...]:
    """A metrics file is never silently overwritten: a continued run appends to its own; a new run
    is refused next to another run's (--overwrite: removed, if phalanx wrote it). Returns what to remove."""
    assert cfg.metrics is not None, "placed() names the metrics file"
    path = Path(cfg.metrics)
    if launcher_rank() != 0 or not path.is_file() or path.stat().st_size == 0:
        return ()
    ours, owner = metrics_owner(path)
    if owner == run_id:
        return ()
    if not new:
        if owner is None:
            return ()  # no run line (a file from before runs had ids): appended to
        raise PhalanxError(f"--metrics {path} holds another run's metrics; this run continues a different one: "
                           "choose another --metrics")
    if not cfg.overwrite:
        raise PhalanxError(f"--metrics {path} holds another run's metrics; start over with --overwrite (replaces "
                           "it), or choose another --metrics")
    if not ours:
        raise PhalanxError(f"--metrics {path} is not a phalanx metrics file, and --overwrite removes only "
                           "phalanx's own files; choose another --metrics")
    return (path,)


# --------------------------------------------------------------------------- once the directory is locked


def record_run(directory: str, run_id: str, remove: tuple[Path, ...]) -> None:
    """Remove what --overwrite named, then write the record: this directory now holds run ``run_id``
    (a directory of an older phalanx is adopted with its checkpoints in step order)."""
    for path in remove:
        ckpt.remove(path)
    root = Path(directory)
    record = ckpt.read_run(root)
    launcher = launcher_identity()
    if record is None or record.run_id != run_id:
        names = tuple(p.name for p in ckpt.list_checkpoints(root))  # the record's order, else by step
        ckpt.write_run(root, ckpt.RunRecord(run_id, launcher, names))
    elif record.launcher != launcher:
        ckpt.write_run(root, record._replace(launcher=launcher))
