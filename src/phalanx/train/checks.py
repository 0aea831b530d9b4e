"""Everything checked in the parent, before any worker starts: each bad input is one line, exit 2.

Nothing here writes a file: the checkpoint directory is created only once every check passed.
What needs a process group (nothing here does) is the strategies' business inside the workers.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import pickle
import socket
import sys
import tempfile
import threading
from types import FrameType
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..data import DataBundle, load_data
from ..data.datasets import DATASETS, CIFAR_CROP, cifar10_sizes, check_cifar10_files
from ..errors import PhalanxError
from ..task.models import MODELS
from ..strategies import STRATEGIES, Layout
from ..task import Task
from .. import checkpoint as ckpt
from . import rundir
from .config import TrainConfig
from .resume import batch_for, check_fits


# --------------------------------------------------------------------------- data


@dataclasses.dataclass
class DataFacts:
    """What the parent knows of the data without loading a large set."""

    input_shape: tuple[int, ...]
    num_classes: int
    train_size: int
    example: Any  #: two examples as a model sees them: a pair, or a batch of any structure
    bundle: Optional[DataBundle] = None  #: the data itself, where it is small enough to send to the workers


def data_facts(cfg: TrainConfig, user: Optional[DataBundle]) -> DataFacts:
    if user is not None:
        return _facts(user, user)
    if cfg.data == "digits":
        bundle = load_data("digits", seed=cfg.seed)
        return _facts(bundle, bundle)  # small: loaded once here and sent to the workers
    if cfg.data == "cifar10":
        check_cifar10_files(cfg.data_dir)
        train_size, _ = cifar10_sizes(cfg.data_dir)
        shape = (3, CIFAR_CROP, CIFAR_CROP)
        return DataFacts(shape, 10, train_size, (torch.zeros(2, *shape), torch.zeros(2, dtype=torch.long)))
    assert cfg.synthetic_shape is not None and cfg.synthetic_size is not None, "resolved() fills their defaults"
    synthetic, size = tuple(cfg.synthetic_shape), cfg.synthetic_size
    return DataFacts(synthetic, 10, size - size // 5, (torch.zeros(2, *synthetic), torch.zeros(2, dtype=torch.long)))


def _facts(bundle: DataBundle, keep: Optional[DataBundle]) -> DataFacts:
    train = bundle.train
    idx = torch.arange(min(2, len(train)))
    example = train.take(idx)
    return DataFacts(bundle.input_shape, bundle.num_classes, len(train), example, keep)


# --------------------------------------------------------------------------- sizes and the model


def check_global_batch(cfg: TrainConfig, layout: Layout, facts: DataFacts) -> None:
    shards = layout.shards
    batch = cfg.batch_size * shards
    if batch > facts.train_size:
        how = f"{cfg.batch_size} per worker x {shards} workers" if shards > 1 else "every worker reads the whole batch"
        raise PhalanxError(f"global batch {batch} ({how}) is larger than the {facts.train_size} training examples; "
                           "use a smaller --batch-size")


def check_precision(cfg: TrainConfig, layout: Layout) -> None:
    """fp16 needs a gradient scaler, which needs CUDA and one optimizer step per rank per step (sync)."""
    if cfg.precision != "fp16":
        return
    if any(d.type != "cuda" for d in layout.devices):
        raise PhalanxError("--precision fp16 runs on CUDA devices only (its gradient scaler is a GPU feature); "
                           "use --precision bf16 on the CPU (fp32's range, no scaler; faster than fp32 only on CPUs "
                           "with AMX or AVX-512 BF16), or fp32")
    if not cfg.options.fp16_scaler:
        able = " or ".join(name for name, cls in STRATEGIES.items() if cls.fp16_scaler)
        raise PhalanxError(f"--precision fp16 works with --strategy {able} only (a gradient scaler that skips a step "
                           f"must skip it on every replica alike); use --precision bf16 with {cfg.options.name}")


def check_async_checkpoint(cfg: TrainConfig, layout: Layout) -> None:
    """--async-checkpoint writes sharded checkpoints in the background: a run that writes one file is refused."""
    if not cfg.async_checkpoint:
        return
    if not cfg.options.sharded_checkpoints:
        able = " or ".join(name for name, cls in STRATEGIES.items() if cls.sharded_checkpoints)
        raise PhalanxError(f"--async-checkpoint writes sharded checkpoints, which --strategy {able} saves; "
                           f"{cfg.options.name} saves one file from rank 0: leave --async-checkpoint out")
    if layout.world_size < 2:
        raise PhalanxError(f"--async-checkpoint writes sharded checkpoints, and {cfg.options.name} on one worker "
                           "shards nothing (it saves one file): leave --async-checkpoint out, or use --workers 2 "
                           "or more")


def check_straggler(cfg: TrainConfig, layout: Layout) -> None:
    """``--straggler RANK:FACTOR`` must name a rank of this run that computes (reads data)."""
    slow = cfg.slowness
    if slow is None or slow.kind != "slow" or slow.rank is None:
        return
    spelled = f"--straggler {slow.rank}:{slow.factor:g}"
    if slow.rank >= layout.world_size:
        raise PhalanxError(f"{spelled} names rank {slow.rank} but this run has ranks 0..{layout.world_size - 1}; "
                           "pick one of them")
    if layout.ranks[slow.rank].shard is None:
        computing = [r for r, plan in enumerate(layout.ranks) if plan.shard is not None]
        raise PhalanxError(f"{spelled} names {layout.label(slow.rank)}, which computes no gradients; slow one of "
                           f"the workers instead (ranks {computing[0]}..{computing[-1]})")


# --------------------------------------------------------------------------- sending to spawned workers


def check_sendable(task: Task) -> None:
    """Spawned workers get the task (model factory, loss, optimizer factory) by pickling: functions and
    classes travel by module and name, so say so plainly when they cannot."""
    main = sys.modules.get("__main__")
    for what, obj in (("the model", task.make_model), ("loss_fn", task.loss_fn),
                      ("the optimizer factory", task.make_optimizer),
                      ("the LR scheduler factory", task.make_scheduler), ("the training step", task.training_step)):
        inner = getattr(obj, "args", ())  # a partial's model object or imported factory
        defined = [type(o) if isinstance(o, nn.Module) else o for o in (obj, *inner)]
        if any(getattr(o, "__module__", None) == "__main__" for o in defined) and not getattr(main, "__file__", None):
            raise PhalanxError(f"{what} is defined interactively (a notebook or a REPL), where spawned workers "
                               "cannot import it: define it in a .py file and import it, or use workers=1")
        try:
            pickle.dumps(obj)
        except Exception as e:
            first = (str(e).splitlines() or [type(e).__name__])[0][:160]
            if what == "the model":
                raise PhalanxError(_unsendable_model(obj, first)) from None
            raise PhalanxError(f"{what} cannot be sent to the worker processes ({first}): it must be picklable; "
                               "define classes and functions at module level, not as lambdas or local "
                               "functions") from None


def _unsendable_model(make_model: Any, first: str) -> str:
    """What to do where the model (an object: minGPT's holds lambdas) or its factory cannot be pickled: a
    factory every worker calls, in a form pickle takes (a lambda is not one)."""
    given = next(iter(getattr(make_model, "args", ())), None)
    fix = ("pass a factory that pickle can send, which every worker calls: model=functools.partial(GPT, config) "
           "(a lambda is not picklable either) or a function defined at module level, or "
           "TrainConfig(model='mymodule:make')")
    if isinstance(given, nn.Module):
        return (f"the model cannot be sent to the worker processes ({first}): {type(given).__name__} holds "
                f"something pickle cannot send (a lambda, a local function); {fix}")
    return f"the model factory cannot be sent to the worker processes ({first}); {fix}"


def check_main_guard() -> None:
    """A script that calls fit() outside ``if __name__ == "__main__":`` would start again in every worker."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    if not path or not os.path.isfile(path) or (spec is not None and spec.name.endswith("__main__")):
        return  # nothing spawn would run again (a package's __main__.py is never re-run)
    line: Optional[int] = None
    frame: Optional[FrameType] = sys._getframe()
    while frame is not None:  # the outermost module-level line of the script that led here
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
        frame = frame.f_back
    if line is None:
        return
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError, ValueError):
        return
    if not any(_is_main_guard(node) and node.lineno <= line <= (node.end_lineno or node.lineno)
               for node in tree.body):
        raise PhalanxError(f"{os.path.basename(path)} line {line} starts training at the top level of the script: "
                           "phalanx spawns worker processes that import the script again, so put the call under "
                           "'if __name__ == \"__main__\":'")


def _is_main_guard(node: ast.AST) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.comparators) != 1:
        return False
    sides = [node.test.left, node.test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    values = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"] and isinstance(node.test.ops[0], ast.Eq)


def check_address(addr: str, deadline_s: float = 5.0) -> None:
    """The rendezvous address must resolve quickly and belong to this machine (the parent listens on it)."""
    found: list = []

    def resolve() -> None:
        try:
            found.append(socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM))
        except OSError as e:
            found.append(e)

    thread = threading.Thread(target=resolve, daemon=True)
    thread.start()
    thread.join(deadline_s)
    if not found:
        raise PhalanxError(f"--master-addr {addr} did not resolve within {deadline_s:g} s; use an address of this "
                           "machine such as 127.0.0.1")
    if isinstance(found[0], OSError):
        raise PhalanxError(f"--master-addr {addr} does not resolve ({found[0].strerror or found[0]}); use an "
                           "address of this machine such as 127.0.0.1")
    family, _, _, _, sockaddr = found[0][0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((sockaddr[0], 0))
    except OSError as e:
        raise PhalanxError(f"--master-addr {addr} is not an address of this machine ({e.strerror or e}): the "
                           "workers rendezvous on the machine that starts them; use 127.0.0.1, or torchrun for "
                           "several machines") from None


# --------------------------------------------------------------------------- files


def check_metrics_path(cfg: TrainConfig) -> None:
    """The metrics file must be creatable; its directory must exist unless it is the checkpoint directory."""
    assert cfg.metrics is not None, "rundir.placed names the metrics file"
    path = Path(cfg.metrics)
    if path.is_dir():
        raise PhalanxError(f"--metrics {path} is a directory; give a file name such as {path}/metrics.jsonl")
    parent = path.parent
    inside_checkpoints = parent.resolve() == Path(cfg.run_dir).resolve()
    if not parent.is_dir():
        if inside_checkpoints:
            return  # created with the checkpoint directory, whose writability is checked there
        existing = next(a for a in (parent, *parent.parents) if a.exists())  # '.' or '/' at the latest
        if not existing.is_dir():  # a file where the path needs a directory
            raise PhalanxError(f"--metrics {path}: {existing} is a file, not a directory; choose another path")
        raise PhalanxError(f"--metrics {path}: directory {parent} does not exist; create it or choose another path")
    try:  # prove it: a probe file created and removed at once (the metrics file itself is left alone)
        fd, probe = tempfile.mkstemp(prefix=".phalanx-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
        if path.exists():
            open(path, "a").close()
    except OSError as e:
        raise PhalanxError(f"--metrics {path} cannot be written ({e.strerror or e}); choose another path") from None


def check_checkpoint_dir(cfg: TrainConfig) -> None:
    """Without creating it: the checkpoint directory exists and is writable, or can be created."""
    root = Path(cfg.run_dir)
    probe = root
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise PhalanxError(f"cannot write checkpoints to {root}: {probe} is not a directory; choose another "
                           "--checkpoint-dir")
    if not os.access(probe, os.W_OK):
        raise PhalanxError(f"cannot write checkpoints to {root}: permission denied; choose another --checkpoint-dir")
    for entry in ckpt.step_entries(root):
        # phalanx writes (and reads) checkpoints by these names
        if not (ckpt.is_checkpoint(entry) or ckpt.is_damaged_checkpoint(entry)):
            what = "a directory" if entry.is_dir() else "not a regular file"
            raise PhalanxError(f"{entry} is {what}, not a checkpoint, but phalanx names its checkpoints so; move it "
                               "out of --checkpoint-dir, or choose another --checkpoint-dir")


def check_init(cfg: TrainConfig, model: nn.Module) -> TrainConfig:
    """``--init-from``: the checkpoint verifies and holds this model (else the line a resume gives); the
    config then names its exact file, so that every rank (and a restarted attempt) loads the same one."""
    if cfg.init_from is None:
        return cfg
    state = ckpt.load_checkpoint(cfg.init_from, "--init-from")
    ckpt.warn_skipped(state)  # as --resume and evaluate say it: a newer checkpoint that did not verify
    check_fits(state, model, state["path"], "start from it")
    if cfg.overwrite and Path(state["path"]).resolve().parent == Path(cfg.run_dir).resolve():
        raise PhalanxError(f"--overwrite would remove {state['path']} before --init-from starts from it; choose "
                           "another --checkpoint-dir for the new run")
    return dataclasses.replace(cfg, init_from=state["path"])


def check_resume(cfg: TrainConfig, layout: Layout, task: Task, model: nn.Module,
                 restarted: bool = False) -> tuple[Optional[str], int, Optional[str]]:
    """The checkpoint to resume from, its step and its run (None, 0, None without --resume); refuses a
    foreign one. ``restarted``: a restarted attempt, for which a run already at --steps is complete."""
    if cfg.resume is None:
        return None, 0, None
    state = ckpt.load_checkpoint(cfg.resume)
    ckpt.warn_skipped(state)
    meta = state.get("meta", {})
    # Only another model or data set is refused: the worker count, the strategy and the batch may
    # change (every strategy saves the whole model and a plain optimizer's state; see resume.py).
    # The parameters' shapes are compared here, on the model the task builds: one line naming the first.
    # Names are compared where both are built-in ones (cnn vs mlp); a model or data of the user's own may be
    # renamed or moved between runs, and the shapes say exactly what differs.
    want = {"model": (task.model_name, MODELS), "data": (task.data_name, DATASETS)}
    for key, (value, builtin) in want.items():
        if key in meta and meta[key] != value and meta[key] in builtin and value in builtin:
            raise PhalanxError(
                f"checkpoint {state['path']} was written with {key} = {meta[key]!r} but this run has "
                f"{value!r}; resume with the same settings (--{key} {meta[key]})"
            )
    check_fits(state, model, state["path"])
    run_id = rundir.resumed_run(cfg, state)  # the run it continues, which the directory must hold (or none)
    if state["step"] >= cfg.steps and restarted:
        raise rundir.RunComplete(int(state["step"]), state["path"])
    if state["step"] >= cfg.steps:
        raise PhalanxError(
            f"checkpoint {state['path']} is already at step {state['step']} and --steps is {cfg.steps}; "
            "raise --steps to train further"
        )
    batch_for(cfg, state, layout.shards)  # --keep-global-batch: refused here where it cannot split
    return state["path"], int(state["step"]), run_id
