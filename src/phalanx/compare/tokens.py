"""What ``phalanx compare`` is asked to compare: strategy tokens and straggler scenarios, parsed.

A strategy token is a strategy's name, with its main option (its first declared option) after a
colon: ``sync``, ``ps``, ``ssp:2`` (staleness), ``local-sgd:8`` and ``diloco:20`` (sync every), ``backup:1``
(backup workers), ``hogwild``. The value is read by the option's own parser and checked by the options'
own validation, so ``ssp:-1`` fails with the message ``--staleness -1`` would.

A scenario is ``none``, ``slow:RANK:FACTOR`` or ``pauses:P:FACTOR``: a
:class:`~phalanx.scenarios.straggle.Slowness`, the same as ``phalanx train --straggler`` takes; or
``link:RATE``: every run on a real link of RATE, the same as ``phalanx train --link RATE``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional

from ..errors import PhalanxError
from ..options import declared, flag_name
from ..comm.shaped_link import LinkRate, parse_rate
from ..strategies import STRATEGIES, Options
from ..scenarios.straggle import Slowness


@dataclasses.dataclass(frozen=True)
class StrategyToken:
    token: str  #: as the user wrote it (and as tables name it): "ssp:2"
    options: Options


@dataclasses.dataclass(frozen=True)
class Scenario:
    token: str  #: "none", "slow:1:2", "pauses:0.1:4", "link:50mbit"
    slowness: Optional[Slowness]  #: None: nobody is slowed
    link: Optional[LinkRate] = None  #: None: the loopback, unshaped

    def describe(self) -> str:
        if self.link is not None:
            return f"a real {self.link.describe()} link shared by every worker"
        s = self.slowness
        if s is None:
            return "no straggler"
        if s.kind == "slow":
            return f"rank {s.rank} {s.factor:g}x as slow every step"
        return f"each worker {s.factor:g}x as slow with probability {s.probability:g} per step"


def _split(text: str, what: str) -> list[str]:
    items = [item.strip() for item in str(text).split(",")]
    if not items or any(not item for item in items):
        raise PhalanxError(f"--{what} {text!r} has an empty entry; give a comma-separated list such as "
                           f"{'sync,ps,ssp:2' if what == 'strategies' else 'none,slow:1:2'}")
    duplicates = sorted({item for item in items if items.count(item) > 1})
    if duplicates:
        raise PhalanxError(f"--{what} names {', '.join(duplicates)} twice; list each once")
    return items


def main_option(cls: type[Options]) -> Optional[dataclasses.Field]:
    """The option a token's value sets: the strategy's first declared option (None: it takes none)."""
    fields = declared(cls)
    return fields[0] if fields else None


def _value(cls: type[Options], field: dataclasses.Field, text: str, token: str) -> Any:
    parse = field.metadata.get("parse")
    if parse is None:  # the field's type, Optional[...] unwrapped
        kinds = [k for k in typing.get_args(typing.get_type_hints(cls)[field.name]) if k is not type(None)] or \
            [typing.get_type_hints(cls)[field.name]]
        parse = kinds[0] if kinds[0] in (int, float, str) else str
    try:
        return parse(text)
    except PhalanxError as e:
        raise PhalanxError(f"strategy {token!r}: {e}") from None
    except ValueError:
        raise PhalanxError(f"strategy {token!r}: {flag_name(field)} takes "
                           f"{'a whole number' if parse is int else 'a number' if parse is float else 'a value'}, "
                           f"got {text!r}") from None


def parse_strategy(token: str) -> StrategyToken:
    name, _, value = token.partition(":")
    if name not in STRATEGIES:
        raise PhalanxError(f"unknown strategy {name!r} in {token!r}: choose one of {', '.join(STRATEGIES)}, with "
                           "its main option after a colon where it has one (ssp:2, local-sgd:8, backup:1)")
    cls = STRATEGIES[name]
    if not _:
        return StrategyToken(token, cls())
    field = main_option(cls)
    if field is None:
        raise PhalanxError(f"strategy {token!r}: {name} takes no option; write {name}")
    if not value:
        raise PhalanxError(f"strategy {token!r}: give {flag_name(field)} after the colon, e.g. {name}:1")
    try:
        options = cls(**{field.name: _value(cls, field, value, token)})
    except PhalanxError as e:
        message = str(e)
        raise PhalanxError(message if message.startswith("strategy ") else f"strategy {token!r}: {message}") from None
    return StrategyToken(token, options)


def parse_strategies(text: str) -> list[StrategyToken]:
    """``sync,ps,ssp:2,local-sgd:8,hogwild,backup:1`` -> one :class:`StrategyToken` each."""
    return [parse_strategy(item) for item in _split(text, "strategies")]


def parse_scenario(item: str) -> Scenario:
    parts = item.strip().lower().split(":")
    if parts == ["none"]:
        return Scenario("none", None)
    if parts[0] == "link" and len(parts) == 2:
        try:
            return Scenario(":".join(parts), None, parse_rate(parts[1], flag="link:"))
        except PhalanxError as e:
            raise PhalanxError(f"--scenarios: {e}") from None
    wrong = PhalanxError(f"--scenarios: {item!r} is not none, slow:RANK:FACTOR or pauses:P:FACTOR, nor link:RATE (e.g. "
                         "slow:1:2: rank 1 twice as slow; pauses:0.1:4: each worker 4x as slow in 10% of its steps; "
                         "link:100mbit: every worker on one real 100 Mbit/s link)")
    if len(parts) != 3 or parts[0] not in ("slow", "pauses"):
        raise wrong
    try:
        rank, probability = (int(parts[1]), 0.0) if parts[0] == "slow" else (None, float(parts[1]))
        factor = float(parts[2])
    except ValueError:
        raise wrong from None
    try:
        slowness = Slowness(parts[0], factor, rank=rank, probability=probability)
    except PhalanxError as e:
        raise PhalanxError(f"--scenarios: {e}") from None
    return Scenario(":".join(parts), slowness)


def parse_scenarios(text: str) -> list[Scenario]:
    """``none,slow:1:2,pauses:0.1:4`` -> one :class:`Scenario` each."""
    return [parse_scenario(item) for item in _split(text, "scenarios")]


__all__ = ["Scenario", "StrategyToken", "main_option", "parse_scenario", "parse_scenarios", "parse_strategies",
           "parse_strategy"]
