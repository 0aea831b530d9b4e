"""``phalanx`` on the command line: parse flags into config dataclasses and call the library.

Exit status: 0 done; 1 the run failed (a worker crashed, the model diverged); 2 bad input, with a
one-line message that names the fix.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Callable, Optional, Sequence

from .errors import PhalanxError, WorkerFailed
from .strategies import STRATEGIES


def _positive_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(p) for p in text.lower().replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not like 3x24x24") from None
    return shape


def _islands(text: str) -> list[list[int]]:
    try:
        return [[int(r) for r in part.split(",")] for part in text.split(";")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"islands {text!r} are not like '0,1;2,3'") from None


def add_train_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--strategy", default="sync", help=f"how workers cooperate: {', '.join(STRATEGIES)}")
    g.add_argument("--devices", default="auto", help="auto | cpu | cuda | cuda:0,2 (default auto)")
    g.add_argument("--strict-devices", action="store_true", help="fail instead of falling back to the CPU")
    g.add_argument("--workers", type=int, help="worker processes (default: one per GPU; on CPU, 2)")
    g.add_argument("--threads", type=int, help="torch threads per CPU worker (default: its share of the cores)")
    g.add_argument("--reduce", default="flat", help="sync: flat | hierarchical | auto")
    g.add_argument("--compress", default=None, help="sync: bf16 | fp16 gradient all-reduce")
    g.add_argument("--islands", type=_islands, help="sync: ranks grouped for --reduce, e.g. '0,1;2,3'")
    g.add_argument("--staleness", type=int, help="ssp: how many steps a worker may run ahead of the slowest")
    g.add_argument("--sync-every", type=int, help="local-sgd: average the parameters every H steps")
    g.add_argument("--straggler", help="RANK:FACTOR slows that rank by FACTOR (for studying stragglers)")
    g.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address on one machine")
    g = p.add_argument_group("pipeline (--strategy pipeline; see docs/pipeline.md)")
    g.add_argument("--stages", type=int, help="pipeline stages, one worker each (default: the number of workers)")
    g.add_argument("--chunks", type=int, default=4, help="micro-batches per step (default 4)")
    g.add_argument("--schedule", default="gpipe", help="gpipe | 1f1b (default gpipe)")
    g.add_argument("--balance", default="auto", help="auto | params | time | blocks per stage, e.g. 3,2 (default auto)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="cnn", help="cnn | mlp | cifar10 | lstm")
    g.add_argument("--data", default="digits", help="digits | cifar10 | synthetic")
    g.add_argument("--data-dir", help="directory holding the CIFAR-10 binary files")
    g.add_argument("--synthetic-shape", type=_positive_shape, default=(3, 24, 24), help="e.g. 3x24x24")
    g.add_argument("--synthetic-size", type=int, default=4096)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=300)
    g.add_argument("--batch-size", type=int, default=32, help="examples per worker per step")
    g.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (one all-reduce)")
    g.add_argument("--optimizer", default="sgd", help="sgd | adam")
    g.add_argument("--lr", type=float, default=0.05)
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--lr-schedule", default="constant", help="constant | exponential | cosine")
    g.add_argument("--lr-decay-every", type=int, default=100)
    g.add_argument("--lr-decay-factor", type=float, default=0.5)
    g.add_argument("--staircase", action="store_true", help="exponential decay in whole steps")
    g.add_argument("--warmup-steps", type=int, default=0)
    g.add_argument("--lr-base-batch", type=int, help="linear scaling rule: lr x global batch / this")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("observation and checkpoints")
    g.add_argument("--log-every", type=int, default=20)
    g.add_argument("--eval-every", type=int, default=0)
    g.add_argument("--metrics", help="JSON-lines file (default: CHECKPOINT_DIR/metrics.jsonl)")
    g.add_argument("--checkpoint-dir", default="checkpoints")
    g.add_argument("--checkpoint-every", type=int, default=100)
    g.add_argument("--keep-checkpoints", type=int, default=3)
    g.add_argument("--resume", nargs="?", const="", default=None,
                   help="continue from a checkpoint file, or (alone) the newest in --checkpoint-dir")
    g.add_argument("--progress", default="auto", help="auto | bar | lines | none")
    g.add_argument("--prefetch", type=int, default=2, help="batches prepared ahead")
    g.add_argument("--timeout", type=float, default=300.0, dest="timeout_s",
                   help="seconds a collective waits for a peer")


def config_from_args(args: argparse.Namespace):
    from .strategies import strategy_from_name
    from .train import TrainConfig

    options = {k: v for k, v in vars(args).items() if v is not None}
    strategy = strategy_from_name(args.strategy, **options)
    fields = set(TrainConfig.__dataclass_fields__)
    values = {k: v for k, v in vars(args).items() if k in fields and k != "strategy"}
    if values.get("resume") == "":
        values["resume"] = args.checkpoint_dir
    return TrainConfig(strategy=strategy, **values)


def cmd_train(args: argparse.Namespace) -> int:
    from .train import Trainer

    started = time.perf_counter()
    summary = Trainer(config_from_args(args)).fit()
    if summary is not None:
        print(f"wall time {time.perf_counter() - started:.1f} s (including worker start-up)", flush=True)
    return 0


Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]


def commands() -> dict[str, Command]:
    from .topology import cli as topology_cli

    return {
        "train": (add_train_flags, cmd_train, "train a model"),
        "topology": (topology_cli.add_flags, topology_cli.run, "show which devices reach each other directly"),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx", description="Train one PyTorch model on many devices.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_flags, run, help_) in commands().items():
        p = sub.add_parser(name, help=help_, description=help_)
        add_flags(p)
        p.set_defaults(run=run)
    return parser


def _one_line_warnings(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    warnings.showwarning = _one_line_warnings
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except WorkerFailed as e:
        print(f"error: {e.who} failed:\n{e.detail}", file=sys.stderr)
        return e.exit_code
    except PhalanxError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
