"""Persistent saves promoted, not serialized again: the fast tier's committed file, copied to ``dirpath``.

Where a persistent save of ``OrtCheckpoint`` falls on a step its fast tier saves too (``_tiers``), the plugin writes
the checkpoint once, into the fast tier, and then copies that committed file, byte for byte, to the persistent
path (:func:`copy_verified`), where the plugin's saves run: on its background thread with ``async_save=True``, after
the fast file is durable. The training thread pays one save; the copy is checked against the checksums the file
records before a byte of it is stored, and is committed as every save is (the store's ``writing``: whole or not at
all).
"""

from __future__ import annotations

import os
import shutil

from ..format import data_path, open_checkpoint
from ..format._store import Store

_CHUNK = 8 << 20  # bytes copied at a time


def copy_verified(source: str, target: str, store: Store) -> None:
    """Copy the checkpoint ``source`` (a local file, with its ``.data`` where it has one) to ``target`` on ``store``,
    after every tensor of it matched its checksum (a ``CorruptCheckpointError`` naming ``source`` otherwise: a
    damaged file is never promoted)."""
    with open_checkpoint(source) as reader:
        reader.verify()
    data = data_path(source)
    with_data = os.path.exists(data)
    size = os.path.getsize(source) + (os.path.getsize(data) if with_data else 0)
    with store.writing(target, with_data=with_data, required_bytes=size) as files:
        with open(source, "rb") as main:
            shutil.copyfileobj(main, files.main, _CHUNK)
        if with_data and files.data is not None:
            with open(data, "rb") as rest:
                shutil.copyfileobj(rest, files.data, _CHUNK)
