"""Inside a worker: what rank 0 says about the run as a whole, the header before the first step and the
summary after the last, and the counts the summary gathers (memory, bytes on the wire).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import config_file
from ..memory import Held, describe, held, largest
from ..task.metrics import said
from ..comm.shaped_link import loopback_bytes
from ..comm.wire import summary_fields, summary_line
from .resume import settings_line


@dataclasses.dataclass
class Outcome:
    """How the loop ended: what the summary reports."""

    step: int  #: the last step taken
    steps: int  #: steps this job took (a resumed run started at its checkpoint's)
    seconds: float  #: training time, evaluations left out
    eval_seconds: float
    values: Optional[dict[str, float]]  #: the final evaluation (None: a stop asked for speed skipped it)
    reached: bool  #: an evaluation reached the target
    stopped: Optional[str]  #: the signal that stopped the run, if one did
    checkpoint: Optional[str]  #: the run's last checkpoint
    checkpoint_blocked_s: float


class Summary:
    """The header and the summary, on rank 0 (every rank gathers what the summary needs); the training
    steps' window of bytes on the wire, and of a shaped link's counters (--link).

    ``recomputed``, ``compiled``: what --activation-checkpointing and --compile did to the model."""

    def __init__(self, ctx: Any, plan: Any, cfg: Any, runtime: Any, data: Any, reporter: Any, meter: Any,
                 marks: Any, global_batch: int, recomputed: Any, compiled: Optional[str]):
        self.ctx, self.plan, self.cfg, self.runtime, self.data = ctx, plan, cfg, runtime, data
        self.reporter, self.meter, self.marks, self.global_batch = reporter, meter, marks, global_batch
        self.recomputed, self.compiled = recomputed, compiled
        self.target = cfg.target
        # On a shaped link (--link) rank 0 also reads the loopback's own counters at both ends of the steps.
        self.link_at: list[int] = []

    # ---- before the first step ----
    def header(self, step: int, resumed: Any, init_line: Optional[str], straggle: Any) -> None:
        """The run in one line, then what it resumed from (``resumed``: what resume.py took from the
        checkpoint) or started from (``init_line``: --init-from), the data's, strategy's, straggler's and
        precision's notes, and the settings."""
        devs = sorted({str(d) for d in self.plan.layout.devices})
        backend = self.ctx.backend or "none (one process)"
        at = f", resuming at step {step}" if step else ""
        model = self.plan.task.model_name
        self.reporter.say(
            f"phalanx train: strategy {self.runtime.description}, world size {self.ctx.world_size}, devices "
            f"{', '.join(devs)}, backend {backend}, global batch {self.global_batch} "
            f"({self._batch_split()}), {model} on {self.data.name}{at}{self._threads()}"
        )
        first = resumed.lines if resumed else [init_line] if init_line else []
        for line in first + list(self.data.notes) + self.runtime.notes + straggle.lines() + self._precision_lines():
            self.reporter.say(line)
        self.reporter.say(settings_line(self.cfg) if resumed else self.plan.recipe)
        if straggle.fields():
            self.reporter.record("straggle", **straggle.fields())

    def _threads(self) -> str:
        """Each CPU worker's share of its machine's cores (a worker that took them all would fight the others)."""
        if self.ctx.device.type != "cpu":
            return ""
        n = torch.get_num_threads()
        return f", {n} thread{'s' if n > 1 else ''} per worker"

    def _precision_lines(self) -> list[str]:
        lines = []
        if self.cfg.precision != "fp32":
            scaler = ", with a gradient scaler" if self.cfg.precision == "fp16" else ""
            lines.append(f"precision: {self.cfg.precision} autocast in every forward pass{scaler}; parameters, "
                         "gradients, optimizer state and checkpoints in fp32")
        if self.recomputed is not None:
            lines.append(self.recomputed.line())
        if self.compiled:
            lines.append(f"compiled: {self.compiled} with torch.compile (the first steps include the compilation)")
        return lines

    def _batch_split(self) -> str:
        shards = self.plan.layout.shards
        readers = sum(rank.shard is not None for rank in self.plan.layout.ranks)
        if shards == self.ctx.world_size:
            return f"{self.cfg.batch_size} per worker x {self.ctx.world_size}"
        if shards == 1:
            return "every worker reads the whole batch"
        if readers == shards:  # one rank reads no data (a parameter server)
            return f"{self.cfg.batch_size} per worker x {shards} workers"
        return f"{self.cfg.batch_size} per replica x {shards} replicas, each read by {readers // shards} ranks"

    # ---- the training steps' window ----
    def count_wire(self, start: bool) -> None:
        """The training steps' window of the bytes on the wire (and of the shaped link's counters)."""
        if self.cfg.link is not None and self.ctx.is_main:
            self.link_at.append(loopback_bytes())
        if start and self.cfg.link is not None and self.ctx.distributed and self.plan.layout.lockstep:
            # Once per run, on a shaped link only: no rank sends its first step's bytes before rank 0
            # (which opens the metrics file and prints the header first) has read the link's counter.
            dist.barrier()
        if start:
            self.meter.begin()
        else:
            self.meter.end()

    # ---- after the last step ----
    def final(self, end: Outcome) -> dict[str, Any]:
        """Every rank: the summary (recorded, and returned); rank 0 prints it."""
        rate = end.steps * self.global_batch / max(end.seconds, 1e-9)
        report = self.runtime.report(final=True)
        mine, most, wire = self._gathered()
        summary = self._fields(end, rate, mine, most, wire, report)
        self.reporter.record("summary", **summary)
        self.reporter.close()
        self._print(end, rate, mine, most, wire, report)
        return summary

    def _fields(self, end: Outcome, rate: float, mine: Held, most: Optional[Held], wire: Optional[float],
                report: Any) -> dict[str, Any]:
        reached, values = end.reached, end.values
        return {"steps": end.step, "test_accuracy": (values or {}).get("accuracy"), "test_metrics": values,
                "held_out": self.data.held_out, "examples_per_sec": rate,
                "train_seconds": end.seconds, "eval_seconds": end.eval_seconds,
                "checkpoint_blocked_s": round(end.checkpoint_blocked_s, 6),
                "target": None if self.target is None else str(self.target),
                "stopped_at_target": reached, "stopped_at_accuracy": reached, "checkpoint": end.checkpoint,
                "metrics": self.cfg.metrics, "stopped_by": end.stopped,
                "world_size": self.ctx.world_size, "strategy": self.cfg.strategy.name,
                "precision": self.cfg.precision, "compiled": self.compiled,
                **({"activation_checkpointing": self.recomputed.fields()} if self.recomputed else {}),
                "watch_cpu_seconds": round(self.ctx.progress.cpu_seconds, 4),
                "memory_bytes": mine.as_dict(), **({"memory_bytes_max": most.as_dict()} if most else {}),
                "startup_seconds": self.marks.seconds, **summary_fields(self.meter, wire, end.steps, self.link_at),
                **report.fields}

    def _print(self, end: Outcome, rate: float, mine: Held, most: Optional[Held], wire: Optional[float],
               report: Any) -> None:
        say = self.reporter.result
        if end.stopped:
            say(f"stopped at step {end.step} by {end.stopped}")
        else:
            if end.reached:
                say(f"stopped at step {end.step}: {self.data.held_out} {self.target.metric} reached the target "
                    f"{self.target}")
            if end.values is not None:  # (None: a stop asked for speed skipped the evaluation)
                say(f"{self.data.held_out} {said(end.values)} after {end.step} steps")
        say(f"throughput {rate:.1f} examples/sec (global), training time {end.seconds:.1f} s")
        for line in describe(mine, most):
            say(line)
        say(summary_line(self.meter, wire, end.steps))
        for line in report.lines:
            say(line)
        if self.cfg.profile_startup:
            say(self.marks.line())
        say(f"checkpoint {end.checkpoint}")
        say(f"metrics {self.cfg.metrics}")
        if self.cfg.checkpoint_dir is not None and (Path(self.cfg.checkpoint_dir) / config_file.SAVED_NAME).exists():
            say(f"config {Path(self.cfg.checkpoint_dir) / config_file.SAVED_NAME} (--config of it repeats this run)")

    def _gathered(self) -> tuple[Held, Optional[Held], Optional[float]]:
        """This rank's parameter, gradient and optimizer bytes; the max over ranks; and the job's bytes
        on the wire in the steps (what every rank sent), or None where unknown here.

        Ranks in step gather both in one collective, once, after the last step. A job whose every
        message has rank 0 at one end (a parameter server) needs none: rank 0's sent and received
        bytes are everything that crossed. Other ranks not in step cannot gather: None."""
        mine = held(self.runtime.module, self.runtime.optimizer)
        layout = self.plan.layout
        if not self.ctx.distributed:
            return mine, None, 0.0
        if not layout.lockstep:
            return mine, None, self.meter.total if layout.hub == self.ctx.rank else None
        every: list = [None] * self.ctx.world_size
        dist.all_gather_object(every, (mine, self.meter.sent))
        return mine, largest([m for m, _ in every]), sum(sent for _, sent in every)
