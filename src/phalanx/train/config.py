"""The training run's configuration: one validated dataclass; the CLI flags are made from its fields.

Fields left at ``None`` mean "not given": the optimizer, learning rate and steps then come from
the model's recipe (:data:`phalanx.task.models.RECIPES`), and options that only apply to one setting
(``momentum`` to SGD, ``lr_decay_*`` to the exponential schedule, ``data_dir`` to CIFAR-10,
``synthetic_*`` to synthetic data) take their defaults there, or are refused anywhere else:
a flag that does nothing is an error, not a surprise. :meth:`TrainConfig.resolved` fills them in,
and remembers which optimisation settings were given: on ``--resume`` those win over the
checkpoint's, and the others continue as the checkpoint has them (see ``resume.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

from ..data.datasets import DATASETS
from ..errors import PhalanxError
from ..task.metrics import Target, parse_target
from ..task.models import MODELS, RECIPES, USER_RECIPE, Recipe
from ..options import option
from ..precision import PRECISIONS
from ..comm.shaped_link import LinkRate, parse_rate
from ..strategies import STRATEGIES, Options, strategy_class
from ..task.schedules import SCHEDULES
from ..scenarios.straggle import Slowness, parse_slowness

OPTIMIZERS = ("sgd", "adam", "adamw")
PROGRESS = ("auto", "bar", "lines", "none", "silent")
#: --steps beyond this is a typo, not a plan: a billion steps of a millisecond each already take 12 days
MAX_STEPS = 10**9

#: The optimisation settings: on --resume each one given wins over the checkpoint's (see resume.py).
SETTINGS = ("optimizer", "lr", "momentum", "weight_decay", "lr_schedule", "lr_decay_every", "lr_decay_factor",
            "staircase", "warmup_steps", "lr_base_batch", "lr_scheduler", "clip_grad_norm")
#: phalanx's own schedule's settings, which a scheduler of the user's (--lr-scheduler) replaces
OWN_SCHEDULE = ("lr_schedule", "lr_decay_every", "lr_decay_factor", "staircase", "warmup_steps")
#: Settings whose default is the same for every model (None until resolved, so that giving one is seen).
PLAIN_DEFAULTS: dict[str, Any] = {"weight_decay": 0.0, "lr_schedule": "constant", "warmup_steps": 0}

#: field -> (the setting it belongs to, the values of that setting it applies to, its default there)
ONLY_FOR: dict[str, tuple[str, tuple[str, ...], Any]] = {
    "momentum": ("optimizer", ("sgd",), 0.9),
    "lr_decay_every": ("lr_schedule", ("exponential",), 100),
    "lr_decay_factor": ("lr_schedule", ("exponential",), 0.5),
    "staircase": ("lr_schedule", ("exponential",), False),
    "data_dir": ("data", ("cifar10",), None),
    "synthetic_shape": ("data", ("synthetic",), (3, 24, 24)),
    "synthetic_size": ("data", ("synthetic",), 4096),
}


#: How ``phalanx train --help`` groups the training flags (every TrainConfig field appears once).
SECTIONS = {
    "parallelism": ("strategy", "devices", "strict_devices", "workers", "threads", "master_addr", "link"),
    "faults": ("timeout_s", "hang_timeout_s", "max_restarts"),
    "speed and memory": ("precision", "compile", "activation_checkpointing"),
    "model and data": ("model", "data", "loss", "training_step", "target_key", "metric", "validation_split", "loader_workers", "data_dir",
                       "synthetic_shape", "synthetic_size"),
    "optimisation (unset: the model's recipe)": (
        "steps", "batch_size", "accumulate", "optimizer", "lr", "momentum", "weight_decay", "lr_schedule",
        "lr_decay_every", "lr_decay_factor", "staircase", "warmup_steps", "lr_base_batch", "lr_scheduler",
        "clip_grad_norm", "seed", "straggler"),
    "observation and checkpoints": ("log_every", "eval_every", "stop_at", "stop_at_accuracy", "metrics", "tensorboard",
                                    "checkpoint_dir", "checkpoint_every", "keep_checkpoints", "async_checkpoint",
                                    "resume", "init_from", "overwrite", "keep_global_batch", "progress", "profile_startup", "prefetch"),
}


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.lower().replace("x", ",").split(","))
    except ValueError:
        raise PhalanxError(f"shape {text!r} is not like 3x24x24") from None


@dataclasses.dataclass
class TrainConfig:
    # --- how the replicas cooperate ---
    strategy: Union[str, Options] = option("sync", "how the workers cooperate", choices=tuple(STRATEGIES))
    devices: Union[str, int, list] = option("auto", "where to run: auto, cpu, cuda or cuda:0,2; CUDA asked for "
                                                    "but absent falls back to the CPU with a warning")
    strict_devices: bool = option(False, "fail instead of falling back to the CPU")
    workers: Optional[int] = option(None, "worker processes", show="one per GPU; on CPU, 2")
    threads: Optional[int] = option(None, "torch threads per CPU worker", show="its share of the cores")
    # --- what is trained ---
    model: str = option("cnn", "a built-in model, or MODULE:CALLABLE returning an nn.Module (it may take "
                               "input_shape and num_classes keywords); a model given to Trainer replaces it",
                        choices=tuple(MODELS) + ("MODULE:CALLABLE",))
    data: str = option("digits", "a built-in data set, or MODULE:CALLABLE returning (train, test) datasets, test may "
                                 "be None; data given to Trainer replaces it", choices=DATASETS + ("MODULE:CALLABLE",))
    loss: Optional[str] = option(None, "MODULE:CALLABLE: the loss, (outputs, targets) -> a scalar tensor (a mean "
                                       "over the batch)",
                                 show="cross-entropy (per token for targets per position); MSE for float targets")
    training_step: Optional[str] = option(None, "MODULE:CALLABLE: your step(model, batch) -> loss or (loss, "
                                                "outputs), for training and (without gradients) evaluation",
                                          show="model(x) and the loss for a pair; model(**batch) for a dict, its "
                                               "output's own loss where it has one")
    target_key: Optional[str] = option(None, "the key of a dict batch that holds the targets", show="labels or label")
    metric: Optional[str] = option(None, "what evaluation reports, besides the loss: built-in names or "
                                         "MODULE:CALLABLE ((outputs, targets) -> (sum, count) for a batch), "
                                         "comma-separated", choices=("accuracy", "loss", "perplexity", "mse", "rmse",
                                                                     "mae", "MODULE:CALLABLE"),
                                   show="accuracy; perplexity and accuracy for targets per position; "
                                        "loss and mse for float targets")
    validation_split: Optional[float] = option(None, "without a test set: the fraction of the training data held "
                                                     "out (seeded) for validation", show="0.1")
    loader_workers: int = option(0, "DataLoader worker processes per rank reading a map-style Dataset of your own "
                                    "lazily, a batch at a time (for data on disk, or too large for memory); 0: "
                                    "the Dataset is read into memory once")
    data_dir: Optional[str] = option(None, "cifar10: the directory holding the CIFAR-10 binary files")
    synthetic_shape: Optional[tuple] = option(None, "synthetic: input shape of an example, e.g. 3x24x24",
                                              parse=parse_shape, show="3x24x24")
    synthetic_size: Optional[int] = option(None, "synthetic: examples (train + test)", show="4096")
    # --- optimisation (None: the model's recipe) ---
    steps: Optional[int] = option(None, "global steps (one optimizer update each)", show="the model's recipe")
    batch_size: int = option(32, "examples per data shard (worker) per step; the global batch is this x shards")
    accumulate: int = option(1, "micro-batches per step; gradients are reduced only after the last")
    optimizer: Optional[str] = option(None, "optimizer, or MODULE:CALLABLE (params -> torch.optim.Optimizer, with "
                                            "its own lr)", choices=OPTIMIZERS + ("MODULE:CALLABLE",),
                                      show="the model's recipe")
    lr: Optional[float] = option(None, "peak learning rate (before the linear scaling rule, if any)",
                                 show="the model's recipe")
    momentum: Optional[float] = option(None, "sgd: momentum, in [0, 1)", show="0.9")
    weight_decay: Optional[float] = option(None, "L2 penalty", show="0")
    lr_schedule: Optional[str] = option(None, "learning-rate schedule", choices=SCHEDULES, show="constant")
    lr_decay_every: Optional[int] = option(None, "exponential: steps per decay", show="100")
    lr_decay_factor: Optional[float] = option(None, "exponential: multiplier per --lr-decay-every steps, in (0, 1]",
                                              show="0.5")
    staircase: Optional[bool] = option(None, "exponential: decay in whole steps", show="off")
    warmup_steps: Optional[int] = option(None, "linear warmup length in steps", show="0")
    lr_base_batch: Optional[int] = option(None, "linear scaling rule: lr x global batch / this")
    lr_scheduler: Optional[str] = option(None, "MODULE:CALLABLE: a torch LR scheduler of yours, called with the "
                                               "optimizer (and total_steps= where it names it), stepped once per "
                                               "global step, saved in checkpoints; replaces --lr-schedule",
                                         show="phalanx's --lr-schedule")
    clip_grad_norm: Optional[float] = option(None, "clip the norm of the gradient each update applies to this "
                                                   "(torch's clip_grad_norm_ over the whole model: after the "
                                                   "all-reduce, over every shard and stage; the server's under ps)",
                                             show="no clipping")
    seed: int = option(0, "model initialisation and data order")
    precision: str = option("fp32", "autocast each forward pass to bf16 or fp16 (fp16: CUDA and sync only, with a "
                                    "gradient scaler); parameters and checkpoints stay fp32", choices=PRECISIONS)
    compile: bool = option(False, "torch.compile each block of the model (in place: checkpoints are unchanged)")
    activation_checkpointing: bool = option(
        False, "keep only each block's input for backward and run its forward again there (torch's non-reentrant "
               "checkpoint, the blocks fsdp shards: the model's repeated blocks, or --blocks): less activation "
               "memory for about one more forward per step; the run measures and prints what it saves")
    straggler: Optional[Union[str, tuple, Slowness]] = option(
        None, "slow a worker down, for studying stragglers: RANK:FACTOR (that rank's compute takes FACTOR times as "
              "long every step) or pauses:P:FACTOR (every step, each worker is FACTOR times as slow with "
              "probability P); the delay is calibrated compute time, the same whatever the strategy",
        parse=parse_slowness)
    # --- observation and safety ---
    log_every: int = option(20, "progress line every N steps")
    eval_every: int = option(0, "evaluate on the test set every N steps (0: only at the end)")
    stop_at: Optional[str] = option(None, "stop once an evaluation (every --eval-every steps) reaches this target: "
                                          "accuracy>=0.95, loss<=0.30, perplexity<=5, or a --metric's name with >= "
                                          "or <=; a bare number is an accuracy")
    stop_at_accuracy: Optional[float] = option(None, "the same as --stop-at accuracy>=VALUE, e.g. 0.95")
    metrics: Optional[str] = option(None, "JSON-lines metrics file", show="CHECKPOINT_DIR/metrics.jsonl")
    tensorboard: Optional[str] = option(None, "also write the metrics as TensorBoard scalars in this folder (loss, "
                                              "learning rate, examples/s, every metric, staleness, gradients "
                                              "dropped; compare: one run per SCENARIO/STRATEGY-rN in it); needs "
                                              "pip install 'phalanx[tensorboard]'", argparse_extra={"metavar": "DIR"})
    checkpoint_dir: Optional[str] = option(None, "where step-*.pt checkpoints and the metrics go: one run per "
                                                 "directory", show="a new runs/STRATEGY-N for each run")
    checkpoint_every: int = option(100, "save every N steps (0: only at the end)")
    keep_checkpoints: int = option(3, "keep the K checkpoints written last")
    resume: Optional[str] = option(None, "continue from a checkpoint file or a directory's newest; alone (or "
                                         "'last'): the newest in --checkpoint-dir, or without it the newest run's "
                                         "newest under runs/", argparse_extra={"nargs": "?", "const": "last"})
    init_from: Optional[str] = option(None, "start from a checkpoint's model weights (a file, or the newest in a "
                                            "directory) with a fresh optimizer, step 0 and a fresh schedule: "
                                            "fine-tuning", argparse_extra={"metavar": "PATH"})
    async_checkpoint: bool = option(False, "write sharded checkpoints (fsdp or a pipeline on 2+ workers) in the "
                                           "background: the step waits only while each rank copies its shards to "
                                           "CPU memory")
    overwrite: bool = option(False, "start a new run in a --checkpoint-dir that holds another run: remove its "
                                    "checkpoints and metrics file first (phalanx's own files only)")
    progress: str = option("auto", "auto draws a bar on a terminal; none shows no header or progress, only the "
                                   "result; silent, not even that", choices=PROGRESS)
    profile_startup: bool = option(False, "print where the seconds before the first step went (imports, workers "
                                          "joining, data, model, calibration, strategy, first step); always in "
                                          "the metrics file")
    prefetch: Optional[int] = option(None, "batches read ahead of the towers on a background thread (0: each "
                                           "read in the loop when it is needed)",
                                     show="2 on a GPU; 0 on CPU, where the thread competes with the workers")
    master_addr: str = option("127.0.0.1", "address the workers rendezvous on (one machine)")
    link: Optional[Union[str, LinkRate]] = option(
        None, "run the job on a real slow link: a private network namespace whose loopback the kernel shapes to "
              "this rate (tc tbf), shared by every worker: 50mbit, 1gbit, or bytes per second as tc reads them "
              "(12mbps); needs root and iproute2", parse=parse_rate, show="the loopback, unshaped",
        argparse_extra={"metavar": "RATE"})
    timeout_s: float = option(300.0, "seconds a collective waits for a peer (at least twice --hang-timeout, so "
                                     "that a hang is diagnosed first)", flag="--timeout")
    hang_timeout_s: float = option(120.0, "end a job in which no rank moved for this many seconds, with a report "
                                          "naming the stuck rank and where it is (0: never)", flag="--hang-timeout")
    max_restarts: int = option(0, "when a worker dies or the job hangs, restart every worker from the newest "
                                  "checkpoint, up to this many times")
    keep_global_batch: bool = option(False, "on --resume with another worker count: keep the checkpoint's global "
                                            "batch (the per-worker batch, or --accumulate, adapts) instead of the "
                                            "per-worker batch")
    #: set by resolved(): the unset fields are filled in (no flag; not for users)
    _resolved: bool = dataclasses.field(default=False, repr=False)
    #: set by resolved(): the SETTINGS the user gave (on --resume they win over the checkpoint's)
    _given: tuple = dataclasses.field(default=(), repr=False)

    def __post_init__(self) -> None:
        self._check_paths()
        self._check_names()
        self._check_counts()
        self._check_choices()
        self._check_numbers()
        if not self._resolved:
            self._check_applicable()
        self.straggler = parse_slowness(self.straggler)
        self.link = None if self.link is None else parse_rate(self.link)
        if isinstance(self.strategy, str):
            self.strategy = strategy_class(self.strategy)()
        elif not isinstance(self.strategy, Options):
            raise PhalanxError(f"strategy must be a name ({', '.join(STRATEGIES)}) or options such as "
                               f"phalanx.Sync(), got {type(self.strategy).__name__}")
        self._check_recompute()
        if self.metrics is None and self.checkpoint_dir is not None:  # else named with the run's directory
            self.metrics = f"{self.checkpoint_dir}/metrics.jsonl"

    def _check_recompute(self) -> None:
        """--activation-checkpointing wraps the model's blocks before the strategy does: a strategy whose engine
        traces or splits the model, or that has not been wired and tested for it, refuses it."""
        if not isinstance(self.activation_checkpointing, bool):
            raise PhalanxError(f"--activation-checkpointing is on or off, got {self.activation_checkpointing!r}")
        if self.activation_checkpointing and not self.strategy.checkpoints_activations:
            takes = ", ".join(name for name, cls in STRATEGIES.items() if cls.checkpoints_activations)
            raise PhalanxError(f"--strategy {self.strategy.name} does not take --activation-checkpointing; use one of "
                               f"{takes}, or drop the flag")

    def _check_paths(self) -> None:
        """An empty path would mean the current directory (or nothing): never what was meant."""
        for name in ("checkpoint_dir", "metrics", "data_dir", "resume", "tensorboard", "init_from"):
            value = getattr(self, name)
            if value is not None:  # no --checkpoint-dir: each run gets its own (rundir.placed)
                if not isinstance(value, str) or not value.strip():
                    raise PhalanxError(f"{_flag(name)} is empty ({value!r}); give a path, e.g. "
                                       f"{_PATH_EXAMPLES[name]}")
        if self.overwrite and self.resume is not None:
            raise PhalanxError("--overwrite starts a new run and --resume continues one: give one of them")
        if self.init_from is not None and self.resume is not None:
            raise PhalanxError("--init-from starts a new run from a checkpoint's weights and --resume continues a "
                               "run with its optimizer and step: give one of them")

    def _check_names(self) -> None:
        """An empty name would fall back to the default silently: ``--metric ''`` is a typo, not a choice."""
        for name, example in (("loss", "mymodule:my_loss"), ("metric", "accuracy")):
            value = getattr(self, name)
            if isinstance(value, str) and not value.replace(",", "").strip():
                raise PhalanxError(f"{_flag(name)} is empty ({value!r}); name one, e.g. {_flag(name)} {example}, "
                                   f"or drop {_flag(name)} for the default")

    def _check_counts(self) -> None:
        if self.steps is not None and not isinstance(self.steps, bool) and isinstance(self.steps, int) \
                and self.steps > MAX_STEPS:
            raise PhalanxError(f"--steps {self.steps} is more than a run can take (at most {MAX_STEPS:,}); give "
                               "fewer, e.g. --steps 1000")
        for name in ("batch_size", "accumulate", "log_every", "keep_checkpoints"):
            _positive_int(name, getattr(self, name))
        for name in ("steps", "lr_decay_every", "lr_base_batch", "synthetic_size"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        for name in ("workers", "threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise PhalanxError(f"--{name} must be at least 1, got {value!r}")
        for name in ("eval_every", "checkpoint_every", "warmup_steps", "seed", "max_restarts", "loader_workers",
                     "prefetch"):
            value = getattr(self, name)
            if value is None and (name in PLAIN_DEFAULTS or name == "prefetch"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PhalanxError(f"{_flag(name)} must be 0 or more, got {value!r}")
        if self.batch_size % self.accumulate:
            raise PhalanxError(
                f"--batch-size {self.batch_size} does not split into --accumulate {self.accumulate} equal "
                f"micro-batches ({self.batch_size} / {self.accumulate} = {self.batch_size / self.accumulate:g})"
            )
        if self.synthetic_shape is not None and (not self.synthetic_shape or any(s < 1 for s in self.synthetic_shape)):
            raise PhalanxError(f"--synthetic-shape {tuple(self.synthetic_shape)}: every dimension must be at least 1")
        if self.synthetic_size is not None and self.synthetic_size < 10:
            raise PhalanxError(f"--synthetic-size {self.synthetic_size} is too small: a fifth is held out for "
                               "testing; use at least 10")

    def _check_choices(self) -> None:
        for name, choices in (("optimizer", OPTIMIZERS), ("lr_schedule", SCHEDULES), ("progress", PROGRESS),
                              ("model", tuple(MODELS)), ("data", DATASETS), ("precision", PRECISIONS)):
            value = getattr(self, name)
            if name in ("optimizer", "model", "data") and isinstance(value, str) and ":" in value:
                continue  # an import path, resolved (or refused in one line) when the task is built
            if value is not None and value not in choices:
                what = {"optimizer": "optimizer", "model": "model", "data": "data set"}.get(name, _flag(name))
                raise PhalanxError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")

    def _check_numbers(self) -> None:
        if self.lr is not None and not (isinstance(self.lr, (int, float)) and 0 < self.lr < math.inf):
            raise PhalanxError(f"--lr must be positive and finite, got {self.lr}")
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise PhalanxError(f"--momentum must be in [0, 1) (0.9 is usual), got {self.momentum}")
        if self.weight_decay is not None and not 0 <= self.weight_decay < math.inf:
            raise PhalanxError(f"--weight-decay must be 0 or a small positive number (e.g. 5e-4), "
                               f"got {self.weight_decay}")
        if self.validation_split is not None and not 0 < self.validation_split < 1:
            raise PhalanxError(f"--validation-split must be a fraction in (0, 1), e.g. 0.1, got {self.validation_split}")
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, (int, float))
                                                    and 0 < self.clip_grad_norm < math.inf):
            raise PhalanxError(f"--clip-grad-norm must be a positive, finite norm (e.g. 1.0), got {self.clip_grad_norm}")
        if self.lr_scheduler is not None and not (isinstance(self.lr_scheduler, str) and ":" in self.lr_scheduler):
            raise PhalanxError(f"--lr-scheduler {self.lr_scheduler}: write MODULE:CALLABLE, a function of the "
                               "optimizer returning a torch LR scheduler (e.g. mymod:one_cycle)")
        if self.lr_decay_factor is not None and not 0 < self.lr_decay_factor <= 1:
            raise PhalanxError(f"--lr-decay-factor must be in (0, 1], got {self.lr_decay_factor}")
        if self.stop_at_accuracy is not None:
            if not (isinstance(self.stop_at_accuracy, (int, float)) and 0 < self.stop_at_accuracy <= 1):
                raise PhalanxError(f"--stop-at-accuracy must be in (0, 1], e.g. 0.95, got {self.stop_at_accuracy}")
            if self.stop_at is not None:
                raise PhalanxError(f"--stop-at {self.stop_at} and --stop-at-accuracy {self.stop_at_accuracy:g} both "
                                   "set a target: give one")
        if self.target is not None and not self.eval_every:
            flag = "--stop-at" if self.stop_at is not None else "--stop-at-accuracy"
            raise PhalanxError(f"{flag} needs evaluations during training: add --eval-every N (e.g. 20)")
        if not 0 < self.timeout_s < math.inf:
            raise PhalanxError(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        if not 0 <= self.hang_timeout_s < math.inf:
            raise PhalanxError(f"--hang-timeout must be 0 (never) or a number of seconds, got {self.hang_timeout_s}")

    def _check_applicable(self) -> None:
        """A value given for an option that does nothing with the chosen setting is refused."""
        if isinstance(self.optimizer, str) and ":" in self.optimizer:  # a factory sets its own lr and decay
            for name in ("lr", "weight_decay", "lr_base_batch"):
                if getattr(self, name) is not None:
                    raise PhalanxError(f"{_flag(name)} applies to the built-in optimizers ({', '.join(OPTIMIZERS)}); "
                                       f"--optimizer {self.optimizer} builds its own: set it there, or drop "
                                       f"{_flag(name)}")
        if self.lr_scheduler is not None:
            for name in OWN_SCHEDULE:
                if getattr(self, name) is not None:
                    raise PhalanxError(f"--lr-scheduler {self.lr_scheduler} replaces phalanx's own schedule, and "
                                       f"{_flag(name)} sets that one: drop {_flag(name)}, or --lr-scheduler")
        for name, (setting, applies_to, _) in ONLY_FOR.items():
            value = getattr(self, name)
            chosen = getattr(self, setting)
            chosen = PLAIN_DEFAULTS.get(setting) if chosen is None else chosen
            if value is None or chosen is None or chosen in applies_to:
                continue
            raise PhalanxError(f"{_flag(name)} applies to {_flag(setting)} {' or '.join(applies_to)}, and this run "
                               f"has {_flag(setting)} {chosen}; drop {_flag(name)} or set {_flag(setting)} "
                               f"{applies_to[0]}")

    # ---- what a run uses ----
    @property
    def target(self) -> Optional[Target]:
        """What stops the run early (--stop-at, or --stop-at-accuracy); None: it runs every step."""
        if self.stop_at is not None:
            return parse_target(self.stop_at, "--stop-at")
        return None if self.stop_at_accuracy is None else Target("accuracy", True, float(self.stop_at_accuracy))

    def recipe(self, model: Optional[str] = None) -> tuple[Recipe, str]:
        """The recipe the unset fields come from, and how the header names it; ``model``: the task's
        name for its model (a model object or an import path has none of the built-in recipes)."""
        name = model or self.model
        if name not in RECIPES:
            return USER_RECIPE, "phalanx's default for a model of your own"
        return RECIPES[name], f"{name} default"

    def resolved(self, model: Optional[str] = None) -> "TrainConfig":
        """A copy with every unset field filled from the recipe and the per-setting defaults."""
        recipe, _ = self.recipe(model)
        values = {name: getattr(recipe, name) for name in ("optimizer", "lr", "steps") if getattr(self, name) is None}
        if values.get("optimizer", self.optimizer) not in (None, "sgd") and self.momentum is not None:
            raise PhalanxError(f"--momentum applies to --optimizer sgd, and the {recipe_name(self, model)} "
                               f"uses {values['optimizer']}; drop --momentum or add --optimizer sgd")
        for name, (setting, applies_to, default) in ONLY_FOR.items():
            if getattr(self, name) is None:
                values[name] = default
        values.update({name: default for name, default in PLAIN_DEFAULTS.items() if getattr(self, name) is None})
        # What the user gave, before the recipe fills the rest in (kept when resolving again).
        given = self._given if self._resolved else tuple(n for n in SETTINGS if getattr(self, n) is not None)
        return dataclasses.replace(self, **values, _resolved=True, _given=given)

    def recipe_line(self, model: Optional[str] = None) -> str:
        """``recipe: adam, lr 0.01, 300 steps (lstm default; set by flags: lr)``."""
        _, source = self.recipe(model)
        given = [name for name in ("optimizer", "lr", "steps") if getattr(self, name) is not None]
        run = self.resolved(model)
        told = f"; set by flags: {', '.join(given)}" if given else "; any flag overrides"
        lr = "its own lr" if ":" in run.optimizer else f"lr {run.lr:g}"
        return f"recipe: {run.optimizer}, {lr}, {run.steps} steps ({source}{told})"


def recipe_name(cfg: TrainConfig, model: Optional[str]) -> str:
    name = model or cfg.model
    return f"{name} recipe" if name in RECIPES else "recipe for a model of your own"


_PATH_EXAMPLES = {"checkpoint_dir": "--checkpoint-dir checkpoints", "metrics": "--metrics metrics.jsonl",
                  "data_dir": "--data-dir cifar-10-batches-bin", "resume": "--resume checkpoints/step-00000100.pt",
                  "tensorboard": "--tensorboard runs",
                  "init_from": "--init-from pretrained/step-00000300.pt"}


def _flag(name: str) -> str:
    return {"timeout_s": "--timeout", "hang_timeout_s": "--hang-timeout"}.get(name, "--" + name.replace("_", "-"))


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PhalanxError(f"{_flag(name)} must be a positive integer, got {value!r}")
