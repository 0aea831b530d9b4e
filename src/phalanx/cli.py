"""``phalanx`` on the command line: flags made from the config and options dataclasses, then the library.

Every ``phalanx train`` flag is a field of :class:`~phalanx.train.TrainConfig` or of a strategy's
options, declared once with its help and default (``phalanx/options.py``); this module only lays
the flags out and maps what the user typed back onto those dataclasses. A strategy option given
with a strategy that does not take it is refused, naming the strategies that do.

Exit status: 0 done; 1 the run failed (a worker crashed, the model diverged); 2 bad input, with a
one-line message that names the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
import warnings
from typing import Callable, Optional, Sequence

from . import __version__, config_file, log
from .launcher import startup
from .errors import PhalanxError, Stopped, TrainingDiverged, WorkerFailed
from .options import add_flags, declared, field_flag, given

#: seconds a rank other than 0 waits, under torchrun or srun, before exiting on an error every rank meets
#: alike, so that rank 0 prints it first (rank 0's exit ends the job, this rank included, sooner)
AGREED_GRACE_S = 5.0


class Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other bad input. No abbreviations: argparse would read
    ``--step 5`` as ``--steps 5`` (and a flag added later could change what an abbreviation means)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message}{_train_only(message)} (see '{self.prog} --help')\n")


def _train_only(message: str) -> str:
    """Where a command refuses a strategy's flag (compare and estimate take only what they model): whose flag it is."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    flags = {field_flag(cls, name): names for name, (cls, names) in strategy_fields().items()}
    for token in message.partition(":")[2].split():
        flag = token.partition("=")[0]
        if flag in flags:
            return (f"; {flag} is {' and '.join(flags[flag])}'s option in phalanx train, and this command runs or "
                    f"predicts each strategy without it: drop {flag}")
    return ""


def strategy_fields() -> dict[str, tuple[type, list[str]]]:
    """Every strategy option: field name -> (the first options class declaring it, every strategy taking it)."""
    from .strategies import STRATEGIES, takers

    out: dict[str, tuple[type, list[str]]] = {}
    for cls in STRATEGIES.values():
        for field in declared(cls):
            out.setdefault(field.name, (cls, takers(field.name)))
    return out


def add_train_flags(p: argparse.ArgumentParser) -> None:
    from .train import TrainConfig
    from .train.config import SECTIONS

    config_file.add_flag(p)
    for title, names in SECTIONS.items():
        add_flags(p.add_argument_group(title), TrainConfig, names)
    group = p.add_argument_group("strategy options (each refused by the strategies that do not take it)")
    for name, (cls, owners) in strategy_fields().items():
        add_flags(group, cls, [name], prefix=f"{', '.join(owners)}: ")


def strategy_from_args(args: argparse.Namespace):
    """The chosen strategy's options from the flags typed; a flag it does not take is an error."""
    from .strategies import strategy_class

    chosen = strategy_class("sync" if args.strategy is None else args.strategy)  # '' is a name, and unknown
    own = {f.name for f in dataclasses.fields(chosen)}
    typed = given(args, strategy_fields())
    for name in typed:
        if name not in own:
            owners = strategy_fields()[name][1]
            flag = field_flag(strategy_fields()[name][0], name)
            raise PhalanxError(f"{flag} is an option of {' and '.join(owners)}; --strategy {chosen.name} does not "
                               f"take it (drop {flag}, or use --strategy {owners[0]})")
    return chosen(**typed)


def config_from_args(args: argparse.Namespace):
    from .train import TrainConfig

    fields = [f.name for f in declared(TrainConfig) if f.name != "strategy"]
    values = given(args, fields)
    return TrainConfig(strategy=strategy_from_args(args), **values)


def cmd_train(args: argparse.Namespace) -> int:
    from .launcher import launcher_rank
    from .train import Trainer

    started = time.perf_counter()
    try:
        summary = Trainer(config_from_args(args)).fit()
    except Stopped as e:
        again = " ".join(["phalanx", *[a for a in sys.argv[1:] if a != "--resume"], "--resume"])
        raise Stopped(f"{e}; continue with: {again}" if e.summary else str(e), e.signame, e.summary) from None
    if summary is not None and launcher_rank() == 0:  # under torchrun or srun every rank gets here
        print(f"wall time {time.perf_counter() - started:.1f} s (including worker start-up)", flush=True)
    return 0


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its one-line help, and the module holding its flags and its run. The module is
    imported only when the command is chosen (or the whole parser is built, for docs/flags.md): a cold
    ``phalanx train`` does not import compare's, estimate's or topology's code to lay out flags it never reads."""

    help: str  #: shown by ``phalanx --help`` and as the command's description
    module: str  #: imported when the command is chosen
    add_flags: str = "add_flags"  #: name in ``module`` of ``(parser) -> None``: the command's flags
    run: str = "run"  #: name in ``module`` of ``(args) -> exit status``

    def load(self) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
        module = importlib.import_module(self.module)
        return getattr(module, self.add_flags), getattr(module, self.run)


#: Every command, in the order ``--help`` and docs/flags.md list them.
COMMANDS = {
    "train": Command("train a model", __name__, "add_train_flags", "cmd_train"),
    "compare": Command("which strategy reaches a target accuracy first, with and without stragglers",
                       "phalanx.compare.cli", "add_compare_flags"),
    "topology": Command("show which devices reach each other directly", "phalanx.topology.cli"),
    "estimate": Command("predict step time and scaling per strategy and worker count, before renting the machines",
                        "phalanx.estimate.cli"),
    "evaluate": Command("print every metric of a checkpoint on its test set (or validation part), in one process",
                        "phalanx.train.evaluate", "add_flags_to"),
}


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"phalanx {__version__} (torch {torch_version}, Python {sys.version.split()[0]})"


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The command line's parser: every command's flags, or, given ``only``, that command's alone (the
    others listed by name and help, which is all ``phalanx --help`` shows of them; ``""``: none's)."""
    parser = Parser(prog="phalanx", description="Train one PyTorch model on many devices.")
    parser.add_argument("--version", action="version", version=_versions())
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        if only is None or name == only:
            add_flags_, run = command.load()
            add_flags_(p)
            p.set_defaults(run=run, command_parser=p)
    return parser


def chosen_command(argv: Sequence[str]) -> Optional[str]:
    """The command ``argv`` names: its first word that is not a flag (the top level takes only ``--help`` and
    ``--version``, neither with a value, so argparse reads the same word as the command); None if it names none."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def _one_line_warnings(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    startup.begin()
    fresh = "torch" not in sys.modules  # (a new process: nothing ran torch in it yet)
    argv = sys.argv[1:] if argv is None else list(argv)
    warnings.showwarning = _one_line_warnings
    log.show_on_streams()  # the library's notes and warnings, as this command always printed them
    # (a command's flags only: none where argv names no command, for --version and --help, which import no torch)
    parser = build_parser(only=chosen_command(argv) or "")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # (refused by the command's parser: its help is the one that lists what it takes)
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    _start_worker_server(args, fresh)
    try:
        if getattr(args, "config", None) is not None:  # the file's values, where no flag was typed
            config_file.apply(args.config, args.command_parser, args)
        code = args.run(args)
    except WorkerFailed as e:
        _say(f"error: {e.who} failed:\n{e.detail}", agreed=False)
        code = e.exit_code
    except (Stopped, TrainingDiverged) as e:
        _say(f"error: {e}" if isinstance(e, TrainingDiverged) else str(e), agreed=True)
        code = e.exit_code
    except PhalanxError as e:
        _say(f"error: {e}", agreed=not _in_a_running_job())
        code = e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    from .launcher import leave  # (not before the flags are read: --version and --help import no torch)

    return leave(code)


def _start_worker_server(args: argparse.Namespace, fresh: bool) -> None:
    """A command that will start worker processes (train, compare, estimate's measuring processes) starts their fork
    server once its flags are read: a fork of this process, if ``fresh`` (nothing ran torch here before the
    command), that imports the rest while this one plans (see :mod:`phalanx.launcher.forkserver`). Not under
    torchrun or srun (this process is a worker: nothing to start), nor for a simulated comparison given its step
    time and link (``--step-time``, ``--link-bandwidth``: no process runs), nor for a run in this one process
    (``train --workers 1`` without loader workers, as typed: a --config file may ask for more, and then the server
    starts when the workers do)."""
    from .launcher.forkserver import start_early
    from .launcher.env import joined

    wanted = os.environ.get("PHALANX_START_METHOD", "forkserver") == "forkserver"
    # (a simulated comparison measures this machine's step and link in worker processes, unless both are given)
    simulated_only = args.command == "compare" and args.simulate and None not in (args.step_time, args.link_bandwidth)
    runs = args.command in ("train", "estimate", "compare") and not simulated_only
    one_process = args.command == "train" and args.workers == 1 and not args.loader_workers
    if wanted and runs and not one_process and joined() is None:
        from .task.import_paths import import_early, is_import_path

        if fresh:  # (the server forks from this process: with the user's code imported, so is every worker)
            for module in _code_modules(args):
                import_early(module)
        # (the parent tries a user's optimizer and scheduler factories once: see train/step_checks.py)
        factories = [str(getattr(args, name, None) or "") for name in ("optimizer", "lr_scheduler")]
        strategies = str(getattr(args, "strategy", None) or getattr(args, "strategies", None) or "").split(",")
        start_early(fork=fresh, builds_an_optimizer=any(is_import_path(spec) for spec in factories),
                    traces=args.command != "estimate" and "pipeline" in strategies,  # (estimate prices blocks only)
                    compiles=bool(getattr(args, "compile", False)))


#: the flags that may name the user's code as MODULE:CALLABLE (a metric's among names separated by commas)
CODE_FLAGS = ("model", "data", "loss", "training_step", "metric", "optimizer", "lr_scheduler", "init_weights")


def _code_modules(args: argparse.Namespace) -> list[str]:
    """The modules of the user's code that the flags typed name (``--model mymod:Net``): this process imports them to
    plan the run in any case, and imported before the server forks from it, every worker forks with them (a Hugging
    Face model's module imports transformers' modeling machinery, 2.4 to 3.4 s of CPU in each worker otherwise)."""
    from .task.import_paths import is_import_path

    specs = [spec for name in CODE_FLAGS for spec in str(getattr(args, name, None) or "").split(",")]
    modules = [spec.partition(":")[0] for spec in specs if is_import_path(spec)]
    return [module for module in modules if module]


def _in_a_running_job() -> bool:
    from .launcher import joined_a_group

    return joined_a_group()


def _say(message: str, agreed: bool) -> None:
    """Print an error once per job: under torchrun or srun every rank runs this command, and an error
    every rank reaches alike (bad input found before the job starts, an agreed stop, the NaN guard)
    is rank 0's to print; any other is this rank's own and says which rank it is."""
    from .launcher import launcher_rank

    rank = launcher_rank()
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    elif not agreed:
        print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
    else:
        # Rank 0 says it. A rank that failed first would have torchrun end the others at once, rank 0
        # perhaps before it printed (seen under load): give it the time; its exit ends this rank too.
        time.sleep(AGREED_GRACE_S)


if __name__ == "__main__":
    sys.exit(main())
