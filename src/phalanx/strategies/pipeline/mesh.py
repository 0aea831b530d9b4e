"""The stages × replicas mesh in numbers: how many replicas a pipeline has, how a rank is named.

Pure and shared: the layout checks the mesh in the parent before any worker starts, and every
worker's runtime reads its place on it (rank = stage × replicas + replica).
"""

from __future__ import annotations

from ...errors import PhalanxError


def check_mesh(stages: int, processes: int) -> int:
    """Replicas of a ``stages``-stage pipeline on ``processes`` workers; a clear error unless a whole number."""
    if processes < stages:
        raise PhalanxError(f"--stages {stages} needs {stages} workers (one per stage) but this run has "
                           f"{processes}; add --workers {stages}")
    if processes % stages:
        below, above = processes // stages * stages, -(-processes // stages) * stages
        raise PhalanxError(f"--workers {processes} is not a multiple of --stages {stages} ({processes} / {stages} = "
                           f"{processes / stages:.3g} replicas of the pipeline); use --workers {below} or {above}")
    return processes // stages


def mesh_label(rank: int, replicas: int) -> str:
    """How messages name a rank: ``stage 1 (rank 1)``, or ``stage 1 replica 0 (rank 2)`` on a 2-D mesh."""
    stage, replica = divmod(rank, replicas)
    return f"stage {stage} (rank {rank})" if replicas == 1 else f"stage {stage} replica {replica} (rank {rank})"
