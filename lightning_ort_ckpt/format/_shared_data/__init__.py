"""A ``.data`` file of frozen tensors that several checkpoints share by hard link.

ORT reads each external tensor from ``<checkpoint path>.data`` at the tensor's own ``external_data_offset``; nothing
else ties a file to its ``.data`` (no name, size or hash inside). So when a save finds its frozen tensors unchanged
since the previous save, its ``.data`` can be a second name (a hard link) of the previous save's ``.data``: the new
checkpoint's main file points its frozen tensors at the same offsets, and only the main file (trainable parameters,
optimizer state, changed buffers, metadata) is written. Where the file system offers copy-on-write clones (the
``FICLONE`` ioctl: XFS, Btrfs), the new ``.data`` is a clone instead: the blocks are shared, the inode is not, so no
write through another name can reach it. Every file stays whole: deleting or replacing one name of a shared
``.data`` leaves the inode to the others. A shared ``.data`` is never opened for writing again; it is made
read-only when written, so that ONNX Runtime's own ``save_checkpoint`` to such a path fails instead of changing the
file under the other checkpoints. A process running as root is not stopped by the mode, nor is ``truncate`` or ``cp``
over one name: that damage is bounded by the redundancy ``_sharing`` keeps (every frozen byte in two independent
files, one of them under a hidden reserve name (:func:`keep_reserve`) where retention deleted every checkpoint of it)
and found by :func:`verify_data` before anything links to the file again; :func:`write_copy` writes the
independent copies (new blocks, never a clone, read back before use); :func:`damage_note` names the checkpoints one
damaged file takes with it (docs/format.md).

The writer's side and the reader's side of a shared ``.data`` live here together. A save is handed one plan object
(:class:`SharedFrozen`, decided once by the caller, ``lightning_ort_ckpt._sharing``: which tensors, linked from
which copy), and neither the writer nor the store knows more of sharing: the store makes the link the plan asks for
(``SharedFrozen.link``, its ``link_data``), the writer plans and streams, and ``SharedFrozen.carried_out`` confirms
the linked bytes and says what the save put there (:class:`SavedData`). A read whose checksum fails on a frozen tensor takes its bytes from another copy
(:class:`OtherCopies`; the reader keeps them in a :class:`Healing`), and :func:`repair` writes a fresh copy from
good bytes and relinks the checkpoints that pointed at a damaged one (the save that finds damage, ``ort-ckpt verify
--repair``).

One module a job: :mod:`._plan` (what a save shares and what it put there), :mod:`._links` (a file's identity,
links and clones, independent copies, checked bytes), :mod:`._names` (reserve names, the checkpoints of one file),
:mod:`._healing` (the reader's fallback), :mod:`._repair`.
"""

from __future__ import annotations

from ._healing import Healing, recorded_slots
from ._links import Identity, identity, link_into, verify_data, write_copy
from ._names import damage_note, drop_name, is_reserve, keep_reserve, looked_at, reserves, sharing_checkpoints
from ._plan import NotShared, SavedData, SharedFrozen, SharedTooLarge
from ._repair import repair

__all__ = ["Healing", "Identity", "NotShared", "SavedData", "SharedFrozen", "SharedTooLarge",
           "damage_note", "drop_name", "identity", "is_reserve", "keep_reserve", "link_into", "looked_at",
           "recorded_slots", "repair", "reserves", "sharing_checkpoints", "verify_data", "write_copy"]
