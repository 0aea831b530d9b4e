"""What ``phalanx compare`` tells the user: a table per scenario, the answer in words, report.md and report.json.

Every figure here is computed from the runs' :class:`~phalanx.compare.results.RunResult` (which
are read from their metrics files): the tables and the answer say nothing that the runs did not
measure. A strategy's time to target is the median over its repeats, a repeat that missed the
target counting as infinitely slow; the winner of a scenario is the lowest median.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ..task.metrics import Target
from ..comm.wire import size
from .results import Figures, RunResult, figures, rank
from .runner import Checked, Setup
from .tokens import Scenario


def baseline(setup: Setup) -> str:
    """What the ratios compare against: the reference strategy (sync) where it runs, else the first listed."""
    return next((s.token for s in setup.strategies if s.options.reference), setup.strategies[0].token)


def tables(setup: Setup, runs: list[RunResult]) -> dict[str, list[Figures]]:
    """scenario -> one :class:`Figures` per strategy (in the order given), ranked."""
    out = {}
    for scenario in setup.scenarios:
        rows = []
        for strategy in setup.strategies:
            mine = [r for r in runs if r.scenario == scenario.token and r.strategy == strategy.token]
            if mine:
                rows.append(figures(mine, setup.max_steps))
        out[scenario.token] = rank(rows, baseline(setup))
    return out


# --------------------------------------------------------------------------- cells


def target_words(target: Target) -> str:
    """``0.95 test accuracy`` for an accuracy; ``test loss<=0.3`` for any other metric."""
    return f"{target.value:g} test accuracy" if target.metric == "accuracy" and target.higher else f"test {target}"


def short(target: Target) -> str:
    """``0.95`` for an accuracy; ``loss<=0.3`` for any other metric."""
    return f"{target.value:g}" if target.metric == "accuracy" and target.higher else str(target)


def _final(r: RunResult) -> str:
    value = r.final if r.final is not None else r.final_accuracy
    return "-" if value is None else f"{value:.4f}"


def _missed(r: RunResult) -> str:
    """Why a run has no step to target."""
    if r.diverged:
        return "diverged"
    return f"stopped at step {r.steps}, past {seconds(r.stopped_behind)}" if r.stopped_behind is not None \
        else "not reached"


def seconds(value: Optional[float]) -> str:
    """``1.23 s``; ``-`` where not known (a run that did not reach the target)."""
    if value is None:
        return "-"
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def best(f: Figures, digits: int = 2) -> str:
    """The best value of the target's metric any repeat reached: ``0.93``; ``loss 0.41`` for another metric."""
    value = f.best_value
    text = "-" if value is None else f"{value:.{digits}f}"
    return text if f.metric == "accuracy" else f"{f.metric} {text}"


def time_cell(f: Figures) -> str:
    """``4.12 s (3.90-4.40)``; ``not reached in 600 steps (best 0.93)``; ``> 3.10 s (stopped; best 0.91)``
    where the race stopped it; partial successes say how many."""
    if f.behind is not None:
        return f"> {seconds(f.behind)} (stopped; best {best(f)})"
    if not f.any_reached:
        return f"not reached in {f.max_steps} steps (best {best(f)})"
    spread = f"{seconds(min(f.seconds))}-{seconds(max(f.seconds))}".replace(" s-", "-") if f.runs > 1 else ""
    if math.isinf(f.median_seconds):
        return f"reached in {f.reached} of {f.runs} runs only ({spread or seconds(f.seconds[0])})"
    cell = seconds(f.median_seconds) + (f" ({spread})" if spread else "")
    return cell + (f", {f.reached} of {f.runs} reached" if f.reached < f.runs else "")


def row(f: Figures) -> list[str]:
    return [("* " if f.winner else "  ") + f.strategy, time_cell(f),
            f"{f.median_steps:.0f}" if f.median_steps is not None else "-",
            f"{f.examples_per_sec:,.0f}",
            f"{f.ratio:.2f}" if f.ratio is not None else "-",
            f"{f.staleness_mean:.1f}" if f.staleness_mean is not None else "-",
            f"{100 * f.dropped_fraction:.1f}%" if f.dropped_fraction is not None else "-",
            size(f.bytes_per_step) if f.bytes_per_step is not None else "-",
            size(f.bytes_to_target) if f.bytes_to_target is not None else "-"]


HEADERS = ["strategy", "time to target (median, min-max)", "steps", "examples/s", "vs {base}", "staleness",
           "dropped", "bytes/step", "bytes to target"]


def _headers(setup: Setup) -> list[str]:
    return [h.format(base=baseline(setup)) for h in HEADERS]


def _title(setup: Setup, checked: Checked, scenario: Scenario) -> str:
    return (f"{'simulated: ' if setup.simulated else ''}{scenario.token} ({scenario.describe()}): time to "
            f"{target_words(setup.target)}, "
            f"{checked.workers} workers, {setup.repeats} repeat{'s' * (setup.repeats != 1)}")


def terminal(setup: Setup, checked: Checked, table: dict[str, list[Figures]]) -> str:
    """The tables printed at the end of a comparison."""
    blocks = []
    for scenario in setup.scenarios:
        rows = [_headers(setup)] + [row(f) for f in table[scenario.token]]
        rows[0][0] = "  " + rows[0][0]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i in (0, 1) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        blocks.append("\n".join([_title(setup, checked, scenario)] + lines))
    legend = (f"* reached the target first. Time is {'simulated ' if setup.simulated else ''}training time "
              "(start-up and evaluations excluded), measured "
              f"at evaluations every {setup.eval_every} steps; 'vs {baseline(setup)}' is the ratio of median times.")
    if any(f.behind is not None for rows in table.values() for f in rows):
        legend += (" '> T (stopped)': its runs were stopped once their simulated clock passed T, the fastest time to "
                   "the target found before them, so it could not be first (--no-race runs them to the end).")
    return "\n\n".join(blocks + [legend])


# --------------------------------------------------------------------------- the answer in words


def _why(w: Figures, base: Figures) -> str:
    """Which of the two factors (steps, time per step) made ``w`` faster than ``base``."""
    if w.median_steps is None or base.median_steps is None:
        return ""
    return (f": it needed {w.median_steps:.0f} steps to {base.strategy}'s {base.median_steps:.0f} and computed "
            f"{w.examples_per_sec:,.0f} examples/s to {base.examples_per_sec:,.0f}")


def scenario_sentence(setup: Setup, scenario: Scenario, rows: list[Figures]) -> str:
    name = f"With {scenario.describe()} ({scenario.token})"
    if not rows:  # a comparison stopped by a signal before any run of this scenario finished
        return f"{name}, no run finished."
    winner = next((f for f in rows if f.winner), None)
    base = next((f for f in rows if f.strategy == baseline(setup)), None)
    missed = [f for f in rows if not f.any_reached and f.behind is None]
    stopped = [f.strategy for f in rows if f.behind is not None]
    if winner is None:
        known = [(f.best_value, f) for f in rows if f.best_value is not None]
        top = (max if setup.target.higher else min)(known, key=lambda p: p[0])[1] if known else rows[0]
        return (f"{name}, no strategy reached {short(setup.target)} in {setup.max_steps} steps in most runs (the best "
                f"{setup.target.metric} was {best(top, 3).split()[-1]}, by {top.strategy}).")
    text = f"{name}, **{winner.strategy}** reached {short(setup.target)} first, in {seconds(winner.median_seconds)}"
    if base is not None and base is not winner and base.ratio is not None and winner.ratio:
        text += f", {1 / winner.ratio:.2f}x as fast as {base.strategy} ({seconds(base.median_seconds)})"
        text += _why(winner, base)
    elif base is winner:
        others = sorted(((f.ratio, f) for f in rows if f is not winner and f.ratio is not None), key=lambda p: p[0])
        if others:
            ratio, nxt = others[0]
            text += f"; the next, {nxt.strategy}, took {ratio:.2f}x as long" + _why(nxt, winner)
    if missed:
        text += "; " + ", ".join(f"{f.strategy} never reached it (best {best(f, 3)})" for f in missed)
    if stopped:
        text += f"; {', '.join(stopped)} {'was' if len(stopped) == 1 else 'were'} stopped once slower"
    return text + "."


def answer(setup: Setup, checked: Checked, table: dict[str, list[Figures]]) -> str:
    """One paragraph: which strategy reached the target first in each scenario, and why, from the numbers."""
    model = setup.task.model_name
    sentences = [scenario_sentence(setup, s, table[s.token]) for s in setup.scenarios]
    wins: dict[str, int] = {}
    for rows in table.values():
        for f in rows:
            wins[f.strategy] = wins.get(f.strategy, 0) + f.winner
    champions = sorted((n, s) for s, n in wins.items() if n)
    if champions and len(champions) == 1 and champions[0][0] == len(setup.scenarios):
        close = f"On this problem, {champions[0][1]} was the fastest to the target in every scenario."
    elif champions:
        close = "The fastest strategy depends on the stragglers: " + ", ".join(
            f"{s} won {n} of {len(setup.scenarios)} scenario{'s' * (len(setup.scenarios) != 1)}"
            for n, s in reversed(champions)) + "."
    else:
        close = "No strategy reached the target: raise --max-steps, or lower --target."
    lead = (f"{'Simulated (an event simulation, not a run). ' if setup.simulated else ''}Problem: {model} on "
            f"{setup.task.data_name}, {checked.workers} workers, target {target_words(setup.target)}, "
            f"medians of {setup.repeats} repeat{'s' * (setup.repeats != 1)}.")
    return " ".join([lead] + sentences + [close])


# --------------------------------------------------------------------------- files


def machine() -> dict[str, Any]:
    """The machine and versions the comparison ran on (every figure depends on them)."""
    import torch

    from .. import __version__

    cores: Optional[int]
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_cores": cores, "python": sys.version.split()[0], "torch": torch.__version__,
            "phalanx": __version__, "cuda": torch.version.cuda,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def setup_dict(setup: Setup, checked: Checked, command: Optional[str]) -> dict[str, Any]:
    train = setup.train.resolved(setup.task.model_name)
    return {"command": command, "strategies": [s.token for s in setup.strategies],
            "scenarios": [s.token for s in setup.scenarios], "target": str(setup.target), "repeats": setup.repeats,
            "max_steps": setup.max_steps, "eval_every": setup.eval_every, "workers": checked.workers,
            "model": setup.task.model_name, "data": setup.task.data_name, "batch_size": train.batch_size,
            "global_batch": checked.global_batch, "optimizer": train.optimizer, "lr": train.lr,
            "momentum": train.momentum, "seed": setup.train.seed, "devices": str(setup.train.devices)}


def markdown(setup: Setup, checked: Checked, table: dict[str, list[Figures]], runs: list[RunResult],
             plots: list[dict[str, Any]], info: dict[str, Any], command: Optional[str]) -> str:
    heading = "phalanx compare --simulate" if setup.simulated else "phalanx compare"
    lines = [f"# {heading}: which strategy reaches {target_words(setup.target)} first", "",
             answer(setup, checked, table), ""]
    for scenario in setup.scenarios:
        lines += [f"## {_title(setup, checked, scenario)}", "",
                  "| " + " | ".join(_headers(setup)) + " |", "|" + "---|" * len(HEADERS)]
        for f in table[scenario.token]:
            cells = row(f)
            cells[0] = f"**{f.strategy}** (fastest)" if f.winner else f.strategy
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += [("Every figure is simulated: time is the simulation's clock (the cost models of phalanx estimate), "
               "learning is real (each worker's gradients of the model, in the simulated order). "
               if setup.simulated else "")
              + "Time is training time: worker start-up and evaluations are excluded (each run's are in "
              f"report.json), measured at evaluations every {setup.eval_every} steps. Examples/s counts every "
              "example a worker computed a gradient on, dropped ones included. Staleness: mean updates behind; "
              "dropped: late gradients a backup strategy did not apply. Bytes: what every rank sent over the "
              "network in the training steps, priced by each collective's algorithm (bytes to target: per step x "
              "steps to target).", ""]
    lines += [f"![{p['title']}]({p['file']})" for p in plots] + [""]
    lines += ["## Setup", "", f"    {command}" if command else "", ""]
    lines += [f"- {k}: {v}" for k, v in setup_dict(setup, checked, None).items() if k != "command"]
    lines += ["", "## Machine and versions", ""] + [f"- {k}: {v}" for k, v in info.items()]
    lines += ["", "## Every run", "", "| scenario | strategy | repeat | reached at step | time to target | "
              f"final {setup.target.metric} | training s | evaluation s | start-up s | examples/s |", "|" + "---|" * 10]
    for r in runs:
        lines.append(f"| {r.scenario} | {r.strategy} | {r.repeat + 1} | "
                     f"{r.steps_to_target if r.reached else _missed(r)} | "
                     f"{seconds(r.seconds_to_target) if r.reached else '-'} | {_final(r)} | "
                     f"{r.train_seconds:.2f} | {r.eval_seconds:.2f} | {r.startup_seconds:.2f} | "
                     f"{r.examples_per_sec:,.0f} |")
    return "\n".join(lines) + "\n"


def write(out: Path, setup: Setup, checked: Checked, table: dict[str, list[Figures]], runs: list[RunResult],
          plots: list[dict[str, Any]], command: Optional[str], incomplete: Optional[dict] = None) -> list[Path]:
    """report.md and report.json in ``out``; returns their paths. ``incomplete``: the comparison was
    stopped (by whom, during which run); the report says so first, and holds the runs that finished."""
    info = machine()
    data = {**({"incomplete": incomplete} if incomplete else {}),
            "setup": setup_dict(setup, checked, command), "machine": info, "answer": answer(setup, checked, table),
            "baseline": baseline(setup),
            "figures": {s: [f.to_dict() for f in rows] for s, rows in table.items()},
            "plots": plots, "runs": [r.to_dict() for r in runs]}
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    text = markdown(setup, checked, table, runs, plots, info, command)
    if incomplete:
        first, rest = text.split("\n", 1)
        text = (f"{first}\n\n**Incomplete**: stopped by {incomplete['stopped_by']} during run "
                f"{incomplete['interrupted_run']} of {incomplete['runs_planned']} ({incomplete['interrupted_label']}); "
                f"the figures below are from the {incomplete['runs_finished']} run(s) that finished.\n{rest}")
    (out / "report.md").write_text(text)
    return [out / "report.md", out / "report.json"]
