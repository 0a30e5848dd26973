"""Crash-safe, concurrency-safe replacement of a checkpoint and its ``.data`` companion on the local disk: the local
store's operations, one module per concept.

``_commit``: a save writes temporary files (``.<name>.<token>.tmp``) in the target's directory, fsyncs them and
renames them into place, so a failure, a full disk or a kill leaves the previous checkpoint untouched. A checkpoint
with external data is two files that cannot be renamed together; a small journal (``<path>.commit``), written durably
before the first rename, records the pair and marks the commit in progress. Only writers act on it: the next save of
the path (or :func:`repair`) completes an interrupted commit. A removal (a checkpoint folder too, as a whole) and a
link are committed the same way. ``_pairs``: readers never change the directory: :func:`open_pair` opens a
consistent pair (old or new, whole) even while a commit is in progress or after a writer died in one, or says that it
could not.

``_lock``: writers of one directory take a lock for the short commit (``flock`` on the directory, or a lock file where
that is not available), so two processes saving the same path never undo each other's renames. ``_cleanup``: replaced
and removed files get a hidden second name (``.<name>.<token>.old``) and are unlinked on a background thread; the
queue is drained at exit, or by :func:`drain_deletions`. The token (``_names``) is ``<host>-<boot>.<pid>.<random>``:
leftovers of a killed save are swept only when they are this host's, of this boot and of a process that no longer
runs (or of an earlier boot), so a shared file system never loses another machine's save in progress; anything else
is swept only when it is older than ``_cleanup.STALE_AGE_S``.
"""

from .._naming import DATA_SUFFIX, FOLDER_COMMIT_NAME, data_path  # the rule every store follows, defined there
from ._cleanup import UNLINKER as _UNLINKER, drain_deletions, keep_spares, sweep_stale as _sweep_stale, wait_for_cleanup
from ._commit import SaveFiles, atomic_save, link, remove, repair
from ._lock import LOCK_NAME
from ._names import (BOOT as _BOOT, HOST as _HOST, JOURNAL_SUFFIX, LEFTOVER as _LEFTOVER,
                     OLD_LEFTOVER as _OLD_LEFTOVER, hidden_name as _hidden_name, temp_name)
from ._pairs import open_pair

__all__ = ["DATA_SUFFIX", "FOLDER_COMMIT_NAME", "JOURNAL_SUFFIX", "LOCK_NAME", "SaveFiles", "atomic_save", "data_path", "drain_deletions", "keep_spares", "link",
           "open_pair", "remove", "repair", "temp_name", "wait_for_cleanup",
           # the tests forge a dead writer's leftovers, and hold the unlink thread, with these
           "_BOOT", "_HOST", "_LEFTOVER", "_OLD_LEFTOVER", "_UNLINKER", "_hidden_name", "_sweep_stale"]
