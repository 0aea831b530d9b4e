"""What ``phalanx estimate`` shows: what was measured, a table per strategy, what would help; the plot."""

from __future__ import annotations

from pathlib import Path

from ..costs import modelled_cost
from ..costs.inputs import MEETING_AFTER
from ..errors import PhalanxError
from .run import Estimate
from ..units import fmt_bytes, fmt_seconds


def describe(est: Estimate) -> str:
    s = est.setup
    cfg, facts = s.config, s.facts
    shape = "x".join(map(str, s.input_shape))
    where = f"{s.device.type}, {s.cores} cores" if s.device.type == "cpu" else str(s.device)
    lines = [f"phalanx estimate: {s.task.model_name} on {s.task.data_name} ({shape}), batch {cfg.batch_size} per "
             f"worker, {cfg.optimizer}; measured on {where}; {s.per_node} workers per machine",
             f"model: {facts.params:,} parameters, {fmt_bytes(facts.param_bytes)} of gradients in "
             f"{len(facts.buckets)} DDP bucket(s) of {s.bucket_mb:g} MiB at most",
             f"compute per worker (means of {s.options.measure_steps} steps or more, a second of them at least, "
             f"after 5 warm-up steps):"]
    for cond, m in est.computes.items():
        server = " (a parameter server beside them)" if cond.beside else ""
        slowest = f"; slowest worker {fmt_seconds(m.slowest)} (each step, on average)" if cond.processes > 1 else ""
        lines.append(f"  {cond.processes} process(es) x {cond.threads} thread(s) on {cond.device}{server}: forward "
                     f"{fmt_seconds(m.forward)}, backward {fmt_seconds(m.backward)}, optimizer "
                     f"{fmt_seconds(m.optimizer)}, rest of the loop {fmt_seconds(m.loop)}{slowest}")
        if cond.beside:
            lines.append(f"    beyond compute and bytes: a parameter server's round trip of a 2-parameter model, "
                         f"another worker computing: {fmt_seconds(m.round_trip_tiny)}")
        elif cond.processes > 1 and cond.device == "cpu":
            lines.append(f"    beyond compute: the model's DDP step over its bare step +{fmt_seconds(m.ddp_excess)}; "
                         f"its parameters' all-reduce after {MEETING_AFTER} steps apart "
                         f"{fmt_seconds(m.allreduce_params)}, waiting there for the slowest "
                         f"{fmt_seconds(m.meeting_wait)}")
    lines += [f"link {note}" for note in est.link_notes]
    lines += est.warnings  # before the tables: they stand on these figures
    for cls in s.predicted:
        rows = [p for p in est.predictions if p.strategy == cls.name]
        if not rows:
            continue
        cost = modelled_cost(cls)
        lines += ["", cost.title, _header(cost.bubble)]
        lines += [_row(est, p, cost.bubble) for p in rows]
        lines += [f"  {note}" for note in rows[-1].notes]
        for advice in est.advice.get(cls.name, []):
            lines.append(f"  would help: {advice}")
    if s.skipped:
        lines += ["", "not predicted: " + "; ".join(s.skipped)]
    lines += ["", "speedup: examples/s over one worker alone on this machine; efficiency: over the same workers "
                  "with no communication (and no bubble); comm: the share of the step spent communicating after "
                  "overlap (or waiting for shared cores)"]
    return "\n".join(lines)


def _header(bubble: bool) -> str:
    extra = "  bubble" if bubble else ""
    return f"  {'workers':>7} {'machines':>8} {'step':>10} {'examples/s':>11} {'speedup':>8} {'efficiency':>10} " \
           f"{'comm':>6}{extra}"


def _row(est: Estimate, p, bubble: bool) -> str:
    extra = f"  {p.bubble / p.step:6.0%}" if bubble else ""
    return (f"  {p.workers:>7} {p.nodes:>8} {fmt_seconds(p.step):>10} {p.examples_per_s:>11,.0f} "
            f"{est.speedup(p):>8.2f} {p.efficiency:>10.2f} {p.comm_share:>6.0%}{extra}")


def plot(est: Estimate, path: str) -> None:
    """Examples/s and efficiency against workers, one line per strategy, with linear scaling for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, eff) = plt.subplots(1, 2, figsize=(11, 4.2))
    workers = sorted({p.workers for p in est.predictions})
    alone = est.setup.facts.batch_size / est.baseline.step
    rate.plot(workers, [alone * n for n in workers], "k:", label="linear (one worker alone x N)")
    for strategy in est.setup.options.strategies:
        rows = [p for p in est.predictions if p.strategy == strategy]
        if rows:
            rate.plot([p.workers for p in rows], [p.examples_per_s for p in rows], "o-", label=strategy)
            eff.plot([p.workers for p in rows], [p.efficiency for p in rows], "o-", label=strategy)
    for ax, title in ((rate, "predicted examples/s"), (eff, "scaling efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(workers, [str(n) for n in workers])
        ax.minorticks_off()
        ax.set_xlabel("workers")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    rate.set_yscale("log")
    eff.set_ylim(0, 1.05)
    rate.legend(fontsize=8)
    cfg = est.setup.config
    fig.suptitle(f"phalanx estimate: {est.setup.task.model_name}, batch {cfg.batch_size} per worker")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise PhalanxError(f"--plot {path}: cannot write it ({e.strerror or e}); choose a writable path") from None
    finally:
        plt.close(fig)


def check_plot_path(path: str) -> None:
    """Before measuring: the plot's directory must exist."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise PhalanxError(f"--plot {path}: directory {parent} does not exist; create it or choose another path")
