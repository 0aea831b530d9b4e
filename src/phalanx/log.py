"""phalanx's own messages as a library: the logger ``phalanx``, one child per module (``getLogger(__name__)``).

Notes on how a run goes (a lost worker it carries on without) are INFO; warnings that something went
wrong on the way (a worker died and the job restarts) are WARNING. A program that uses phalanx decides
where they go, as with any library's logging; phalanx adds no handler of its own there.

The command line shows them as it always has (:func:`show_on_streams`, called by ``cli.py``): the bare
message, a note on stdout among the step lines, a warning on stderr. What a command prints as its
output (the run header, the step lines, summaries, tables, reports) is not logged: it is the command's.
Warnings about the caller's own input (a device asked for that is not there) stay Python warnings.
"""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("phalanx")


class Streams(logging.Handler):
    """Below WARNING to stdout, the rest to stderr, each line flushed; the streams looked up as each record
    is written, so a stream replaced meanwhile (a test capturing output) gets it."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def show_on_streams() -> None:
    """Show phalanx's messages as the command line does, in this process (again: no second handler)."""
    if shown_on_streams():
        return
    handler = Streams()
    handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False  # shown once, here: a handler the program put on the root would show it twice


def shown_on_streams() -> bool:
    """Whether this process shows them so (the launcher asks, so that its workers do the same)."""
    return any(isinstance(h, Streams) for h in LOGGER.handlers)
