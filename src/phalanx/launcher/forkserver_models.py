"""Imported by the fork server where the process starting it uses a model library (``forkserver.MODEL_LIBRARIES``):
the library's modeling machinery, once, rather than in each worker that unpickles a model of its. An error is left to
the worker that needs the library: multiprocessing's server would end on any exception but an ImportError here."""

import importlib

from .forkserver import MODEL_LIBRARIES

for _module in MODEL_LIBRARIES.values():
    try:
        importlib.import_module(_module)
    except Exception:  # (a library that cannot import here fails where a worker imports it, in its words)
        pass
