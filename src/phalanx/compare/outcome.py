"""What a comparison returns: its runs, its tables, its answer, and ``save(dir)``.

``phalanx compare --out DIR`` and ``phalanx.compare(...).save(DIR)`` write the same files through
:meth:`Comparison.save`: every run's metrics file (``runs/SCENARIO/STRATEGY-repeat-N/metrics.jsonl``),
the plots, report.md and report.json. The metrics files are kept as text in the result, so a
comparison run without a folder can still be saved after it ended (they are small: one line per
evaluation and log step).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import PhalanxError
from . import plots, report
from .results import Figures, RunResult
from .runner import Checked, Setup


@dataclasses.dataclass
class Comparison:
    setup: Setup
    checked: Checked
    runs: list[RunResult]  #: every finished run, in the order they ran
    table: dict[str, list[Figures]]  #: scenario -> one ranked row per strategy (medians over the repeats)
    metrics_files: dict[str, str]  #: each run's metrics file: its path under the report folder -> its text
    command: Optional[str] = None  #: the command line, where the CLI ran it (the report's Setup section)
    incomplete: Optional[dict] = None  #: stopped by a signal: by which, during which run

    @property
    def answer(self) -> str:
        """The answer in words: which strategy reached the target first in each scenario, and why."""
        return report.answer(self.setup, self.checked, self.table).replace("**", "")

    @property
    def tables(self) -> str:
        """The tables ``phalanx compare`` prints: one per scenario."""
        return report.terminal(self.setup, self.checked, self.table)

    def __str__(self) -> str:
        return f"{self.tables}\n\n{self.answer}"

    def save(self, out: Union[str, Path]) -> list[Path]:
        """Write what ``--out`` writes into ``out``: report.md, report.json, the plots and every run's
        metrics file. Returns report.md's and report.json's paths, then the plots'."""
        out = Path(out)
        writable(out)
        for name, text in self.metrics_files.items():
            path = out / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        drawn = plots.draw(self.setup, self.table, self.runs, out)
        written = report.write(out, self.setup, self.checked, self.table, self.runs, drawn, self.command,
                               self.incomplete)
        return written + [out / p["file"] for p in drawn]

    def to_dict(self) -> dict[str, Any]:
        """report.json's figures and runs (without the machine, the plots and the setup's command)."""
        return {"answer": self.answer, "baseline": report.baseline(self.setup),
                "figures": {s: [f.to_dict() for f in rows] for s, rows in self.table.items()},
                "runs": [r.to_dict() for r in self.runs]}


def report_folder(out: Optional[str]) -> Optional[Path]:
    """``--out`` as a folder checked writable before any run starts (None: no report asked for)."""
    if out is None:
        return None
    writable(Path(out))
    return Path(out)


def writable(out: Path, flag: str = "--out") -> None:
    """The report folder exists and takes a file, or one line naming it, before any run starts."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".phalanx-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise PhalanxError(f"{flag} {out} cannot be written ({e.strerror or e}); choose another directory") from None
