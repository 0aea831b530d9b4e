"""Checkpoints you can trust: atomic, checksummed, verified on load, one job per directory, nothing read runs code.

Below the strategies and the training loop, which both use it (a strategy saves and reads its own shards; the
loop commits each checkpoint into the run's directory and resumes from it); it imports neither. Which file
holds what:

- ``format.py``: what a checkpoint is on disk (``step-00000120.pt``, or a sharded ``step-00000120.dcp/``), the
  run record and the directory's checkpoints in write order;
- ``pt.py``: a single-file checkpoint, written atomically (temporary file, fsync, rename), read weights-only;
- ``dcp.py``: a sharded one, every rank its own shards through torch's distributed checkpoint, sealed by rank 0;
- ``directory.py``: the run's directory: proven writable, locked to one job, each checkpoint committed into it
  (record, retention), a storage error one line naming the previous good checkpoint;
- ``integrity.py``: the SHA-256 of every payload and every shard, verified on every read;
- ``load.py``: any checkpoint loaded and verified; from a directory, the newest that verifies;
- ``convert.py``: a checkpoint in the form its reader needs (a sharded one whole, without its optimizer);
- ``entries.py``: a sharded checkpoint's entries read by name, without a template or a process group;
- ``safe_read.py``: DCP's index and entries read through a restricted unpickler.
"""

from .dcp import ShardWriter
from .directory import DirectoryLock, ensure_writable, remove_stale_temporaries
from .entries import ALIASES, model_aliases, read_entries, with_aliases
from .format import (FORMAT, LOCK_NAME, RUN_NAME, STATE, RunRecord, checkpoint_path, is_checkpoint,
                     is_damaged_checkpoint, latest_checkpoint, list_checkpoints, read_run, remove, step_entries,
                     step_of, write_run)
from .convert import shapes, tensors, without_optimizer
from .load import load_checkpoint, warn_skipped
from .pt import save_checkpoint

__all__ = ["ALIASES", "FORMAT", "LOCK_NAME", "RUN_NAME", "STATE", "DirectoryLock", "RunRecord", "ShardWriter",
           "checkpoint_path", "ensure_writable", "is_checkpoint", "is_damaged_checkpoint", "latest_checkpoint",
           "list_checkpoints", "load_checkpoint", "model_aliases", "read_entries", "read_run", "remove",
           "remove_stale_temporaries", "save_checkpoint", "shapes", "step_entries", "step_of", "tensors",
           "warn_skipped", "with_aliases", "without_optimizer", "write_run"]
