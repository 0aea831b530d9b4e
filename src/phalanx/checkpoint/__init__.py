"""Checkpoints: the format, the ``.pt`` and ``.dcp`` readers and writers, their integrity and their conversions.

Below the strategies and the training loop, which both use it (a strategy saves and reads its own shards; the
loop commits each checkpoint into the run's directory and resumes from it); it imports neither.
"""

from .dcp import STATE, ShardWriter
from .directory import (FORMAT, LOCK_NAME, RUN_NAME, DirectoryLock, RunRecord, checkpoint_path, ensure_writable,
                        is_checkpoint, is_damaged_checkpoint, latest_checkpoint, list_checkpoints, load_checkpoint,
                        read_run, remove, remove_stale_temporaries, save_checkpoint, shapes, step_entries, tensors,
                        warn_skipped, without_optimizer, write_run)
from .entries import ALIASES, model_aliases, read_entries, with_aliases

__all__ = ["ALIASES", "FORMAT", "LOCK_NAME", "RUN_NAME", "STATE", "DirectoryLock", "RunRecord", "ShardWriter",
           "checkpoint_path", "ensure_writable", "is_checkpoint", "is_damaged_checkpoint", "latest_checkpoint",
           "list_checkpoints", "load_checkpoint", "model_aliases", "read_entries", "read_run", "remove",
           "remove_stale_temporaries", "save_checkpoint", "shapes", "step_entries", "tensors", "warn_skipped",
           "with_aliases", "without_optimizer", "write_run"]
