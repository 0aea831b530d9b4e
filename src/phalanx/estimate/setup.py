"""What an estimate is computed for: the checked inputs, and which rows and conditions follow from them.

:func:`prepare` makes every check that needs no measurement (bad input is one line before anything
runs) and reads the model's sizes; :func:`conditions_for` says under which conditions a row's
worker computes (how many processes share its node, how many threads each has); :func:`predict`
asks the cost model (``costs/``) for one row.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..devices import resolve_devices
from ..errors import PhalanxError
from ..launch import available_cores
from ..models import build_model
from ..strategies import LocalSGD, Pipeline, Sync
from ..train import TrainConfig
from ..costs import (Compute, ModelFacts, Network, Prediction, predict_fsdp, predict_local_sgd, predict_pipeline,
                    predict_ps, predict_sync)
from .facts import model_facts
from .options import EstimateOptions
from .profile import Conditions


@dataclasses.dataclass
class Setup:
    """Everything checked before a measurement starts."""

    options: EstimateOptions
    config: TrainConfig  #: resolved: the recipe's optimizer and the data defaults filled in
    sync: Sync
    local_sgd: LocalSGD
    pipeline: Pipeline
    device: torch.device
    per_node: int
    cores: int
    facts: ModelFacts
    input_shape: tuple
    skipped: list[str]  #: rows that cannot exist, and why


# --------------------------------------------------------------------------- checks (no measurement)

def prepare(options: EstimateOptions, train_values: dict, strategy_values: dict) -> Setup:
    """Check everything and read the model; ``*_values``: the flags the user typed, by field name."""
    config = TrainConfig(**train_values).resolved()
    sync = Sync(**{k: v for k, v in strategy_values.items() if k in ("reduce", "compress", "bucket_mb")})
    local_sgd = LocalSGD(**{k: v for k, v in strategy_values.items() if k == "sync_every"})
    pipeline = Pipeline(**{k: v for k, v in strategy_values.items() if k in ("stages", "chunks", "schedule")})
    from ..train.checks import data_facts

    facts = data_facts(config, None)
    if config.batch_size > facts.train_size:
        raise PhalanxError(f"--batch-size {config.batch_size} is larger than the {facts.train_size} training "
                           "examples; use a smaller --batch-size")
    device = resolve_devices(config.devices)[0]
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    per_node = options.per_node or (gpus if device.type == "cuda" else 2)
    torch.manual_seed(config.seed)
    model = build_model(config.model, facts.input_shape, facts.num_classes)
    sizes = model_facts(model, facts.example[0], config.batch_size, sync.bucket_mb)
    skipped = _check_pipeline(options, pipeline, config.batch_size, len(sizes.block_names))
    if "ps" in options.strategies and 1 in options.workers:
        skipped.append("ps on 1 worker: a parameter server needs at least 2 workers")
    return Setup(options, config, sync, local_sgd, pipeline, device, per_node, available_cores(), sizes,
                 tuple(facts.input_shape), skipped)


def _check_pipeline(options: EstimateOptions, pipeline: Pipeline, batch: int, blocks: int) -> list[str]:
    if "pipeline" not in options.strategies:
        return []
    if batch % pipeline.chunks:
        raise PhalanxError(f"--batch-size {batch} does not split into --chunks {pipeline.chunks} equal micro-batches "
                           f"({batch} / {pipeline.chunks} = {batch / pipeline.chunks:g}); use a batch divisible by "
                           f"{pipeline.chunks}")
    if pipeline.stages is not None and pipeline.stages > blocks:
        raise PhalanxError(f"--stages {pipeline.stages} but the model has only {blocks} blocks; use --stages "
                           f"{blocks} or fewer")
    skipped = []
    for n in options.workers:
        stages = pipeline_stages(pipeline, n, blocks)
        if n % stages:
            skipped.append(f"pipeline on {n} workers: {n} workers do not make whole {stages}-stage pipelines")
        elif pipeline.schedule == "1f1b" and pipeline.chunks < stages:
            skipped.append(f"pipeline on {n} workers: 1f1b needs --chunks >= {stages} stages")
    return skipped


def pipeline_stages(pipeline: Pipeline, workers: int, blocks: int) -> int:
    """P: --stages, or one stage per worker up to one per block (the rest are replicas of the pipeline)."""
    return pipeline.stages or min(workers, blocks)


# --------------------------------------------------------------------------- rows

def conditions_for(setup: Setup, strategy: str, workers: int) -> Conditions:
    """The processes that would share a node and the threads each would have (as phalanx's launcher gives them)."""
    local = min(workers, setup.per_node)
    if setup.device.type == "cuda":
        return Conditions(1, setup.config.threads or max(1, setup.cores // local), "cuda:0")
    server = 1 if strategy == "ps" else 0  # the server process shares node 0's cores
    return Conditions(local, setup.config.threads or max(1, setup.cores // (local + server)), "cpu")


def predict(setup: Setup, strategy: str, workers: int, compute: Compute, net: Network, *,
            facts: Optional[ModelFacts] = None, **changes: Any) -> Prediction:
    """One row; ``changes`` override the options (compress, hierarchical, sync_every, chunks) for advice."""
    facts = facts or setup.facts
    if strategy == "sync":
        hierarchical = changes.get("hierarchical", setup.sync.reduce == "hierarchical" or (
            setup.sync.reduce == "auto" and net.nodes(workers) > 1 and net.per_node > 1))
        return predict_sync(compute, facts, net, workers, changes.get("compress", setup.sync.compress), hierarchical)
    if strategy == "ps":
        return predict_ps(compute, facts, net, workers)
    if strategy == "local-sgd":
        return predict_local_sgd(compute, facts, net, workers, changes.get("sync_every", setup.local_sgd.sync_every))
    if strategy == "pipeline":
        stages = pipeline_stages(setup.pipeline, workers, len(facts.block_names))
        return predict_pipeline(compute, facts, net, workers, stages, changes.get("chunks", setup.pipeline.chunks))
    return predict_fsdp(compute, facts, net, workers)
