"""What rank 0 shows the user: header, progress lines (or a bar), summary, JSON-lines metrics (and, with
``--tensorboard``, the same records as TensorBoard scalars: ``tensorboard.py``)."""

from __future__ import annotations

import errno
import json
import sys
import time
from pathlib import Path
from typing import IO, Any, Optional

from tqdm import tqdm

from ..errors import StorageError
from ..files import open_private, private_dir, replace_private
from ..launcher.context import bars_without_semaphores


def step_line(step: int, loss: float, examples_per_sec: float, sec_per_batch: float) -> str:
    return f"step {step}, loss = {loss:.2f} ({examples_per_sec:.1f} examples/sec; {sec_per_batch:.3f} sec/batch)"


def keep_until(path: str, step: int) -> None:
    """Drop the records of steps after ``step`` (a run that went past its last checkpoint before it
    stopped), so that a resumed run's records follow on without repeating steps, and a last line that a kill
    cut short (no newline, and not JSON: the resumed run's first record would have continued it). Atomic
    rewrite."""
    file = Path(path)
    if not file.is_file():
        return
    text = file.read_text(errors="replace")
    lines = text.splitlines()
    if lines and not text.endswith("\n") and not _is_json(lines[-1]):
        lines.pop()
    kept = []
    for line in lines:
        try:
            event = json.loads(line)
            at = event.get("step", event.get("steps", 0))
        except (ValueError, AttributeError):
            at = 0  # not ours to judge: kept as it was
        if not isinstance(at, int) or at <= step:
            kept.append(line)
    replace_private(file, "".join(f"{line}\n" for line in kept))


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


class Reporter:
    """Prints on rank 0 only; every other rank gets a silent one."""

    def __init__(self, enabled: bool, progress: str, metrics_path: Optional[str], total_steps: int,
                 start_step: int, resumed_from: Optional[str] = None, run_id: Optional[str] = None,
                 tensorboard: Optional[str] = None):
        self.enabled = enabled
        self.metrics: Optional[IO[str]] = None
        self.metrics_path = metrics_path
        self.bar = None
        self.board = None
        if not enabled:
            return
        if metrics_path:
            self._open_metrics(metrics_path, start_step, resumed_from, run_id)
        if tensorboard:
            from .tensorboard import Board

            self.board = Board(tensorboard, resumed_at=start_step if resumed_from is not None else None)
        use_bar = progress == "bar" or (progress == "auto" and sys.stdout.isatty())
        self.quiet = progress in ("none", "silent")
        self.silent = progress == "silent"  # not even the result: a run inside phalanx compare, which reports it
        if use_bar:
            bars_without_semaphores()  # one bar in one process: a thread lock is all it needs
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, leave=False)

    def say(self, line: str) -> None:
        """A line of progress: the header, step lines, evaluations during the run (``--progress none``: none)."""
        if not self.enabled or self.quiet:
            return
        self._print(line)

    def result(self, line: str) -> None:
        """A line of the run's result (its metrics, throughput, checkpoint): printed whatever ``--progress`` says,
        as ``--progress none`` hides the progress, not what the run found."""
        if self.enabled and not self.silent:
            self._print(line)

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def _open_metrics(self, path: str, start_step: int, resumed_from: Optional[str], run_id: Optional[str]) -> None:
        """A continued run appends to its metrics (the parent checked the file is this run's or new);
        a new run's first line names its run, so that no other run's takes it for its own."""
        try:
            private_dir(Path(path).parent)
            if resumed_from is not None:
                keep_until(path, start_step)
            self.metrics = open_private(path, "a" if resumed_from is not None else "w", buffering=1)
        except OSError as e:
            raise metrics_error(path, e) from None
        if resumed_from is not None:
            self.record("resume", step=start_step, checkpoint=resumed_from, run_id=run_id)
        else:
            self.record("run", run_id=run_id)

    def record(self, event: str, **fields: Any) -> None:
        stamp = round(time.time(), 3)
        if self.board is not None:
            self.board.write(event, {"time": stamp, **fields})
        if self.metrics is None:
            return
        try:
            self.metrics.write(json.dumps({"event": event, "time": stamp, **fields}) + "\n")
        except OSError as e:  # line-buffered: a full disk shows here, at the line that did not fit
            self._drop_metrics()
            raise metrics_error(self.metrics_path, e) from None

    def _drop_metrics(self) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.close()  # closes the file even when its last flush fails again
        except OSError:
            pass
        self.metrics = None

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def show_loss(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.metrics is not None:
            try:
                self.metrics.close()
            except OSError as e:
                self.metrics = None
                raise metrics_error(self.metrics_path, e) from None
            self.metrics = None


def metrics_error(path: Optional[str], e: OSError) -> StorageError:
    """``cannot write metrics file m.jsonl: No space left on device (ENOSPC); free some space ...``"""
    code = errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    why = f"{e.strerror or e}{f' ({code})' if code else ''}"
    fix = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
           errno.EIO: "check the disk"}.get(e.errno or 0, "fix the permissions")
    return StorageError(f"cannot write metrics file {path}: {why}; {fix} or choose another --metrics, then continue "
                        "with --resume (the checkpoints are not affected)")
