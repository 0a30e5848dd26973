"""Files that are not ORT checkpoints, read with torch's loader: never unpickling arbitrary objects unasked, and
failing with our error.

``fit(ckpt_path="last")`` may pick any ``*.ckpt`` in a directory, and ``OrtCheckpointIO`` hands every file that is
not an ORT checkpoint to torch; a pickle there could run code. torch's ``weights_only=True`` loader unpickles only
tensors and plain containers; it is what we pass unless the caller explicitly passed ``weights_only=False``.
"""

from __future__ import annotations

import errno
import os
import pickle
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from ..format._store import store_for
from .._translation.counters import check_counters


def load_torch_file(load: Callable[..., Any], path: Any, map_location: Any, weights_only: bool | None) -> Any:
    """A file that is not an ORT checkpoint, through torch's loader ``load``, with no unpickling of arbitrary objects
    unless the caller asked for it: ``weights_only`` is True unless it is explicitly False (the one opt-in, for
    trusted files: ``Trainer.fit(..., weights_only=False)``). Whatever torch raises about the content comes back as
    our :class:`CorruptCheckpointError` naming the file; the system's errors (a missing file, a directory) stay as
    they are, naming it too. A file named by a path has been opened by then, so an invalid seek inside it
    (``EINVAL``: a zip archive cut short points before its own start) is about its content, not the system. A FIFO,
    socket or device is refused by its store first: torch's open would wait on it forever."""
    weights_only = True if weights_only is None else weights_only
    named = isinstance(path, (str, os.PathLike))  # else a file object: torch reads it as it is
    if named:
        store_for(path).check_file(os.fspath(path))
    try:
        checkpoint = load(path, map_location=map_location, weights_only=weights_only)
    except (CheckpointError, OSError) as e:  # ours already (an ORT-aware loader inside), or the system's
        if not (named and isinstance(e, OSError) and e.errno == errno.EINVAL):
            raise
        raise _not_loadable(path, e, weights_only) from e
    except Exception as e:  # noqa: BLE001 - torch raises EOFError, UnpicklingError, RuntimeError, IndexError...
        raise _not_loadable(path, e, weights_only) from e
    return check_counters(checkpoint, os.fspath(path)) if named else checkpoint


def _not_loadable(path: Any, e: Exception, weights_only: bool) -> CorruptCheckpointError:
    """Our error for a file torch's loader failed on, with the first line of torch's reason."""
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path)
    hint = ("; if you trust this file, load it with weights_only=False" if weights_only
            and isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e) else "")
    return CorruptCheckpointError(f"neither an ORT checkpoint nor a torch checkpoint that torch can load "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}){hint}", name)
