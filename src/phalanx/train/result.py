"""What ``Trainer.fit()`` returns: the run's result, typed, the same shape on every path.

A run's figures are its attributes (``result.test_accuracy``, ``result.examples_per_sec``); the figures
only some strategies or settings have (a parameter server's staleness, a shaped link's bytes) are in
``extra``. The result is also a read-only mapping of exactly the keys the run's summary event in the metrics
file has (``result["test_accuracy"]``, ``"memory_bytes_max" in result``, ``dict(result)``), so code written
against the summary as a dict reads it unchanged.

A restarted attempt that finds its run already complete (``already_complete``) returns the summary the run
wrote in its metrics file, where it wrote one; else only the step and the checkpoint are known.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class TrainResult(Mapping):
    """One training run's result (rank 0's view; what its final summary printed and recorded)."""

    steps: int  #: the global step the run ended at
    checkpoint: Optional[str] = None  #: the final checkpoint: what ``phalanx evaluate`` reads back
    test_accuracy: Optional[float] = None  #: on the test set (or validation part); None without accuracy
    test_metrics: Optional[dict[str, float]] = None  #: every metric there, by name (loss, perplexity ...)
    held_out: Optional[str] = None  #: "test" or "validation": what the metrics were measured on
    examples_per_sec: Optional[float] = None  #: global examples per second of training time
    train_seconds: Optional[float] = None  #: time in training steps (evaluations and start-up left out)
    eval_seconds: Optional[float] = None  #: time in evaluations during the run
    checkpoint_blocked_s: Optional[float] = None  #: time the steps waited for checkpoints
    target: Optional[str] = None  #: --stop-at's target, as text
    stopped_at_target: Optional[bool] = None  #: whether the run stopped because it reached the target
    stopped_at_accuracy: Optional[bool] = None  #: the same (the flag's older name)
    metrics: Optional[str] = None  #: the metrics file
    stopped_by: Optional[str] = None  #: SIGINT, SIGTERM or SIGHUP where a signal stopped the run
    world_size: Optional[int] = None  #: processes in the job
    strategy: Optional[str] = None  #: the strategy's name
    precision: Optional[str] = None  #: fp32, bf16 or fp16
    compiled: Optional[str] = None  #: what --compile compiled (None: nothing)
    activation_checkpointing: Optional[dict[str, Any]] = None  #: what recomputation saved, where it ran
    watch_cpu_seconds: Optional[float] = None  #: CPU time of the watcher thread
    memory_bytes: Optional[dict[str, int]] = None  #: parameters, gradients, optimizer state on rank 0
    memory_bytes_max: Optional[dict[str, int]] = None  #: the same, the largest over the ranks
    startup_seconds: Optional[dict[str, float]] = None  #: where the seconds before the first step went
    wire_sent_bytes: Optional[int] = None  #: bytes rank 0 sent in the training steps
    wire_received_bytes: Optional[int] = None  #: bytes rank 0 received in them
    wire_bytes: Optional[int] = None  #: bytes every rank sent in them (None where not known)
    wire_bytes_per_step: Optional[float] = None  #: the same per step
    already_complete: bool = False  #: a restarted attempt found the run finished: nothing was trained
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  #: the strategy's and the link's own figures
    #: the summary's keys, in its order (the mapping's keys)
    keys_given: tuple[str, ...] = dataclasses.field(default=(), repr=False)

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any]) -> "TrainResult":
        """The result of a summary as the workers record it (the metrics file's ``summary`` event)."""
        named = {f.name for f in dataclasses.fields(cls)} - {"extra", "keys_given"}
        summary = {k: v for k, v in summary.items() if k not in ("event", "time")}
        return cls(**{k: v for k, v in summary.items() if k in named},
                   extra={k: v for k, v in summary.items() if k not in named}, keys_given=tuple(summary))

    @classmethod
    def complete(cls, step: int, checkpoint: str, metrics: Optional[str]) -> "TrainResult":
        """A restarted attempt's result when the run was already complete: the run's own summary from its metrics
        file where it wrote one at this step, else the step and the checkpoint."""
        summary = _last_summary(metrics or str(Path(checkpoint).parent / "metrics.jsonl"))
        if summary is None or summary.get("steps") != step:
            summary = {"steps": step, "checkpoint": checkpoint}
        return cls.from_summary({**summary, "checkpoint": checkpoint, "already_complete": True})

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys_given:
            raise KeyError(key)
        return self.extra[key] if key in self.extra else getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_given)

    def __len__(self) -> int:
        return len(self.keys_given)

    def to_dict(self) -> dict[str, Any]:
        """The summary as a plain dict (what the metrics file's ``summary`` event holds)."""
        return dict(self.items())


def _last_summary(metrics: Optional[str]) -> Optional[dict[str, Any]]:
    """The last ``summary`` event of a metrics file (None: no file, or none in it)."""
    if not metrics or not Path(metrics).is_file():
        return None
    found = None
    for line in Path(metrics).read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if isinstance(event, dict) and event.get("event") == "summary":
            found = event
    return found
