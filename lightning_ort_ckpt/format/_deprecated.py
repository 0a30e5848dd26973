"""Public names of 0.2 kept for one minor release: each warns once per process and names its replacement.

The rule (README, "Deprecations"): a public name that is renamed or made private keeps an alias that warns
(``FutureWarning``, shown by default) for the next minor release and goes in the one after; CHANGELOG.md lists it
under "Deprecated". Here in the format layer (it imports nothing) so that every layer's aliases can use it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

REMOVED_IN = "0.4"
_warned: set[str] = set()


def warn_once(old: str, new: str, stacklevel: int = 3, *, since: str = "0.3", removed_in: str = REMOVED_IN) -> None:
    """A ``FutureWarning`` the first time ``old`` is used in this process: deprecated in ``since``, it goes in
    ``removed_in`` (the next minor release)."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(f"{old} is deprecated since {since} and will be removed in {removed_in}: {new}", FutureWarning,
                  stacklevel=stacklevel)


def moved_module(old: str, target: str, advice: str, moved: dict[str, str] | None = None
                 ) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the 0.2 module ``old``: warns once at import, then every name is the one of
    ``target`` (or, for a name in ``moved``, of the module it names there, as ``"module:name"``)."""
    warn_once(old, advice, stacklevel=4)
    moved = moved or {}

    def __getattr__(name: str) -> Any:
        module, _, attr = moved.get(name, f"{target}:{name}").partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except AttributeError:
            raise AttributeError(f"{old}.{name} is gone since 0.3 ({advice})") from None

    return __getattr__
