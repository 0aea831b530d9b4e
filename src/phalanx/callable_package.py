"""A package that is also a function: ``phalanx.compare(...)`` and ``phalanx.estimate(...)``.

Python sets the attribute ``phalanx.compare`` to the package ``phalanx/compare/`` whenever one of its modules is
imported, so a function of that name beside it could not stay there. The package's module object takes a class
whose ``__call__`` is the function instead, and the package stays a package.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable


def make_callable(module_name: str, function: Callable[..., Any]) -> None:
    """Calling the module ``module_name`` calls ``function`` (its docstring is the call's)."""

    class CallablePackage(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

        __call__.__doc__ = function.__doc__

    sys.modules[module_name].__class__ = CallablePackage
