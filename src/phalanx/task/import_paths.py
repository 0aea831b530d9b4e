"""The user's import paths, ``mymodels:Net`` as uvicorn and gunicorn spell them: found, or one line on why not.

Resolved in the parent, so that nothing starts if one fails, and again in every spawned worker (which
copies the parent's ``sys.path``; :func:`importable_cwd` makes the current directory importable in
both, and in a restarted job through ``PYTHONPATH``). :func:`label` is the way back: how the header
and the checkpoint name a function or class the API was given.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from typing import Any, Callable, TypeGuard

from ..errors import PhalanxError


def is_import_path(name: Any) -> TypeGuard[str]:
    return isinstance(name, str) and ":" in name


def importable_cwd() -> None:
    """The current directory is importable, as with ``python -m``: here, and in every process this
    one starts (spawned workers copy sys.path; others, e.g. a restarted job, read PYTHONPATH)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd] + [p for p in paths if p])


#: module -> what importing it raised in this process: imported once, as Python runs a module's top level once, and
#: reported where its path is resolved (:func:`import_early`)
_failed: dict[str, Exception] = {}


def import_early(module_name: str) -> None:
    """Import the user's module now, before the command's fork server forks from this process, so that the server
    and every worker fork with it and what it imports (a Hugging Face model's module imports transformers' modeling
    machinery: 2.4 to 3.4 s of CPU in each worker otherwise). What it raises is kept for :func:`resolve` to report,
    naming the flag, rather than the module run again."""
    importable_cwd()
    try:
        importlib.import_module(module_name)
    except Exception as e:  # (the user's module may raise anything while importing)
        _failed[module_name] = e


def resolve(spec: str, flag: str, expected: str) -> Callable:
    """``module:name`` (dots allowed in both) as the object it names, or one line naming what failed."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise PhalanxError(f"{flag} {spec}: write MODULE:CALLABLE, e.g. mymodels:Net")
    importable_cwd()
    obj: Any = _import(module_name, spec, flag)
    for part in attr.split("."):
        obj = _attribute(obj, part, module_name, attr, spec, flag)
    if not callable(obj):
        raise PhalanxError(f"{flag} {spec}: '{attr}' is a {type(obj).__name__}, not callable; expected {expected}")
    return obj


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, at most 160 characters: what a one-line error quotes."""
    return (str(e).strip().splitlines() or [""])[0][:160]


def _import(module_name: str, spec: str, flag: str) -> Any:
    """The module, or one line: where the module itself is not found, where to run from; where it (or an
    import inside it) raised, the exception, since running elsewhere would not help."""
    try:
        if module_name in _failed:  # (imported early, and it raised: not run again)
            raise _failed[module_name]
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only this module (or a package above it) missing means it is not on the path; a module it
        # imports that is missing is the user's environment, named as it is.
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise PhalanxError(f"{flag} {spec}: cannot import module '{module_name}' (ModuleNotFoundError: "
                               f"{first_line(e)}); "
                               "run from the directory that holds it, or add it to PYTHONPATH") from None
        raise PhalanxError(f"{flag} {spec}: importing module '{module_name}' failed (ModuleNotFoundError: "
                           f"{first_line(e)}); install what it imports") from None
    except Exception as e:  # the user's module may raise anything while importing (SyntaxError included)
        raise PhalanxError(f"{flag} {spec}: importing module '{module_name}' raised {type(e).__name__}: "
                           f"{first_line(e)}") from None


def _attribute(obj: Any, part: str, module_name: str, attr: str, spec: str, flag: str) -> Any:
    """``getattr(obj, part)``, or one line: a lazy module (transformers' ``_LazyModule``) imports on
    attribute access and may raise anything there, not only AttributeError."""
    try:
        return getattr(obj, part)
    except AttributeError:
        raise PhalanxError(f"{flag} {spec}: module '{module_name}' has no attribute '{attr}'") from None
    except Exception as e:
        raise PhalanxError(f"{flag} {spec}: looking up '{attr}' in module '{module_name}' raised "
                           f"{type(e).__name__}: {first_line(e)}") from None


def label(obj: Any) -> str:
    """``module:qualname`` of a function or class (of an object: of its class)."""
    target: Any = obj.func if isinstance(obj, functools.partial) \
        else obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
    return f"{target.__module__}:{target.__qualname__}"
