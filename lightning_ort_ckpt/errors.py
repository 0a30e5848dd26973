"""The one exception family of lightning-ort-ckpt.

Every error we raise on purpose derives from :class:`CheckpointError`, so callers can catch one type. Messages name
the file (or parameter) and say what is wrong in the user's terms.
"""

from __future__ import annotations

import os


class CheckpointError(Exception):
    """Base class of every error raised by lightning-ort-ckpt."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else os.fspath(path)
        super().__init__(f"{self.path}: {message}" if self.path is not None else message)


class CorruptCheckpointError(CheckpointError, ValueError):
    """The file is not a valid ORT checkpoint: truncated, damaged, foreign, or inconsistent with its ``.data`` file."""


class CheckpointSaveError(CheckpointError):
    """A save could not complete. Whatever was at the target path before is left as it was."""


class CheckpointWarning(UserWarning):
    """Something was saved or restored in a reduced form; the message names the key or parameter concerned."""


class CheckpointConfigError(CheckpointError, ValueError):
    """An argument of ``OrtCheckpoint`` or ``OrtCheckpointIO`` (or their combination with the Trainer) is invalid;
    raised when they are built or set up, before anything is trained or saved."""
