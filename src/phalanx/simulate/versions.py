"""Parameter versions, shared and reference-counted: kept only while some worker still holds one.

A parameter server hands every worker the parameters of the moment it replies; 256 workers may
hold 256 different versions, or all the same one. A version is stored once (a flat tensor) and
counted: each worker that holds it (to compute its next gradient on it) is one reference, and the
version is dropped as soon as the last reference goes. So memory follows the versions actually
in use, not the number of workers or of updates.
"""

from __future__ import annotations

from typing import Optional

import torch


class Versions:
    def __init__(self) -> None:
        self._store: dict[int, list] = {}  # id -> [flat tensor, references]
        self.peak = 0  #: the most versions held at once

    def add(self, flat: Optional[torch.Tensor], version: int) -> int:
        """Keep ``flat`` as ``version`` (once: a second add of the same version only counts a reference, and may
        give None)."""
        if version in self._store:
            self._store[version][1] += 1
        else:
            self._store[version] = [flat, 1]
            self.peak = max(self.peak, len(self._store))
        return version

    def has(self, version: int) -> bool:
        return version in self._store

    def get(self, version: int) -> torch.Tensor:
        return self._store[version][0]

    def release(self, version: int) -> None:
        entry = self._store[version]
        entry[1] -= 1
        if entry[1] == 0:
            del self._store[version]

    def __len__(self) -> int:
        return len(self._store)
