"""Checksums: a byte changed on disk is found before it is trained on.

Every checkpoint holds the SHA-256 of its payload (every tensor's bytes, dtype and shape, every other value,
by key), recomputed and compared on load; a sharded checkpoint's state file holds the SHA-256 of each of its
other files as well, since DCP's metadata records where each tensor lies, not what its bytes are, and
neither torch's zip reader nor DCP's checks anything. A digest is not a signature: whoever made the files
could make their digests too, so nothing read may run code whatever it says (``safe_read.py``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

#: what a checkpoint's digest leaves out: the digest itself, and what a read adds (where it came from, what it
#: skipped)
_NOT_HASHED = ("checksum", "path", "skipped")


def payload_digest(state: dict[str, Any]) -> str:
    """SHA-256 of everything in ``state`` but its own checksum: tensors by bytes, dtype and shape."""
    digest = hashlib.sha256()

    def walk(obj: Any, where: str) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            digest.update(f"{where}:{t.dtype}:{tuple(t.shape)};".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().data)  # (.data: its bytes, not copied)
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                walk(obj[key], f"{where}/{key}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, f"{where}[{i}]")
        else:
            digest.update(f"{where}={obj!r};".encode())

    walk({k: v for k, v in state.items() if k not in _NOT_HASHED}, "")
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, streamed: no file is held in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
