"""The numbers frozen sharing decides by, in one module read at each use (a test or benchmark sets them here)."""

from __future__ import annotations

MIN_BYTES = 64 << 10
"""A frozen tensor smaller than this stays inline (rewritten by every save)."""
MIN_TOTAL_BYTES = 1 << 20
"""Below this many bytes of frozen tensors, nothing is shared."""
COPIES = 2
"""Independent ``.data`` files (inodes) holding the frozen tensors among a directory's saves: while fewer can be
linked, one more is written (in the background after the first), else a save links the one linked least recently
(see :class:`~._copies.Copies`)."""
LINKS_PER_COPY = 32
"""Saves that may link one ``.data`` file (what one damaged file can take); its successor is written in the
background from two links before."""
VERIFY_EVERY = 16
"""Saves of a directory between two full read-backs of a ``.data`` file before it is linked again (each started in
the background 3/4 of the way, and waited for only where it is not done when due)."""
ONE_COPY_SAVES = 3
"""After a save that writes the frozen part fresh with no second copy to link (the first of a directory, the first
after the frozen tensors changed), the saves that may link that one copy while the second is written in the
background (the window with one copy); the next save that would link it waits for the second instead."""

REMEMBERED = 2 * COPIES
"""Copies remembered per directory (the newest): older ones are never linked again."""
