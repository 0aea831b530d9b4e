"""A kind is a closed set of values (a layout's stop rule, a rank's role, a worker's report): an enum.

Each member is also its string (``StopRule.AGREE == "agree"``), so what is written to a metrics file,
a JSON report or a message reads exactly as the plain word did, and a comparison with the word still
holds. A word from outside (the user's code, a flag) becomes a member at the edge, through
:meth:`Kind.of`, which refuses anything else in one line naming the values there are.
"""

from __future__ import annotations

import enum
from typing import Union

from .errors import PhalanxError


class Kind(str, enum.Enum):
    """Base of phalanx's kinds: a str-valued enum that prints as its value."""

    def __str__(self) -> str:
        # Python 3.12 formats a str-mixed enum as ``Class.MEMBER``; the value is what every output shows.
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def of(cls, value: Union[str, "Kind"], what: str) -> "Kind":
        """``value`` as a member of this kind; ``what`` names it in the error (``a layout's stop_rule``)."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise PhalanxError(f"{what} {value!r} is not one of {choices}") from None
