"""What a checkpoint directory holds, as Orbax's step registry sees it: one listing for "last", retention and the
ranks' agreement (and, next, ``ort-ckpt ls`` and the loggers).

A checkpoint is one unit: a file with its ``.data``, or a folder (a sharded checkpoint, committed by its
``checkpoint.ort-meta``). :func:`scan` lists a directory through its :class:`~.format._store.Store` (local or remote)
and says of every visible entry whether it is a committed checkpoint, a half-written one (a checkpoint folder whose
save did not finish: skipped, and cleaned after the next save) or foreign (anything else: never touched; an entry
named like a checkpoint that is no regular file, a FIFO, socket or device, is foreign too, with a warning: one odd
entry never stops the scan). Committed
checkpoints come newest first by the step recorded in their own metadata (a file's Lightning metadata, read
without its tensors; a folder's metadata document), then by save order (when the file, or the folder's metadata
file, was committed), never by a folder's modification time. A checkpoint whose step cannot be known without
running or downloading it (a torch file, which is never unpickled to be listed; a remote single file) keeps its
place in save order among the others.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

from ..errors import CheckpointError, CheckpointWarning
from ..format import open_checkpoint
from ..format._atomic import DATA_SUFFIX, FOLDER_COMMIT_NAME
from ..format._schema import FILE_IDENTIFIER
from ..format._store import Store


class Kind(Enum):
    FILE = "file"
    FOLDER = "folder"


class State(Enum):
    COMMITTED = "committed"  # a whole checkpoint (whether it loads is the reader's question)
    HALF = "half"  # a checkpoint folder without its metadata: a save that did not finish
    FOREIGN = "foreign"  # not a checkpoint of this directory's naming: left alone


@dataclass(frozen=True)
class Entry:
    """One unit in a checkpoint directory."""

    path: str
    kind: Kind
    state: State
    step: int | None = None  # the global step its own metadata records; None when unknown (see the module doc)
    epoch: int | None = None
    saved: float = float("-inf")  # when it was committed (the file's, or the folder's metadata file's, time)
    problem: str | None = None  # why its own metadata cannot be read (a committed entry that cannot resume)
    link: bool = False  # a symbolic link to another checkpoint (save_last="link")
    size: int | None = None  # bytes, with its .data or everything in the folder; None unless asked for


def scan(directory: str, store: Store, *, extension: str = ".ckpt", recursive: bool = False, last_name: str = "last",
         sizes: bool = False, remote_metadata: bool = True) -> list[Entry]:
    """Every visible entry of ``directory`` (and below it where ``recursive``; never inside a checkpoint folder):
    committed checkpoints newest first, then half-written ones, then foreign ones. ``store`` is ``directory``'s,
    built by the caller (every file and folder is read through it). ``remote_metadata=False``: a folder on a
    remote store is listed without a download, its step unknown (as a remote file's), for a caller that ranks it
    by its name (the tiers: a valid fast tier reads no object of the persistent one)."""
    folders = store.list_folders(directory, recursive)
    checkpoints = [d for d in folders if d.endswith(extension) and not _inside_any(d, folders, extension)]
    entries = [_folder(store, d, remote_metadata or store.local) for d in checkpoints]
    for path in store.list_files(directory, recursive):
        if _inside_any(path, checkpoints, extension) or (path.endswith(DATA_SUFFIX)
                                                         and path[:-len(DATA_SUFFIX)].endswith(extension)):
            continue  # a checkpoint folder's own files, a checkpoint's .data: parts of one unit
        entries.append(_named_file(store, path) if path.endswith(extension) else
                       Entry(path, Kind.FILE, State.FOREIGN, saved=store.modified(path)))
    if sizes:
        entries = [_with_size(store, e) for e in entries]
    lasts = re.compile(rf"^{re.escape(last_name)}(-\d+)?{re.escape(extension)}$")

    def tie(e: Entry) -> tuple[bool, bool, str]:  # a link and its target, a copy as "last": the link, then last*
        return e.link, bool(lasts.match(os.path.basename(e.path))), e.path

    by_time = sorted(committed(entries), key=lambda e: (e.saved, *tie(e)), reverse=True)
    # the checkpoints whose step is known take the places of those in step order; one whose step cannot be known
    # without running it (a torch file, a remote file) keeps its place in save order
    stepped = iter(sorted((e for e in by_time if e.step is not None), key=lambda e: (e.step, e.saved, *tie(e)),
                          reverse=True))
    newest_first = [next(stepped) if e.step is not None else e for e in by_time]
    return newest_first + sorted(half(entries), key=lambda e: e.path) + \
        sorted((e for e in entries if e.state is State.FOREIGN), key=lambda e: e.path)


def committed(entries: list[Entry]) -> list[Entry]:
    return [e for e in entries if e.state is State.COMMITTED]


def half(entries: list[Entry]) -> list[Entry]:
    return [e for e in entries if e.state is State.HALF]


def _inside_any(path: str, folders: list[str], extension: str) -> bool:
    return any(path != f and path.startswith(f.rstrip("/\\") + sep) for f in folders if f.endswith(extension)
               for sep in ("/", os.sep))


def _folder(store: Store, path: str, read: bool = True) -> Entry:
    meta = store.join(path, FOLDER_COMMIT_NAME)
    if not store.exists(meta):
        return Entry(path, Kind.FOLDER, State.HALF, saved=store.modified(path))
    if not read:  # its metadata checked when it loads
        return Entry(path, Kind.FOLDER, State.COMMITTED, saved=store.modified(meta))
    from .._dcp._dcp_folder import read_metadata  # a sharded checkpoint's metadata document, checked

    step = epoch = problem = None
    try:
        tree = read_metadata(path, store).get("tree")
        step, epoch = _counter(tree, "global_step"), _counter(tree, "epoch")
    except CheckpointError:
        problem = f"a checkpoint folder whose {FOLDER_COMMIT_NAME} is damaged"
    return Entry(path, Kind.FOLDER, State.COMMITTED, step, epoch, store.modified(meta), problem)


def _named_file(store: Store, path: str) -> Entry:
    """A file named like a checkpoint: one (:func:`_file`), or, where it is no regular file (a FIFO, socket or
    device, which the store refuses to read), a foreign entry, with a warning."""
    try:
        return _file(store, path)
    except CheckpointError as e:
        why = str(e).removeprefix(f"{path}: ").removeprefix("checkpoint ")
        warnings.warn(f"{path} is skipped: it {why}", CheckpointWarning, stacklevel=3)
        return Entry(path, Kind.FILE, State.FOREIGN, saved=store.modified(path))


def _file(store: Store, path: str) -> Entry:
    """A checkpoint file; its step read from its Lightning metadata where the file is local (parsed, no tensor
    read: a file that does not parse is committed with its ``problem``); a torch file's is not unpickled."""
    step = epoch = problem = None
    if store.local and store.read_head(path, 8)[4:8] == FILE_IDENTIFIER:
        from .._translation import MANIFEST

        try:
            with open_checkpoint(path) as reader:
                manifest = reader.properties.get(MANIFEST)
            values = json.loads(manifest).get("values", {}) if isinstance(manifest, str) else {}
            step, epoch = _counter(values, "global_step"), _counter(values, "epoch")
        except (CheckpointError, OSError) as e:
            problem = str(e).removeprefix(f"{path}: ")
        except (ValueError, AttributeError) as e:  # the manifest's JSON, damaged: say it as the reader would
            problem = f"its Lightning metadata ({MANIFEST}) is damaged: {e}"
    return Entry(path, Kind.FILE, State.COMMITTED, step, epoch, store.modified(path), problem,
                 link=store.link_target(path) is not None)


def _counter(tree: object, key: str) -> int | None:
    value = tree.get(key) if isinstance(tree, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _with_size(store: Store, entry: Entry) -> Entry:
    return replace(entry, size=store.size(entry.path))


def belongs(directory: str, path: str, extension: str, store_of: Callable[[str], Store]) -> bool:
    """Whether ``path`` is a checkpoint of ``directory``, which its callback may delete or link: a visible
    ``*<extension>`` name in ``directory`` or a folder below it, on the same store, after ``..`` and symbolic links
    in its folders are resolved (the name itself is never followed)."""
    name = os.path.basename(path)
    if name.startswith(".") or not name.endswith(extension):
        return False
    return type(store_of(path)) is type(store_of(directory)) and store_of(path).contains(directory, path)
