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
from typing import Any, Optional, Union

from ..data.datasets import DATASETS
from ..errors import PhalanxError
from ..task.metrics import Target, parse_target
from ..task.models import MODELS, RECIPES, USER_RECIPE, Recipe
from .. import config_file
from ..options import declared, option
from ..precision import PRECISIONS
from ..comm.shaped_link import LinkRate, parse_rate
from ..strategies import STRATEGIES, Options, strategy_class
from .config_checks import (ONLY_FOR, OPTIMIZERS, OWN_SCHEDULE, PLAIN_DEFAULTS, PROGRESS, SETTINGS, check_fields,
                            check_recompute)
from ..task.schedules import SCHEDULES
from ..scenarios.straggle import Slowness, parse_slowness

#: How ``phalanx train --help`` groups the training flags (every TrainConfig field appears once).
SECTIONS = {
    "parallelism": ("strategy", "devices", "strict_devices", "workers", "threads", "master_addr", "link"),
    "faults": ("timeout_s", "hang_timeout_s", "max_restarts"),
    "speed and memory": ("precision", "compile", "activation_checkpointing"),
    "model and data": ("model", "data", "loss", "training_step", "target_key", "metric", "validation_split",
                       "loader_workers", "data_dir", "synthetic_shape", "synthetic_size"),
    "optimisation (unset: the model's recipe)": (
        "steps", "batch_size", "accumulate", "optimizer", "lr", "momentum", "weight_decay", "lr_schedule",
        "lr_decay_every", "lr_decay_factor", "staircase", "warmup_steps", "lr_base_batch", "lr_scheduler",
        "clip_grad_norm", "seed", "straggler"),
    "observation and checkpoints": ("log_every", "eval_every", "stop_at", "stop_at_accuracy", "metrics", "tensorboard",
                                    "checkpoint_dir", "checkpoint_every", "keep_checkpoints", "async_checkpoint",
                                    "resume", "init_from", "overwrite", "keep_global_batch", "progress",
                                    "profile_startup", "prefetch"),
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
    compile: bool = option(False, "torch.compile the model in place (checkpoints are unchanged): whole, or block by "
                                  "block where the strategy communicates during backward or splits the model")
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
    async_checkpoint: bool = option(False, "write sharded checkpoints (fsdp, a pipeline, local-sgd or diloco on 2+ "
                                           "workers) in the background: the step waits only while each rank copies "
                                           "its shards to CPU memory")
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
    #: the paths named for the user (the metrics file beside --checkpoint-dir; rundir.placed()'s run directory): a
    #: saved run leaves them out
    _placed: tuple = dataclasses.field(default=(), repr=False)

    def __post_init__(self) -> None:
        check_fields(self)
        self.straggler = parse_slowness(self.straggler)
        self.link = None if self.link is None else parse_rate(self.link)
        if isinstance(self.strategy, str):
            self.strategy = strategy_class(self.strategy)()
        elif not isinstance(self.strategy, Options):
            raise PhalanxError(f"strategy must be a name ({', '.join(STRATEGIES)}) or options such as "
                               f"phalanx.Sync(), got {type(self.strategy).__name__}")
        check_recompute(self)
        if self.metrics is None and self.checkpoint_dir is not None:  # else named with the run's directory
            self.metrics = f"{self.checkpoint_dir}/metrics.jsonl"
            self._placed += ("metrics",)

    # ---- fields as a run reads them: each takes what a user may give (a name, None for "the default"), and
    # __post_init__, resolved() or rundir.placed() leaves it in one form; these read that form, typed ----
    @property
    def options(self) -> Options:
        """The strategy's options (a name given is its default options from __post_init__ on)."""
        assert isinstance(self.strategy, Options), "__post_init__ makes a strategy's name its options"
        return self.strategy

    @property
    def link_rate(self) -> Optional[LinkRate]:
        """``link`` parsed (from __post_init__ on)."""
        assert not isinstance(self.link, str), "__post_init__ parses the link's rate"
        return self.link

    @property
    def slowness(self) -> Optional[Slowness]:
        """``straggler`` parsed (from __post_init__ on)."""
        assert self.straggler is None or isinstance(self.straggler, Slowness), "__post_init__ parses the straggler"
        return self.straggler

    @property
    def run_dir(self) -> str:
        """The run's directory: ``checkpoint_dir`` once ``rundir.placed`` named it."""
        assert self.checkpoint_dir is not None, "rundir.placed names the run's directory"
        return self.checkpoint_dir

    @property
    def total_steps(self) -> int:
        """``steps`` once :meth:`resolved` filled it from the recipe."""
        assert self.steps is not None, "resolved() fills the steps from the recipe"
        return self.steps

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

    def to_toml(self) -> str:
        """The run as a ``--config`` file: the sections of ``--help`` as tables, the strategy's options under
        its name; unset values and what is an action rather than the run (--resume, --overwrite) left out."""
        tables = {section.split(" (")[0].replace(" ", "_"): {name: _flag_value(getattr(self, name))
                                                             for name in names if self._saved(name)}
                  for section, names in SECTIONS.items()}
        tables["parallelism"]["strategy"] = self.options.name
        tables[self.options.name] = {f.name: _flag_value(getattr(self.options, f.name))
                                     for f in declared(type(self.options))}
        return config_file.render(tables, "a phalanx train run: phalanx train --config FILE repeats it "
                                          "(flags typed with it override its values)")

    def _saved(self, name: str) -> bool:
        """Whether a saved run writes ``name``: never an action, nor a path phalanx chose (its ``--config`` then
        places a new run, rather than meet this one's checkpoints, and ``--checkpoint-dir`` alone moves the metrics
        with it); a setting's own option only where it applies (momentum under sgd), so that reading the file back
        refuses nothing."""
        if name in NOT_SAVED or name in self._placed or (name in OWN_SCHEDULE and self.lr_scheduler is not None):
            return False
        setting, applies_to, _ = ONLY_FOR.get(name, (None, (), None))
        return setting is None or getattr(self, setting) in applies_to

    def recipe_line(self, model: Optional[str] = None) -> str:
        """``recipe: adam, lr 0.01, 300 steps (lstm default; set by flags: lr)``."""
        _, source = self.recipe(model)
        given = [name for name in ("optimizer", "lr", "steps") if getattr(self, name) is not None]
        run = self.resolved(model)
        told = f"; set by flags: {', '.join(given)}" if given else "; any flag overrides"
        lr = "its own lr" if run.optimizer is not None and ":" in run.optimizer else f"lr {run.lr:g}"
        return f"recipe: {run.optimizer}, {lr}, {run.steps} steps ({source}{told})"


#: fields a saved run leaves out: what to do with the directory, not what the run is
NOT_SAVED = ("resume", "overwrite")


def _flag_value(value: Any) -> Any:
    """A field's value as its flag would spell it (a straggler as ``slow:1:2``); None for an inactive one."""
    if isinstance(value, Slowness):
        return value.text() if value.active else None
    if isinstance(value, LinkRate):
        return value.text
    return value


def recipe_name(cfg: TrainConfig, model: Optional[str]) -> str:
    name = model or cfg.model
    return f"{name} recipe" if name in RECIPES else "recipe for a model of your own"
