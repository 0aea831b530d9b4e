"""One simulated run: the problem at W workers, its clock, its evaluations, and what it measured.

A :class:`World` is what a strategy's simulated rule plays on. It hands the rule what a real run
has and a rule should not rebuild: the model's initial weights (the run's seed), each worker's
shard of the data (the same :class:`~phalanx.data.ShardedBatches` a real worker reads, so worker
r's k-th batch is the real one), the run's optimizer and learning-rate schedule (as the training
loop builds them), the gradient engine, the parameter versions, the straggler delay of a worker's
step (the scenario's pure pause schedule), and the strategy's cost-model prediction at W workers.
The rule advances the simulated clock and reports each global step (:meth:`World.step_done`); the
world evaluates when a real run would and says when to stop (the target reached, or the last step).

An evaluation is a real run's: the task's metrics (accuracy, loss, perplexity, mse, a user's own),
each batch's (sum, count) added up by :func:`~phalanx.task.metrics.add_up` with the run's
:class:`~phalanx.task.metrics.Totals`, on the simulated parameters copied into the model; so the values
at a step are those a real one-process evaluation of the same parameters reports.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import time
from statistics import NormalDist
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..costs import Prediction, modelled_cost
from ..data import ShardedBatches, eval_batches
from ..data.batch import to_device
from ..errors import PhalanxError
from ..launcher import available_cores
from ..launcher.stop_signals import stop_if_asked
from ..task.metrics import Target, Totals, add_up
from ..comm.staleness import StalenessStats
from ..task import label, names_parameter
from ..task.schedules import Schedule
from ..scenarios.straggle import Slowness, unit_draw
from .gradients import Gradients
from .problem import Problem
from .versions import Versions


@dataclasses.dataclass
class Outcome:
    """What one simulated run measured (in simulated seconds), for the comparison's report."""

    #: every evaluation: step, seconds and the target's metric (a real run's curve); ``values``: every metric
    curve: list[dict[str, float]] = dataclasses.field(default_factory=list)
    values: list[dict[str, float]] = dataclasses.field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0  #: simulated training time
    examples: int = 0  #: examples a worker computed a gradient on (dropped ones included)
    applied: Optional[int] = None  #: gradients applied (the parameter-server family)
    dropped: Optional[int] = None
    dropped_by: dict[str, int] = dataclasses.field(default_factory=dict)  #: rank -> gradients dropped
    drops: bool = False  #: dropping is part of the rule (it drops late gradients): reported even when none was
    diverged: bool = False
    wall_seconds: float = 0.0  #: what simulating it took here
    peak_versions: int = 0
    outrun: bool = False  #: stopped past its deadline without the target (compare --simulate's race)


class World:
    def __init__(self, problem: Problem, options: Any, workers: int, slowness: Optional[Slowness], seed: int,
                 max_steps: int, eval_every: int, target: Optional[Target], deadline: float = math.inf):
        self.problem, self.options, self.workers = problem, options, workers
        self.slowness, self.seed = slowness, seed
        self.max_steps, self.eval_every = max_steps, eval_every
        self.target = target  #: what stops the run (None: only the last step)
        #: simulated seconds past which the run stops without the target: another strategy reached it sooner
        self.deadline = deadline
        self.cfg = problem.config
        self.device = problem.device  #: where every tensor of the run lives (the batches are moved there as read)
        self.data = problem.data(seed)
        self.template = problem.model(seed)
        self.step = problem.task.step  #: one object for the run: it remembers what it looked up of the model
        # workers computed in turn (a model vmap cannot batch), several at once: --threads, else every core
        self.grads = Gradients(self.template, problem.task.loss_fn, self.step, self.cfg.threads or available_cores())
        self.totals = Totals(problem.task.metrics, problem.task.loss_fn)  #: what a real run's evaluation adds up
        self.versions = Versions()
        self.staleness: Optional[StalenessStats] = None  #: set by rules whose gradients can be stale
        self.outcome = Outcome()
        self.stopped = False
        self.final: Optional[torch.Tensor] = None  #: the trained model's parameters, flat (set by the rule)
        self.began = time.perf_counter()

    # ---- what a real run is made of ----
    def fresh_model(self) -> nn.Module:
        """The run's initial model (its seed), a copy of its own."""
        return self.problem.model(self.seed)

    def stepped(self):
        """The run's initial parameters as one optimizer steps them (:class:`~phalanx.simulate.params.Stepped`)."""
        from .params import Stepped

        return Stepped(self.fresh_model(), elementwise=self.problem.task.make_optimizer is None)

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.workers

    def optimizer(self, params) -> torch.optim.Optimizer:
        """The run's optimizer, as the training loop makes it (the linear scaling rule on the global batch).
        ``params``: a :class:`~phalanx.simulate.params.Stepped` (a factory that takes the model gets its module,
        as a real run's does: groups by name, ``configure_optimizers``), or the tensors to step."""
        from .params import Stepped

        factory = self.problem.task.make_optimizer
        module = params.model if isinstance(params, Stepped) else None
        if takes_the_model(factory):
            if module is None:
                raise PhalanxError(stacked_copies(factory, self.options.name))
            return self.problem.task.optimizer_for(self.cfg, module, self.global_batch)
        tensors = params.tensors if isinstance(params, Stepped) else params
        return self.problem.task.optimizer_for(self.cfg, tensors, self.global_batch)

    def clip(self, tensors: list[torch.Tensor], rows: bool = False) -> None:
        """``--clip-grad-norm`` on the gradients of ``tensors``, as a real run clips them (the applied gradient's
        norm); ``rows``: each tensor stacks the W workers' own copies (row w: worker w's), each clipped alone."""
        limit = self.cfg.clip_grad_norm
        if limit is None:
            return
        if rows:
            clip_rows([t.grad for t in tensors if t.grad is not None], limit)
        else:
            torch.nn.utils.clip_grad_norm_([t for t in tensors if t.grad is not None], limit)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        """The run's LR scheduler: the user's (``--lr-scheduler``), else phalanx's schedule; stepped once per
        global step, as the training loop steps it."""
        cfg = self.cfg
        if self.problem.task.make_scheduler is not None:
            return self.problem.task.scheduler(optimizer, self.max_steps)
        schedule = Schedule(cfg.lr_schedule, cfg.lr_decay_every, cfg.lr_decay_factor, cfg.staircase,
                            cfg.warmup_steps, self.max_steps)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    def reader(self, worker: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Worker ``worker``'s batches, its own step after step (data shard ``worker`` of W), on :attr:`device`."""
        return self._on_device(ShardedBatches(self.data.train, self.cfg.batch_size, worker, self.workers, self.seed)(0))

    def global_reader(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every worker's batch of a step at once: the W shards, in order, are one slice of the epoch's shuffle."""
        return self._on_device(ShardedBatches(self.data.train, self.global_batch, 0, 1, self.seed)(0))

    def _on_device(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The batches read (on the CPU, as a real worker's loader reads them), moved to :attr:`device`; on the CPU
        they are the same tensors."""
        return (to_device(batch, self.device) for batch in batches)

    def prediction(self, options: Any = None) -> Prediction:
        """The strategy's cost model at W workers: its step time and where the time goes."""
        options = options or self.options
        return modelled_cost(options).predict(options, self.problem.compute, self.problem.facts,
                                           self.problem.network, self.workers)

    # ---- the clock ----
    @property
    def compute_seconds(self) -> float:
        """Forward + backward of one worker's batch: what a straggler's factor multiplies (as ``straggle.py``)."""
        c = self.problem.compute
        return c.forward + c.backward

    def delay(self, worker: int, own_step: int, rank: int) -> float:
        """Seconds a straggler adds to ``worker``'s own step ``own_step`` (``rank``: its process's rank)."""
        if self.slowness is None:
            return 0.0
        factor = self.slowness.factor_at(self.seed, own_step, rank, worker)
        return (factor - 1.0) * self.compute_seconds

    def jitter(self, worker: int, own_step: int, mean: float, spread: float) -> float:
        """Seconds ``worker``'s own step ``own_step``, of ``mean`` seconds on average, takes beyond that mean
        (negative: less). Real workers' steps vary, and where they do not meet (the parameter-server family)
        who arrives first is decided by that. A log-normal draw of mean ``mean`` and standard deviation
        ``spread`` (measured: ``Compute.step_spread``, and a ps worker's round trip's): never negative, and
        with a tail to the slow side, as measured round trips have; pure in (seed, step, worker), as the
        pauses are."""
        if spread <= 0 or mean <= 0:
            return 0.0
        sigma = math.sqrt(math.log1p((spread / mean) ** 2))
        u = min(max(unit_draw(self.seed, "jitter", own_step, worker), 1e-12), 1.0 - 1e-12)
        return mean * (math.exp(sigma * NormalDist().inv_cdf(u) - sigma * sigma / 2) - 1.0)

    def slowest_delay(self, step: int, first_rank: int = 0) -> float:
        """The largest delay over every worker at a step all of them take together."""
        if self.slowness is None:
            return 0.0
        return max(self.delay(w, step, w + first_rank) for w in range(self.workers))

    # ---- evaluations, and when to stop ----
    def evaluate(self, flat: torch.Tensor) -> dict[str, float]:
        """Every metric of the parameters ``flat`` on the whole test set."""
        return self.totals.values(self._sums(flat, eval_batches(self.data.test, 256)).tolist())

    def evaluate_parts(self, flats: list[torch.Tensor]) -> dict[str, float]:
        """Each worker's own parameters on its part of the test set, the sums added (a real run's
        collective evaluation, where replicas differ between averagings)."""
        sums = self.totals.zeros()
        for part, flat in enumerate(flats):
            sums += self._sums(flat, eval_batches(self.data.test, 256, part, len(flats)))
        return self.totals.values(sums.tolist())

    def _sums(self, flat: torch.Tensor, batches) -> torch.Tensor:
        """The (sum, count) vector of :attr:`totals` over ``batches``, the model holding ``flat``. The
        template's own parameters are free to take it: gradients are computed with parameters given
        to it (``functional_call``), never with its own."""
        with torch.no_grad():
            offset = 0
            for p in self.template.parameters():
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        with self.grads.using_threads():  # a forward of the whole test set: every core
            return add_up(self.template, batches, self.device, self.totals, self.step)

    def due(self, step: int) -> bool:
        """Whether a real run evaluates after global step ``step`` (every --eval-every steps, and the last)."""
        return step >= self.max_steps or step % self.eval_every == 0

    def step_done(self, step: int, seconds: float, values: Optional[dict[str, float]] = None,
                  loss: float = 0.0) -> bool:
        """Global step ``step`` ended at simulated ``seconds``; ``values``: the metrics where the rule
        evaluated (it must when :meth:`due`). True: stop here (the target reached, the last step, divergence, or
        the clock past :attr:`deadline`). A stop signal recorded meanwhile raises
        :class:`~phalanx.errors.Stopped` here, between steps (``launcher/stop_signals.py``)."""
        stop_if_asked()
        self.outcome.steps, self.outcome.seconds = step, seconds
        if not math.isfinite(loss):
            self.outcome.diverged = True
            self.stopped = True
            return True
        if values is not None:
            point = {"step": step, "seconds": seconds}
            if self.target is not None:
                point[self.target.metric] = values.get(self.target.metric, math.nan)
            self.outcome.curve.append(point)
            self.outcome.values.append(values)
            if self.target is not None and self.target.reached(values):
                self.stopped = True
        if not self.stopped and seconds > self.deadline:
            self.outcome.outrun = self.stopped = True
        if step >= self.max_steps:
            self.stopped = True
        return self.stopped

    def finish(self) -> Outcome:
        out = self.outcome
        out.examples = self.grads.computed * self.cfg.batch_size
        out.wall_seconds = time.perf_counter() - self.began
        out.peak_versions = self.versions.peak
        return out


def takes_the_model(factory: Any) -> bool:
    """An optimizer factory ``(model) -> Optimizer`` (a real run gives it the module: groups by name)."""
    return factory is not None and names_parameter(factory, "model", first=True)


def stacked_copies(factory: Any, strategy: str) -> str:
    """Why a rule that steps the workers' copies stacked (no module of one worker's) cannot take such a factory."""
    return (f"the optimizer factory {label(factory)} takes the model, and simulated {strategy} steps the workers' "
            "copies stacked as one tensor per parameter (no module of one worker's to give it); give a params -> "
            f"Optimizer factory, or compare {strategy} without --simulate")


def clip_rows(grads: list[torch.Tensor], limit: float) -> None:
    """torch's clip_grad_norm_ rule applied to each row alone, in place: row w of every tensor in ``grads`` is
    worker w's gradient (the simulated local steps stack the W workers' copies)."""
    if not grads:
        return
    norms = functools.reduce(operator.add, (g.reshape(len(g), -1).square().sum(1) for g in grads)).sqrt()
    scale = (limit / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.view(-1, *([1] * (g.dim() - 1))))
