"""Loop counters of a Lightning checkpoint, checked before Lightning trusts them.

Lightning resumes its loops from the counters in ``checkpoint["loops"]`` (and reports ``epoch`` and
``global_step``); it compares them with ``max_epochs`` and ``max_steps``. A counter that is NaN compares false with
everything, so a run resumed from it never stops; a negative or float one silently changes how long it trains. A
file is not trusted with that: every number there must be a count, a non-negative integer that fits in int64.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError

_TOP_LEVEL = ("epoch", "global_step")
_MAX = 2**63


def check_counters(checkpoint: Any, path: str) -> Any:
    """``checkpoint``, once every loop counter in it is a count; else :class:`CorruptCheckpointError` naming the
    first that is not."""
    if not isinstance(checkpoint, dict):
        return checkpoint
    for key in _TOP_LEVEL:
        if key in checkpoint:
            _check(checkpoint[key], key, path)
    loops = checkpoint.get("loops")
    if loops is not None:
        _walk(loops, "loops", path, depth=0)
    return checkpoint


def _walk(value: Any, where: str, path: str, depth: int) -> None:
    if depth > 32:  # Lightning's loop state is a few levels deep
        raise CorruptCheckpointError(f"its loop state is damaged: {where} is nested {depth} levels deep", path)
    if isinstance(value, dict):
        for k, v in value.items():
            _walk(v, f"{where}[{k!r}]", path, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _walk(v, f"{where}[{i}]", path, depth + 1)
    elif not isinstance(value, (bool, str)) and value is not None:
        _check(value, where, path)


def _check(value: Any, where: str, path: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX:
        raise CorruptCheckpointError(f"its loop state is damaged: {where} = {value!r} is not a count (a "
                                     "non-negative integer); resuming from it could train forever or not at all",
                                     path)
