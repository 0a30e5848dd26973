"""Which checkpoint files a save lets go: a small pure rule, as Orbax keeps its retention policies.

``OrtCheckpoint`` keeps Lightning's top k by metric (``ModelCheckpoint`` decides those and hands over the files it
drops), the newest ``keep_newest`` files it saved, and whatever is protected: the best and last files, the target
of a ``last`` link, the file a user resumed from. Everything else that is waiting goes, oldest name first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def retain(saved: Sequence[str], waiting: Collection[str], protected: Collection[str],
           keep_newest: int | None) -> tuple[list[str], set[str]]:
    """``(delete now, still waiting)``.

    ``saved``: the files saved for top-k or periodically, oldest first; ``waiting``: files dropped earlier but not
    deleted yet (protected then); ``protected``: files that must stay now; ``keep_newest``: with it, every saved file
    but the newest ``keep_newest`` waits too. A waiting file that is protected now waits on.
    """
    waiting = set(waiting)
    protected = set(protected)
    if keep_newest is not None:
        if keep_newest < 1:
            raise ValueError(f"keep_newest must be None or >= 1, got {keep_newest}")
        protected.update(saved[-keep_newest:])
        waiting.update(saved[:-keep_newest])
    delete = sorted(waiting - protected)
    return delete, waiting - set(delete)
