"""What a local run directory holds, unit by unit, for ``ort-ckpt verify/inspect/ls DIR``: the CLI's own small
listing (no torch, no Lightning), by names and the folder commit file only; the step and epoch come later, from each
checkpoint's own metadata (``_cli_runs``).

A checkpoint is one unit: a file with its ``.data``, or a folder committed by its ``checkpoint.ort-meta`` (a
sharded checkpoint). A ``*.ckpt`` folder without that file is a half-written checkpoint (its save did not finish);
hidden names (our temporaries, the reserve copies of frozen sharing), ``.data`` companions and commit journals are
parts of other units; anything else (a logger's files, a README) is foreign and left out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .format._atomic import DATA_SUFFIX, FOLDER_COMMIT_NAME, JOURNAL_SUFFIX

CHECKPOINT_SUFFIX = ".ckpt"  # Lightning's ModelCheckpoint.FILE_EXTENSION, which OrtCheckpoint keeps


@dataclass(frozen=True)
class Unit:
    path: str
    folder: bool  # a sharded checkpoint (or a half-written one)
    committed: bool  # False: a checkpoint folder without its commit file

    def files(self) -> list[str]:
        """Every file of the unit: a file and its ``.data``, or everything in the folder."""
        if self.folder:
            return sorted(os.path.join(root, name) for root, _, names in os.walk(self.path) for name in names)
        return [p for p in (self.path, self.path + DATA_SUFFIX) if os.path.exists(p)]


def is_checkpoint_folder(path: str) -> bool:
    """A folder committed as a sharded checkpoint (its metadata file exists, damaged or not)."""
    return os.path.isfile(os.path.join(path, FOLDER_COMMIT_NAME))


def is_run_directory(path: str) -> bool:
    """A local directory that is not itself a checkpoint (committed or half-written)."""
    return os.path.isdir(path) and not is_checkpoint_folder(path) and not path.rstrip("/").endswith(CHECKPOINT_SUFFIX)


def units(directory: str) -> list[Unit]:
    """The checkpoints in ``directory`` (not below it), by name."""
    out = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(".") or name.endswith(JOURNAL_SUFFIX) or (
                name.endswith(DATA_SUFFIX) and os.path.exists(path[:-len(DATA_SUFFIX)])):
            continue
        if os.path.isdir(path):
            if is_checkpoint_folder(path) or name.endswith(CHECKPOINT_SUFFIX):
                out.append(Unit(path, folder=True, committed=is_checkpoint_folder(path)))
        elif name.endswith(CHECKPOINT_SUFFIX):
            out.append(Unit(path, folder=False, committed=True))
    return out
