"""Saves that write frozen tensors only when they changed: which ones a save can share with the previous one.

Fine-tuning keeps a large frozen part (``requires_grad=False`` parameters, buffers) and trains a small one. The
format layer can keep frozen tensors in a ``.data`` file that later checkpoints share by hard link
(``format._shared_data``); this package decides, per save, which frozen tensors are unchanged since the previous save
of the same plugin to the same directory, and remembers what each save put in its ``.data``.

Change is detected by torch first: the live module tensor (the very object, held weakly), its memory
(``data_ptr``, shape, strides, dtype, device) and its version counter, which in-place operations bump
(``load_state_dict``'s copies, ``optimizer.step``, ``torch.no_grad()`` edits). A tensor that differs in any of these
is written fresh. What torch calls unchanged is then confirmed by content: the writer hashes the tensors it links
on a helper thread while it writes the rest, and compares with the checksums recorded when the shared ``.data`` was
written. That catches what the counter misses: BatchNorm's kernels update its running statistics in place without
bumping it (a buffer found changed that way is never shared again), and a write through ``tensor.data`` bypasses it
(such a parameter gets a fresh ``.data``). A file never holds a frozen tensor other than the one saved. With
``trust_parameters`` (``share_frozen="trusted"``) frozen parameters are taken on torch's word and not hashed: a
little faster on a busy machine (docs/performance.md has the cost of hashing), but a write through ``.data`` then
goes unseen and the file keeps the old bytes.

No single point of failure: the saves of a directory keep two independent ``.data`` files of the frozen tensors and
alternate between them, and a file is read back against its checksums before it is linked when it may have changed
(``_copies.Copies``); one damaged file costs no checkpoint: readers take its tensors from the other copy
(``format._shared_data.OtherCopies``), and the save that finds it repairs the checkpoints linking it (a fresh copy
from good bytes, relinked). Retention does
not undo that: where it deletes the last checkpoint of one copy while kept checkpoints link the other, the copy stays
under a hidden reserve name until two copies are named by checkpoints again (``Copies.before_remove``).

Off the save path: the second copy, the renewal of a copy, and the periodic read-backs are done by one worker thread
of the :class:`FrozenSharing` (started on first need, stopped by :meth:`FrozenSharing.close` at the plugin's
teardown, which waits for it; nothing at import, nothing global). A copy written there is a new file (the bytes
copied in the kernel, never cloned), made durable, and read back against the checksums before any save may link it;
a read-back is started ahead and taken by the save that links the copy, which waits for it only where it is due and
not done. **The window with one copy**: after a save that writes the frozen part fresh with no second copy to link
(the first save to a directory, and the first after the frozen tensors changed), the next ``ONE_COPY_SAVES``
saves link that one copy while the second is written; the save after them waits for it. Those checkpoints (at most
``1 + ONE_COPY_SAVES``) share one file: damage to it in that window takes them all, as with one copy. A renewal
(``LINKS_PER_COPY``) opens no window: the copy it replaces stays linkable until the new one is written.

Only tensors of the live module at least ``MIN_BYTES`` large take part, and only when they add up to
``MIN_TOTAL_BYTES``: below that a second file costs more than it saves. Sharing applies to local directories; a
remote (``scheme://``) path is written whole. (The numbers: ``_limits``.)

One entry on the save path, the plugin's: :class:`FrozenSharing` (``decide`` at the save call, the
:class:`Decision`'s ``write`` where the save runs, ``before_remove`` before retention deletes, ``close``). Inside,
each save calls down one way: ``_policy`` (the decision, and the save again where the writer refuses the plan) asks
the directory's ``_copies.Copies`` to begin, choose the copy and the plan (``format._shared_data.SharedFrozen``, all
the writer and the store see of sharing), and record what the save put there; ``_snapshot`` is torch's word on what
changed. The read path's entry (healing from another copy) and the repair are ``format._shared_data``'s.
"""

from __future__ import annotations

from ._policy import Decision, FrozenSharing

__all__ = ["Decision", "FrozenSharing"]
