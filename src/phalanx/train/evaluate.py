"""``phalanx evaluate``: every metric of a checkpoint on its test set (or validation part), in one process.

    phalanx evaluate --checkpoint checkpoints            # the newest step-*.pt there, its model and data
    phalanx evaluate --checkpoint run/step-00000300.pt --data mymod:load --metric accuracy,mymod:f1 --json

The model and data default to what the checkpoint recorded, where those are built-in names or import
paths (a model or data handed to ``Trainer`` as an object has to be named again: ``--model``/``--data``
here, ``model=``/``test_data=`` in :func:`evaluate`), and so does the seed, so a validation part is the
one the run held out. The model is built with the checkpoint's input shape and class count, checked
against its parameters (the one line a resume gives), and evaluated exactly as a run's evaluation is:
the metrics' sums and counts over the whole set (``metrics.py``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..data import eval_batches, load_data
from ..data.datasets import DATASETS
from ..data.user import cast_to_model
from ..errors import PhalanxError
from ..task.metrics import Totals, add_up, said
from ..task.models import MODELS
from ..options import add_flags, given
from ..task import is_import_path, task_from
from .. import checkpoint as ckpt
from .config import TrainConfig
from .resume import check_fits

#: The training flags evaluate takes, the same fields (and help) as ``phalanx train``'s.
FIELDS = ("model", "data", "loss", "training_step", "target_key", "metric", "validation_split", "loader_workers",
          "data_dir", "synthetic_shape", "synthetic_size", "batch_size", "seed", "devices")
#: Examples per forward pass when --batch-size is not given (a training run's evaluation uses the same).
EVAL_BATCH = 256


def evaluate(checkpoint: str, *, model: Optional[nn.Module] = None, test_data: Any = None,
             loss_fn: Optional[Callable] = None, metrics: Any = None, **config: Any) -> dict[str, float]:
    """Every metric of ``checkpoint`` (a step-*.pt, or a directory: its newest) on a held-out set, by name.

    ``model``: a module of the checkpoint's architecture (default: the model the checkpoint names);
    ``test_data``: what to evaluate on (default: the checkpoint's data's test set, or the validation part
    held out of it); ``config``: other :class:`~phalanx.train.TrainConfig` fields (``data="mymod:load"``,
    ``batch_size``, ``devices``)."""
    return Evaluation(checkpoint, model=model, test_data=test_data, loss_fn=loss_fn, metrics=metrics,
                      config=config).run()["metrics"]


class Evaluation:
    """One checkpoint, its model rebuilt and loaded, and the set it is evaluated on."""

    def __init__(self, checkpoint: str, *, model: Optional[nn.Module] = None, test_data: Any = None,
                 loss_fn: Optional[Callable] = None, metrics: Any = None, config: Optional[dict] = None):
        if not isinstance(checkpoint, (str, os.PathLike)) or not str(checkpoint).strip():
            # '' would be the current directory: never what was meant
            raise PhalanxError(f"--checkpoint is empty ({checkpoint!r}); give a step-*.pt written by phalanx train, "
                               "or its directory, e.g. --checkpoint checkpoints")
        self.state = ckpt.load_checkpoint(checkpoint, "--checkpoint")
        ckpt.warn_skipped(self.state)  # a directory whose newer checkpoints do not verify
        meta = self.state.get("meta", {})
        config = dict(config or {})
        self.batch = config.pop("batch_size", None) or EVAL_BATCH
        cfg = TrainConfig(**{**recorded(meta, model is not None, test_data is not None), **config})
        # A test set handed in also stands in as the training set: only its kind (classes or floats) is read.
        self.task = task_from(cfg, model=model, train_data=test_data, test_data=test_data, loss_fn=loss_fn,
                              metrics=metrics)
        bundle = self.task.data or load_data(cfg.data, cfg.data_dir, tuple(cfg.synthetic_shape or (3, 24, 24)),
                                             cfg.synthetic_size or 4096, cfg.seed)
        self.device = _device(cfg)
        self.model = self._model(meta, bundle).to(self.device)
        self.data = cast_to_model(bundle, self.model) if self.task.data is not None else bundle

    def _model(self, meta: dict[str, Any], bundle: Any) -> nn.Module:
        """The checkpoint's architecture: built with the input shape and classes it was trained with, then
        its weights (or the line a resume gives when the model is another)."""
        shape = tuple(meta.get("input_shape") or bundle.input_shape)
        classes = int(meta.get("num_classes") or bundle.num_classes)
        torch.manual_seed(0)
        model = self.task.make_model(shape, classes)
        check_fits(self.state, model, self.state["path"], "evaluate it")
        model.load_state_dict(ckpt.tensors(self.state, optimizer=False)["model"])  # (a sharded one: read whole)
        return model

    def run(self) -> dict[str, Any]:
        """The metrics over the whole held-out set, with where they come from."""
        test = self.data.test
        totals = Totals(self.task.metrics, self.task.loss_fn)
        sums = add_up(self.model, eval_batches(test, self.batch), self.device, totals, self.task.step)
        values = totals.values(sums.tolist())
        return {"checkpoint": self.state["path"], "step": int(self.state["step"]), "model": self.task.model_name,
                "data": self.task.data_name, "held_out": self.data.held_out, "examples": len(test),
                "metrics": values, "skipped": [path for path, _ in self.state.get("skipped", [])]}


def recorded(meta: dict[str, Any], has_model: bool, has_data: bool) -> dict[str, Any]:
    """The TrainConfig fields a checkpoint names: its model and data where they can be built again here
    (built-in names, import paths) and not given, and its seed (which fixes a validation part)."""
    out: dict[str, Any] = {"seed": int(meta.get("seed", 0))}
    for key, builtin, given_here in (("model", MODELS, has_model), ("data", DATASETS, has_data)):
        name = meta.get(key)
        if given_here or not isinstance(name, str):
            continue
        if name in builtin or is_import_path(name):
            out[key] = name
        elif key == "data":
            raise PhalanxError(f"the checkpoint was trained on data handed to the API ({name!r}), which it cannot "
                               "load again; name it with --data MODULE:CALLABLE (or test_data= in phalanx.evaluate)")
    for key in ("training_step", "target_key"):  # how the run called its model: evaluated the same way
        if isinstance(meta.get(key), str):
            out[key] = meta[key]
    return out


def _device(cfg: TrainConfig) -> torch.device:
    from ..devices import resolve_devices

    return resolve_devices(cfg.devices, strict=cfg.strict_devices)[0]


# --------------------------------------------------------------------------- the command


def add_flags_to(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a step-*.pt written by phalanx train, or a directory: its newest checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the sentence")
    add_flags(p.add_argument_group("the problem (default: what the checkpoint recorded; flags as in train)"),
              TrainConfig, FIELDS)


def run(args: argparse.Namespace) -> int:
    result = Evaluation(args.checkpoint, config=given(args, FIELDS)).run()
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(f"{result['checkpoint']} (step {result['step']}, {result['model']} on {result['data']}): "
              f"{result['held_out']} {said(result['metrics'])} over {result['examples']} examples", flush=True)
    return 0
