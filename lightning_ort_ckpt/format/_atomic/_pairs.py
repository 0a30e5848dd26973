"""Reading a checkpoint and its ``.data`` as one consistent pair, changing nothing on disk, even while a commit is in
progress or after a writer died in one (the journal says which files make a whole pair)."""

from __future__ import annotations

import contextlib
import os
import stat
import time

from ...errors import CheckpointError
from .._naming import data_path
from ._commit import NONBLOCK, read_journal

_OPEN_ATTEMPTS = 100  # a reader retries this often (with growing sleeps, ~3 s in all) while saves race it


def open_pair(path: str) -> tuple[int, int | None]:
    """Open ``path`` and its ``.data`` (None when there is no such regular file) as one consistent pair.

    While a commit is in progress, or after a writer died in one, the journal says which files make a whole pair:
    the old pair until the new ``.data`` is in place, then the new ``.ckpt`` (still under its temporary name) with it.
    After opening, the reader checks that the journal is unchanged and that ``path`` still names the file it opened;
    if a save raced it, it tries again (bounded), then raises :class:`CheckpointError`. Errors opening ``path``
    itself propagate as ``OSError``; it is opened non-blocking, so a FIFO cannot hang it.
    """
    pause = 0.0005
    for _ in range(_OPEN_ATTEMPTS):
        pair = _try_open_pair(path)
        if pair is not None:
            return pair
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)
    raise CheckpointError("the checkpoint kept changing while it was being opened (another process is saving it "
                          "over and over, or an interrupted save of the file it links to is pending: the next save "
                          "of that file, or lightning_ort_ckpt.format._atomic.repair, completes it); try again", path)


def _try_open_pair(path: str) -> tuple[int, int | None] | None:
    real = os.path.realpath(path) if os.path.islink(path) else None  # a link (last.ckpt): its target's commits
    target_pending = real is not None and read_journal(real) is not None
    before = read_journal(path)
    main, decided_late = path, False
    if before is not None:
        tmp_main, tmp_data = before
        if not os.path.lexists(tmp_data):
            if os.path.lexists(tmp_main):  # the new .data is in place, the new .ckpt not yet
                main = tmp_main
        else:
            decided_late = True  # the old pair, if the new .data was still a temporary after we opened it
    try:
        fd = os.open(main, os.O_RDONLY | NONBLOCK)
    except FileNotFoundError:
        if main != path:  # renamed into place meanwhile
            return None
        raise
    data_fd: int | None = None
    try:
        with contextlib.suppress(OSError):
            data_fd = os.open(data_path(path), os.O_RDONLY | NONBLOCK)
            if not stat.S_ISREG(os.fstat(data_fd).st_mode):  # not a data file: the reader says what it is
                os.close(data_fd)
                data_fd = None
        after = read_journal(path)
        ok = after == before and not target_pending and (real is None or read_journal(real) is None)
        if ok and main == path:
            ok = _same_file(fd, path) and (not decided_late or os.path.lexists(before[1]))  # type: ignore[index]
    except BaseException:
        _close(fd, data_fd)
        raise
    if ok:
        return fd, data_fd
    _close(fd, data_fd)
    return None


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)
