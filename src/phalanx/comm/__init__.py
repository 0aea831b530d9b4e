"""Communication: how the workers' tensors meet and what crossing the wire costs them.

- ``reduce.py``: the all-reduce choices (flat, hierarchical by islands, compressed) and their wording;
- ``wire.py``: the meter of every collective's and message's bytes, for the run's summary;
- ``shaped_link.py``: a slow link, as ``compare --scenarios slow-link`` asks (``tc``'s token bucket on a
  private loopback, or paced sends);
- ``staleness.py``: how many versions old an asynchronous update was when it arrived;
- ``own_group.py``: a process group of the parent's own, for a moment (a rehearsal, a measurement).
"""
