"""Loop counters of a Lightning checkpoint, checked before Lightning trusts them.

Lightning resumes its loops from the counters in ``checkpoint["loops"]`` (and reports ``epoch`` and
``global_step``); it compares them with ``max_epochs`` and ``max_steps``. A counter that is NaN compares false with
everything, so a run resumed from it never stops; a negative or float one silently changes how long it trains. A
file is not trusted with that: every progress counter there must be a count, a non-negative integer that fits in
int64 (the rest of the loop state, a data loader's own say, is not checked).
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError

_TOP_LEVEL = ("epoch", "global_step")
_COUNTERS = {"ready", "started", "processed", "completed", "_batches_that_stepped"}
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
    """Check every progress counter (``ready``, ``started``, ``processed``, ``completed``,
    ``_batches_that_stepped``) in the loop state; the rest (a data loader's own state, say) is not Lightning's to
    count with."""
    if depth > 32 or not isinstance(value, dict):  # Lightning's progress tracking is a few dicts deep
        return
    for k, v in value.items():
        if k in _COUNTERS and not isinstance(v, dict):
            _check(v, f"{where}[{k!r}]", path)
        else:
            _walk(v, f"{where}[{k!r}]", path, depth + 1)


def _check(value: Any, where: str, path: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX:
        raise CorruptCheckpointError(f"its loop state is damaged: {where} = {value!r} is not a count (a "
                                     "non-negative integer); resuming from it could train forever or not at all",
                                     path)
