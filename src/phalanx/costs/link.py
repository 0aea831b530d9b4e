"""A link between workers as two numbers, α (seconds per message) and β (seconds per byte). Pure.

A message of S bytes over a link costs α + S·β; a ring all-reduce of S bytes over N ranks takes
2(N−1) steps of S/N bytes each (Thakur, Rabenseifner and Gropp 2005). Where the figures come from
(measured, given, datasheets) is ``phalanx/estimate/link.py``'s business; this is only the arithmetic
every cost model shares.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Link:
    alpha: float  #: seconds per message (per ring step)
    beta: float  #: seconds per byte (1 / bus bandwidth)
    source: str  #: where the figures come from
    #: Sending and receiving are both copies made by the same CPUs (gloo between CPU processes of one
    #: machine). A ring step sends and receives at once, so a one-way message, which only sends, moves
    #: its bytes in half the time; on a full-duplex link (a NIC, NVLink) it takes S·β either way.
    shared_copy: bool = False

    @property
    def bandwidth(self) -> float:
        return 1.0 / self.beta

    def message(self, nbytes: float) -> float:
        """One point-to-point message of ``nbytes``."""
        return self.alpha + nbytes * self.copy_seconds_per_byte()

    def copy_seconds_per_byte(self) -> float:
        """Seconds per byte of one direction: β, or β/2 where one CPU copies both ways (``shared_copy``)."""
        return self.beta / 2 if self.shared_copy else self.beta

    def cpu(self, messages: float, nbytes: float) -> float:
        """CPU-seconds one end spends on ``messages`` carrying ``nbytes`` in all, one way.

        Every byte is copied by a CPU. Where the CPUs themselves are the link (``shared_copy``: no
        wire between processes of one machine), a message's α is software too (system calls,
        waking the peer) and is charged to each end as well (the overhead *o* of the LogP model).
        """
        return nbytes * self.copy_seconds_per_byte() + (messages * self.alpha if self.shared_copy else 0.0)

    def to_dict(self) -> dict:
        return {"alpha_s": self.alpha, "beta_s_per_byte": self.beta, "bandwidth_bytes_per_s": self.bandwidth,
                "shared_copy": self.shared_copy, "source": self.source}


def ring_terms(ranks: int, nbytes: float) -> tuple[float, float]:
    """(messages, bytes) on the critical path of a ring all-reduce: (2(N−1), 2(N−1)/N · S)."""
    return 2.0 * (ranks - 1), 2.0 * (ranks - 1) / ranks * nbytes
