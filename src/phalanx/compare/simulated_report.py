"""What ``compare --simulate`` tells the user: a real comparison's tables at every worker count, marked
simulated, time to target against worker count, and where the fastest strategy changes.

Each worker count gets the very report a real comparison writes (``compare/report.py`` and
``compare/plots.py``, in ``workers-N/``), computed from the simulated runs; the top-level report.md
and report.json hold what only several counts show: the median time to target of every strategy
at every count, the plot of it, and the crossover in words (``from 64 workers on, diloco:20
reaches 0.95 first``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from . import plots, report
from .results import Figures
from .runner import Checked

SCALING_PLOT = "time-to-target-vs-workers.png"
#: How far to trust the figures: where the simulation was checked against real runs. Words and a pointer, not
#: figures: the figures live with their measurement (benchmarks/results/simulate*.json), on their machine.
VALIDATED = ("How it was validated: phalanx's benchmarks/simulate.py plays the same comparison for real (real gloo "
             "workers) and simulated at 2 and 3 workers, on the digits MLP and on the GPT example of "
             "examples/gpt.py, beside a second real run of each case (the noise floor); docs/simulate.md "
             "(\"Validation and speed\") gives its figures, how often simulated steps and time to target come "
             "within 20% and 25% of real, and the machine they were measured on. Checked at 2 and 3 workers, "
             "the simulation is extrapolated beyond them: its clock is the cost models of phalanx estimate.")


def checked_at(setup, workers: int) -> Checked:
    batch = setup.train.batch_size
    return Checked({s.token: batch * workers for s in setup.strategies}, batch, workers)


def tables(setup, results: dict[int, list]) -> dict[int, dict[str, list[Figures]]]:
    """worker count -> scenario -> one ranked :class:`Figures` per strategy (the real comparison's tables)."""
    return {n: report.tables(setup, runs) for n, runs in results.items()}


def crossover(setup, by_workers: dict[int, dict[str, list[Figures]]]) -> list[str]:
    """One sentence per scenario: which strategy reaches the target first at which worker counts."""
    counts = sorted(by_workers)
    goal = report.short(setup.target)
    sentences = []
    for scenario in setup.scenarios:
        winners = [next((f.strategy for f in by_workers[n][scenario.token] if f.winner), None) for n in counts]
        last = winners[-1]
        first = len(winners) - 1
        while first > 0 and winners[first - 1] == last:
            first -= 1
        where = f"under {scenario.token}"
        if last is None:
            sentences.append(f"{where.capitalize()}, no strategy reached {goal} at {counts[-1]} workers.")
            continue
        if first == 0:
            span = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
            sentences.append(f"{where.capitalize()}, {last} reaches {goal} first at every worker count "
                             f"simulated ({span}).")
            continue
        before = ", ".join(f"{w or 'none'} at {n}" for n, w in zip(counts[:first], winners[:first]))
        sentences.append(f"{where.capitalize()}, from {counts[first]} workers on, {last} reaches {goal} "
                         f"first (before that: {before}).")
    return sentences


def terminal(setup, by_workers) -> str:
    blocks = []
    for n, table in sorted(by_workers.items()):
        blocks.append(f"=== {n} workers (simulated) ===\n" + report.terminal(setup, checked_at(setup, n), table))
    return "\n\n".join(blocks)


def scaling_plot(setup, by_workers, out: Path) -> dict[str, Any]:
    """Median time to target against worker count, one panel per scenario, one line per strategy
    (x on the line's count axis where it was not reached; ^ at the fastest's time where the race stopped it)."""
    plots._pyplot()  # (matplotlib with its file backend, before the panels)
    colours = plots._colours(setup)
    counts = sorted(by_workers)
    fig, axes = plots._panels(len(setup.scenarios))
    for ax, scenario in zip(axes, setup.scenarios):
        for strategy in setup.strategies:
            rows = {n: next(f for f in by_workers[n][scenario.token] if f.strategy == strategy.token) for n in counts}
            xs = [n for n in counts if not math.isinf(rows[n].median_seconds)]
            ax.plot(xs, [rows[n].median_seconds for n in xs], marker="o", ms=4, lw=1.5, color=colours[strategy.token],
                    label=strategy.token)
            behind = [n for n in counts if rows[n].behind is not None]
            if behind:  # stopped by the race: slower than the fastest time, drawn there pointing up
                ax.plot(behind, [rows[n].behind for n in behind], ls="none", marker="^", ms=7, mfc="none",
                        color=colours[strategy.token])
            missed = [n for n in counts if math.isinf(rows[n].median_seconds) and rows[n].behind is None]
            if missed:
                ax.plot(missed, [0] * len(missed), ls="none", marker="x", ms=8, mew=2, color=colours[strategy.token],
                        clip_on=False)
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_ylim(bottom=0)
        ax.set_title(scenario.token)
        ax.set_xlabel("workers")
        ax.set_ylabel(f"simulated time to {report.short(setup.target)} (s)")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8)
    fig.suptitle("simulated: time to target against worker count (x at 0: not reached; ^: stopped, slower)")
    return plots._save(fig, out / SCALING_PLOT, "simulated time to target against worker count")


def figures_table(setup, by_workers) -> list[str]:
    """Markdown: one row per (scenario, strategy), one column per worker count: median simulated time."""
    counts = sorted(by_workers)
    lines = ["| scenario | strategy | " + " | ".join(f"{n} workers" for n in counts) + " |",
             "|" + "---|" * (2 + len(counts))]
    for scenario in setup.scenarios:
        for strategy in setup.strategies:
            cells = []
            for n in counts:
                f = next(f for f in by_workers[n][scenario.token] if f.strategy == strategy.token)
                cell = report.time_cell(f)
                cells.append(f"**{cell}**" if f.winner else cell)
            lines.append(f"| {scenario.token} | {strategy.token} | " + " | ".join(cells) + " |")
    return lines


def write(out: Path, setup, problem, results: dict[int, list], by_workers, command: Optional[str],
          incomplete: Optional[dict] = None) -> list[Path]:
    """Every worker count's report in ``workers-N/``, and the scaling report at the top; returns report.md's path
    first. ``incomplete``: stopped by a signal; ``by_workers`` then holds the worker counts that finished, and the
    count it stopped in gets its own report of the runs that finished, marked incomplete."""
    written = []
    for n, runs in sorted(results.items()):
        table = by_workers.get(n) or report.tables(setup, runs)
        folder = out / f"workers-{n}"
        folder.mkdir(parents=True, exist_ok=True)
        drawn = plots.draw(setup, table, runs, folder)
        partial = None if n in by_workers or not incomplete else {**incomplete, "runs_finished": len(runs)}
        written.append(report.write(folder, setup, checked_at(setup, n), table, runs, drawn, command, partial)[0])
    lines = ["# phalanx compare --simulate: which strategy reaches the target first, by worker count", ""]
    if incomplete:
        done = ", ".join(map(str, sorted(by_workers))) or "none"
        lines += [f"**Incomplete**: stopped by {incomplete['stopped_by']} during run {incomplete['interrupted_run']} "
                  f"of {incomplete['runs_planned']} ({incomplete['interrupted_label']}). Worker counts finished: "
                  f"{done}; the runs that finished after them are in their worker count's report.", ""]
    sentences = crossover(setup, by_workers) if by_workers else []
    picture = scaling_plot(setup, by_workers, out) if by_workers else None
    if picture is not None:  # (there is one exactly when some worker count finished)
        lines += [" ".join(sentences), "",
                  f"Every figure is simulated: {setup.task.model_name} on {setup.task.data_name}, target "
                  f"{report.target_words(setup.target)}, medians of {setup.repeats} "
                  f"repeat{'s' * (setup.repeats != 1)}, the simulated training time (fastest in bold).", ""]
        lines += figures_table(setup, by_workers) + ["", f"![{picture['title']}]({picture['file']})"]
    lines += ["", "## The clock", ""] + [f"- {note}" for note in problem.clock_notes]
    lines += ["", VALIDATED]
    lines += ["", "## Each worker count", ""] + [f"- [{p.parent.name}]({p.parent.name}/report.md)" for p in written]
    lines += ["", "## Setup", "", f"    {command}" if command else ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    data = {**({"incomplete": incomplete} if incomplete else {}),
            "simulated": True, "command": command, "workers": sorted(by_workers), "answer": sentences,
            "clock": list(problem.clock_notes), "validated": VALIDATED,
            "setup": report.setup_dict(setup, checked_at(setup, max(results)), command),
            "figures": {str(n): {s: [f.to_dict() for f in rows] for s, rows in table.items()}
                        for n, table in by_workers.items()},
            "plot": picture, "machine": report.machine()}
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    return [out / "report.md", out / "report.json", *written]
