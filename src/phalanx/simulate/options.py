"""``compare --simulate``'s own options, declared once: the fields are the flags.

The link flags are ``phalanx estimate``'s own (same names, same units, same parsers), because the
simulation's clock is the estimate's cost model.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..errors import PhalanxError
from ..units import check_link_pair, parse_bandwidth, parse_duration
from ..options import declared, flag_name, option


def parse_step_time(text: str) -> float:
    """``0.012`` (seconds) or ``12ms``."""
    try:
        return float(text)
    except ValueError:
        return parse_duration(text)


@dataclasses.dataclass(frozen=True)
class SimulateOptions:
    simulate: bool = option(False, "answer by an event simulation at the --workers counts (e.g. 8,64,256): real "
                                   "gradients of your model, each strategy's own rule, the estimate's clock")
    step_time: Optional[float] = option(None, "--simulate: seconds of one worker's step on your target device "
                                              "(e.g. 0.012 or 12ms)", parse=parse_step_time, show="measured here")
    link_bandwidth: Optional[float] = option(
        None, "--simulate: bus bandwidth between machines (e.g. 25GB/s, 10Gb/s)", parse=parse_bandwidth,
        show="this machine's loopback, measured")
    link_latency: Optional[float] = option(None, "--simulate: latency per message between machines (e.g. 10us)",
                                           parse=parse_duration, show="measured with the bandwidth")
    per_node: Optional[int] = option(None, "--simulate: workers per machine", show="2 on CPU, one per GPU")
    race: bool = option(True, "--simulate: stop a strategy's run once its simulated clock passes the fastest time "
                              "to target found at that worker count and scenario (it cannot be first; reported as "
                              "'> T'); --no-race runs every strategy to the target or --max-steps")

    def __post_init__(self) -> None:
        if not self.simulate:
            typed = [f"--no-{f.name.replace('_', '-')}" if f.default is True else flag_name(f)
                     for f in declared(type(self)) if f.name != "simulate" and getattr(self, f.name) != f.default]
            if typed:
                raise PhalanxError(f"{typed[0]} is a flag of the simulation: add --simulate, or drop {typed[0]}")
        check_link_pair(self.link_bandwidth, self.link_latency)
        if self.step_time is not None and not self.step_time > 0:
            raise PhalanxError(f"--step-time must be a positive number of seconds, got {self.step_time}")
        if not isinstance(self.race, bool):
            raise PhalanxError(f"--race is on or off, got {self.race!r}")
        if self.per_node is not None and (not isinstance(self.per_node, int) or self.per_node < 1):
            raise PhalanxError(f"--per-node must be at least 1, got {self.per_node!r}")
