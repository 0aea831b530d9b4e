"""The conditions ``compare --scenarios`` names, applied to a real run.

- ``straggle.py``: slow workers (a calibrated pause after each step, by a seeded schedule);
- the slow link is the link's own shaping, beside the rest of the communication: ``comm/shaped_link.py``.
"""
