"""The pictures of a comparison, drawn with matplotlib (no display needed: the Agg backend).

- ``accuracy-vs-time.png``: test accuracy against training time, one panel per scenario, one
  colour per strategy (every repeat drawn), the target as a dashed line;
- ``accuracy-vs-steps.png``: the same against steps (statistical efficiency alone);
- ``time-to-target.png``: the median time to target as bars, min-max as error bars, one group
  per scenario; a strategy that never reached the target is marked instead of drawn;
- ``staleness.png``: for each strategy that has one, its staleness histogram (every repeat pooled),
  one series per scenario.

Each figure is drawn at a fixed size (inches x DPI) and saved without trimming, so its pixel size
is the one :func:`draw` returns for report.json.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .results import Figures, RunResult
from .runner import Setup

DPI = 100
PANEL = (4.6, 3.6)  #: inches per panel


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colours(setup: Setup) -> dict[str, Any]:
    plt = _pyplot()
    cycle = plt.get_cmap("tab10")
    return {s.token: cycle(i % 10) for i, s in enumerate(setup.strategies)}


def _save(fig, path: Path, title: str) -> dict[str, Any]:
    fig.savefig(path, dpi=DPI)
    width, height = fig.get_size_inches()
    _pyplot().close(fig)
    return {"file": path.name, "title": title, "width": int(round(width * DPI)), "height": int(round(height * DPI))}


def _panels(n: int):
    plt = _pyplot()
    fig, axes = plt.subplots(1, n, figsize=(PANEL[0] * n, PANEL[1]), dpi=DPI, squeeze=False, layout="constrained")
    return fig, list(axes[0])


def curves(setup: Setup, runs: list[RunResult], out: Path, x: str) -> dict[str, Any]:
    """The target's metric (accuracy, loss ...) against training time (``x="seconds"``) or steps (``x="step"``)."""
    colours = _colours(setup)
    metric = setup.target.metric
    fig, axes = _panels(len(setup.scenarios))
    for ax, scenario in zip(axes, setup.scenarios):
        for strategy in setup.strategies:
            mine = [r for r in runs if r.scenario == scenario.token and r.strategy == strategy.token]
            for i, r in enumerate(mine):
                ax.plot([p[x] for p in r.curve], [p[metric] for p in r.curve],
                        color=colours[strategy.token],
                        alpha=0.85 if i == 0 else 0.45, lw=1.4, marker=".", ms=3,
                        label=strategy.token if i == 0 else None)
        ax.axhline(setup.target.value, color="0.4", ls="--", lw=1)
        ax.set_title(scenario.token)
        ax.set_xlabel("training time (s)" if x == "seconds" else "steps")
        ax.set_ylabel(f"test {metric}")
        if metric == "accuracy":
            ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8, loc="lower right" if setup.target.higher else "upper right")
    what = "training time" if x == "seconds" else "steps"
    name = f"{metric}-vs-time.png" if x == "seconds" else f"{metric}-vs-steps.png"
    fig.suptitle(f"{'simulated: ' if setup.simulated else ''}test {metric} against {what} (target {setup.target})")
    return _save(fig, out / name, f"test {metric} against {what}")


def bars(setup: Setup, table: dict[str, list[Figures]], out: Path) -> dict[str, Any]:
    """Median time to target per strategy and scenario, with the min-max spread."""
    plt = _pyplot()
    colours = _colours(setup)
    n = len(setup.strategies)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 0.45 * n * len(setup.scenarios)), 4.2), dpi=DPI,
                           layout="constrained")
    width = 0.8 / n
    tallest = max((max(f.seconds) for rows in table.values() for f in rows if f.seconds), default=1.0)
    for g, scenario in enumerate(setup.scenarios):
        for i, f in enumerate(table[scenario.token]):
            x = g + (i - (n - 1) / 2) * width
            label = f.strategy if g == 0 else None
            if math.isinf(f.median_seconds):
                ax.plot(x, 0, marker="x", color=colours[f.strategy], ms=9, mew=2, label=label, clip_on=False)
                continue
            low, high = f.median_seconds - min(f.seconds), max(f.seconds) - f.median_seconds
            ax.bar(x, f.median_seconds, width * 0.9, color=colours[f.strategy], label=label,
                   yerr=[[low], [high]], capsize=3, edgecolor="black" if f.winner else "none")
    ax.set_ylim(0, 1.15 * tallest)
    ax.set_xticks(range(len(setup.scenarios)), [s.token for s in setup.scenarios])
    ax.set_ylabel(f"training time to {setup.target} (s)")
    ax.set_title(f"{'simulated ' if setup.simulated else ''}time to target: median, min-max over repeats "
                 "(x: not reached)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncols=min(n, 4))
    return _save(fig, out / "time-to-target.png", "time to target")


def staleness(setup: Setup, runs: list[RunResult], out: Path) -> dict[str, Any] | None:
    """Staleness histograms of the strategies that have one (None: none has); backup's title says what it dropped."""
    from matplotlib.ticker import MaxNLocator

    having = [s for s in setup.strategies if any(r.staleness for r in runs if r.strategy == s.token)]
    if not having:
        return None
    fig, axes = _panels(len(having))
    width = 0.8 / len(setup.scenarios)
    for ax, strategy in zip(axes, having):
        for j, scenario in enumerate(setup.scenarios):
            pooled: dict[int, int] = {}
            for r in runs:
                if r.strategy == strategy.token and r.scenario == scenario.token and r.staleness:
                    for value, count in r.staleness["histogram"].items():
                        pooled[int(value)] = pooled.get(int(value), 0) + count
            total = sum(pooled.values()) or 1
            values = sorted(pooled)
            ax.bar([v + (j - (len(setup.scenarios) - 1) / 2) * width for v in values],
                   [pooled[v] / total for v in values], width, label=scenario.token)
        dropped = [r.dropped for r in runs if r.strategy == strategy.token and r.dropped]
        share = sum(d["total"] for d in dropped) / max(sum(d["of"] for d in dropped), 1)
        ax.set_title(strategy.token + (f" ({100 * share:.0f}% of gradients dropped)" if dropped else ""))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.set_xlabel("staleness (updates behind)")
        ax.set_ylabel("fraction of gradients applied")
        ax.grid(axis="y", alpha=0.3)
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"{'simulated: ' if setup.simulated else ''}staleness of the gradients applied")
    return _save(fig, out / "staleness.png", "staleness histograms")


def draw(setup: Setup, table: dict[str, list[Figures]], runs: list[RunResult], out: Path) -> list[dict[str, Any]]:
    """Every plot, written to ``out``; each as {file, title, width, height} (pixels)."""
    plots = [curves(setup, runs, out, "seconds"), curves(setup, runs, out, "step"), bars(setup, table, out),
             staleness(setup, runs, out)]
    return [p for p in plots if p is not None]
